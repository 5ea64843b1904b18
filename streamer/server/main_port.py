"""The main port's connections: WebSocket handshakes and plain GETs to websockets,
requests with a body to :class:`~streamer.server.http_exchange.HttpExchange`.

websockets reads only a request's head (a GET); a POST with a body would be closed
without an answer. :class:`MainPortConnection` is websockets' own connection class
(``serve(create_connection=...)``) that looks at the first request line before
websockets does: ``GET`` and ``HEAD`` go on to websockets exactly as before (every
WebSocket route, limit and answer unchanged); any other method is handed, with the
bytes read so far, to an :class:`HttpExchange` on the same transport, and websockets'
handshake task for the connection is cancelled (it never saw a byte). So one port, one
``base_url``, serves the realtime and the file APIs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from websockets.asyncio.server import ServerConnection

from streamer.server.http_exchange import HttpExchange

logger = logging.getLogger(__name__)

WEBSOCKETS_METHODS = (b"GET", b"HEAD")  # what websockets answers itself
MAX_METHOD_BYTES = 16  # longer than any method: not HTTP, websockets refuses it

# (peer, the loop time the connection was accepted) -> a fresh exchange; the head's
# deadline counts from the accept, not from the hand-over
ExchangeFactory = Callable[[str, float], HttpExchange]


class MainPortConnection(ServerConnection):
    """websockets' server connection, which hands non-GET requests to HTTP.

    :attr:`exchange_factory` (set on the class by :func:`connection_class`) makes the
    exchange for one request.
    """

    exchange_factory: ExchangeFactory

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        before = set(self.server.handler_tasks)
        self._accepted_at = asyncio.get_running_loop().time()
        super().connection_made(transport)
        # websockets' task that waits for the handshake: cancelled if HTTP takes over
        self._handshake_tasks = self.server.handler_tasks - before
        self._head: bytes | None = b""  # None once the request went to websockets

    def data_received(self, data: bytes) -> None:
        if self._head is None:
            super().data_received(data)
            return
        head = self._head + data
        method, space, _ = head.partition(b" ")
        if not space and len(head) <= MAX_METHOD_BYTES:
            self._head = head  # the method is not complete yet
            return
        self._head = None
        if not space or method in WEBSOCKETS_METHODS or len(method) > MAX_METHOD_BYTES:
            super().data_received(head)
            return
        self._hand_over(head)

    def _hand_over(self, head: bytes) -> None:
        transport = self.transport
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if peername else "?"
        exchange = type(self).exchange_factory(peer, self._accepted_at)
        for task in self._handshake_tasks:
            task.cancel()  # it may not have started: its own cleanup would not run
            self.server.handler_tasks.discard(task)
        transport.set_protocol(exchange)
        exchange.connection_made(transport)
        exchange.data_received(head)


def connection_class(exchange_factory: ExchangeFactory) -> type[MainPortConnection]:
    """A :class:`MainPortConnection` subclass whose requests with a body go to
    ``exchange_factory``'s exchanges (one class per server: servers in one process
    do not share it)."""
    return type(
        "ServerMainPortConnection",
        (MainPortConnection,),
        {"exchange_factory": staticmethod(exchange_factory)},
    )


__all__ = ["MainPortConnection", "connection_class"]
