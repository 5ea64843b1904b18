"""The FunASR and Wyoming ports over loopback with a test-double recognizer: admission,
auth, bad input, limits and shutdown, each next to a protocol v1 session that must not
notice. The real client libraries with the real model are in ``test_compat_clients.py``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from streamer.client.connection import ClientOptions, StreamingClient
from streamer.client.streaming import transcribe
from streamer.core.compat.wyoming import WyomingEvent, encode_event
from streamer.core.protocol import StreamOptions
from streamer.errors import ConfigError
from streamer.server import wyoming as wyoming_server
from streamer.server.server import ServerOptions
from tests.fakes import FakeRecognizer, silence, tone
from tests.server_fixtures import make_server  # noqa: F401  (fixture)
from tests.support import AUDIO_FORMAT, Wyoming, speech
from tests.timing import eventually, timeout_s

FIRST = {"mode": "2pass", "wav_name": "t", "is_speaking": True, "audio_fs": 16000}


def funasr_uri(server) -> str:
    return f"ws://127.0.0.1:{server.server.listeners['funasr'].port}/"


async def funasr_drain(ws, timeout: float = 20) -> tuple[list[dict], int | None]:
    """Every message until the server closes; returns (messages, close code)."""
    messages = []
    try:
        while True:
            messages.append(orjson.loads(await asyncio.wait_for(ws.recv(), timeout_s(timeout))))
    except ConnectionClosed as closed:
        return messages, closed.rcvd.code if closed.rcvd else None


async def funasr_until_final(ws, timeout: float = 20) -> list[dict]:
    messages: list[dict] = []
    while not (messages and messages[-1]["is_final"]):
        messages.append(orjson.loads(await asyncio.wait_for(ws.recv(), timeout_s(timeout))))
    return messages


# -- the FunASR port -------------------------------------------------------------------


async def test_funasr_echoes_binary_and_needs_no_subprotocol(make_ports_server):
    server = make_ports_server()
    uri = funasr_uri(server)
    for offered, expected in ((["binary"], "binary"), (None, None)):
        async with connect(uri, subprotocols=offered) as ws:
            assert ws.subprotocol == expected
            await ws.send(json.dumps(FIRST))
            await ws.send(speech(1, lead_ms=300).tobytes())
            await ws.send('{"is_speaking": false}')
            (final,) = [m for m in await funasr_until_final(ws) if m["text"]]
            assert final["text"] == "audio 1100 ms"  # the fake's answer: the segment length
    with pytest.raises(InvalidStatus) as refused:
        await connect(uri + "v1/asr")
    assert refused.value.response.status_code == 404


async def test_funasr_token_in_the_url(make_ports_server):
    server = make_ports_server(token="s3cret", wyoming_port=None)
    for uri in (funasr_uri(server), funasr_uri(server) + "?token=nope"):
        with pytest.raises(InvalidStatus) as refused:
            await connect(uri)
        assert refused.value.response.status_code == 401
    async with connect(funasr_uri(server) + "?token=s3cret") as ws:
        await ws.send(json.dumps(FIRST | {"is_speaking": False}))
        assert (await funasr_until_final(ws))[-1]["is_final"] is True


def test_wyoming_with_a_token_needs_an_explicit_opt_in():
    with pytest.raises(ConfigError, match="wyoming-insecure"):
        ServerOptions(token="s3cret", wyoming_port=10300)
    ServerOptions(token="s3cret", wyoming_port=10300, wyoming_insecure=True)


# -- shared limits ---------------------------------------------------------------------


async def test_max_sessions_is_shared_by_every_protocol(make_ports_server):
    server = make_ports_server(max_sessions=1)
    client = await StreamingClient.connect(ClientOptions(url=server.url))
    with pytest.raises(InvalidStatus) as refused:
        await connect(funasr_uri(server))
    assert refused.value.response.status_code == 503
    refused_wyoming = await Wyoming.open(server)
    (error,) = await refused_wyoming.events()
    assert (error.type, error.data["code"]) == ("error", "server_full")
    await client.close()
    await eventually(lambda: server.server.session_count == 0)
    wyoming = await Wyoming.open(server)  # the slot is free again
    await wyoming.send(WyomingEvent("describe"))
    parser_events: list[WyomingEvent] = []
    while not parser_events:
        parser_events += wyoming.parser.feed(
            await asyncio.wait_for(wyoming.reader.read(65536), timeout_s(5))
        )
    assert parser_events[0].type == "info"
    wyoming.writer.close()


async def test_bad_input_in_each_protocol_gets_its_error_and_others_lose_nothing(
    make_ports_server,
):
    server = make_ports_server()
    pcm = speech(3, lead_ms=300)
    v1 = asyncio.create_task(
        transcribe(
            ClientOptions(url=server.url, stream=StreamOptions(partials=False)),
            pcm,
            16000,
            speed=4.0,
        )
    )
    bad_funasr = [
        (None, "unexpected_message"),  # audio before the first JSON
        ("not json at all", "bad_message"),
        (json.dumps(FIRST | {"audio_fs": 11025}), "unsupported_sample_rate"),
        (json.dumps(FIRST | {"wav_format": "mp4"}), "invalid_option"),
    ]
    for first, code in bad_funasr:
        async with connect(funasr_uri(server)) as ws:
            await ws.send(first if first is not None else tone(100).tobytes())
            messages, close_code = await funasr_drain(ws)
        (error,) = messages
        assert error["error"]["code"] == code and error["is_final"] is True
        assert error["text"].startswith("ERROR. ") and close_code == 1008
    bad_wyoming = [
        (b"garbage\n", "bad_message"),
        (b"x" * 70_000, "message_too_big"),
        (b'{"type": "audio-chunk", "payload_length": 99999999}\n', "message_too_big"),
        (
            encode_event(WyomingEvent("audio-start", {"rate": 11025, "width": 2, "channels": 1})),
            "unsupported_sample_rate",
        ),
    ]
    for wire, code in bad_wyoming:
        wyoming = await Wyoming.open(server)
        wyoming.writer.write(wire)
        (error,) = await wyoming.events()
        assert (error.type, error.data["code"]) == ("error", code)
    result = await v1
    assert [f.text for f in result.finals] == ["audio 1100 ms", "audio 1300 ms", "audio 1500 ms"]


async def test_funasr_error_mid_stream_delivers_the_speech_heard_first(make_ports_server):
    server = make_ports_server()
    async with connect(funasr_uri(server)) as ws:
        await ws.send(json.dumps(FIRST))
        await ws.send(speech(1, lead_ms=300).tobytes())
        await eventually(
            lambda: server.worker.stats().live.finals_total == 1, what="the final decoded"
        )
        await ws.send("{oops")
        messages, close_code = await funasr_drain(ws)
    assert [m["text"] for m in messages][0] == "audio 1100 ms"
    assert messages[-1]["error"]["code"] == "bad_message" and close_code == 1008


async def test_wyoming_idle_timeout(make_ports_server):
    server = make_ports_server(idle_timeout_s=0.5)
    wyoming = await Wyoming.open(server)
    await wyoming.send(WyomingEvent("audio-start", AUDIO_FORMAT))
    (error,) = await wyoming.events()
    assert error.data["code"] == "idle_timeout"


async def test_wyoming_half_closed_after_audio_stop_still_gets_its_transcript(
    make_ports_server,
):
    server = make_ports_server(load=lambda: FakeRecognizer(delay_s=0.2))
    wyoming = await Wyoming.open(server)
    await wyoming.audio(speech(2, lead_ms=300))
    await wyoming.send(WyomingEvent("audio-stop"))
    wyoming.writer.write_eof()  # like `nc -N`: done sending, still reading
    events = await wyoming.events()
    (transcript,) = [e for e in events if e.type == "transcript"]
    assert transcript.data["text"] == "audio 1100 ms audio 1300 ms"


async def test_wyoming_half_closed_without_audio_stop_still_gets_its_transcript(
    make_ports_server,
):
    """Closing the sending side ends the audio like audio-stop: nothing heard is lost."""
    server = make_ports_server(load=lambda: FakeRecognizer(delay_s=0.2))
    wyoming = await Wyoming.open(server)
    await wyoming.audio(speech(2, lead_ms=300))
    wyoming.writer.write_eof()
    events = await wyoming.events()
    (transcript,) = [e for e in events if e.type == "transcript"]
    assert transcript.data["text"] == "audio 1100 ms audio 1300 ms"


async def test_a_wyoming_connection_that_sends_nothing_takes_no_session(
    make_ports_server, monkeypatch
):
    """A port scan or a TCP health check must not fill --max-sessions for every protocol."""
    monkeypatch.setattr(wyoming_server, "FIRST_BYTES_TIMEOUT_S", 1.0)
    server = make_ports_server(max_sessions=1)
    silent = [await Wyoming.open(server) for _ in range(3)]
    await asyncio.sleep(0.2)  # time for a session to be taken, were one taken (an absence)
    assert server.server.session_count == 0
    pcm = speech(1, lead_ms=300)
    result = await transcribe(ClientOptions(url=server.url), pcm, 16000)  # admitted
    assert [f.text for f in result.finals] == ["audio 1100 ms"]
    # then closed, without a word: nothing was asked
    assert [await c.events(timeout=5) for c in silent] == [[], [], []]
    # a client that speaks once admitted gets its session as before
    wyoming = await Wyoming.open(server)
    await asyncio.sleep(0.2)
    await wyoming.audio(speech(1, lead_ms=300))
    await wyoming.send(WyomingEvent("audio-stop"))
    (transcript,) = [e for e in await wyoming.events() if e.type == "transcript"]
    assert transcript.data["text"] == "audio 1100 ms"


async def test_wyoming_unpaced_long_stream_is_back_pressured(make_ports_server):
    recognizer = FakeRecognizer(delay_s=0.03)
    server = make_ports_server(
        load=lambda: recognizer, max_pending_finals=2, max_backlog_bytes=64_000
    )
    pcm = np.concatenate([np.concatenate([tone(1000), silence(700)]) for _ in range(30)])
    depths = []

    async def watch_queue():
        while True:
            depths.append(server.worker.stats().queued_finals)
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch_queue())
    wyoming = await Wyoming.open(server)
    await wyoming.audio(pcm, chunk=16000)
    await wyoming.send(WyomingEvent("audio-stop"))
    events = await wyoming.events(timeout=60)
    watcher.cancel()
    (transcript,) = [e for e in events if e.type == "transcript"]
    assert transcript.data["text"] == " ".join(["audio 1200 ms"] + ["audio 1500 ms"] * 29)
    assert max(depths) <= 2  # reading paused instead of queueing the whole stream


@pytest.mark.parametrize(
    ("offered", "is_final"),
    [(["binary"], True), (None, False)],
    ids=["funasr-python (is_final true)", "html5 demo (the C++ server's is_final false)"],
)
async def test_the_offline_result_has_the_clients_dialect(make_ports_server, offered, is_final):
    """FunASR's Python clients offer "binary" and stop at the first is_final true; the
    html5 demo (a browser: no subprotocol) finishes its file mode on the C++ server's
    is_final false."""
    server = make_ports_server()
    async with connect(funasr_uri(server), subprotocols=offered) as ws:
        await ws.send(json.dumps(FIRST | {"mode": "offline", "wav_format": "PCM"}))
        await ws.send(np.concatenate([silence(300), tone(800), silence(900)]).tobytes())
        await ws.send(json.dumps({"is_speaking": False}))
        last = orjson.loads(await asyncio.wait_for(ws.recv(), timeout_s(20)))
    assert (last["mode"], last["text"], last["is_final"]) == ("offline", "audio 1300 ms", is_final)


async def test_shutdown_finishes_open_utterances_in_both_protocols(make_ports_server):
    server = make_ports_server(load=lambda: FakeRecognizer(delay_s=0.05))
    ws = await connect(funasr_uri(server), subprotocols=["binary"])  # funasr-python's dialect
    await ws.send(json.dumps(FIRST | {"mode": "offline"}))
    await ws.send(np.concatenate([silence(300), tone(1500)]).tobytes())
    wyoming = await Wyoming.open(server)
    await wyoming.audio(np.concatenate([silence(300), tone(1000)]))
    await asyncio.sleep(0.3)
    await asyncio.to_thread(server.shutdown)
    messages, close_code = await funasr_drain(ws)
    assert close_code == 1001
    assert [(m["text"], m["is_final"]) for m in messages] == [("audio 1800 ms", True)]
    events = await wyoming.events()
    (transcript,) = [e for e in events if e.type == "transcript"]
    assert transcript.data["text"] == "audio 1300 ms"


async def test_metrics_count_sessions_by_protocol(make_ports_server):
    server = make_ports_server()
    async with connect(funasr_uri(server)) as ws:
        await ws.send(json.dumps(FIRST | {"is_speaking": False}))
        await funasr_until_final(ws)
    wyoming = await Wyoming.open(server)
    await wyoming.send(WyomingEvent("audio-stop"))
    await wyoming.events()
    client = await StreamingClient.connect(ClientOptions(url=server.url))
    await client.close()
    text = server.server.metrics.render().decode()
    for name in ("funasr", "wyoming", "v1"):
        assert f'streamer_sessions_total{{protocol="{name}"}} 1.0' in text


def test_cli_flags_and_environment(monkeypatch):
    from streamer.cli import build_parser
    from streamer.cli.serve_options import server_options_from

    args = build_parser().parse_args(["serve", "--funasr-port", "10095", "--wyoming-port", "0"])
    options = server_options_from(args)
    assert (options.funasr_port, options.wyoming_port, options.wyoming_insecure) == (
        10095,
        0,
        False,
    )
    assert server_options_from(build_parser().parse_args(["serve"])).funasr_port is None
    monkeypatch.setenv("STREAMER_WYOMING_PORT", "10300")
    monkeypatch.setenv("STREAMER_WYOMING_INSECURE", "1")
    options = server_options_from(build_parser().parse_args(["serve", "--token", "t"]))
    assert (options.wyoming_port, options.wyoming_insecure) == (10300, True)


async def test_funasr_client_faster_than_the_model_is_back_pressured_not_killed(
    make_ports_server,
):
    """A FunASR client streams unpaced (as file_asr_stream does) and sends no pings
    (FunASR's clients connect with ping_interval=None) while the model decodes slower
    than the server's ping timeout: reading pauses for back-pressure, so the server's
    pongs wait behind queued audio. The keepalive must not count that pause: every
    utterance and the is_final arrive (websockets' own keepalive closed it with 1011)."""
    server = make_ports_server(
        load=lambda: FakeRecognizer(delay_s=0.4),
        max_pending_finals=1,
        max_backlog_bytes=64 * 1024,
        ping_interval_s=0.2,
        ping_timeout_s=0.5,
        wyoming_port=None,
    )
    utterances = 8
    pcm = speech(utterances, lead_ms=300).astype("<i2").tobytes()
    async with connect(funasr_uri(server), subprotocols=["binary"], ping_interval=None) as ws:
        await ws.send(json.dumps(FIRST | {"mode": "offline"}))
        for i in range(0, len(pcm), 3200):  # unpaced, as fast as the socket takes it
            await ws.send(pcm[i : i + 3200])
        await ws.send('{"is_speaking": false}')
        messages = await funasr_until_final(ws, timeout=60)
    expected = " ".join(f"audio {1100 + 200 * i} ms" for i in range(utterances))
    assert messages[-1]["is_final"] is True  # offline mode: one text, every utterance
    assert messages[-1]["text"] == expected, messages
    registry = server.server.metrics.registry
    killed = registry.get_sample_value(
        "streamer_sessions_terminated_total", {"reason": "keepalive_timeout"}
    )
    assert not killed


@pytest.mark.parametrize(
    ("limits", "reason"),
    [
        ({"write_timeout_s": 600}, "outbox_full"),  # answers pile up past max_outbox_bytes
        ({"write_timeout_s": 0.5, "max_outbox_bytes": 64 << 20}, "write_timeout"),
    ],
)
async def test_a_never_reading_wyoming_client_is_bounded_and_closed(
    make_ports_server, limits, reason
):
    """A Wyoming client that floods describe (each answered with a 660-byte info) and
    reads nothing: the answers wait in the pump's bounded outbox, and past the bound or
    the write timeout the session is closed and its slot freed, as on a WebSocket (the
    Wyoming outbox was unbounded: +36 MB in 10 s)."""
    server = make_ports_server(funasr_port=None, **limits)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.server.listeners["wyoming"].port))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    describe = encode_event(WyomingEvent("describe"))
    writer.write(describe)
    await writer.drain()
    await eventually(lambda: server.server.session_count == 1, 10)
    (connection,) = server.server.admission.connections
    server_sock = connection.writer.transport.get_extra_info("socket")
    # loopback send buffers grow to megabytes: a small one stands in for a stalled peer
    server.loop.call_soon_threadsafe(
        server_sock.setsockopt, socket.SOL_SOCKET, socket.SO_SNDBUF, 4096
    )
    registry = server.server.metrics.registry

    def terminated() -> float:
        value = registry.get_sample_value("streamer_sessions_terminated_total", {"reason": reason})
        return value or 0.0

    with contextlib.suppress(ConnectionError):
        for _ in range(400):  # at most 400 x 100 describes: 26 MB of answers
            if terminated():
                break
            writer.write(describe * 100)
            await writer.drain()
            await asyncio.sleep(0.01)
    await eventually(lambda: server.server.session_count == 0, 10, "the slot to be freed")
    assert terminated() == 1
    assert server.server.session_count == 0  # the slot is free
    writer.transport.abort()
