"""The main port's connections: WebSocket handshakes and plain GETs to the server's
WebSocket, requests with a body to :class:`~streamer.server.http_exchange.HttpExchange`.

:class:`MainPortFront` is each connection's first protocol. It reads until the request's
method is known: ``GET`` and ``HEAD`` (and anything that is not HTTP, which the WebSocket's
parser refuses with a 400) go to a :class:`~streamer.server.websocket.WebSocket` of the
port, which answers plain routes or upgrades; any other method to an
:class:`HttpExchange`, which reads the body. The chosen protocol takes the transport
(``transport.set_protocol``, as uvicorn hands a connection from its HTTP protocol to its
WebSocket one) and is given the bytes read so far. So one port, one ``base_url``, serves
the realtime and the file APIs, on public interfaces only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import cast

from streamer.server.http_exchange import HttpExchange
from streamer.server.port import OPEN_TIMEOUT_S, Port

logger = logging.getLogger(__name__)

WEBSOCKET_METHODS = (b"GET", b"HEAD")  # what the WebSocket's parser and routes answer
MAX_METHOD_BYTES = 16  # longer than any method: not HTTP, the WebSocket's parser refuses it

# (peer, the loop time the connection was accepted) -> a fresh exchange; the head's
# deadline counts from the accept, not from the hand-over
ExchangeFactory = Callable[[str, float], HttpExchange]


class MainPortFront(asyncio.Protocol):
    """One main-port connection until its method is known (then handed over)."""

    def __init__(self, port: Port, exchange_factory: ExchangeFactory) -> None:
        self._port = port
        self._exchange_factory = exchange_factory
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._head = b""
        self._accepted_at = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._accepted_at = self._loop.time()
        self._timer = self._loop.call_later(OPEN_TIMEOUT_S, self._timeout)

    def data_received(self, data: bytes) -> None:
        head = self._head + data
        method, space, _ = head.partition(b" ")
        if not space and len(head) <= MAX_METHOD_BYTES:
            self._head = head  # the method is not complete yet
            return
        if not space or method in WEBSOCKET_METHODS or len(method) > MAX_METHOD_BYTES:
            protocol: asyncio.Protocol = self._port.websocket()
        else:
            transport = self._transport
            assert transport is not None
            peername = transport.get_extra_info("peername")
            peer = str(peername[0]) if peername else "?"
            protocol = self._exchange_factory(peer, self._accepted_at)
        self._hand_over(protocol, head)

    def _hand_over(self, protocol: asyncio.Protocol, head: bytes) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        transport = self._transport
        assert transport is not None
        self._transport = None
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        protocol.data_received(head)

    def eof_received(self) -> bool | None:
        return None  # closed before its method: nothing to answer

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timeout(self) -> None:
        self._timer = None
        if self._transport is not None:
            logger.info("a connection sent no request method in %g s: closed", OPEN_TIMEOUT_S)
            self._transport.abort()
