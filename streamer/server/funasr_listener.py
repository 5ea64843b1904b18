"""The FunASR runtime protocol's own port (``--funasr-port``; FunASR's convention is 10095).

A second listening :class:`~streamer.server.port.Port`, with the main port's front (h11
reads each head; a handshake on ``/`` goes to a
:class:`~streamer.server.websocket.WebSocket`, websockets' sans-I/O protocol driven by the
server; anything else is answered from the route) and every session a
:class:`FunAsrAdapter` on path ``/``,
served like the main port's sessions (:func:`~streamer.server.connection.serve_websocket`),
so it shares admission, ``--max-sessions``, the worker, the connection machinery (our
keepalive, which never counts our own back-pressure against the client, and websockets'
queue of two frames), the request checks (a malformed request is a 400; refusals echo
nothing of the request) and the graceful shutdown. The protocol itself is in
:mod:`streamer.core.compat.funasr`; ``docs/funasr.md`` is the user's page.
"""

from __future__ import annotations

import http
import logging
import ssl
from collections.abc import Mapping, Sequence
from functools import partial
from urllib.parse import SplitResult, parse_qsl

from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from streamer.core.compat.funasr import FunAsrAdapter
from streamer.core.protocol import StreamOptions
from streamer.core.session import Session
from streamer.media import open_decoder
from streamer.server.admission import Admission
from streamer.server.connection import serve_websocket
from streamer.server.http import Endpoint, Negotiation, bearer_or_query_token, json_response
from streamer.server.port import Port
from streamer.server.route_table import UPGRADE, RouteTable, method_not_allowed
from streamer.server.websocket import WebSocket

logger = logging.getLogger(__name__)

PATH = "/"  # where FunASR's clients and its html5 demo connect
SUBPROTOCOL = "binary"  # what FunASR's Python clients ask for


def _negotiate(request: Request, query: Mapping[str, str], defaults: StreamOptions) -> Negotiation:
    """The stream options come from the first JSON frame (the query only carries a token).

    The dialect comes from the subprotocol: FunASR's Python clients offer ``binary`` and
    want the offline result with ``is_final: true``; the html5 demo (a browser, which
    offers none) waits in file mode for the C++ server's ``is_final: false``."""
    offered = request.headers.get("Sec-WebSocket-Protocol", "")
    python_client = SUBPROTOCOL in (p.strip() for p in offered.split(","))
    return Negotiation(defaults, partial(_adapter, offline_final=python_client))


def _adapter(session: Session, *, offline_final: bool = True) -> FunAsrAdapter:
    # compressed wav_format
    return FunAsrAdapter(session, open_decoder=open_decoder, offline_final=offline_final)


def _select_subprotocol(request: Request, offered: Sequence[Subprotocol]) -> Subprotocol | None:
    chosen = _binary_if_offered(offered)
    return Subprotocol(chosen) if chosen is not None else None


def _binary_if_offered(offered: Sequence[str]) -> str | None:
    """Echo ``binary`` when offered; accept clients that offer none (the html5 demo)."""
    return SUBPROTOCOL if SUBPROTOCOL in offered else None


FUNASR_ENDPOINT = Endpoint(
    name="funasr",
    presented_token=bearer_or_query_token,
    auth_hint="a valid token is required: connect to ws://HOST:PORT/?token=TOKEN",
    make_adapter=_adapter,
    negotiate=_negotiate,
    select_subprotocol=_binary_if_offered,
)


def _elsewhere(request: Request, url: SplitResult) -> Response:
    """A path other than :data:`PATH`: 405 for a method it would not take either, else 404."""
    if request.method not in UPGRADE:
        raise method_not_allowed(UPGRADE)
    return json_response(
        http.HTTPStatus.NOT_FOUND,
        {"error": "not_found", "message": f"FunASR clients connect to {PATH}"},
    )


class FunAsrListener:
    """Listens on the FunASR port while the main server runs."""

    name = "funasr"

    def __init__(self, admission: Admission, port: int) -> None:
        self.admission = admission
        self._requested_port = port
        # one WebSocket endpoint, no pages or files; the method is checked first on
        # every path (a GET elsewhere is a 404)
        self.table = RouteTable(fallback=_elsewhere, fallback_methods=None)
        self.table.upgrade(PATH, self._check)
        self._port = Port(admission.options, self._handle, _select_subprotocol, self.table)

    @property
    def port(self) -> int:
        return self._port.port

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> None:
        o = self.admission.options
        await self._port.start(self._requested_port, ssl_context)
        scheme = "wss" if ssl_context else "ws"
        logger.info("FunASR protocol on %s://%s:%d%s", scheme, o.host, self.port, PATH)

    def _check(self, request: Request, url: SplitResult) -> Response | None:
        return self.admission.check_request(request, FUNASR_ENDPOINT, dict(parse_qsl(url.query)))

    async def _handle(self, ws: WebSocket) -> None:
        await serve_websocket(self.admission, ws, FUNASR_ENDPOINT)

    def stop_accepting(self) -> None:
        """Refuse new connections; open sessions go on (the server shuts them down)."""
        self._port.stop_accepting()

    async def close(self) -> None:
        """Close what is still open (after the grace period, 1001 going away) and wait for
        the handlers (the caller bounds the wait; what is left is then aborted)."""
        try:
            await self._port.close()
        finally:
            self._port.abort_all()
