"""One HTTP/1.1 request with a body, on the main port: :class:`HttpExchange` (h11).

The WebSocket's parser reads a request's head only, so requests that carry a body
(file uploads) are handed here by :class:`~streamer.server.front.PortFront` before
the WebSocket sees them. h11 parses the request; the body is read on demand by the
handler (:meth:`HttpExchange.read`), with flow control: while more than
``HttpLimits.buffer_bytes`` wait unread, the socket is not read (TCP pushes back on the
uploader). Every wait has a bound: the head and each body chunk must come within
``HttpLimits.read_timeout_s``, each write within ``write_timeout_s``.

One request per connection: every answer says ``Connection: close``, and the
connection closes after it. An answer sent before the body was read (a refusal) is
followed by a lingering close (the rest of the body is read and dropped for a short
while), so that the client reads the answer instead of a reset.

When the client disconnects, the handler's task is cancelled: what it was doing for
the client (a decode job) stops with it. A client that closes its side after the whole
body (a zero-byte read: how browsers and the SDKs close, a timed-out SDK before its
retry) is gone too: nobody would read the answer. Whatever ends the handler, the
connection is closed after it: an answer that cannot be written (a header value that
cannot be encoded, a write that fails) never leaves it open.
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

from streamer.errors import BodyError, HttpError
from streamer.server.chunked import ChunkSizeError, ChunkSizes

logger = logging.getLogger(__name__)

SERVER_HEADER = "sensevoice-streamer"
LINGER_S = 2.0  # after an early answer, the unread body is drained for this long
LINGER_BYTES = 1 << 20  # ... or until this much was dropped
MAX_HEAD_BYTES = 64 * 1024  # the request line and headers
HTTP_VERSIONS = (b"1.0", b"1.1")  # what h11 speaks; HTTP/9.9 parses but is refused (505)


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

    def __init__(
        self,
        handler: Handler,
        limits: HttpLimits,
        *,
        peer: str = "?",
        head_deadline: float | None = None,
        connection: h11.Connection | None = None,
    ) -> None:
        """``head_deadline``: the loop time by which the whole head must have come (by
        default ``limits.read_timeout_s`` after :meth:`connection_made`; the connection's
        own start when the exchange takes over a connection already under way).
        ``connection``: the h11 connection the port's front fed the bytes read so far
        (:meth:`read_buffered` parses them: the head is parsed once, by one h11)."""
        self._handler = handler
        self.limits = limits
        self.peer = peer
        self._head_deadline = head_deadline
        self._h11 = connection if connection is not None else new_h11()
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
        self._chunk_sizes: ChunkSizes | None = None  # a chunked body's declared sizes
        self._head_timer: asyncio.TimerHandle | None = None
        self.responded = False  # a response (its head at least) was sent
        self.closed = asyncio.Event()  # the connection is closed
        self._lingering = False
        self._lingered = 0

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport (asyncio's, or uvloop's, which is not a subclass of it)
        self._transport = cast(asyncio.Transport, transport)
        deadline = self._head_deadline
        if deadline is None:
            deadline = self._loop.time() + self.limits.read_timeout_s
        self._head_timer = self._loop.call_at(deadline, self._head_timeout)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self._close()
            return
        self._feed_chunk_sizes(data)
        self._h11.receive_data(data)
        self.read_buffered()

    def read_buffered(self) -> None:
        """Parse what the h11 connection holds (what came, or what the front fed it)."""
        try:
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
        if self.request is None:
            return False  # closed before its head was complete: nothing to answer
        if self._body_done and not self.answered:
            # the whole body came, then the client closed: it is gone (browsers and the
            # SDKs close so, a timed-out SDK before its retry); nobody reads the answer,
            # and its transcription would hold a slot and the cores to the end
            logger.info("HTTP client %s closed its connection before the answer", self.peer)
            return False  # asyncio closes the transport; connection_lost cancels the task
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

    @property
    def answered(self) -> bool:
        """The whole answer was written (the connection closes, or has closed, after it)."""
        return self._h11.our_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)

    # -- reading -----------------------------------------------------------------------

    def _process(self) -> None:
        while True:
            event = self._h11.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._start(event)
            elif self._transport is None or self._transport.is_closing():
                return  # refused (a 505): nothing more is read
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
        if event.http_version not in HTTP_VERSIONS:
            self._refuse(
                http.HTTPStatus.HTTP_VERSION_NOT_SUPPORTED,
                "unsupported_http_version",
                "only HTTP/1.1 and HTTP/1.0 are served",
            )
            return
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
        elif any("chunked" in v.lower() for v in headers.get_all("Transfer-Encoding")):
            # h11 never says a chunk's size: one too large to wait for is refused at once
            self._chunk_sizes = ChunkSizes(self.limits.max_body_bytes)
            self._feed_chunk_sizes(self._h11.trailing_data[0])  # the body so far
        self._task = self._loop.create_task(self._run(), name=f"http {self.request.path}")

    def _feed_chunk_sizes(self, data: bytes) -> None:
        """A chunked body's bytes to the size reader: a chunk too large is refused now."""
        if self._chunk_sizes is None or self._body_error is not None:
            return
        try:
            self._chunk_sizes.feed(data)
        except ChunkSizeError as error:
            self._chunk_sizes = None
            self._fail_body(error.status, error.message)

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
            await self._serve()
        except Exception:  # what answering a failure raised: the connection ends below
            logger.exception("answering an HTTP request from %s failed", self.peer)
        finally:
            if not self.answered:  # whatever happened, no connection is left open
                self.abort()

    async def _serve(self) -> None:
        try:
            await self._handler(self)
        except asyncio.CancelledError:
            if not self.closed.is_set():
                self.abort()  # cancelled by a shutdown: the answer cannot be finished
            raise
        except HttpError as error:  # BodyError, BadRequest, a handler's refusal
            await self._answer_error(error.status, error.body, error.headers)
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
        if self.request is not None:
            self._fail_body(http.HTTPStatus.BAD_REQUEST, "the request body is malformed")
            return  # the handler answers (or has answered)
        self._refuse(
            http.HTTPStatus(error.error_status_hint), "bad_request", "malformed HTTP request"
        )

    def _refuse(self, status: http.HTTPStatus, code: str, message: str) -> None:
        """Answer a request that gets no handler (its head is not one we serve) and close."""
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        body = orjson.dumps({"error": code, "message": message})
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


def new_h11() -> h11.Connection:
    """A connection's h11 parser, with the head's bound (the front's and the exchange's)."""
    return h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)


def _encode(pairs: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.encode("ascii"), header_value(value)) for name, value in pairs]


def header_value(value: str) -> bytes:
    """``value`` as a header may carry it: a control character (CR, LF, NUL, ...) is a
    space and what Latin-1 cannot encode a ``?``. Error messages echo request text (a
    parameter's value, a URL) into headers such as Deepgram's ``dg-error``."""
    printable = "".join(" " if ord(c) < 32 or ord(c) == 127 else c for c in value).strip()
    return printable.encode("latin-1", "replace")
