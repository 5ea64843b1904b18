"""One limit, every transport: what the session pump owns holds for the WebSocket port and
the Wyoming port alike: the outbox bound and the write timeout for a never-reading client,
the idle timeout for a silent one, back-pressure (the pending-finals gate pauses reading)
for an unpaced one, and the accounting (audio seconds, finals, the first partial) for
speech, which holds for every protocol's adapter too.

The pump (``server/pump.py``) owns the outbox and the write timeout; the transports are
thin readers and writers over it. Each case runs the same check through each transport:
a client that never reads makes the server write (WebSocket: an audio byte and an invalid
text frame, each answered with an error; Wyoming: ``describe``, answered with ``info``),
the outbox stays within its bound, the session is closed for the expected reason and its
slot freed, and the server goes on serving that transport.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket

import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from streamer.core.compat.wyoming import EventParser, WyomingEvent, encode_event
from tests.fakes import FakeRecognizer, loudness_classifier, silence, tone
from tests.server_fixtures import (  # noqa: F401  (make_server: a fixture)
    ServerThread,
    make_server,
    messages_until_close,
)
from tests.timing import eventually, timeout_s

BOUND_S = 20  # every wait gives up after this, scaled (a failure, never a pass)
MAX_OUTBOX_BYTES = 64 * 1024
DESCRIBE = encode_event(WyomingEvent("describe"))


def tiny_receive_buffer_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


class NeverReadingWebSocket:
    """A protocol v1 client that never reads (websockets stops reading at one message)."""

    def __init__(self, server: ServerThread) -> None:
        self.server = server

    async def open(self) -> None:
        sock = tiny_receive_buffer_socket(self.server.port)
        self.ws = await connect(self.server.url, sock=sock, ping_interval=None, max_queue=1)

    def server_socket(self, connection) -> socket.socket:
        return connection.ws.transport.get_extra_info("socket")

    async def provoke(self, times: int) -> None:
        for _ in range(times):
            await self.ws.send(b"\x00")  # audio between errors: no error burst
            await self.ws.send("junk")  # answered with an error message

    def abort(self) -> None:
        self.ws.transport.abort()

    async def still_served(self) -> bool:
        async with connect(self.server.url) as ws:
            return '"ready"' in str(await asyncio.wait_for(ws.recv(), timeout_s(BOUND_S)))


class NeverReadingWyoming:
    """A Wyoming client that never reads."""

    def __init__(self, server: ServerThread) -> None:
        self.server = server
        self.port = server.server.listeners["wyoming"].port

    async def open(self) -> None:
        sock = tiny_receive_buffer_socket(self.port)
        self.reader, self.writer = await asyncio.open_connection(sock=sock)
        self.writer.write(DESCRIBE)
        await self.writer.drain()

    def server_socket(self, connection) -> socket.socket:
        return connection.writer.transport.get_extra_info("socket")

    async def provoke(self, times: int) -> None:
        self.writer.write(DESCRIBE * times)  # each answered with a 660-byte info
        await self.writer.drain()

    def abort(self) -> None:
        self.writer.transport.abort()

    async def still_served(self) -> bool:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(DESCRIBE)
            await writer.drain()
            parser = EventParser()
            while True:
                data = await asyncio.wait_for(reader.read(65536), timeout_s(BOUND_S))
                if not data:
                    return False
                for event in parser.feed(data):
                    if event.type == "info":
                        return True
        finally:
            writer.close()


TRANSPORTS = {"websocket": NeverReadingWebSocket, "wyoming": NeverReadingWyoming}


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize(
    ("limits", "reason"),
    [
        ({"write_timeout_s": 600, "max_outbox_bytes": MAX_OUTBOX_BYTES}, "outbox_full"),
        ({"write_timeout_s": 0.5, "max_outbox_bytes": 64 << 20}, "write_timeout"),
    ],
    ids=["outbox_bound", "write_timeout"],
)
async def test_a_never_reading_client_is_bounded_and_closed_on_every_transport(
    make_server,  # noqa: F811
    transport: str,
    limits: dict,
    reason: str,
) -> None:
    server = make_server(
        lambda: FakeRecognizer(delay_s=0.01),
        classifier_factory=loudness_classifier,
        wyoming_port=0,
        close_timeout_s=0.5,
        idle_timeout_s=600,
        **limits,
    )
    client = TRANSPORTS[transport](server)
    await client.open()
    await eventually(lambda: server.server.session_count == 1, BOUND_S, "the session")
    (connection,) = server.server.admission.connections
    # loopback send buffers grow to megabytes: a small one stands in for a stalled peer
    server.loop.call_soon_threadsafe(
        client.server_socket(connection).setsockopt, socket.SOL_SOCKET, socket.SO_SNDBUF, 4096
    )
    registry = server.server.metrics.registry

    def terminated() -> float:
        value = registry.get_sample_value("streamer_sessions_terminated_total", {"reason": reason})
        return value or 0.0

    waiting: list[int] = []

    async def sample() -> None:  # what waits in the outbox, every 2 ms
        while True:
            waiting.append(connection.pump.outbox_bytes)
            await asyncio.sleep(0.002)

    sampler = asyncio.create_task(sample())
    with contextlib.suppress(ConnectionError, OSError):
        for _ in range(10_000):  # 20 answers a round: far past the bound and the timeout
            if terminated():
                break
            await client.provoke(20)
            await asyncio.sleep(0.005)
    await eventually(lambda: server.server.session_count == 0, BOUND_S, "the slot to be freed")
    sampler.cancel()
    client.abort()
    most_waiting = max(waiting)
    assert terminated() == 1
    assert 0 < most_waiting <= limits["max_outbox_bytes"]
    assert await client.still_served()


# -- the same session through each transport: idle timeout, accounting ----------------------

AUDIO_FORMAT = {"rate": 16000, "width": 2, "channels": 1}


async def wyoming_events_until_close(reader) -> list[WyomingEvent]:
    parser, events = EventParser(), []
    async with asyncio.timeout(timeout_s(BOUND_S)):
        while data := await reader.read(65536):
            events += parser.feed(data)
    return events


async def websocket_session(server: ServerThread, pcm: np.ndarray | None) -> list[str]:
    """A v1 session: ``pcm`` then stop (None: silent, nothing sent); what it was told."""
    async with connect(server.url + "?partials=false") as ws:
        assert orjson.loads(await ws.recv())["type"] == "ready"
        if pcm is not None:
            await ws.send(pcm.tobytes())
            await ws.send('{"type":"stop"}')
        messages, _ = await messages_until_close(ws, BOUND_S)
    return [m["type"] if m["type"] != "error" else m["code"] for m in messages]


async def wyoming_session(server: ServerThread, pcm: np.ndarray | None) -> list[str]:
    """A Wyoming session: audio-start, ``pcm``, audio-stop (None: audio-start, then
    silent); the events it was told (an error's code in place of "error")."""
    port = server.server.listeners["wyoming"].port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    events = [WyomingEvent("audio-start", AUDIO_FORMAT)]
    if pcm is not None:
        data = pcm.astype("<i2").tobytes()
        events += [
            WyomingEvent("audio-chunk", AUDIO_FORMAT, data[i : i + 2048])
            for i in range(0, len(data), 2048)
        ]
        events.append(WyomingEvent("audio-stop"))
    writer.write(b"".join(encode_event(e) for e in events))
    await writer.drain()
    if pcm is not None:
        writer.write_eof()  # done sending (like `nc -N`), still reading
    told = await wyoming_events_until_close(reader)
    writer.close()
    return [e.type if e.type != "error" else e.data["code"] for e in told]


SESSIONS = {"websocket": websocket_session, "wyoming": wyoming_session}


def counter(server: ServerThread, name: str, **labels: str) -> float:
    registry = server.server.metrics.registry
    return sum(
        sample.value
        for metric in registry.collect()
        for sample in metric.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


@pytest.mark.parametrize("transport", sorted(SESSIONS))
async def test_a_silent_client_is_closed_by_the_idle_timeout_on_every_transport(
    make_server,  # noqa: F811
    transport: str,
) -> None:
    server = make_server(
        FakeRecognizer, classifier_factory=loudness_classifier, wyoming_port=0, idle_timeout_s=0.5
    )
    told = await SESSIONS[transport](server, None)
    assert "idle_timeout" in told, told
    assert counter(server, "streamer_errors_total", code="idle_timeout") == 1
    await eventually(lambda: server.server.session_count == 0, BOUND_S, "the slot to be freed")


@pytest.mark.parametrize("transport", sorted(SESSIONS))
async def test_speech_is_counted_alike_on_every_transport(
    make_server,  # noqa: F811
    transport: str,
) -> None:
    """Two utterances: two finals, the session's own audio seconds, one session; and the
    client is told of both (v1: two finals; Wyoming: one transcript of both)."""
    server = make_server(
        lambda: FakeRecognizer(delay_s=0.01), classifier_factory=loudness_classifier, wyoming_port=0
    )
    pcm = np.concatenate([silence(300), tone(600), silence(900), tone(800), silence(900)])
    told = await SESSIONS[transport](server, pcm)
    assert told.count("final" if transport == "websocket" else "transcript") == (
        2 if transport == "websocket" else 1
    ), told
    await eventually(lambda: server.server.session_count == 0, BOUND_S, "the session's end")
    assert counter(server, "streamer_segments_total") == 2
    assert counter(server, "streamer_audio_seconds_total") == pytest.approx(pcm.size / 16000)
    assert counter(server, "streamer_sessions_total") == 1
    assert counter(server, "streamer_sessions_terminated_total") == 0
    assert counter(server, "streamer_time_to_first_partial_seconds_count") == 2


@pytest.mark.parametrize("transport", sorted(SESSIONS))
async def test_an_unpaced_client_is_back_pressured_and_gets_every_final_on_every_transport(
    make_server,  # noqa: F811
    transport: str,
) -> None:
    """Eight utterances sent as fast as the socket takes them to a model slower than the
    audio: the pending-finals gate fills the backlog, reading pauses (TCP pushes back),
    and every utterance still gets its final, on either transport."""
    server = make_server(
        lambda: FakeRecognizer(delay_s=0.2),
        classifier_factory=loudness_classifier,
        wyoming_port=0,
        max_pending_finals=1,
        max_backlog_bytes=64 * 1024,
    )
    parts = [silence(300)]
    for i in range(8):
        parts += [tone(600 + 200 * i), silence(900)]
    pcm = np.concatenate(parts)
    paused: list[bool] = []

    async def watch() -> None:  # whether the pump ever stopped reading
        while True:
            paused.extend(
                not c.pump.backlog_has_room.is_set() for c in server.server.admission.connections
            )
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        told = await SESSIONS[transport](server, pcm)
    finally:
        watcher.cancel()
    assert any(paused), "reading never paused: the backlog was not back-pressured"
    assert counter(server, "streamer_segments_total") == 8
    if transport == "websocket":
        assert told.count("final") == 8, told
    else:
        assert told.count("transcript") == 1, told
    assert counter(server, "streamer_sessions_terminated_total") == 0


# -- the same accounting through every protocol ---------------------------------------------


async def until_closed_or(ws, done) -> list[dict]:
    """Messages until the server closes or ``done(messages)``; then the client closes."""
    messages: list[dict] = []
    with contextlib.suppress(ConnectionClosed):
        while not done(messages):
            messages.append(orjson.loads(await asyncio.wait_for(ws.recv(), timeout_s(BOUND_S))))
    await ws.close()
    return messages


async def deepgram_session(server: ServerThread, pcm: np.ndarray) -> list[dict]:
    query = "encoding=linear16&sample_rate=16000&channels=1"
    async with connect(f"ws://127.0.0.1:{server.port}/v1/listen?{query}") as ws:
        await ws.send(pcm.tobytes())
        await ws.send('{"type": "CloseStream"}')
        return await until_closed_or(ws, lambda m: False)


async def openai_session(server: ServerThread, pcm: np.ndarray) -> list[dict]:
    update = {
        "type": "session.update",
        "session": {
            "type": "transcription",
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": 16000},
                    "turn_detection": {"type": "server_vad", "silence_duration_ms": 500},
                }
            },
        },
    }
    url = f"ws://127.0.0.1:{server.port}/v1/realtime?intent=transcription"
    async with connect(url) as ws:
        await ws.send(json.dumps(update))
        audio = base64.b64encode(pcm.tobytes()).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
        completed = "conversation.item.input_audio_transcription.completed"
        return await until_closed_or(ws, lambda m: sum(x.get("type") == completed for x in m) == 2)


async def funasr_session(server: ServerThread, pcm: np.ndarray) -> list[dict]:
    first = {"mode": "2pass", "wav_name": "t", "is_speaking": True, "audio_fs": 16000}
    port = server.server.listeners["funasr"].port
    async with connect(f"ws://127.0.0.1:{port}/", subprotocols=["binary"]) as ws:
        await ws.send(json.dumps(first))
        await ws.send(pcm.tobytes())
        await ws.send('{"is_speaking": false}')
        return await until_closed_or(ws, lambda m: bool(m) and m[-1].get("is_final") is True)


async def v1_session(server: ServerThread, pcm: np.ndarray) -> list[dict]:
    async with connect(server.url) as ws:
        await ws.send(pcm.tobytes())
        await ws.send('{"type":"stop"}')
        return await until_closed_or(ws, lambda m: False)


async def wyoming_protocol_session(server: ServerThread, pcm: np.ndarray) -> list[str]:
    return await wyoming_session(server, pcm)


PROTOCOLS = {
    "v1": v1_session,
    "deepgram": deepgram_session,
    "openai": openai_session,
    "funasr": funasr_session,
    "wyoming": wyoming_protocol_session,
}


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
async def test_speech_is_counted_alike_through_every_protocol(
    make_server,  # noqa: F811
    protocol: str,
) -> None:
    """Two utterances through each protocol's adapter: two segments and two first-text
    observations in /metrics, whether or not the protocol has an event for a speech
    start (Deepgram without vad_events, FunASR and Wyoming have none)."""
    server = make_server(
        lambda: FakeRecognizer(delay_s=0.01),
        classifier_factory=loudness_classifier,
        wyoming_port=0,
        funasr_port=0,
    )
    pcm = np.concatenate([silence(300), tone(600), silence(900), tone(800), silence(900)])
    told = await PROTOCOLS[protocol](server, pcm)
    assert told, "the client was told nothing"
    await eventually(lambda: server.server.session_count == 0, BOUND_S, "the session's end")
    assert counter(server, "streamer_segments_total") == 2
    assert counter(server, "streamer_time_to_first_partial_seconds_count") == 2
    assert counter(server, "streamer_audio_seconds_total") == pytest.approx(pcm.size / 16000)
