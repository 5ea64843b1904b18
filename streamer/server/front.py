"""Each port's connections: every request head parsed by one h11 connection, plain pages
answered here, WebSocket handshakes handed to the port's WebSocket, requests with a body to
:class:`~streamer.server.http_exchange.HttpExchange`.

:class:`PortFront` is the first protocol of every connection of a
:class:`~streamer.server.port.Port` (the main port and the FunASR port alike). It makes the
connection's one h11 parser and feeds it every byte read. A method other than ``GET`` or
``HEAD`` goes, with that parser, to an :class:`HttpExchange` of the port (the main port's
file APIs), which parses the head where the front left it and reads the body (nothing is
parsed twice), and whose handler answers it from the port's
:class:`~streamer.server.route_table.RouteTable`. A ``GET`` or ``HEAD`` head is read by
h11 to its end and routed from the same table: a plain page of the port (``/healthz``,
``/readyz``, ``/metrics``, ``/v1/models``, the web demo, a 404 or 405) is answered here,
and the connection closes after it; a
WebSocket endpoint's handshake goes to a :class:`~streamer.server.websocket.WebSocket`,
which is given the exact bytes read (as uvicorn replays the head into websockets' sans-I/O
protocol) and takes the transport (``transport.set_protocol``). So one port, one
``base_url``, serves the realtime and the file APIs, on public interfaces only. A port
without file APIs (FunASR's) hands a request with a body to the WebSocket, whose route
answers it (405), as before.

What h11 and websockets' parser would answer differently is left to websockets, as
before: a head h11 refuses, one that is not HTTP/1.1, one with a body, one with a line or
a header count past websockets' bounds, and anything that is not HTTP at all go to the
WebSocket with the bytes read, and it answers them as it always has; what websockets
cannot parse at all, which it closes unanswered, the port's WebSocket answers with a 400
(:func:`~streamer.server.port.malformed_answer`) before the close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit

import h11
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from streamer.server.http_exchange import HttpExchange, new_h11
from streamer.server.route_table import RouteTable

if TYPE_CHECKING:  # the port makes its fronts (it imports this module)
    from streamer.server.port import Port

logger = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 10.0  # a connection's handshake request within this (websockets' default)
WEBSOCKET_METHODS = (b"GET", b"HEAD")  # read here: plain pages and handshakes
MAX_METHOD_BYTES = 16  # longer than any method: not HTTP, the WebSocket's parser refuses it
# websockets' parser's bounds (websockets.http11: MAX_LINE_LENGTH, MAX_NUM_HEADERS): a
# head past them is left to it, which refuses it as soon as it sees the line
WS_MAX_LINE_BYTES = 8192
WS_MAX_HEADERS = 128

# (peer, the loop time the connection was accepted, the connection's h11 parser with the
# bytes read so far) -> a fresh exchange; the head's deadline counts from the accept
ExchangeFactory = Callable[[str, float, h11.Connection], HttpExchange]


def serialize(response: Response) -> bytes:
    """``response`` on the wire, as websockets' ``ServerProtocol.send_response`` writes it."""
    lines = [f"HTTP/1.1 {response.status_code} {response.reason_phrase}\r\n"]
    lines += [f"{name}: {value}\r\n" for name, value in response.headers.raw_items()]
    lines.append("\r\n")
    return "".join(lines).encode() + response.body


class PortFront(asyncio.Protocol):
    """One connection of a port: its head read and routed (then handed over, or answered)."""

    def __init__(
        self, port: Port, exchange_factory: ExchangeFactory | None, table: RouteTable
    ) -> None:
        """``exchange_factory``: the port's file APIs (None: a request with a body goes to
        the WebSocket, whose route refuses it)."""
        self._port = port
        self._table = table
        self._exchange_factory = exchange_factory
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._head = bytearray()  # every byte read (replayed into a WebSocket)
        self._h11 = new_h11()  # the connection's one parser, fed every byte
        self._method: bytes | None = None  # once it is GET or HEAD
        self._line_bytes = 0  # the head's line under way (websockets' bounds, read as they come)
        self._lines = 0  # complete lines
        self._accepted_at = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._port.heads.add(self._transport)
        self._accepted_at = self._loop.time()
        self._timer = self._loop.call_later(OPEN_TIMEOUT_S, self._timeout)

    def data_received(self, data: bytes) -> None:
        if self._transport is None:
            return  # answered: the rest is dropped
        self._head += data
        self._h11.receive_data(data)
        if self._method is not None:
            self._read_head(data)
            return
        head = self._head
        method, space, _ = head.partition(b" ")
        if not space and len(head) <= MAX_METHOD_BYTES:
            return  # the method is not complete yet
        if not space or len(method) > MAX_METHOD_BYTES:
            self._hand_over(self._port.websocket())  # not HTTP: websockets refuses it
        elif method in WEBSOCKET_METHODS or self._exchange_factory is None:
            # the head is due OPEN_TIMEOUT_S after its method (as the WebSocket's was)
            self._restart_timer()
            self._method = bytes(method)
            self._read_head(bytes(head))
        else:
            transport = self._transport
            peername = transport.get_extra_info("peername")
            peer = str(peername[0]) if peername else "?"
            exchange = self._exchange_factory(peer, self._accepted_at, self._h11)
            self._release()
            transport.set_protocol(exchange)
            exchange.connection_made(transport)
            exchange.read_buffered()

    def _read_head(self, data: bytes) -> None:
        if self._past_websockets_bounds(data):
            self._hand_over(self._port.websocket())
            return
        try:
            event = self._h11.next_event()
        except h11.RemoteProtocolError:
            self._hand_over(self._port.websocket())  # websockets' parser answers it
            return
        if event is h11.NEED_DATA:
            return
        if not isinstance(event, h11.Request) or not self._plain_page(event):
            self._hand_over(self._port.websocket())
            return
        self._answer(event)

    def _past_websockets_bounds(self, data: bytes) -> bool:
        """Whether websockets' parser may refuse the head so far, ``data`` its latest
        bytes, on its bounds (a line too long, too many headers) before h11 would: then
        it reads it. Counted as the bytes come, so a head sent a byte at a time costs
        no more than one sent at once."""
        lines = data.split(b"\n")
        longest = self._line_bytes + len(lines[0])
        if len(lines) > 1:
            longest = max(longest, *(len(line) for line in lines[1:]))
            self._lines += len(lines) - 1
            self._line_bytes = len(lines[-1])
        else:
            self._line_bytes = longest
        return self._lines > WS_MAX_HEADERS or longest >= WS_MAX_LINE_BYTES - 2

    def _plain_page(self, event: h11.Request) -> bool:
        """Whether the route answers ``event`` alone: an HTTP/1.1 head without a body, on a
        path that is no WebSocket endpoint (what websockets' parser reads as h11 does)."""
        if event.http_version != b"1.1":
            return False
        end = self._head.find(b"\r\n\r\n")
        if end < 0 or self._head[:end].count(b"\n") != self._head[:end].count(b"\r\n"):
            return False  # a line ends in a bare LF: h11 reads it, websockets refuses it
        if any(name in (b"content-length", b"transfer-encoding") for name, _ in event.headers):
            return False
        try:
            target = event.target.decode("ascii")
            path = urlsplit(target).path
        except (UnicodeDecodeError, ValueError):
            return False
        return not self._table.is_websocket(path)

    def _answer(self, event: h11.Request) -> None:
        """A plain page: the port's route answers, as the WebSocket answered it before."""
        transport = self._transport
        assert transport is not None
        headers = Headers()
        for name, value in event.headers.raw_items():
            headers[name.decode("latin-1")] = value.decode("latin-1")
        request = Request(event.target.decode("ascii"), headers, method=event.method.decode())
        try:
            response = self._port.answer(request)
        except Exception:  # the WebSocket answers it (500) as it always has
            logger.exception("answering an HTTP request failed")
            response = None
        if response is None:
            self._hand_over(self._port.websocket())
            return
        self._release()
        transport.write(serialize(response))
        if transport.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):
                transport.write_eof()
        transport.close()

    def _hand_over(self, protocol: asyncio.Protocol) -> None:
        transport = self._transport
        assert transport is not None
        self._release()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        protocol.data_received(bytes(self._head))

    def _release(self) -> None:
        """The connection leaves the front (answered, or handed over)."""
        self._cancel_timer()
        if self._transport is not None:
            self._port.heads.discard(self._transport)
            self._transport = None

    def eof_received(self) -> bool | None:
        if self._method is not None and self._transport is not None:
            # closed within a GET's head: websockets' parser ends it, as before
            ws = self._port.websocket()
            self._hand_over(ws)
            return ws.eof_received()
        return None  # closed before its method: nothing to answer

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()

    def _restart_timer(self) -> None:
        self._cancel_timer()
        self._timer = self._loop.call_later(OPEN_TIMEOUT_S, self._timeout)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timeout(self) -> None:
        self._timer = None
        if self._transport is not None:
            if self._method is None:
                logger.info("a connection sent no request method in %g s: closed", OPEN_TIMEOUT_S)
            else:
                logger.info("no complete request head in %g s: closed", OPEN_TIMEOUT_S)
            self._transport.abort()
