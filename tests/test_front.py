"""The main port's front: h11 reads every GET and HEAD head, the port's route answers a
plain page there, and each answer is byte for byte what the WebSocket's parser and routes
answered before (what h11 and websockets would read differently is left to websockets)."""

from __future__ import annotations

import asyncio
import http
import re

import pytest
from websockets.http11 import Response

from streamer.server.front import PortFront, serialize
from streamer.server.funasr_listener import FunAsrListener
from streamer.server.http import bytes_response, json_response
from streamer.server.http_exchange import HttpExchange
from tests.fakes import FakeTransport

DATE = re.compile(rb"\r\nDate: [^\r]*")


def head(target: str, *headers: str, method: str = "GET", version: str = "HTTP/1.1") -> bytes:
    lines = [f"{method} {target} {version}", *headers, "", ""]
    return "\r\n".join(lines).encode("latin-1")


HOST = "Host: localhost"
# (head, whether the front answers it itself)
CASES = [
    (head("/healthz", HOST), True),
    (head("/healthz", HOST, method="HEAD"), True),
    (head("/readyz", HOST), True),
    (head("/v1/models", HOST), True),
    (head("/v1/models/no-such-model", HOST), True),
    (head("/", HOST), True),  # the web demo
    (head("/no-such-file.js", HOST), True),  # 404
    (head("/v1/audio/transcriptions", HOST), True),  # 405, Allow: POST, OPTIONS
    (head("/" + "a" * 300, HOST), True),  # 400
    (head("/healthz", HOST, "Origin: http://a", "Origin: http://b"), True),  # 400
    (head("/v1/asr", HOST), False),  # a WebSocket endpoint: 426 from its handshake
    (head("/v1/asr", HOST, method="HEAD"), False),
    (head("/healthz", HOST, version="HTTP/1.0"), False),
    (head("/healthz"), False),  # no Host: h11 refuses, websockets reads it
    (head("/healthz", HOST, "Content-Length: 0"), False),
    (head("/healthz", HOST, "Transfer-Encoding: chunked"), False),
    (head("/static/\x00name", HOST), False),
    (head("/caf\xe9", HOST), False),
    (head("/healthz", HOST, "X-Long: " + "x" * 9000), False),
    (head("/healthz", HOST, *(f"X-{i}: {i}" for i in range(200))), False),
    (head("/healthz", HOST).replace(b"\r\n", b"\n"), False),  # bare LF
    (b"GET  /healthz HTTP/1.1\r\nHost: x\r\n\r\n", False),
    (b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n", False),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Name: y\r\n\r\n", False),
    (b"\x16\x03\x01" + b"\x00" * 40 + b"\r\n\r\n", False),  # not HTTP (a TLS hello)
]


class HandOverTransport(FakeTransport):
    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol  # type: ignore[assignment]

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self.protocol is not None
        return self.protocol


async def _answers(server, request: bytes, port=None) -> tuple[bytes, bytes, int]:
    """What the port's WebSocket answers ``request`` (as every GET was answered before),
    what the front answers, and how many WebSockets the front made (the main port's, or
    ``port``)."""
    port = port or server.server._server
    old = HandOverTransport()
    ws = port.websocket()
    old.protocol = ws
    ws.connection_made(old)
    ws.data_received(request)
    made = 0
    websocket = port.websocket

    def counted():
        nonlocal made
        made += 1
        return websocket()

    port.websocket = counted
    try:
        new = HandOverTransport()
        front = port._protocol()
        new.protocol = front
        front.connection_made(new)
        front.data_received(request)
    finally:
        del port.websocket
    for _ in range(5):
        await asyncio.sleep(0)
    for transport in (old, new):
        if not transport.closing:
            transport.abort()
    await asyncio.sleep(0)
    return bytes(old.written), bytes(new.written), made


@pytest.mark.parametrize(("request_bytes", "answered_here"), CASES)
def test_every_get_and_head_is_answered_as_before(
    make_fake_server, request_bytes: bytes, answered_here: bool
) -> None:
    server = make_fake_server(token=None)
    before, after, made = server.call(_answers(server, request_bytes))
    assert before.startswith(b"HTTP/1.1 "), before[:80]
    assert DATE.sub(b"", after) == DATE.sub(b"", before)
    assert made == (0 if answered_here else 1)


def test_split_heads_and_pipelined_bytes(make_fake_server) -> None:
    """A head that comes a byte at a time is answered once it is complete, as it was."""
    server = make_fake_server(token=None)

    async def run() -> tuple[bytes, bool]:
        port = server.server._server
        transport = HandOverTransport()
        front = PortFront(port, server.server.files.exchange, server.server.routes.table)
        transport.protocol = front
        front.connection_made(transport)
        for byte in head("/healthz", HOST):
            assert not transport.written
            front.data_received(bytes([byte]))
        front.data_received(b"GET /readyz HTTP/1.1\r\n\r\n")  # dropped: one request
        await asyncio.sleep(0)
        return bytes(transport.written), transport.eof_written

    written, eof = server.call(run())
    assert written.startswith(b"HTTP/1.1 200 OK\r\n") and written.count(b"HTTP/1.1") == 1
    assert b"Connection: close\r\n" in written and eof


@pytest.mark.parametrize(
    "response",
    [
        json_response(http.HTTPStatus.NOT_FOUND, {"error": "not_found"}),
        bytes_response(http.HTTPStatus.OK, "text/plain", b"a\r\nb"),
        Response(204, "No Content", json_response(http.HTTPStatus.OK, {}).headers, b""),
    ],
)
def test_serialize_is_websockets_own(response: Response) -> None:
    assert serialize(response) == response.serialize()


def test_the_web_demo_s_cached_page_gains_no_header_per_request(make_fake_server) -> None:
    """Each answer of the web demo's page is the same: the port's headers go on a copy (they
    were added to the cached answer, one more ``Server`` header at every request)."""
    server = make_fake_server(token=None)
    answers = [DATE.sub(b"", server.call(_answers(server, head("/", HOST)))[1]) for _ in range(3)]
    assert answers[0] == answers[1] == answers[2]
    assert answers[0].count(b"\r\nServer: ") == 1


def _front(server) -> tuple[PortFront, HandOverTransport]:
    port = server.server._server
    transport = HandOverTransport()
    front = PortFront(port, server.server.files.exchange, server.server.routes.table)
    transport.protocol = front
    front.connection_made(transport)
    return front, transport


def test_a_line_past_websockets_bound_goes_to_it_as_it_comes(make_fake_server) -> None:
    """A header line longer than websockets' parser takes, sent in pieces, is handed to it
    (which refuses it at once) before the head ends, and not read on by h11."""
    server = make_fake_server(token=None)

    async def run() -> tuple[bool, bool]:
        front, transport = _front(server)
        front.data_received(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Long: ")
        for _ in range(100):
            front.data_received(b"x" * 100)
            if transport.protocol is not front:
                break
        handed = transport.protocol is not front
        await asyncio.sleep(0)
        return handed, transport.closing

    handed, closing = server.call(run())
    assert handed and closing


def test_a_shutdown_drops_a_connection_still_sending_its_head(make_fake_server) -> None:
    server = make_fake_server(token=None)

    async def run() -> tuple[bool, bool, bool]:
        port = server.server._server
        _, transport = _front(server)
        _front_2, answered = _front(server)
        _front_2.data_received(head("/healthz", HOST))  # answered: no longer the front's
        _, waiting = _front(server)
        waiting.protocol.data_received(b"GET /healthz HTT")  # type: ignore[union-attr]
        held = transport in port.heads and waiting in port.heads
        port.abort_all()
        await asyncio.sleep(0)
        return (
            held and answered not in port.heads,
            transport.aborted and waiting.aborted,
            (not port.heads),
        )

    held, aborted, gone = server.call(run())
    assert held and aborted and gone


def test_a_head_cut_by_the_client_s_eof_ends_as_before(make_fake_server) -> None:
    """The client closes its side within a GET's head: websockets' parser reads the end
    (nothing to answer), as when the WebSocket read every GET."""
    server = make_fake_server(token=None)

    async def run() -> tuple[bytes, bytes, bool]:
        port = server.server._server
        old = HandOverTransport()
        ws = port.websocket()
        old.protocol = ws
        ws.connection_made(old)
        ws.data_received(b"GET /healthz HTTP/1.1\r\nHo")
        ws.eof_received()
        front, new = _front(server)
        front.data_received(b"GET /healthz HTTP/1.1\r\nHo")
        front.eof_received()
        handed = new.protocol is not front and new not in port.heads
        for transport in (old, new):
            transport.close()
        await asyncio.sleep(0)
        return bytes(old.written), bytes(new.written), handed

    before, after, handed = server.call(run())
    assert after == before and handed


FUNASR_CASES = [
    (head("/healthz", HOST), True),  # 404: FunASR clients connect to /
    (head("/healthz", HOST, method="HEAD"), True),  # 405 (GET only)
    (head("/v1/models", HOST), True),  # the main port's pages are not FunASR's
    (head("/x", HOST, method="POST"), True),  # 405, without a body
    (head("/x", HOST, "Content-Length: 3", method="POST") + b"abc", False),
    (head("/", HOST), False),  # the WebSocket endpoint: 426 from its handshake
    (head("/", HOST, method="HEAD"), False),
    (head("/", HOST, method="OPTIONS"), False),
    (head("/healthz"), False),  # no Host
    (b"\x16\x03\x01" + b"\x00" * 40 + b"\r\n\r\n", False),
]


@pytest.mark.parametrize(("request_bytes", "answered_here"), FUNASR_CASES)
def test_the_funasr_port_has_the_same_front(
    make_fake_server, request_bytes: bytes, answered_here: bool
) -> None:
    """FunASR's port reads its heads with the front too, and answers each as its
    WebSocket answered every request before; it has no file APIs (a body: the WebSocket)."""
    server = make_fake_server(token=None)
    listener = FunAsrListener(server.server.admission, 0)
    before, after, made = server.call(_answers(server, request_bytes, listener._port))
    assert DATE.sub(b"", after) == DATE.sub(b"", before)
    assert made == (0 if answered_here else 1)


def test_a_request_with_a_body_is_parsed_once_by_the_front_s_h11(make_fake_server) -> None:
    """A POST goes to the port's exchange with the connection's one h11 parser, which
    parses the head where the front left it (the bytes are not read a second time)."""
    server = make_fake_server(token=None)

    async def run() -> tuple[object, object, str | None]:
        front, transport = _front(server)
        parser = front._h11
        front.data_received(b"POST /v1/audio/trans")
        exchange = transport.protocol
        exchange.data_received(b"criptions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
        request = exchange.request
        transport.abort()
        exchange.connection_lost(None)
        await asyncio.sleep(0)
        return exchange, parser, request.path if request is not None else None

    exchange, parser, path = server.call(run())
    assert isinstance(exchange, HttpExchange) and exchange._h11 is parser
    assert path == "/v1/audio/transcriptions"


MALFORMED = [
    b"GET /healthz HTTP/1.1\nHost: x\n\n",  # bare LF
    b"GET  /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Name: y\r\n\r\n",
    b"GET /caf\xe9 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"\x16\x03\x01" + b"\x00" * 40 + b"\r\n\r\n",  # not HTTP (a TLS hello)
]


@pytest.mark.parametrize("request_bytes", MALFORMED)
def test_a_head_nothing_can_parse_is_answered_400_and_closed(
    make_fake_server, request_bytes: bytes
) -> None:
    """websockets ends such a connection unanswered; the port tells the client first."""
    server = make_fake_server(token=None)

    async def run() -> tuple[bytes, bool]:
        front, transport = _front(server)
        front.data_received(request_bytes)
        await asyncio.sleep(0)
        return bytes(transport.written), transport.closing

    written, closing = server.call(run())
    status, _, body = written.partition(b"\r\n")
    assert status == b"HTTP/1.1 400 Bad Request" and closing
    assert b"\r\nConnection: close\r\n" in body and b"\r\nServer: sensevoice-streamer" in body
    assert body.endswith(b'{"error":"bad_request","message":"malformed HTTP request"}')
