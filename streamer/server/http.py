"""Plain HTTP on the WebSocket port: health, readiness, metrics, the web demo, admission.

Everything here answers a :class:`websockets.http11.Request` with a ``Response`` (or
``None`` to go on with the WebSocket handshake) and never blocks: static files are read
once and kept in memory.
"""

from __future__ import annotations

import hmac
import http
import logging
import mimetypes
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from websockets.datastructures import Headers, MultipleValuesError
from websockets.http11 import Request, Response

from streamer.core.protocol import StreamOptions, parse_stream_options
from streamer.core.session import Session
from streamer.core.wire import V1Adapter, WireAdapter
from streamer.errors import BadRequest
from streamer.media import open_decoder

logger = logging.getLogger(__name__)

WEBSOCKETS_REFUSAL = b"Failed to open a WebSocket connection"  # its reject() texts start so
STATIC_SUFFIXES = frozenset({".html", ".css", ".js", ".svg", ".png", ".ico", ".json", ".wav"})


def json_response(status: http.HTTPStatus, body: Mapping[str, Any]) -> Response:
    headers = Headers()
    headers["Content-Type"] = "application/json"
    headers["Cache-Control"] = "no-store"
    data = orjson.dumps(dict(body))
    headers["Content-Length"] = str(len(data))
    return Response(status.value, status.phrase, headers, data)


def bytes_response(status: http.HTTPStatus, content_type: str, body: bytes) -> Response:
    headers = Headers()
    headers["Content-Type"] = content_type
    headers["Cache-Control"] = "no-cache"
    headers["Content-Length"] = str(len(body))
    return Response(status.value, status.phrase, headers, body)


def unavailable_response(body: Mapping[str, Any], retry_after_s: int) -> Response:
    """503 with ``Retry-After``: the server is loading, full, stopping or restarting."""
    response = json_response(http.HTTPStatus.SERVICE_UNAVAILABLE, body)
    response.headers["Retry-After"] = str(retry_after_s)
    return response


def without_body(response: Response) -> Response:
    """The answer to HEAD: the GET answer's headers (Content-Length included), no body."""
    return Response(response.status_code, response.reason_phrase, response.headers, b"")


def safe_response(response: Response) -> Response:
    """websockets' own handshake refusals echo header values: replace their text."""
    if response.status_code == 101 or not response.body.startswith(WEBSOCKETS_REFUSAL):
        return response
    status = http.HTTPStatus(response.status_code)
    safe = json_response(
        status, {"error": "bad_handshake", "message": "not a valid WebSocket handshake"}
    )
    for name in ("Upgrade", "Sec-WebSocket-Version", "Retry-After"):
        if name in response.headers:
            safe.headers[name] = response.headers[name]
    if "Sec-WebSocket-Version" not in safe.headers:  # RFC 6455 4.4: the version we speak
        safe.headers["Sec-WebSocket-Version"] = "13"
    return safe


def single_header(request: Request, name: str) -> str | None:
    """The value of a header that must appear at most once (else :class:`BadRequest`)."""
    try:
        return request.headers.get(name)
    except MultipleValuesError:
        raise BadRequest(f"more than one {name} header") from None


def bearer_or_query_token(request: Request, query: Mapping[str, str]) -> str | None:
    """Protocol v1's token: ``Authorization: Bearer T`` or ``?token=T``."""
    auth = single_header(request, "Authorization") or ""
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return query.get("token")


def token_matches(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


def offered_subprotocols(request: Request) -> list[str]:
    """The ``Sec-WebSocket-Protocol`` values a client offered, in its order."""
    return [
        value.strip()
        for header in request.headers.get_all("Sec-WebSocket-Protocol")
        for value in header.split(",")
        if value.strip()
    ]


@dataclass(frozen=True)
class Negotiation:
    """What an endpoint made of one upgrade request."""

    stream: StreamOptions  # the new session's stream options
    make_adapter: Callable[[Session], WireAdapter]  # wraps the new session


@dataclass(frozen=True)
class Endpoint:
    """A WebSocket path and the wire protocol spoken there."""

    name: str  # metrics label and log name ("v1", "deepgram", ...)
    presented_token: Callable[[Request, Mapping[str, str]], str | None]  # its auth scheme
    auth_hint: str  # what a refused client is told to send
    make_adapter: Callable[[Session], WireAdapter]  # wraps a new session
    # Protocols whose handshake says more than v1's stream options read the whole request
    # here; a ProtocolError is refused with HTTP 400 before the upgrade.
    negotiate: Callable[[Request, Mapping[str, str], StreamOptions], Negotiation] | None = None
    select_subprotocol: Callable[[Sequence[str]], str | None] | None = None  # one to echo
    refusal: Callable[[http.HTTPStatus, str, str], Response] | None = None  # its error shape

    def stream_options(self, query: Mapping[str, str], defaults: StreamOptions) -> StreamOptions:
        """The session's stream options from the handshake's query (raises ProtocolError)."""
        return parse_stream_options(dict(query), defaults, strings=True)

    def negotiation(
        self, request: Request, query: Mapping[str, str], defaults: StreamOptions
    ) -> Negotiation:
        """Stream options and adapter for one upgrade request (raises ProtocolError)."""
        if self.negotiate is None:
            return Negotiation(self.stream_options(query, defaults), self.make_adapter)
        return self.negotiate(request, query, defaults)

    def refuse(self, status: http.HTTPStatus, code: str, message: str) -> Response:
        """A refused handshake, in the protocol's own error shape."""
        if self.refusal is None:
            return json_response(status, {"error": code, "message": message})
        return self.refusal(status, code, message)


def _v1_adapter(session: Session) -> V1Adapter:
    return V1Adapter(session, open_decoder=open_decoder)  # containers with encoding=...


V1_ENDPOINT = Endpoint(
    name="v1",
    presented_token=bearer_or_query_token,
    auth_hint="a valid token is required (Authorization: Bearer or ?token=)",
    make_adapter=_v1_adapter,
)


class StaticFiles:
    """The files of one folder, read once on first request and kept in memory."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self._cache: dict[str, Response] = {}  # only files that exist: bounded by the folder

    def response(self, path: str) -> Response | None:
        """The file at URL ``path`` ("/" is index.html), or None when there is none: a
        copy of the cached answer each time (the port adds its headers to what it sends,
        which added one more ``Server`` header to the cached one at every request)."""
        name = "index.html" if path in ("", "/") else path.lstrip("/")
        cached = self._cache.get(name)
        if cached is None:
            cached = self._load(name)
            if cached is None:
                return None
            self._cache[name] = cached
        headers = Headers(cached.headers.raw_items())
        return Response(cached.status_code, cached.reason_phrase, headers, cached.body)

    def _load(self, name: str) -> Response | None:
        try:
            target = (self.root / name).resolve()
        except (OSError, ValueError):  # NUL bytes, names too long for the file system
            return None
        if self.root not in target.parents or target.suffix not in STATIC_SUFFIXES:
            return None
        try:
            body = target.read_bytes()
        except OSError:
            return None
        content_type = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        if target.suffix == ".js":
            content_type = "text/javascript"
        if content_type.startswith("text/"):
            content_type += "; charset=utf-8"
        return bytes_response(http.HTTPStatus.OK, content_type, body)
