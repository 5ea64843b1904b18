"""Every (method, path) a port answers, in one table.

Two dispatchers serve the main port, both behind one h11 parser
(:class:`~streamer.server.front.PortFront`): :class:`~streamer.server.routes.Routes`
(``GET``/``HEAD``: the front tells a WebSocket endpoint's handshake from a plain page by
this table) and :class:`~streamer.server.file_routes.FileRoutes` (requests with a body).
Both answer a method a path does not take from this table, with 405 and the same
``Allow``, so that a client is told the same thing whichever route answers it. The FunASR
port's table has its one WebSocket endpoint and no pages.
"""

from __future__ import annotations

from collections.abc import Iterable

from streamer.server import models_page

PLAIN = ("GET", "HEAD")  # pages: health, readiness, metrics, models, the web demo
UPGRADE = ("GET",)  # a WebSocket endpoint's handshake
UPLOAD = ("POST", "OPTIONS")  # a file API (OPTIONS: a browser's CORS preflight)
PLAIN_PATHS = ("/", "/healthz", "/readyz", "/metrics", models_page.PATH)  # "/": the web demo
PLAIN_PREFIXES = (models_page.PATH + "/",)  # /v1/models/{id}
METHOD_ORDER = ("GET", "HEAD", "POST", "OPTIONS")


class RouteTable:
    """The main port's paths and the methods each takes; any other path is the web
    demo's (``GET``, ``HEAD``; 404 when no such file)."""

    def __init__(
        self,
        websocket_paths: Iterable[str],
        upload_paths: Iterable[str],
        *,
        pages: bool = True,
    ) -> None:
        """``pages``: whether the port serves the plain pages (FunASR's port does not)."""
        methods: dict[str, set[str]] = {path: set(PLAIN) for path in PLAIN_PATHS if pages}
        self.websocket_paths = frozenset(websocket_paths)
        for path in self.websocket_paths:
            methods.setdefault(path, set()).update(UPGRADE)
        for path in upload_paths:
            methods.setdefault(path, set()).update(UPLOAD)
        self.paths: dict[str, tuple[str, ...]] = {
            path: tuple(m for m in METHOD_ORDER if m in taken) for path, taken in methods.items()
        }

    def allowed(self, path: str) -> tuple[str, ...]:
        """The methods ``path`` takes (a web demo's file: GET and HEAD)."""
        found = self.paths.get(path)
        if found is not None:
            return found
        return PLAIN  # /v1/models/{id} and the web demo's files

    def preflight_methods(self, path: str) -> tuple[str, ...]:
        """What a browser's CORS preflight (``OPTIONS``) on ``path`` is told it may send
        (``Access-Control-Allow-Methods``): the path's file API methods; none: ``path``
        takes no preflight."""
        found = self.paths.get(path, ())
        return tuple(m for m in found if m in UPLOAD) if "OPTIONS" in found else ()

    def is_websocket(self, path: str) -> bool:
        """Whether ``path`` is a WebSocket endpoint's (its GET is a handshake)."""
        return path in self.websocket_paths

    def is_known(self, path: str) -> bool:
        """Whether ``path`` is one of the table's (not a web demo file's)."""
        return path in self.paths or path.startswith(PLAIN_PREFIXES)
