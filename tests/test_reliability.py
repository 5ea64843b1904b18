"""Reliability under stress, fast and bounded cases (issue 9; the long runs are in bench/stress/).

Loopback servers with a test-double recognizer where timing must be controlled (hung,
dying, slow); the real tagged model where transcripts are compared.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from streamer.client.connection import ClientOptions, StreamingClient
from streamer.client.streaming import transcribe
from streamer.core.protocol import Final, StreamOptions
from streamer.server.options import WS_MAX_QUEUE_FRAMES
from streamer.testkit import speech as synth
from tests.fakes import (
    DyingRecognizer,
    FakeRecognizer,
    HangingRecognizer,
    loudness_classifier,
    silence,
    tone,
)
from tests.server_fixtures import (
    make_server,  # noqa: F401  (fixture)
    messages_until_close,
)
from tests.support import http_get, recv_json, speech
from tests.timing import eventually, timeout_s

BOUND_S = 20  # every wait below gives up after this, scaled (a failure, never a pass)


@pytest.fixture
def fake(make_server):  # noqa: F811
    def factory(load=FakeRecognizer, **options):
        return make_server(load, classifier_factory=loudness_classifier, **options)

    return factory


def metric(server, name: str, **labels) -> float:
    value = server.server.metrics.registry.get_sample_value(name, labels or None)
    return value or 0.0


async def never_reading_client(server):
    """A WebSocket client whose socket receive buffer is tiny and that never reads."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.setblocking(False)
    # max_queue=1: websockets stops reading the socket as soon as one message waits
    ws = await connect(server.url, sock=sock, ping_interval=None, max_queue=1)
    # Loopback send buffers grow to megabytes; a small one stands in for a peer that has
    # been stalled long enough to fill them, so the server's writes block soon.
    await eventually(lambda: server.server.session_count == 1, BOUND_S, "the session")
    (connection,) = server.server.admission.connections
    server_sock = connection.ws.transport.get_extra_info("socket")
    server.loop.call_soon_threadsafe(
        server_sock.setsockopt, socket.SOL_SOCKET, socket.SO_SNDBUF, 4096
    )
    return ws


async def writer_blocked(server, after_s: float = 0.0) -> bool:
    """Whether a session's writer waits inside a send, read on the server's own loop: from
    this thread the flag could be caught mid-send by a thread switch (a send that does not
    wait sets and clears it in one step of the loop), and the shutdown test then found
    nothing to wait for (it failed once in CI this way)."""

    async def blocked() -> bool:
        await asyncio.sleep(after_s)
        return any(c.pump.send_blocked for c in server.server.admission.connections)

    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(blocked(), server.loop))


async def make_server_write(ws, pairs: int = 20000, server=None) -> None:
    """Each (audio, junk) pair makes the server send one small error: its writes pile up.

    With ``server``, stops once the server's writer is blocked in a send.
    """
    for i in range(pairs):
        await ws.send(b"\x00")
        await ws.send("junk")
        if server is not None and i % 100 == 99:
            await asyncio.sleep(0.02)
            if await writer_blocked(server) and await writer_blocked(server, after_s=0.1):
                return
    if server is not None:
        raise AssertionError("the server's writes never blocked")


# -- 1, 8: back-pressure never kills a live client; memory bound ---------------


async def test_back_pressured_unpaced_client_with_pings_on_both_sides_gets_every_final(fake):
    # decodes slower than either side's ping timeout and a backlog that fills at once:
    # the server stops reading, so both sides' pongs wait behind queued audio
    server = fake(
        lambda: FakeRecognizer(delay_s=0.7),
        max_pending_finals=1,
        max_backlog_bytes=64 * 1024,
        ping_interval_s=0.2,
        ping_timeout_s=0.5,
    )
    options = ClientOptions(
        url=server.url,
        stream=StreamOptions(partials=False),
        ping_interval_s=0.2,
        ping_timeout_s=0.5,
    )
    pcm = np.concatenate([speech(4), speech(4)])  # 15 s: more than BEHIND_LIMIT_S
    result = await transcribe(options, pcm, 16000)
    assert [f.segment_id for f in result.finals] == list(range(8))
    assert result.end is not None and result.end.segments == 8
    assert metric(server, "streamer_sessions_terminated_total", reason="keepalive_timeout") == 0


async def test_backlog_holds_at_most_the_documented_bound(fake):
    recognizer = HangingRecognizer()
    server = fake(lambda: recognizer, max_pending_finals=1, max_backlog_bytes=128 * 1024)
    pcm = np.tile(np.concatenate([tone(600), silence(900)]), 40).tobytes()  # 60 s of audio
    ws = await connect(server.url + "?partials=false")
    await recv_json(ws)

    async def send_all():
        for i in range(0, len(pcm), 3200):
            await ws.send(pcm[i : i + 3200])

    sender = asyncio.create_task(send_all())
    try:
        await eventually(
            lambda: (
                server.server.session_count == 1
                and not next(
                    iter(server.server.admission.connections)
                ).pump.backlog_has_room.is_set()
            ),
            BOUND_S,
            "reading to pause",
        )
        (connection,) = server.server.admission.connections
        assert connection.ws.max_queue_high == WS_MAX_QUEUE_FRAMES  # websockets' own queue
        assert connection.pump.backlog_bytes <= 128 * 1024 + 32000
    finally:
        sender.cancel()
        recognizer.release.set()
        ws.transport.abort()


# -- 2: a client that never reads ---------------------------------------------


async def test_never_reading_client_is_closed_after_the_write_timeout_and_frees_its_slot(fake):
    server = fake(write_timeout_s=0.5, close_timeout_s=0.5, idle_timeout_s=60)
    ws = await never_reading_client(server)
    flood = asyncio.create_task(make_server_write(ws))
    # closed for the blocked send or, if it keeps producing replies, for the outbox
    await eventually(
        lambda: (
            sum(
                metric(server, "streamer_sessions_terminated_total", reason=r)
                for r in ("write_timeout", "outbox_full")
            )
            == 1
        ),
        BOUND_S,
        "the write timeout",
    )
    await eventually(lambda: server.server.session_count == 0, BOUND_S, "the slot to be freed")
    flood.cancel()
    ws.transport.abort()
    # the server goes on serving, and stops promptly
    result = await transcribe(ClientOptions(url=server.url), speech(1), 16000)
    assert len(result.finals) == 1


async def test_idle_timeout_fires_while_a_send_is_blocked(fake):
    server = fake(write_timeout_s=600, close_timeout_s=0.5, idle_timeout_s=1.0)
    ws = await never_reading_client(server)
    await asyncio.wait_for(make_server_write(ws, server=server), timeout_s(BOUND_S))
    await eventually(
        lambda: metric(server, "streamer_sessions_terminated_total", reason="idle_timeout") == 1,
        BOUND_S,
        "the idle timeout",
    )
    await eventually(lambda: server.server.session_count == 0, BOUND_S, "the slot to be freed")
    ws.transport.abort()


async def test_junk_flood_is_answered_once_and_does_not_keep_the_session_alive(fake):
    # read unpaced (the next test paces one): 12 MB is past 1 s of the default pace
    server = fake(idle_timeout_s=1.0, max_input_bytes_per_s=1e12)
    async with connect(server.url) as ws:
        await recv_json(ws)
        junk = "x" * 60000
        for _ in range(200):  # 12 MB of junk
            await ws.send(junk)
        messages, code = await messages_until_close(ws)
    errors = [m for m in messages if m["type"] == "error"]
    assert [e["code"] for e in errors] == ["bad_message", "bad_message", "idle_timeout"]
    assert errors[1]["suppressed"] == 199
    assert all(len(orjson.dumps(m)) < 400 for m in messages)  # nothing echoed
    assert code == 1008


async def test_junk_sent_faster_than_the_pace_still_times_out(fake):
    """A client that never stops sending junk faster than its pace: each pacing pause
    used to count as input time, so the session never went idle and kept its slot."""
    server = fake(idle_timeout_s=1.0, max_input_messages_per_s=20)
    started = time.monotonic()
    async with connect(server.url) as ws:
        await recv_json(ws)
        with pytest.raises(ConnectionClosed):
            while time.monotonic() - started < timeout_s(BOUND_S):
                await ws.send("junk")
                await asyncio.sleep(0.005)  # 200 messages a second: paced at 20
        messages, code = await messages_until_close(ws)
    assert [e["code"] for e in messages if e["type"] == "error"][-1] == "idle_timeout"
    assert code == 1008
    await eventually(lambda: server.server.session_count == 0, BOUND_S, "the slot to be freed")


async def test_shutdown_with_a_blocked_client_ends_within_the_grace_period(fake):
    server = fake(
        write_timeout_s=600, idle_timeout_s=600, shutdown_grace_s=0.5, close_timeout_s=0.5
    )
    ws = await never_reading_client(server)
    await asyncio.wait_for(make_server_write(ws, server=server), timeout_s(BOUND_S))
    await asyncio.to_thread(server.shutdown, BOUND_S)
    assert not server._thread.is_alive()
    ws.transport.abort()


async def test_cutting_the_grace_short_aborts_what_shutdown_still_waits_for(fake):
    """SIGTERM or SIGINT again during the graceful shutdown: no more waiting (the process
    used to die of the signal's default action, with no log and no clean exit)."""
    server = fake(
        write_timeout_s=600, idle_timeout_s=600, shutdown_grace_s=600, close_timeout_s=600
    )
    ws = await never_reading_client(server)
    await asyncio.wait_for(make_server_write(ws, server=server), timeout_s(BOUND_S))
    started = time.monotonic()
    server.loop.call_soon_threadsafe(server._stop.set)  # the graceful shutdown begins
    await asyncio.sleep(0.5)  # time for the shutdown to end, were it not waiting (an absence)
    assert server._thread.is_alive()  # waiting on the blocked client
    server.loop.call_soon_threadsafe(server.server.cut_grace_short)
    await asyncio.to_thread(server._thread.join, timeout_s(BOUND_S))
    assert not server._thread.is_alive() and time.monotonic() - started < timeout_s(BOUND_S)
    ws.transport.abort()


# -- 3: a hung or dead model ---------------------------------------------------


@pytest.mark.parametrize("recognizer", [HangingRecognizer, DyingRecognizer])
async def test_a_stalled_model_tells_every_session_and_turns_unready(fake, recognizer):
    instance = recognizer()
    server = fake(lambda: instance, decode_timeout_s=0.5)
    try:
        async with (
            connect(server.url + "?partials=false") as a,
            connect(server.url + "?partials=false") as b,
        ):
            for ws in (a, b):
                await recv_json(ws)
                # a dying worker may fail on a's audio and close b (1011) before b has
                # sent its own: what b was told is read below all the same
                with contextlib.suppress(ConnectionClosed):
                    await ws.send(speech(2).tobytes())
                    await ws.send('{"type":"stop"}')
            (ma, code_a), (mb, code_b) = await asyncio.gather(
                messages_until_close(a), messages_until_close(b)
            )
        # a dying worker can fail before b's audio is read: b is then told at once
        assert any(m["type"] == "final" for m in ma + mb)
        for messages in (ma, mb):
            finals = [m for m in messages if m["type"] == "final"]
            assert len(finals) == sum(m["type"] == "speech_start" for m in messages)
            assert all(f["error"]["code"] == "model_stalled" for f in finals)
            # told once: fatally while it streamed, or with its finals once it had stopped
            # (it was ending anyway); never both
            told = {(m["code"], m["fatal"]) for m in messages if m["type"] == "error"}
            assert told in ({("model_stalled", True)}, {("model_stalled", False)}), told
            assert messages[-1]["type"] == "end"
        status, body, _ = await asyncio.to_thread(http_get, server.http_url + "/readyz")
        assert status == 503 and orjson.loads(body)["status"] == "model_stalled"
        assert orjson.loads(body)["reason"]
        with pytest.raises(InvalidStatus) as refused:
            await connect(server.url)
        assert refused.value.response.status_code == 503
        assert refused.value.response.headers["Retry-After"]
        assert server.call(server.server.wait_failed(), timeout=5)
    finally:
        if isinstance(instance, HangingRecognizer):
            instance.release.set()


async def test_a_session_open_when_the_model_stalls_is_closed_1011(fake):
    instance = HangingRecognizer()
    server = fake(lambda: instance, decode_timeout_s=0.5)
    try:
        async with connect(server.url + "?partials=false") as ws:
            await recv_json(ws)
            await ws.send(speech(1).tobytes())  # a final is queued; the stream stays open
            messages, code = await messages_until_close(ws)
        assert code == 1011
        # told once, fatally, before the final that failed with it; not again, non-fatally,
        # with that final (the final carries the code)
        errors = [(m["code"], m["fatal"]) for m in messages if m["type"] == "error"]
        assert errors == [("model_stalled", True)]
        assert [m["type"] for m in messages][-3:] == ["error", "final", "end"]
        assert messages[-2]["error"]["code"] == "model_stalled"
    finally:
        instance.release.set()


# -- 5: finalize never loses or splits speech (real tagged model) --------------


async def finals_with_finalize_every(url: str, pcm: np.ndarray, chunk_ms: int | None):
    options = ClientOptions(url=url, stream=StreamOptions(itn=False, partials=False))
    client = await StreamingClient.connect(options)
    finals: list[Final] = []

    async def read():
        async for message in client.messages():
            if isinstance(message, Final):
                finals.append(message)

    reader = asyncio.create_task(read())
    step = 16 * (chunk_ms or 100)
    for i in range(0, pcm.size, step):
        await client.send_audio(pcm[i : i + step])
        if chunk_ms is not None:
            await client.finalize()
    await client.stop()
    await asyncio.wait_for(reader, timeout_s(BOUND_S * 3))
    await client.close()
    return finals


async def test_finalize_spam_gives_the_same_words_as_no_finalize(tagged_server_url, speech_cache):
    fox = synth.speak("the quick brown fox jumps over the lazy dog", "en", cache_dir=speech_cache)
    hello = synth.speak("hello there", "en", cache_dir=speech_cache)
    pcm, _ = synth.join_with_silence([("en", "fox", fox), ("en", "hello", hello)], 1500)
    plain = await finals_with_finalize_every(tagged_server_url, pcm, None)
    expected = ["the quick brown fox jumps over the lazy dog", "hello there"]
    assert [f.text for f in plain] == expected
    for chunk_ms in (20, 40, 100, 320):
        spammed = await finals_with_finalize_every(tagged_server_url, pcm, chunk_ms)
        assert [f.text for f in spammed if f.text] == expected, chunk_ms


# -- 6, 9: HTTP hygiene --------------------------------------------------------


def raw_http(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s(5)) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def get(path: str, *extra: str, method: str = "GET") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", *extra, "", ""]
    return "\r\n".join(lines).encode("latin-1")


@pytest.mark.parametrize("port_name", ["main", "funasr"])
async def test_malformed_requests_get_400_and_nothing_is_echoed(fake, port_name):
    """The same request checks on the main port and on the FunASR port (where a repeated
    header was a 500 with a traceback, and websockets' refusals echoed header values)."""
    server = fake(token="s3cret", allowed_origins=("http://good.example",), funasr_port=0)
    if port_name == "main":
        port, ws_path = server.port, "/v1/asr"
    else:
        port, ws_path = server.server.listeners["funasr"].port, "/"
    cases = [
        get(ws_path, "Authorization: Bearer a", "Authorization: Bearer b"),
        get(ws_path, "Origin: http://good.example", "Origin: http://good.example"),
        get("/" + "a" * 300),
        get("/static/\x00name"),
    ]
    for request in cases:
        status, headers, body = await asyncio.to_thread(raw_http, port, request)
        assert status == 400, request
        assert json.loads(body)["error"] == "bad_request"
        assert b"aaaa" not in body and b"Bearer" not in body and b"good" not in body
    marker = "zz-echo-marker"
    for request, expected in [
        (get(f"/{marker}"), 404),
        (get(f"{ws_path}?token=s3cret", f"Origin: http://{marker}"), 403),
        (get(f"{ws_path}?token=s3cret", f"Connection: {marker}"), 426),
    ]:
        status, _, body = await asyncio.to_thread(raw_http, port, request)
        assert status == expected and marker.encode() not in body, (request, body)


async def test_a_handshake_of_another_websocket_version_is_told_ours(fake):
    server = fake()
    upgrade = (
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
    )
    for version, key in (("8", None), ("13", "Sec-WebSocket-Key: not-base64!")):
        headers = [*upgrade, f"Sec-WebSocket-Version: {version}"]
        if key is not None:
            headers[2] = key
        status, answer, body = await asyncio.to_thread(
            raw_http, server.port, get("/v1/asr", *headers)
        )
        assert status == 400, (version, body)
        assert answer["sec-websocket-version"] == "13"
        assert json.loads(body)["error"] == "bad_handshake"


def raw_answer(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s(5)) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


async def test_the_web_demo_s_page_is_the_same_at_every_request(fake):
    """The port's headers go on a copy of the cached page (each request added one more
    ``Server`` header to the cached answer)."""
    server = fake()
    answers = [await asyncio.to_thread(raw_answer, server.port, get("/")) for _ in range(3)]
    assert answers[0].startswith(b"HTTP/1.1 200 ")
    assert answers[0] == answers[1] == answers[2]
    assert answers[0].count(b"\r\nServer: ") == 1


async def test_only_get_and_head_are_served(fake):
    server = fake()
    for method in ("POST", "PUT", "DELETE", "OPTIONS", "PATCH"):
        status, headers, _ = await asyncio.to_thread(
            raw_http, server.port, get("/healthz", method=method)
        )
        assert status == 405 and "GET" in headers["allow"]
    status, headers, body = await asyncio.to_thread(
        raw_http, server.port, get("/healthz", method="HEAD")
    )
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0
    status, _, body = await asyncio.to_thread(raw_http, server.port, get("/healthz"))
    assert status == 200 and int(headers["content-length"]) == len(body)


async def test_metrics_need_the_token_unless_public(fake):
    server = fake(token="s3cret")
    status, *_ = await asyncio.to_thread(http_get, server.http_url + "/metrics")
    assert status == 401
    status, body, _ = await asyncio.to_thread(http_get, server.http_url + "/metrics?token=s3cret")
    assert status == 200 and b"streamer_sessions_active" in body
    public = fake(token="s3cret", public_metrics=True)
    status, *_ = await asyncio.to_thread(http_get, public.http_url + "/metrics")
    assert status == 200


async def test_503_carries_retry_after(fake):
    server = fake(max_sessions=1)
    async with connect(server.url) as ws:
        await recv_json(ws)
        with pytest.raises(InvalidStatus) as refused:
            await connect(server.url)
    assert refused.value.response.status_code == 503
    assert int(refused.value.response.headers["Retry-After"]) > 0


# -- 7: shutdown ---------------------------------------------------------------


async def test_audio_streamed_after_server_shutdown_is_dropped_quietly(fake):
    server = fake(lambda: FakeRecognizer(delay_s=0.05), shutdown_grace_s=5)
    async with connect(server.url + "?partials=false") as ws:
        await recv_json(ws)
        await ws.send(np.concatenate([silence(300), tone(600)]).tobytes())

        async def keep_streaming():
            for _ in range(200):
                await ws.send(tone(40).tobytes())
                await asyncio.sleep(0.01)

        streamer = asyncio.create_task(keep_streaming())
        await asyncio.sleep(0.2)
        stopper = asyncio.create_task(asyncio.to_thread(server.shutdown, BOUND_S))
        messages, code = await messages_until_close(ws)
        streamer.cancel()
        await stopper
    assert code == 1001 and messages[-1]["type"] == "end"
    assert [m["code"] for m in messages if m["type"] == "error"] == ["server_shutdown"]


async def test_a_flood_of_tiny_frames_is_parsed_a_slice_at_a_time(fake, monkeypatch):
    """websockets parsed each socket read whole (up to 256 KiB: 32768 frames of 2 bytes,
    270 ms of the loop) and queued every frame; now one callback parses at most a slice,
    only while the queue has room, and every byte still arrives, in order."""
    from websockets.server import ServerProtocol

    from streamer.server.websocket import READ_SLICE_BYTES, WebSocket

    parsed: list[int] = []  # what each call gave the server's protocol to parse
    queued: list[int] = []  # the messages waiting for the session after each
    receive_data, process = ServerProtocol.receive_data, WebSocket._process

    def recording(self, data: bytes) -> None:
        parsed.append(len(data))
        receive_data(self, data)

    def counting(self, *, lost: bool = False) -> None:
        process(self, lost=lost)
        queued.append(len(self._messages))

    monkeypatch.setattr(ServerProtocol, "receive_data", recording)
    monkeypatch.setattr(WebSocket, "_process", counting)
    server = fake(max_input_messages_per_s=1e6)  # unpaced: the parsing is what is tested
    frames = 20000
    async with connect(server.url, max_queue=None) as ws:
        await recv_json(ws)
        for i in range(frames):
            await ws.send(b"\x00\x00")
            if i % 1000 == 999:
                await asyncio.sleep(0)  # let the socket fill while the server paces
        await ws.send('{"type":"stop"}')
        messages, code = await messages_until_close(ws)
    assert code == 1000
    assert messages[-1]["type"] == "end" and messages[-1]["audio_ms"] == frames / 16
    assert parsed and max(parsed) <= READ_SLICE_BYTES
    # the queue holds one slice's frames at most (8 bytes each) beyond its limit
    assert max(queued) <= WS_MAX_QUEUE_FRAMES + READ_SLICE_BYTES // 8
