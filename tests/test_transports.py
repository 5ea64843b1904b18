"""One limit, every transport: the session pump's outbox bound and write timeout hold for a
never-reading client of the WebSocket port and of the Wyoming port alike.

The pump (``server/pump.py``) owns the outbox and the write timeout; the transports are
thin readers and writers over it. Each case runs the same check through each transport:
a client that never reads makes the server write (WebSocket: an audio byte and an invalid
text frame, each answered with an error; Wyoming: ``describe``, answered with ``info``),
the outbox stays within its bound, the session is closed for the expected reason and its
slot freed, and the server goes on serving that transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from websockets.asyncio.client import connect

from streamer.core.compat.wyoming import EventParser, WyomingEvent, encode_event
from tests.fakes import FakeRecognizer, loudness_classifier
from tests.server_fixtures import ServerThread, make_server  # noqa: F401  (fixture)
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
