"""The server's WebSocket over websockets' sans-I/O protocol, fed bytes with no socket: the
handshake and its refusals, messages in order, reading paused while the queue is full and
parsed a slice per callback, pings and pongs, the close handshake, frames too large or not
UTF-8, a handshake that never comes. The ports that serve through it are tested over
loopback (tests/test_compat_ports.py, tests/test_compat_port_clients.py)."""

from __future__ import annotations

import asyncio

import pytest
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.http11 import Request, Response
from websockets.protocol import OPEN
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from streamer.server.websocket import READ_SLICE_BYTES, WebSocket
from tests.fakes import FakeTransport
from tests.timing import eventually, timeout_s


class Peer:
    """The client's side: websockets' sans-I/O client protocol over the fake transport."""

    def __init__(self, ws: WebSocket, transport: FakeTransport) -> None:
        self.ws = ws
        self.transport = transport
        self.client = ClientProtocol(
            parse_uri("ws://127.0.0.1/"), subprotocols=[Subprotocol("binary")]
        )
        self.request = self.client.connect()

    def handshake_bytes(self) -> bytes:
        self.client.send_request(self.request)
        return b"".join(self.client.data_to_send())

    def take_written(self) -> list:
        """What the server wrote, as the client's events."""
        data = bytes(self.transport.written)
        self.transport.written.clear()
        self.client.receive_data(data)
        return self.client.events_received()

    def frames(self, *frames: tuple[Opcode, bytes]) -> bytes:
        for opcode, data in frames:
            self.client.send_frame(Frame(opcode, data))
        return b"".join(self.client.data_to_send())


OPENED: list[tuple[WebSocket, FakeTransport, set]] = []


@pytest.fixture(autouse=True)
async def drop_connections():
    """Each test's connections are dropped at its end and their handlers awaited."""
    yield
    while OPENED:
        ws, transport, tasks = OPENED.pop()
        if not transport.closing:
            transport.abort()
        await asyncio.sleep(0)
        if tasks:
            await asyncio.wait(set(tasks), timeout=timeout_s(5))


def open_connection(
    route=lambda request: None,
    handler=None,
    *,
    max_queue: int = 2,
    max_size_bytes: int = 1 << 20,
    open_timeout_s: float = 10.0,
    close_timeout_s: float = 5.0,
) -> tuple[WebSocket, FakeTransport, Peer, set]:
    tasks: set = set()
    served = asyncio.Event()

    async def default_handler(ws: WebSocket) -> None:
        served.set()
        await ws.wait_closed()

    ws = WebSocket(
        handler or default_handler,
        route=route,
        process_response=lambda request, response: response,
        select_subprotocol=lambda request, offered: "binary" if "binary" in offered else None,
        max_size_bytes=max_size_bytes,
        max_queue=max_queue,
        close_timeout_s=close_timeout_s,
        open_timeout_s=open_timeout_s,
        server_header="test-server",
        tasks=tasks,
    )
    transport = FakeTransport()
    transport.protocol = ws
    ws.connection_made(transport)
    OPENED.append((ws, transport, tasks))
    return ws, transport, Peer(ws, transport), tasks


async def test_the_handshake_is_accepted_with_the_chosen_subprotocol() -> None:
    ws, transport, peer, tasks = open_connection()
    ws.data_received(peer.handshake_bytes())
    events = peer.take_written()
    response = events[0]
    assert isinstance(response, Response) and response.status_code == 101
    assert response.headers["Sec-WebSocket-Protocol"] == "binary"
    assert response.headers["Server"] == "test-server"
    assert ws.protocol.state is OPEN and ws.request is not None and len(tasks) == 1
    assert ws.remote_address == ("127.0.0.1", 5555)


async def test_a_route_s_answer_refuses_the_upgrade_and_closes() -> None:
    def route(request: Request) -> Response:
        body = b'{"error": "unauthorized"}'
        return Response(401, "Unauthorized", _headers(len(body)), body)

    ws, transport, peer, tasks = open_connection(route)
    ws.data_received(peer.handshake_bytes())
    assert bytes(transport.written).startswith(b"HTTP/1.1 401 Unauthorized\r\n")
    assert transport.written.endswith(b'{"error": "unauthorized"}')
    assert transport.closing and not tasks


async def test_a_route_that_raises_is_a_500() -> None:
    def route(request: Request) -> Response:
        raise RuntimeError("a bug")

    ws, transport, peer, _ = open_connection(route)
    ws.data_received(peer.handshake_bytes())
    assert bytes(transport.written).startswith(b"HTTP/1.1 500 ")
    assert transport.closing


async def test_messages_arrive_in_order_and_reading_pauses_while_the_queue_is_full() -> None:
    ws, transport, peer, _ = open_connection(max_queue=2)
    ws.data_received(peer.handshake_bytes())
    peer.take_written()
    ws.data_received(
        peer.frames(
            (Opcode.TEXT, b'{"a": 1}'), (Opcode.BINARY, b"\x01\x02"), (Opcode.BINARY, b"\x03")
        )
    )
    assert not transport.reading  # two messages wait, the third's bytes are held
    assert await ws.recv() == '{"a": 1}'
    await asyncio.sleep(0)  # the held bytes are parsed in the next callback
    assert await ws.recv() == b"\x01\x02"
    await asyncio.sleep(0)
    assert await ws.recv() == b"\x03"
    assert transport.reading


async def test_one_callback_parses_one_slice() -> None:
    ws, transport, peer, _ = open_connection(max_queue=10_000)
    ws.data_received(peer.handshake_bytes())
    peer.take_written()
    tiny = [(Opcode.BINARY, b"x")] * 4000  # 7 bytes each on the wire (masked)
    ws.data_received(peer.frames(*tiny))
    first = len(ws._messages)
    assert 0 < first <= READ_SLICE_BYTES // 6 + 1  # one slice, not the whole read
    assert not transport.reading  # the rest is held: the socket waits
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(ws._messages) == 4000 and transport.reading


async def test_fragments_make_one_message() -> None:
    ws, transport, peer, _ = open_connection()
    ws.data_received(peer.handshake_bytes())
    peer.take_written()
    peer.client.send_text(b"hel", fin=False)
    peer.client.send_continuation(b"lo", fin=True)
    ws.data_received(b"".join(peer.client.data_to_send()))
    assert await ws.recv() == "hello"


async def test_ping_is_answered_and_our_ping_resolved_by_its_pong() -> None:
    ws, transport, peer, _ = open_connection()
    ws.data_received(peer.handshake_bytes())
    peer.take_written()
    ws.data_received(peer.frames((Opcode.PING, b"hi")))
    assert [(f.opcode, f.data) for f in peer.take_written()] == [(Opcode.PONG, b"hi")]
    waiter = await ws.ping()
    pings = [f for f in peer.take_written() if f.opcode is Opcode.PING]
    assert len(pings) == 1 and not waiter.done()
    ws.data_received(peer.frames((Opcode.PONG, pings[0].data)))
    assert waiter.done() and waiter.result() >= 0


async def test_send_and_the_close_handshake() -> None:
    ws, transport, peer, _ = open_connection()
    ws.data_received(peer.handshake_bytes())
    peer.take_written()
    await ws.send('{"type": "final"}', text=True)
    await ws.send(b"\x00\x01")
    closing = asyncio.create_task(ws.close(1000, "bye"))
    await asyncio.sleep(0)
    frames = peer.take_written()
    assert [f.opcode for f in frames] == [Opcode.TEXT, Opcode.BINARY, Opcode.CLOSE]
    assert not closing.done()  # waits for the peer's close frame
    ws.data_received(b"".join(peer.client.data_to_send()))  # the client's answer
    await asyncio.wait_for(closing, timeout_s(5))
    assert transport.eof_written and transport.closing and not transport.aborted
    with pytest.raises(Exception) as closed:
        await ws.recv()
    assert type(closed.value).__name__ == "ConnectionClosedOK"


async def test_a_peer_that_never_answers_the_close_is_aborted() -> None:
    ws, transport, peer, _ = open_connection(close_timeout_s=0.2)
    ws.data_received(peer.handshake_bytes())
    await asyncio.wait_for(ws.close(1001), timeout_s(5))
    assert transport.aborted


async def test_a_frame_over_the_size_limit_closes_with_1009() -> None:
    ws, transport, peer, _ = open_connection(max_size_bytes=100)
    ws.data_received(peer.handshake_bytes())
    peer.take_written()
    ws.data_received(peer.frames((Opcode.BINARY, bytes(200))))
    frames = peer.take_written()
    assert frames[-1].opcode is Opcode.CLOSE
    assert int.from_bytes(frames[-1].data[:2], "big") == 1009


async def test_text_that_is_not_utf8_closes_with_1007() -> None:
    ws, transport, peer, _ = open_connection()
    ws.data_received(peer.handshake_bytes())
    peer.take_written()
    peer.client.send_frame(Frame(Opcode.TEXT, b"\xff\xfe"))
    ws.data_received(b"".join(peer.client.data_to_send()))
    frames = peer.take_written()
    assert frames and frames[-1].opcode is Opcode.CLOSE
    assert int.from_bytes(frames[-1].data[:2], "big") == 1007


async def test_a_handshake_that_never_comes_is_dropped() -> None:
    ws, transport, peer, _ = open_connection(open_timeout_s=0.1)
    ws.data_received(b"GET / HTTP/1.1\r\n")
    await eventually(lambda: transport.aborted, what="the connection dropped")


async def test_a_lost_connection_ends_recv_and_the_handler() -> None:
    ended = asyncio.Event()

    async def handler(ws: WebSocket) -> None:
        try:
            await ws.recv()
        finally:
            ended.set()

    ws, transport, peer, tasks = open_connection(handler=handler)
    ws.data_received(peer.handshake_bytes())
    await asyncio.sleep(0)
    ws.connection_lost(ConnectionResetError())
    await asyncio.wait_for(ended.wait(), timeout_s(5))


def _headers(length: int):
    from websockets.datastructures import Headers

    headers = Headers()
    headers["Content-Type"] = "application/json"
    headers["Content-Length"] = str(length)
    return headers
