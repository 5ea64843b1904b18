"""Binding the main port with websockets' asyncio server: the one place that says how
websockets serves it (the FunASR port is served by :mod:`streamer.server.websocket` over
websockets' sans-I/O protocol, with the same settings from the same options; the main
port follows with the HTTP front of issue 34).

The port brings what is its own (its routes, its subprotocol choice, its connection
class); the rest comes from :class:`~streamer.server.options.ServerOptions`: no
compression (PCM does not compress; deflate would only cost CPU), the largest frame, a
queue of :data:`~streamer.server.options.WS_MAX_QUEUE_FRAMES` frames, no websockets
keepalive (each :class:`~streamer.server.connection.Connection` runs one that knows
back-pressure), the close timeout, the ``Server`` header, and the request checks of
:func:`~streamer.server.routes.guarded` and :func:`~streamer.server.routes.process_response`.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, Sequence

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.typing import Subprotocol

from streamer.server.options import WS_MAX_QUEUE_FRAMES, ServerOptions
from streamer.server.routes import Route, guarded, process_response

SERVER_HEADER = "sensevoice-streamer"

SubprotocolChoice = Callable[[ServerConnection, Sequence[Subprotocol]], Subprotocol | None]


async def listen(
    handler: Callable[[ServerConnection], Awaitable[None]],
    options: ServerOptions,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None,
    route: Route,
    select_subprotocol: SubprotocolChoice,
    create_connection: type[ServerConnection],
) -> Server:
    """A websockets server on ``options.host``:``port`` (raises OSError when it cannot
    bind); ``route`` answers plain HTTP or lets the handshake go on (None)."""
    return await serve(
        handler,
        options.host,
        port,
        ssl=ssl_context,
        process_request=guarded(route),
        process_response=process_response,
        select_subprotocol=select_subprotocol,
        compression=None,
        max_size=options.max_message_bytes,
        max_queue=WS_MAX_QUEUE_FRAMES,
        ping_interval=None,
        close_timeout=options.limits.close_timeout_s,
        server_header=SERVER_HEADER,
        create_connection=create_connection,
    )
