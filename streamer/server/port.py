"""A listening port and its connections: the one place that says how the server's
connections are made (the main port's and FunASR's), so that the ports cannot drift apart.

A :class:`Port` binds with asyncio's own server and gives each connection a
:class:`~streamer.server.front.PortFront`, which parses its request head with h11 and
answers plain pages with :meth:`Port.answer`, hands a handshake to a
:class:`~streamer.server.websocket.WebSocket` (:meth:`Port.websocket`) and a request with
a body to the port's file APIs (its exchange factory; the FunASR port has none). Every
WebSocket it makes has the
options' settings: the largest frame, a queue of
:data:`~streamer.server.options.WS_MAX_QUEUE_FRAMES` messages, the close timeout, the
``Server`` header, no compression (none is offered: PCM does not compress, deflate would
only cost CPU), no keepalive of its own (each
:class:`~streamer.server.connection.Connection` runs one that knows back-pressure); and
the port's routes, subprotocol choice and handler. The port keeps its open connections
and their handlers' tasks, which its shutdown walks.
"""

from __future__ import annotations

import asyncio
import http
import ssl

from websockets.http11 import Request, Response

from streamer.server.front import OPEN_TIMEOUT_S, ExchangeFactory, PortFront, serialize
from streamer.server.http import json_response
from streamer.server.http_exchange import SERVER_HEADER
from streamer.server.options import WS_MAX_QUEUE_FRAMES, ServerOptions
from streamer.server.route_table import RouteTable
from streamer.server.routes import answering, final_response
from streamer.server.websocket import Handler, SubprotocolChoice, WebSocket

CLOSE_GOING_AWAY = 1001  # what open connections hear when the port closes


def malformed_answer() -> bytes:
    """The answer to a head nothing can parse (400, as the port's request checks say it)."""
    response = json_response(
        http.HTTPStatus.BAD_REQUEST,
        {"error": "bad_request", "message": "malformed HTTP request"},
    )
    response.headers["Server"] = SERVER_HEADER
    response.headers["Connection"] = "close"
    return serialize(response)


class Port:
    """One listening port (:meth:`start`), its WebSockets (:meth:`websocket`) and their
    shutdown (:meth:`stop_accepting`, :meth:`close`)."""

    def __init__(
        self,
        options: ServerOptions,
        handler: Handler,
        select_subprotocol: SubprotocolChoice,
        table: RouteTable,
        exchange: ExchangeFactory | None = None,
    ) -> None:
        """``table``: the port's routes, which answer every request (pages and
        handshakes here, through :meth:`RouteTable.answer`; a request with a body through
        the exchange's handler); ``exchange``: the port's requests with a body (None: the
        table answers them from their head)."""
        self.options = options
        self._handler = handler
        # a refusal is its answer (400, 404, 405), a failure a 500
        self._route = answering(table.answer)
        self._select = select_subprotocol
        self._table = table
        self._exchange = exchange
        self._server: asyncio.Server | None = None
        self.connections: set[WebSocket] = set()  # open WebSockets
        self.tasks: set[asyncio.Task[None]] = set()  # their handlers
        # connections whose request head the front is still reading (nothing to answer
        # yet: a shutdown drops them, as a WebSocket still in its handshake)
        self.heads: set[asyncio.Transport] = set()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def websocket(self) -> WebSocket:
        """A new connection's WebSocket, with the server's settings and the port's own."""
        o = self.options
        ws = WebSocket(
            self._handler,
            route=self._route,
            process_response=final_response,
            select_subprotocol=self._select,
            max_size_bytes=o.max_message_bytes,
            max_queue=WS_MAX_QUEUE_FRAMES,
            close_timeout_s=o.limits.close_timeout_s,
            open_timeout_s=OPEN_TIMEOUT_S,
            server_header=SERVER_HEADER,
            tasks=self.tasks,
            malformed=malformed_answer,
        )
        self.connections.add(ws)
        ws.on_lost = self.connections.discard
        return ws

    def answer(self, request: Request) -> Response | None:
        """The port's answer to a plain request, as its WebSockets send it (the ``Server``
        header, :func:`final_response`); None: a handshake that goes on."""
        response = self._route(request)
        if response is None:
            return None
        response.headers["Server"] = SERVER_HEADER
        return final_response(request, response)

    def _protocol(self) -> asyncio.Protocol:
        return PortFront(self, self._exchange, self._table)

    async def start(self, port: int, ssl_context: ssl.SSLContext | None) -> None:
        """Bind ``options.host``:``port`` (0 picks a free one); raises OSError."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._protocol,
            self.options.host,
            port,
            ssl=ssl_context,
            ssl_handshake_timeout=OPEN_TIMEOUT_S if ssl_context is not None else None,
        )

    def stop_accepting(self) -> None:
        """Refuse new connections; open ones go on."""
        if self._server is not None:
            self._server.close()

    def abort_all(self) -> None:
        """Drop every open WebSocket at once (the shutdown's grace period is over)."""
        for ws in list(self.connections):
            ws.transport.abort()
        for transport in list(self.heads):
            transport.abort()

    async def close(self) -> None:
        """Close what is still open (1001 going away) and wait for the handlers; the
        caller bounds the wait, and :meth:`abort_all` what is left."""
        self.stop_accepting()
        for transport in list(self.heads):
            transport.abort()
        for ws in list(self.connections):
            ws.close_soon(CLOSE_GOING_AWAY)
        if self.tasks:
            await asyncio.wait(set(self.tasks))
