"""Every (method, path) a port answers, and what answers it: one table, one lookup.

Each port has one :class:`RouteTable`. Its routes are registered in it keyed by (method,
path): the plain pages (``GET``/``HEAD``, answered by
:class:`~streamer.server.front.PortFront` itself), the WebSocket endpoints' handshakes
(``GET``, whose check lets the upgrade go on) and the requests with a body (``POST``, and
``OPTIONS`` for a browser's CORS preflight: the file APIs, read by an
:class:`~streamer.server.http_exchange.HttpExchange`). :meth:`RouteTable.find` is the
port's one dispatch, whichever protocol read the head: the route of (method, path), else
405 with the path's ``Allow``, else the fallback (the web demo's files), else 404, each
as an :class:`~streamer.errors.HttpError` the reader answers in its own way.
:func:`check_request_line` is the validation every request gets first.
"""

from __future__ import annotations

import http
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import SplitResult, urlsplit

from websockets.http11 import Request, Response

from streamer.errors import BadRequest, HttpError
from streamer.server.http import single_header

if TYPE_CHECKING:  # the exchange's handler is registered here; it never imports the table
    from streamer.server.http_exchange import HttpExchange

PLAIN = ("GET", "HEAD")  # pages: health, readiness, metrics, models, the web demo
UPGRADE = ("GET",)  # a WebSocket endpoint's handshake
UPLOAD = ("POST", "OPTIONS")  # a file API (OPTIONS: a browser's CORS preflight)
METHOD_ORDER = ("GET", "HEAD", "POST", "OPTIONS")
SINGLE_HEADERS = ("Authorization", "Origin", "Host")  # a repeated one is a 400

# a page's answer, or a handshake's check (None: the upgrade goes on); with the URL
Page = Callable[[Request, SplitResult], Response | None]
BodyHandler = Callable[["HttpExchange"], Awaitable[None]]


@dataclass(frozen=True)
class PageRoute:
    """A plain page: answered at once from the head."""

    answer: Page


@dataclass(frozen=True)
class UpgradeRoute:
    """A WebSocket endpoint: ``check`` refuses the handshake (a response) or lets it go on."""

    check: Page


@dataclass(frozen=True)
class BodyRoute:
    """A request with a body: ``handle`` reads it from the exchange and answers."""

    handle: BodyHandler


Entry = PageRoute | UpgradeRoute | BodyRoute


def check_request_line(request: Request) -> SplitResult:
    """The request's URL once its target and single headers are valid (else BadRequest)."""
    try:
        url = urlsplit(request.path)
    except ValueError:
        raise BadRequest("the request target is not a valid URL") from None
    path = url.path
    if "\x00" in path or any(len(part) > 255 for part in path.split("/")):
        raise BadRequest("the request path is not valid")
    for name in SINGLE_HEADERS:
        single_header(request, name)  # raises BadRequest when repeated
    return url


def method_not_allowed(allowed: tuple[str, ...]) -> HttpError:
    """405 with ``Allow``: the methods the path takes."""
    return HttpError(
        http.HTTPStatus.METHOD_NOT_ALLOWED,
        {"error": "method_not_allowed", "message": f"this path takes {', '.join(allowed)}"},
        {"Allow": ", ".join(allowed)},
    )


NOT_FOUND = {"error": "not_found", "message": "no such path"}


class RouteTable:
    """A port's routes by (method, path), and what answers a path not in it."""

    def __init__(
        self, fallback: Page | None = None, fallback_methods: tuple[str, ...] | None = PLAIN
    ) -> None:
        """``fallback``: what answers a path not in the table (the web demo's files), for
        ``fallback_methods`` (None: every method; it then checks the method itself); any
        other request on such a path is a 404."""
        self._entries: dict[tuple[str, str], Entry] = {}
        self._prefixes: dict[tuple[str, str], Entry] = {}  # (method, "/v1/models/")
        self.paths: dict[str, tuple[str, ...]] = {}  # path -> its methods, in METHOD_ORDER
        self._prefix_methods: dict[str, tuple[str, ...]] = {}
        self.websocket_paths: set[str] = set()
        self._fallback = fallback
        self._fallback_methods = fallback_methods

    # -- registering ---------------------------------------------------------------------

    def add(self, methods: Iterable[str], path: str, entry: Entry, *, prefix: bool = False) -> None:
        """``entry`` answers each of ``methods`` on ``path`` (every path under it when
        ``prefix``); one route per (method, path)."""
        entries = self._prefixes if prefix else self._entries
        known = self._prefix_methods if prefix else self.paths
        for method in methods:
            if (method, path) in entries:
                raise ValueError(f"{method} {path} is routed twice")
            entries[method, path] = entry
        taken = {method for method, p in entries if p == path}
        known[path] = tuple(m for m in METHOD_ORDER if m in taken)
        if isinstance(entry, UpgradeRoute) and not prefix:
            self.websocket_paths.add(path)

    def page(self, path: str, answer: Page, *, prefix: bool = False) -> None:
        self.add(PLAIN, path, PageRoute(answer), prefix=prefix)

    def upgrade(self, path: str, check: Page) -> None:
        self.add(UPGRADE, path, UpgradeRoute(check))

    def body(self, methods: Iterable[str], path: str, handle: BodyHandler) -> None:
        self.add(methods, path, BodyRoute(handle))

    # -- reading -------------------------------------------------------------------------

    def _prefix(self, path: str) -> str | None:
        return next((p for p in self._prefix_methods if path.startswith(p)), None)

    def allowed(self, path: str) -> tuple[str, ...]:
        """The methods ``path`` takes (a path not in the table: the fallback's)."""
        found = self.paths.get(path)
        if found is not None:
            return found
        prefix = self._prefix(path)
        if prefix is not None:
            return self._prefix_methods[prefix]
        return self._fallback_methods or ()

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
        """Whether ``path`` is one of the table's (not a fallback's)."""
        return path in self.paths or self._prefix(path) is not None

    # -- dispatching ---------------------------------------------------------------------

    def find(self, method: str, path: str) -> Entry:
        """The route of ``method`` on ``path``; raises :class:`HttpError`: 405 (with
        ``Allow``) for a method the path does not take, 404 for a path nobody serves."""
        entry = self._entries.get((method, path))
        if entry is not None:
            return entry
        prefix = None if path in self.paths else self._prefix(path)
        if prefix is not None and (method, prefix) in self._prefixes:
            return self._prefixes[method, prefix]
        if self.is_known(path):
            raise method_not_allowed(self.allowed(path))
        methods = self._fallback_methods
        if self._fallback is not None and (methods is None or method in methods):
            return PageRoute(self._fallback)
        raise HttpError(http.HTTPStatus.NOT_FOUND, NOT_FOUND)

    def answer(self, request: Request) -> Response | None:
        """A request whose head is all there is (a page, or a WebSocket handshake: None
        lets it go on); raises :class:`HttpError` (its answer)."""
        url = check_request_line(request)
        entry = self.find(request.method, url.path)
        if isinstance(entry, PageRoute):
            return entry.answer(request, url)
        if isinstance(entry, UpgradeRoute):
            return entry.check(request, url)
        raise method_not_allowed(self.allowed(url.path))  # a body: not read by this side
