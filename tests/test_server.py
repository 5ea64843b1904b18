"""The server over loopback with a test-double recognizer: protocol, limits, bad input.

The same server with the real (random-weight) model is exercised in
``test_server_model.py``; here the recognizer is a fake so timing is under control.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from streamer.client.connection import ClientOptions, StreamingClient
from streamer.client.streaming import transcribe
from streamer.core.hotwords import Hotword
from streamer.core.protocol import End, Final, StreamOptions
from streamer.errors import ConnectionRefusedByServer
from tests.fakes import FakeRecognizer, silence, tone
from tests.server_fixtures import messages_until_close
from tests.support import http_get, recv_json, self_signed_cert, speech
from tests.timing import eventually, timeout_s


@pytest.fixture
def fake_server(make_fake_server):
    return make_fake_server(lambda: FakeRecognizer(delay_s=0.01))


async def test_protocol_exchange_with_raw_websocket(fake_server):
    async with connect(fake_server.url + "?partials=true&itn=false") as ws:
        ready = await recv_json(ws)
        assert ready["type"] == "ready" and ready["protocol"] == 1
        assert ready["options"]["itn"] is False and ready["model"] == "fake"
        pcm = speech(2).tobytes()
        for i in range(0, len(pcm), 3201):  # odd-sized chunks
            await ws.send(pcm[i : i + 3201])
        await ws.send('{"type":"stop"}')
        messages, code = await messages_until_close(ws)
    assert code == 1000
    kinds = [m["type"] for m in messages]
    assert kinds[-1] == "end" and kinds.count("final") == 2 == kinds.count("speech_start")
    final = next(m for m in messages if m["type"] == "final")
    assert final["language"] == "en" and final["emotion"] == "NEUTRAL"
    assert final["event"] == "Speech" and final["reason"] == "silence"
    assert final["decode_ms"] >= 0 and final["queue_ms"] >= 0


async def test_client_sees_ordered_segments(fake_server):
    result = await transcribe(ClientOptions(url=fake_server.url), speech(3), 16000)
    assert [f.segment_id for f in result.finals] == [0, 1, 2]
    assert isinstance(result.end, End) and result.end.segments == 3


async def test_many_unpaced_clients_each_get_every_final_and_health_answers(make_fake_server):
    server = make_fake_server(lambda: FakeRecognizer(delay_s=0.02))
    pcm = speech(4)
    health_times = []

    async def poll_health():
        for _ in range(10):
            started = time.perf_counter()
            status, *_ = await asyncio.to_thread(http_get, server.http_url + "/healthz")
            assert status == 200
            health_times.append(time.perf_counter() - started)
            await asyncio.sleep(0.05)

    clients = [transcribe(ClientOptions(url=server.url), pcm, 16000) for _ in range(20)]
    *results, _ = await asyncio.gather(*clients, poll_health())
    for result in results:
        assert [f.segment_id for f in result.finals] == [0, 1, 2, 3]
        assert result.end is not None and result.end.segments == 4
    assert max(health_times) < timeout_s(1.0)
    await eventually(lambda: server.server.session_count == 0)


async def test_unsupported_sample_rate_closes_1003(fake_server):
    async with connect(fake_server.url + "?sample_rate=11025") as ws:
        messages, code = await messages_until_close(ws)
    assert code == 1003
    assert messages[0]["type"] == "error" and messages[0]["code"] == "unsupported_sample_rate"
    assert messages[0]["fatal"] is True


async def test_wrong_option_closes_1008(fake_server):
    async with connect(fake_server.url + "?language=klingon") as ws:
        messages, code = await messages_until_close(ws)
    assert code == 1008 and messages[0]["code"] == "invalid_option"


async def test_bad_text_messages_are_errors_and_session_continues(fake_server):
    async with connect(fake_server.url) as ws:
        await recv_json(ws)
        for bad in ("not json", '{"type":"dance"}', "[]"):
            await ws.send(bad)
            error = await recv_json(ws)
            assert error["type"] == "error" and error["code"] == "bad_message"
            assert error["fatal"] is False
            await ws.send('{"type":"keepalive"}')  # valid input: the next error is a new burst
        await ws.send(b"")  # empty frame: ignored
        await ws.send(speech(1).tobytes())
        await ws.send('{"type":"stop"}')
        await ws.send(b"\x00\x00" * 100)  # audio after stop
        messages, code = await messages_until_close(ws)
    assert code == 1000
    kinds = [m["type"] for m in messages]
    assert "final" in kinds and kinds[-1] == "end"
    assert any(m["type"] == "error" and m["code"] == "unexpected_message" for m in messages)


async def test_oversized_frame_closes_1009(make_fake_server):
    server = make_fake_server(FakeRecognizer, max_message_bytes=64 * 1024)
    async with connect(server.url, max_size=None) as ws:
        await recv_json(ws)
        await ws.send(b"\x00" * (128 * 1024))
        _, code = await messages_until_close(ws)
    assert code == 1009
    # the server is still fine
    result = await transcribe(ClientOptions(url=server.url), speech(1), 16000)
    assert len(result.finals) == 1


async def test_vanishing_client_drops_jobs_and_frees_its_slot(make_fake_server):
    recognizer = FakeRecognizer(delay_s=0.3)
    server = make_fake_server(lambda: recognizer)
    ws = await connect(server.url)
    await recv_json(ws)
    await ws.send(speech(3).tobytes())
    ws.transport.abort()  # no close handshake: the client just disappears
    await eventually(lambda: server.server.session_count == 0, 5.5)
    stats = server.worker.stats()
    assert stats.queued_finals == 0 and stats.queued_partials == 0
    result = await transcribe(ClientOptions(url=server.url), speech(1), 16000)
    assert len(result.finals) == 1


async def test_decode_failure_gives_error_final_and_others_unaffected(make_fake_server):
    # fails on segments shorter than 1.25 s: the first segment of speech() only
    server = make_fake_server(lambda: FakeRecognizer(fail_when=lambda pcm: pcm.size < 20000))
    bad, good = await asyncio.gather(
        transcribe(ClientOptions(url=server.url), speech(2), 16000),
        transcribe(
            ClientOptions(url=server.url),
            np.concatenate([silence(300), tone(2000), silence(900)]),
            16000,
        ),
    )
    assert bad.finals[0].error is not None and bad.finals[0].error["code"] == "decode_failed"
    assert bad.finals[1].error is None and bad.finals[1].text
    assert good.finals[0].error is None and good.end is not None


async def test_idle_timeout_closes_1008_after_delivering_speech(make_fake_server):
    server = make_fake_server(FakeRecognizer, idle_timeout_s=0.5)
    async with connect(server.url + "?partials=false") as ws:
        await recv_json(ws)
        await ws.send(np.concatenate([silence(300), tone(1000)]).tobytes())
        messages, code = await messages_until_close(ws)
    assert code == 1008
    kinds = [m["type"] for m in messages]
    assert kinds == ["speech_start", "error", "final", "end"]
    assert messages[1]["code"] == "idle_timeout"


async def test_keepalive_prevents_idle_timeout(make_fake_server):
    server = make_fake_server(FakeRecognizer, idle_timeout_s=0.6)
    async with connect(server.url) as ws:
        await recv_json(ws)
        for _ in range(5):
            await ws.send('{"type":"keepalive"}')
            await asyncio.sleep(0.3)
        await ws.send('{"type":"stop"}')
        messages, code = await messages_until_close(ws)
    assert code == 1000 and messages[-1]["type"] == "end"


async def test_admission_limit_503(make_fake_server):
    server = make_fake_server(FakeRecognizer, max_sessions=2)
    a = await StreamingClient.connect(ClientOptions(url=server.url))
    b = await StreamingClient.connect(ClientOptions(url=server.url))
    with pytest.raises(InvalidStatus) as refused:
        await connect(server.url)
    assert refused.value.response.status_code == 503
    assert orjson.loads(refused.value.response.body)["error"] == "server_full"
    await a.close()
    await b.close()


async def test_a_session_frees_its_slot_when_end_is_sent(make_fake_server):
    """The client hears `end` and connects again at once: the slot is already free (the
    close handshake that follows must not hold it)."""
    server = make_fake_server(FakeRecognizer, max_sessions=1)
    refused = 0
    for _ in range(20):
        try:
            ws = await connect(server.url)
        except InvalidStatus:
            refused += 1
            await asyncio.sleep(0.2)
            continue
        assert (await recv_json(ws))["type"] == "ready"
        await ws.send('{"type":"stop"}')
        while (await recv_json(ws))["type"] != "end":
            pass
        # no close handshake awaited: reconnect the moment `end` arrives
        ws.transport.abort()
    assert refused == 0


async def test_token_auth(make_fake_server):
    server = make_fake_server(FakeRecognizer, token="s3cret")
    for url, headers in (
        (server.url, None),
        (server.url + "?token=wrong", None),
        (server.url, {"Authorization": "Bearer nope"}),
    ):
        with pytest.raises(InvalidStatus) as refused:
            await connect(url, additional_headers=headers)
        assert refused.value.response.status_code == 401
    with pytest.raises(ConnectionRefusedByServer) as refused:
        await StreamingClient.connect(ClientOptions(url=server.url))
    assert refused.value.status == 401
    async with connect(server.url + "?token=s3cret") as ws:
        assert (await recv_json(ws))["type"] == "ready"
    client = await StreamingClient.connect(ClientOptions(url=server.url, token="s3cret"))
    await client.close()


async def test_origin_allow_list(make_fake_server):
    server = make_fake_server(FakeRecognizer, allowed_origins=("http://good.example",))
    with pytest.raises(InvalidStatus) as refused:
        await connect(server.url, origin="http://evil.example")
    assert refused.value.response.status_code == 403
    async with connect(server.url, origin="http://good.example") as ws:
        assert (await recv_json(ws))["type"] == "ready"


async def test_http_routes(fake_server):
    base = fake_server.http_url
    status, body, _ = await asyncio.to_thread(http_get, base + "/healthz")
    assert status == 200 and orjson.loads(body)["status"] == "ok"
    status, body, _ = await asyncio.to_thread(http_get, base + "/readyz")
    assert status == 200
    await transcribe(ClientOptions(url=fake_server.url), speech(1), 16000)
    status, body, _ = await asyncio.to_thread(http_get, base + "/metrics")
    text = body.decode()
    assert status == 200
    for name in (
        "streamer_sessions_active",
        "streamer_decode_seconds_bucket",
        "streamer_queue_wait_seconds",
        "streamer_time_to_first_partial_seconds",
        "streamer_event_loop_lag_seconds",
        "streamer_partials_skipped_total",
        'streamer_segments_total{reason="silence"}',
    ):
        assert name in text, name
    status, body, _ = await asyncio.to_thread(http_get, base + "/")
    assert status == 200 and b"<html" in body.lower()
    status, *_ = await asyncio.to_thread(http_get, base + "/../pyproject.toml")
    assert status == 404
    status, *_ = await asyncio.to_thread(http_get, base + "/__init__.py")
    assert status == 404


async def test_readyz_503_while_loading(make_fake_server):
    import threading

    gate = threading.Event()

    def slow_load():
        gate.wait(timeout_s(10))
        return FakeRecognizer()

    server = make_fake_server(slow_load, wait_ready=False)
    status, *_ = await asyncio.to_thread(http_get, server.http_url + "/readyz")
    assert status == 503
    with pytest.raises(InvalidStatus) as refused:
        await connect(server.url)
    assert refused.value.response.status_code == 503
    gate.set()
    await asyncio.wrap_future(
        asyncio.run_coroutine_threadsafe(server.server.wait_ready(), server.loop)
    )
    status, *_ = await asyncio.to_thread(http_get, server.http_url + "/readyz")
    assert status == 200


async def test_graceful_shutdown_delivers_open_segments(make_fake_server):
    server = make_fake_server(lambda: FakeRecognizer(delay_s=0.05))
    async with connect(server.url + "?partials=false") as ws:
        await recv_json(ws)
        await ws.send(np.concatenate([silence(300), tone(1500)]).tobytes())
        assert (await recv_json(ws))["type"] == "speech_start"  # the segment is open
        await asyncio.to_thread(server.shutdown)
        messages, code = await messages_until_close(ws)
    assert code == 1001
    assert [m["type"] for m in messages][-2:] == ["final", "end"]
    final = next(m for m in messages if m["type"] == "final")
    assert final["reason"] == "stop" and final["end_ms"] == pytest.approx(1800, abs=1)


async def test_unpaced_long_stream_is_back_pressured(make_fake_server):
    # 5 minutes of speech sent unpaced to a slow model: the server reads only as fast as
    # finals are decoded, so its memory for this session stays bounded
    recognizer = FakeRecognizer(delay_s=0.05)
    server = make_fake_server(lambda: recognizer, max_pending_finals=2)
    pcm = np.concatenate([np.concatenate([tone(2000), silence(800)]) for _ in range(107)])
    depths = []

    async def watch_queue():
        while True:
            depths.append(server.worker.stats().queued_finals)
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch_queue())
    result = await transcribe(
        ClientOptions(url=server.url, stream=StreamOptions(partials=False)), pcm, 16000
    )
    watcher.cancel()
    assert len(result.finals) == 107
    assert max(depths) <= 2  # reading paused instead of queueing the whole file
    assert all(isinstance(f, Final) and f.error is None for f in result.finals)


async def test_stream_options_travel_as_query(fake_server):
    # every stream option the client sets reaches the session (the ready echoes them)
    chosen = StreamOptions(language="en", itn=False, sample_rate=8000, partials=False,
                           endpoint_ms=800, words=True, encoding="auto",
                           hotwords=(Hotword("kubernetes", 3.0),), diarize=True,
                           min_speakers=2, max_speakers=3)  # fmt: skip
    assert all(getattr(chosen, f.name) != getattr(StreamOptions(), f.name)
               for f in dataclasses.fields(StreamOptions))  # fmt: skip
    options = ClientOptions(url=fake_server.url, stream=chosen)
    async with await StreamingClient.connect(options) as client:
        # as JSON has them: the hotwords' tuple is a list
        assert client.ready.options == orjson.loads(orjson.dumps(dataclasses.asdict(chosen)))
        assert client.ready.sample_rate == 8000


async def test_tls_serves_wss(make_fake_server, tmp_path):
    certfile, keyfile = self_signed_cert(tmp_path)
    server = make_fake_server(certfile=certfile, keyfile=keyfile)
    url = f"wss://localhost:{server.port}/v1/asr"
    result = await transcribe(ClientOptions(url=url, insecure=True), speech(1), 16000)
    assert len(result.finals) == 1 and result.end is not None
    with pytest.raises(Exception):  # noqa: B017  plain ws:// cannot talk to a TLS port
        await asyncio.wait_for(connect(server.url), timeout_s(5))


async def test_client_dropping_while_reading_is_paused_is_cleaned_up_at_once(make_fake_server):
    # each final takes 3 s, so the server pauses reading this session for a long time;
    # the dropped connection must still free its slot and its queued jobs at once
    server = make_fake_server(lambda: FakeRecognizer(delay_s=3.0), max_pending_finals=1)
    ws = await connect(server.url + "?partials=false")
    await recv_json(ws)
    await ws.send(speech(4).tobytes())
    await eventually(lambda: server.worker.stats().busy, what="the first final decoding")
    assert server.server.session_count == 1
    ws.transport.abort()
    await eventually(lambda: server.server.session_count == 0, 1.5)
    assert server.worker.stats().queued_finals == 0


async def test_back_pressure_pause_never_outlasts_keepalive(make_fake_server):
    # finals slower than the ping timeout: a reader paused for a whole decode would never
    # read the client's pong, and the session would die with 1011
    server = make_fake_server(
        lambda: FakeRecognizer(delay_s=1.2),
        max_pending_finals=1,
        ping_interval_s=0.3,
        ping_timeout_s=1.0,
    )
    options = ClientOptions(url=server.url, stream=StreamOptions(partials=False))
    result = await transcribe(options, speech(3), 16000)
    assert [f.segment_id for f in result.finals] == [0, 1, 2]
    assert result.end is not None
