"""One HTTP/1.1 request with a body, on the main port: :class:`HttpExchange` (h11).

websockets' HTTP handling reads a request's head only, so requests that carry a body
(file uploads) are handed here by :class:`~streamer.server.main_port.MainPortConnection`
before websockets sees them. h11 parses the request; the body is read on demand by the
handler (:meth:`HttpExchange.read`), with flow control: while more than
``HttpLimits.buffer_bytes`` wait unread, the socket is not read (TCP pushes back on the
uploader). Every wait has a bound: the head and each body chunk must come within
``HttpLimits.read_timeout_s``, each write within ``write_timeout_s``.

One request per connection: every answer says ``Connection: close``, and the
connection closes after it. An answer sent before the body was read (a refusal) is
followed by a lingering close (the rest of the body is read and dropped for a short
while), so that the client reads the answer instead of a reset.

When the client disconnects, the handler's task is cancelled: what it was doing for
the client (a decode job) stops with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import parse_qsl, urlsplit

import h11
import orjson
from websockets.datastructures import Headers
from websockets.http11 import Request

logger = logging.getLogger(__name__)

SERVER_HEADER = "sensevoice-streamer"
LINGER_S = 2.0  # after an early answer, the unread body is drained for this long
LINGER_BYTES = 1 << 20  # ... or until this much was dropped
MAX_HEAD_BYTES = 64 * 1024  # the request line and headers


class HttpError(Exception):
    """A request answered with ``status`` and ``body`` (JSON) instead of being served."""

    def __init__(
        self,
        status: http.HTTPStatus,
        body: Mapping[str, object],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"{status.value} {status.phrase}")
        self.status = status
        self.body = dict(body)
        self.headers = dict(headers or {})


class BodyError(Exception):
    """The request's body cannot be read: the client stopped sending, or sent too much."""

    def __init__(self, status: http.HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class HttpLimits:
    """Bounds of one HTTP exchange."""

    max_body_bytes: int = 100 << 20  # a larger body is refused with 413
    read_timeout_s: float = 30.0  # the head, and each piece of the body, within this
    write_timeout_s: float = 30.0  # each write of the answer within this
    buffer_bytes: int = 256 * 1024  # body read ahead of the handler before reading pauses


@dataclass(frozen=True)
class HttpRequest:
    """A parsed request head (as websockets' ``Request``, so the WebSocket routes' token
    and header checks apply unchanged)."""

    method: str
    target: str
    headers: Headers
    peer: str = "?"
    path: str = field(init=False)
    query: dict[str, str] = field(init=False)
    query_pairs: tuple[tuple[str, str], ...] = field(init=False)

    def __post_init__(self) -> None:
        url = urlsplit(self.target)
        pairs = tuple(parse_qsl(url.query, keep_blank_values=True))
        object.__setattr__(self, "path", url.path)
        object.__setattr__(self, "query_pairs", pairs)
        object.__setattr__(self, "query", dict(pairs))

    @property
    def ws_request(self) -> Request:
        return Request(self.target, self.headers)

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        if value is None or not value.strip().isdigit():
            return None
        return int(value)


Handler = Callable[["HttpExchange"], Awaitable[None]]


class HttpExchange(asyncio.Protocol):
    """One request read with h11 and answered by ``handler`` (an asyncio protocol)."""

    def __init__(self, handler: Handler, limits: HttpLimits, *, peer: str = "?") -> None:
        self._handler = handler
        self.limits = limits
        self.peer = peer
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self.request: HttpRequest | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._body_done = False
        self._body_error: BodyError | None = None
        self._received = 0  # body bytes so far
        self._readable = asyncio.Event()  # a chunk, the end, or an error waits
        self._reading_paused = False
        self._writable = asyncio.Event()
        self._writable.set()
        self._task: asyncio.Task[None] | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self.responded = False  # a response (its head at least) was sent
        self.closed = asyncio.Event()  # the connection is closed
        self._lingering = False
        self._lingered = 0

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport (asyncio's, or uvloop's, which is not a subclass of it)
        self._transport = cast(asyncio.Transport, transport)
        self._head_timer = self._loop.call_later(self.limits.read_timeout_s, self._head_timeout)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self._close()
            return
        try:
            self._h11.receive_data(data)
            self._process()
        except h11.RemoteProtocolError as error:
            self._protocol_error(error)

    def eof_received(self) -> bool | None:
        if self._lingering:
            self._close()
            return None
        with contextlib.suppress(h11.RemoteProtocolError):
            self._h11.receive_data(b"")
            self._process()
        if not self._body_done:
            self._fail_body(http.HTTPStatus.BAD_REQUEST, "the request body ended early")
        return True  # keep the transport open: the answer may still be written

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()
        self._writable.set()
        if self._head_timer is not None:
            self._head_timer.cancel()
        if not self._body_done:
            self._fail_body(http.HTTPStatus.BAD_REQUEST, "the client disconnected")
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client is gone: so is its job

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # -- reading -----------------------------------------------------------------------

    def _process(self) -> None:
        while True:
            event = self._h11.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._start(event)
            elif isinstance(event, h11.Data):
                self._on_data(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self._body_done = True
                self._readable.set()
            elif isinstance(event, h11.ConnectionClosed):
                return

    def _start(self, event: h11.Request) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        headers = Headers(
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in event.headers
        )
        self.request = HttpRequest(
            event.method.decode("ascii", "replace").upper(),
            event.target.decode("latin-1"),
            headers,
            self.peer,
        )
        length = self.request.content_length
        if length is not None and length > self.limits.max_body_bytes:
            self._fail_body(http.HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._too_large())
        self._task = self._loop.create_task(self._run(), name=f"http {self.request.path}")

    def _on_data(self, data: bytes) -> None:
        if self._body_error is not None:
            return  # refused: dropped
        self._received += len(data)
        if self._received > self.limits.max_body_bytes:
            self._fail_body(http.HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._too_large())
            return
        self._chunks.append(data)
        self._buffered += len(data)
        self._readable.set()
        if self._buffered > self.limits.buffer_bytes and not self._reading_paused:
            assert self._transport is not None
            self._transport.pause_reading()
            self._reading_paused = True

    def _too_large(self) -> str:
        return f"the request body is larger than {self.limits.max_body_bytes} bytes"

    def _fail_body(self, status: http.HTTPStatus, message: str) -> None:
        if self._body_error is None and not self._body_done:
            self._body_error = BodyError(status, message)
            self._chunks.clear()
            self._buffered = 0
            self._readable.set()

    async def read(self) -> bytes:
        """The next piece of the body; b"" at its end. Raises :class:`BodyError`."""
        if (
            self._h11.client_is_waiting_for_100_continue
            and self._body_error is None
            and self._h11.our_state is h11.SEND_RESPONSE
        ):
            self._send_event(h11.InformationalResponse(status_code=100, headers=[]))
        while not self._chunks:
            if self._body_error is not None:
                raise self._body_error
            if self._body_done:
                return b""
            self._readable.clear()
            try:
                async with asyncio.timeout(self.limits.read_timeout_s):
                    await self._readable.wait()
            except TimeoutError:
                self._fail_body(
                    http.HTTPStatus.REQUEST_TIMEOUT,
                    f"no part of the body came for {self.limits.read_timeout_s:g} s",
                )
        data = self._chunks.popleft()
        self._buffered -= len(data)
        if self._reading_paused and self._buffered <= self.limits.buffer_bytes // 2:
            assert self._transport is not None
            self._transport.resume_reading()
            self._reading_paused = False
        return data

    # -- answering ---------------------------------------------------------------------

    async def respond(
        self,
        status: http.HTTPStatus,
        content_type: str,
        body: bytes,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """The whole answer at once; the connection closes after it."""
        await self.start(status, content_type, headers, length=len(body))
        await self.write(body)
        await self.finish()

    async def respond_json(
        self,
        status: http.HTTPStatus,
        body: Mapping[str, object],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        await self.respond(status, "application/json", orjson.dumps(dict(body)), headers)

    async def start(
        self,
        status: http.HTTPStatus,
        content_type: str,
        headers: Mapping[str, str] | None = None,
        *,
        length: int | None = None,
    ) -> None:
        """The answer's head; without ``length`` the body is sent chunked (a stream)."""
        pairs: list[tuple[str, str]] = [
            ("Content-Type", content_type),
            ("Cache-Control", "no-store"),
            ("Connection", "close"),
            ("Server", SERVER_HEADER),
        ]
        if length is not None:
            pairs.append(("Content-Length", str(length)))
        pairs += list((headers or {}).items())
        self.responded = True
        await self._write_event(h11.Response(status_code=status.value, headers=_encode(pairs)))

    async def write(self, data: bytes) -> None:
        if data:
            await self._write_event(h11.Data(data=data))

    async def finish(self) -> None:
        """The end of the answer; then the connection closes (after a lingering read
        when the body was not read to its end)."""
        await self._write_event(h11.EndOfMessage())
        self._end_connection()

    def _end_connection(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self._body_done:
            self._close()
            return
        # the client may still be sending the body: read and drop it for a while, so
        # that it reads our answer instead of a reset (RFC 9112 9.6)
        self._lingering = True
        if self._reading_paused:
            transport.resume_reading()
            self._reading_paused = False
        with contextlib.suppress(OSError, RuntimeError, NotImplementedError):
            if transport.can_write_eof():
                transport.write_eof()
        self._loop.call_later(LINGER_S, self._close)

    def _close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    async def _write_event(self, event: h11.Event) -> None:
        if self.closed.is_set():
            raise ConnectionResetError("the client disconnected")
        self._send_event(event)
        if not self._writable.is_set():
            try:
                async with asyncio.timeout(self.limits.write_timeout_s):
                    await self._writable.wait()
            except TimeoutError:
                logger.warning(
                    "HTTP client %s read nothing for %g s: closed",
                    self.peer,
                    self.limits.write_timeout_s,
                )
                self.abort()
                raise ConnectionResetError("the client does not read") from None
            if self.closed.is_set():
                raise ConnectionResetError("the client disconnected")

    def _send_event(self, event: h11.Event) -> None:
        data = self._h11.send(event)
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    # -- the handler and the failures around it ----------------------------------------

    async def _run(self) -> None:
        try:
            await self._handler(self)
        except asyncio.CancelledError:
            if not self.closed.is_set():
                self.abort()  # cancelled by a shutdown: the answer cannot be finished
            raise
        except HttpError as error:
            await self._answer_error(error.status, error.body, error.headers)
        except BodyError as error:
            await self._answer_error(
                error.status, {"error": "bad_request", "message": error.message}, {}
            )
        except (ConnectionError, OSError):
            self.abort()
        except Exception:
            logger.exception("answering an HTTP request failed")
            await self._answer_error(
                http.HTTPStatus.INTERNAL_SERVER_ERROR,
                {"error": "internal_error", "message": "see the server log"},
                {},
            )

    async def _answer_error(
        self, status: http.HTTPStatus, body: Mapping[str, object], headers: Mapping[str, str]
    ) -> None:
        if self.responded:  # too late for a status: the stream is cut instead
            self.abort()
            return
        with contextlib.suppress(ConnectionError, OSError, h11.LocalProtocolError):
            await self.respond_json(status, body, headers)

    def _protocol_error(self, error: h11.RemoteProtocolError) -> None:
        logger.info("malformed HTTP request from %s: %s", self.peer, error)
        status = http.HTTPStatus(error.error_status_hint)
        if self.request is not None:
            self._fail_body(http.HTTPStatus.BAD_REQUEST, "the request body is malformed")
            return  # the handler answers (or has answered)
        body = orjson.dumps({"error": "bad_request", "message": "malformed HTTP request"})
        with contextlib.suppress(h11.LocalProtocolError):
            self._send_event(
                h11.Response(
                    status_code=status.value,
                    headers=_encode(
                        [
                            ("Content-Type", "application/json"),
                            ("Content-Length", str(len(body))),
                            ("Connection", "close"),
                        ]
                    ),
                )
            )
            self._send_event(h11.Data(data=body))
            self._send_event(h11.EndOfMessage())
        self._close()

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.request is None:
            logger.info("HTTP client %s sent no complete request head: closed", self.peer)
            self.abort()


def _encode(pairs: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in pairs]
