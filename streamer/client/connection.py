"""The protocol v1 connection (asyncio, websockets >= 14): one session, its keepalive and
reconnection with backoff.

One implementation for the example clients, the bench and the tests::

    async with await StreamingClient.connect(ClientOptions(url=...)) as client:
        ...  # client.ready is the server's ready message
        await client.send_audio(pcm_int16)
        await client.stop()
        async for message in client.messages():  # ends after `end`
            ...

For a whole signal use :func:`streamer.client.streaming.transcribe` or
:func:`streamer.client.streaming.stream_file` (paced sends, resume after a lost
connection); their results are :mod:`streamer.client.timeline`'s.

Errors: :class:`ConnectionRefusedByServer` when the handshake is refused (``status``
401/403/404/503), :class:`ServerUnreachable` when nothing answers, :class:`ServerClosed`
when the session ends abnormally (``code`` is the close code; 1006 when the connection
was lost without a close frame).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np
import orjson
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import (
    ConnectionClosed,
    ConnectionClosedOK,
    InvalidHandshake,
    InvalidStatus,
    InvalidURI,
)
from websockets.protocol import Event

from streamer.core.hotwords import as_query as hotwords_query
from streamer.core.protocol import (
    PATH,
    ConfigMessage,
    End,
    Error,
    Final,
    FinalizeMessage,
    KeepaliveMessage,
    Partial,
    Ready,
    ServerMessage,
    SpeechStart,
    StopMessage,
    StreamOptions,
    client_message_json,
    decode_server_message,
    parse_stream_options,
)
from streamer.errors import (
    ClientError,
    ConfigError,
    ConnectionRefusedByServer,
    MalformedMessage,
    ServerClosed,
    ServerUnreachable,
)

__all__ = [
    "DEFAULT_URL",
    "RETRYABLE_CLOSE_CODES",
    "ServerUnreachable",
    "ClientOptions",
    "Received",
    "StreamingClient",
    "session_url",
    "backoff_delays",
    "connect_with_backoff",
]

logger = logging.getLogger(__name__)

DEFAULT_URL = f"ws://127.0.0.1:8000{PATH}"
MAX_SERVER_MESSAGE_BYTES = 1 << 20  # server messages are small JSON; this bounds a bad peer
ABNORMAL_CLOSURE = 1006  # RFC 6455: the connection was lost without a close frame
# Close codes after which the same audio may succeed on a new connection: going away
# (server restarting), lost connection, internal error, service restart, try again later.
# 1003/1008/1009 are the client's fault and would fail again.
RETRYABLE_CLOSE_CODES = frozenset({1001, ABNORMAL_CLOSURE, 1011, 1012, 1013})
RETRYABLE_HTTP_STATUSES = frozenset({502, 503, 504})
# Beyond this much audio sent ahead of what the server has reported on, the server is
# busy with our audio (a 7 s segment yields no message until its final) and a late pong
# is expected, not a sign of death.
BEHIND_LIMIT_S = 10.0


@dataclass(frozen=True)
class ClientOptions:
    """How to reach the server and what to ask of it."""

    url: str = DEFAULT_URL  # ws:// or wss:// endpoint; its query parameters are kept
    stream: StreamOptions = field(default_factory=StreamOptions)  # sent as query parameters
    token: str | None = None  # sent as "Authorization: Bearer TOKEN"
    ssl_context: ssl.SSLContext | None = None  # for wss://; None uses the system CAs
    insecure: bool = False  # wss:// without certificate checks (self-signed test servers)
    open_timeout_s: float = 10.0  # TCP + TLS + WebSocket handshake + the `ready` message
    close_timeout_s: float = 5.0  # wait for the server's close frame
    connect_attempts: int = 5  # attempts of connect_with_backoff without a timeout
    initial_backoff_s: float = 0.25  # first delay between attempts, doubled after each
    max_backoff_s: float = 5.0  # cap on that delay (before jitter)
    reconnect_timeout_s: float = 120.0  # stream_file retries a lost server this long
    max_reconnects: int = 20  # reconnections stream_file makes before giving up
    max_message_bytes: int = MAX_SERVER_MESSAGE_BYTES  # largest server frame accepted
    ping_interval_s: float | None = 20.0  # keepalive pings; None sends none
    ping_timeout_s: float | None = 30.0  # silence after a ping (server pings count) before 1006


@dataclass(frozen=True)
class Received:
    """A server message and when it arrived."""

    message: ServerMessage
    arrival_s: float  # time.monotonic() right after the frame was read from the connection


# ---------------------------------------------------------------------------
# Pure helpers (tested without sockets)


def session_url(options: ClientOptions) -> str:
    """``options.url`` with the non-default stream options added as query parameters;
    a URL without a path (``ws://host:8000``) gets protocol v1's (``/v1/asr``), where
    the server's root would answer the web page and refuse the upgrade."""
    parts = urlsplit(options.url)
    if parts.path in ("", "/"):
        parts = parts._replace(path=PATH)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    defaults = StreamOptions()
    for name, value in dataclasses.asdict(options.stream).items():
        if name == "hotwords" and options.stream.hotwords:
            query[name] = hotwords_query(options.stream.hotwords)
        elif value != getattr(defaults, name):
            query[name] = str(value).lower() if isinstance(value, bool) else str(value)
    return urlunsplit(parts._replace(query=urlencode(query)))


def backoff_delays(
    attempts: int, initial_s: float, max_s: float, rng: random.Random | None = None
) -> list[float]:
    """Delays before attempts 2..``attempts``: doubling from ``initial_s`` up to ``max_s``.

    Each delay gets "equal jitter" (between half and all of its nominal value) so that
    clients dropped together do not come back together.
    """
    rng = rng or random.Random()
    delays = []
    for k in range(max(0, attempts - 1)):
        nominal = min(max_s, initial_s * 2**k)
        delays.append(nominal / 2 + rng.uniform(0, nominal / 2))
    return delays


def _pcm_bytes(pcm: bytes | bytearray | memoryview | np.ndarray) -> bytes | bytearray | memoryview:
    if isinstance(pcm, np.ndarray):
        if pcm.dtype != np.int16:
            raise TypeError(
                f"audio must be int16 PCM, got {pcm.dtype}; convert with streamer.audio_io.to_int16"
            )
        return pcm.astype("<i2", copy=False).tobytes()
    return pcm


def _server_closed(exc: ConnectionClosed) -> ServerClosed:
    if exc.rcvd is None:
        return ServerClosed(ABNORMAL_CLOSURE, "connection lost without a close frame")
    return ServerClosed(exc.rcvd.code, exc.rcvd.reason)


def _refusal(exc: InvalidStatus) -> ConnectionRefusedByServer:
    response = exc.response
    reason = response.reason_phrase
    try:
        body = orjson.loads(response.body or b"")
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict):
        code = body.get("error")
        message = body.get("message")
        reason = ": ".join(str(x) for x in (code, message) if x) or reason
    return ConnectionRefusedByServer(response.status_code, reason)


def _ssl_for(options: ClientOptions) -> ssl.SSLContext | bool | None:
    if not options.url.startswith("wss:"):
        return None
    if options.ssl_context is not None:
        return options.ssl_context
    if options.insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return True


# ---------------------------------------------------------------------------
# The connection


class _Connection(ClientConnection):
    """websockets' client connection, noting when the server last sent any frame.

    Pings from the server count: a server that is not reading our audio (back-pressure)
    still writes its keepalive pings, which prove it alive while our pong waits.
    """

    heard_s = 0.0  # time.monotonic() of the last frame received (data, ping or pong)

    def process_event(self, event: Event) -> None:
        self.heard_s = time.monotonic()
        super().process_event(event)


class StreamingClient:
    """One protocol v1 session. Create it with :meth:`connect`; use it as a context manager.

    Send with :meth:`send_audio`, :meth:`finalize`, :meth:`keepalive`, :meth:`stop`;
    read with :meth:`messages` (or :meth:`received` for arrival times) from one task while
    another sends. Not safe to read from two tasks at once.
    """

    def __init__(
        self,
        connection: ClientConnection,
        ready: Ready,
        ready_arrival_s: float,
        options: ClientOptions,
        started_s: float,
    ) -> None:
        self._connection = connection
        self._pending: list[Received] = [Received(ready, ready_arrival_s)]
        self.ready = ready  # the latest ready (a config message is answered by another)
        self.options = options
        self.started_s = started_s  # time.monotonic() when connecting began
        self.end: End | None = None  # the end message, once received
        self.stop_sent = False
        # Keepalive: a pong queued behind our own audio (the server is applying
        # back-pressure; the kernel's socket buffers alone can hold minutes of audio) is
        # not late. Time is excused while a send is blocked or while the server is more
        # than BEHIND_LIMIT_S of audio behind what we sent, and any message from the
        # server proves it alive. A server that crashed resets the connection. (No
        # TCP_USER_TIMEOUT here: while the server pushes back, our data waits in a zero
        # window, which some kernels count against that timeout and abort.)
        self._heard_s = started_s  # time.monotonic() of the last frame from the server
        self._excused_at_heard_s = 0.0
        self._sends_blocked = 0
        self._sent_samples = 0  # audio handed to the connection
        self._progress_samples = 0  # audio the server has reported on (times in messages)
        self._excused_since: float | None = None
        self._excused_total_s = 0.0
        self._keepalive: asyncio.Task[None] | None = None
        if options.ping_interval_s is not None:
            self._keepalive = asyncio.create_task(self._keep_alive(), name="client-keepalive")

    @classmethod
    async def connect(cls, options: ClientOptions | None = None) -> StreamingClient:
        """Open a session and wait for ``ready``; one attempt (see :func:`connect_with_backoff`).

        Raises :class:`ConnectionRefusedByServer` (HTTP 401/403/404/503 at the handshake),
        :class:`ServerUnreachable`, :class:`ServerClosed` (closed before ``ready``),
        :class:`ConfigError` for a malformed URL.
        """
        options = options or ClientOptions()
        url = session_url(options)
        headers = {"Authorization": f"Bearer {options.token}"} if options.token else None
        kwargs: dict[str, Any] = {}
        ssl_arg = _ssl_for(options)
        if ssl_arg is not None:
            kwargs["ssl"] = ssl_arg
        started_s = time.monotonic()
        where = urlsplit(options.url).netloc or options.url
        try:
            connection = await ws_connect(
                url,
                additional_headers=headers,
                compression=None,
                max_size=options.max_message_bytes,
                open_timeout=options.open_timeout_s,
                close_timeout=options.close_timeout_s,
                ping_interval=None,  # our own keepalive knows about back-pressure
                create_connection=_Connection,
                proxy=None,
                user_agent_header="sensevoice-streamer-client",
                **kwargs,
            )
        except InvalidStatus as exc:
            raise _refusal(exc) from None
        except InvalidURI as exc:
            raise ConfigError(f"invalid server URL {options.url!r}: {exc}") from None
        except ssl.SSLCertVerificationError as exc:
            raise ServerUnreachable(
                f"TLS certificate of {where} not trusted ({exc.verify_message});"
                " pass --insecure for a self-signed test certificate"
            ) from exc
        except TimeoutError as exc:
            raise ServerUnreachable(
                f"no answer from {where} within {options.open_timeout_s:g} s"
            ) from exc
        except OSError as exc:
            raise ServerUnreachable(
                f"cannot connect to {where}: {exc.strerror or exc}; is the server running?"
            ) from exc
        except InvalidHandshake as exc:
            raise ServerUnreachable(f"WebSocket handshake with {where} failed: {exc}") from exc
        try:
            ready = await asyncio.wait_for(_first_message(connection), options.open_timeout_s)
        except TimeoutError as exc:
            await connection.close()
            raise ServerUnreachable(
                f"{where} accepted the connection but sent no ready message within"
                f" {options.open_timeout_s:g} s"
            ) from exc
        except BaseException:
            await connection.close()
            raise
        ready_arrival_s = time.monotonic()
        logger.debug("connected to %s, session %s", where, ready.session_id)
        return cls(connection, ready, ready_arrival_s, options, started_s)

    @property
    def session_id(self) -> str:
        return self.ready.session_id

    async def send_audio(self, pcm: bytes | bytearray | memoryview | np.ndarray) -> None:
        """Send PCM s16le mono at ``ready.sample_rate`` (an int16 array or raw bytes)."""
        data = _pcm_bytes(pcm)
        if len(data):
            self._sent_samples += len(data) // 2
            await self._send(data)

    async def config(self, **params: Any) -> None:
        """Send a ``config`` message (before any audio); a new ``ready`` answers it.

        Raises :class:`streamer.errors.InvalidOption` locally for a bad option.
        """
        parse_stream_options(params)
        await self._send(client_message_json(ConfigMessage(params=params)).decode())

    async def finalize(self) -> None:
        """Ask the server to end the current utterance now."""
        await self._send(client_message_json(FinalizeMessage()).decode())

    async def keepalive(self) -> None:
        """Reset the server's idle timer while no audio flows."""
        await self._send(client_message_json(KeepaliveMessage()).decode())

    async def stop(self) -> None:
        """End of stream: the server sends the remaining finals, then ``end``, then closes."""
        await self._send(client_message_json(StopMessage()).decode())
        self.stop_sent = True

    async def _send(self, data: str | bytes | bytearray | memoryview) -> None:
        self._sends_blocked += 1
        self._mark_excused()
        try:
            await self._connection.send(data)
        except ConnectionClosed as exc:
            raise _server_closed(exc) from None
        finally:
            self._sends_blocked -= 1
            self._mark_excused()

    def _excused(self) -> bool:
        behind = self._sent_samples - self._progress_samples
        return self._sends_blocked > 0 or behind > BEHIND_LIMIT_S * self.ready.sample_rate

    def _mark_excused(self) -> None:
        """Account excused time; call after every change to what _excused() reads."""
        now = time.monotonic()
        if self._excused_since is not None and not self._excused():
            self._excused_total_s += now - self._excused_since
            self._excused_since = None
        elif self._excused_since is None and self._excused():
            self._excused_since = now

    def _excused_s(self, now: float) -> float:
        current = now - self._excused_since if self._excused_since is not None else 0.0
        return self._excused_total_s + current

    async def _keep_alive(self) -> None:
        interval_s, timeout_s = self.options.ping_interval_s, self.options.ping_timeout_s
        assert interval_s is not None
        try:
            while True:
                await asyncio.sleep(interval_s)
                # websockets types it as Awaitable; it is the pong's Future
                pong = cast("asyncio.Future[float]", await self._connection.ping())
                if timeout_s is None:
                    continue
                sent = time.monotonic()
                excused_at_ping = self._excused_s(sent)
                while not pong.done():
                    now = time.monotonic()
                    since, excused_since = sent, excused_at_ping
                    heard_s = max(self._heard_s, getattr(self._connection, "heard_s", 0.0))
                    if heard_s > sent:
                        # a frame after the ping: alive then (excused time before is moot)
                        since, excused_since = heard_s, self._excused_s(heard_s)
                    waited_s = (now - since) - (self._excused_s(now) - excused_since)
                    if waited_s >= timeout_s:
                        logger.warning("no pong from the server for %g s: closing", timeout_s)
                        self._connection.transport.abort()  # recv() raises: 1006
                        return
                    await asyncio.wait({pong}, timeout=timeout_s - waited_s)
        except ConnectionClosed:
            pass

    async def received(self) -> AsyncIterator[Received]:
        """Server messages with their arrival times, until ``end`` or the close.

        The first is the ``ready`` that :meth:`connect` waited for. A normal close ends
        the iteration; an abnormal one raises :class:`ServerClosed` after any ``error``
        message that explains it has been yielded. Frames that are not protocol v1
        messages are logged and skipped.
        """
        while self._pending:
            yield self._pending.pop(0)
        while self.end is None:
            try:
                data = await self._connection.recv()
            except ConnectionClosedOK as exc:
                if exc.rcvd is not None and exc.rcvd.code == 1001:
                    # Going away without `end`: the session did not finish.
                    raise _server_closed(exc) from None
                return
            except ConnectionClosed as exc:
                raise _server_closed(exc) from None
            arrival_s = time.monotonic()
            self._heard_s = arrival_s
            self._excused_at_heard_s = self._excused_s(arrival_s)
            if not isinstance(data, str):
                logger.warning("ignoring a %d-byte binary frame from the server", len(data))
                continue
            try:
                message = decode_server_message(data)
            except MalformedMessage as exc:
                logger.warning("ignoring an unreadable server message: %s", exc)
                continue
            if isinstance(message, Ready):
                self.ready = message
            elif isinstance(message, End):
                self.end = message
            self._note_progress(message)
            yield Received(message, arrival_s)

    def _note_progress(self, message: ServerMessage) -> None:
        ms = None
        if isinstance(message, Partial | Final):
            ms = message.end_ms
        elif isinstance(message, SpeechStart):
            ms = message.start_ms
        elif isinstance(message, End):
            ms = message.audio_ms
        if ms is not None:
            samples = int(ms * self.ready.sample_rate / 1000)
            self._progress_samples = max(self._progress_samples, samples)
            self._mark_excused()

    async def messages(self) -> AsyncIterator[ServerMessage]:
        """Typed server messages until ``end`` or the close (see :meth:`received`)."""
        async for item in self.received():
            yield item.message

    @property
    def close_code(self) -> int | None:
        """The code of the server's close frame (None before it came, or without one)."""
        received = self._connection.protocol.close_rcvd
        return None if received is None else received.code

    async def close(self) -> None:
        """Close the connection (waits up to ``close_timeout_s`` for the server)."""
        if self._keepalive is not None:
            self._keepalive.cancel()
        try:
            async with asyncio.timeout(self.options.close_timeout_s + 1):
                await self._connection.close()
        except TimeoutError:
            self._connection.transport.abort()

    async def __aenter__(self) -> StreamingClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


async def _first_message(connection: ClientConnection) -> Ready:
    try:
        data = await connection.recv()
    except ConnectionClosed as exc:
        raise _server_closed(exc) from None
    try:
        message = decode_server_message(data)
    except MalformedMessage as exc:
        raise ClientError(f"the server is not a protocol v1 server: {exc}") from None
    if not isinstance(message, Ready):
        if isinstance(message, Error):
            raise ClientError(f"server error before ready: {message.code}: {message.message}")
        raise ClientError(f"expected a ready message first, got {message.type!r}")
    return message


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, ConnectionRefusedByServer):
        return exc.status in RETRYABLE_HTTP_STATUSES
    if isinstance(exc, ServerClosed):
        return exc.code in RETRYABLE_CLOSE_CODES
    return isinstance(exc, ServerUnreachable)


async def connect_with_backoff(
    options: ClientOptions,
    *,
    attempts: int | None = None,
    timeout_s: float | None = None,
    rng: random.Random | None = None,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> StreamingClient:
    """:meth:`StreamingClient.connect`, retried with jittered exponential backoff.

    Retries when the server is unreachable or answers 502/503/504 (full, loading,
    restarting); a 401/403/404 is raised at once. ``on_retry(attempt, error, delay_s)``
    is called before each wait. With ``timeout_s`` it keeps trying (delays capped at
    ``options.max_backoff_s``) until that much time has passed, which outlasts a server
    restart; else after ``attempts`` (default ``options.connect_attempts``). Then the
    last error is raised.
    """
    rng = rng or random.Random()
    deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
    if deadline_s is not None:
        attempts = 1 << 30  # bounded by the deadline instead
    attempts = max(1, attempts if attempts is not None else options.connect_attempts)
    delays = _delays(attempts, options, rng)
    for attempt in range(1, attempts + 1):
        delay_s = next(delays) if attempt < attempts else None
        if delay_s is not None and deadline_s is not None:
            left_s = deadline_s - time.monotonic()
            delay_s = None if left_s <= 0 else min(delay_s, left_s)
        try:
            return await StreamingClient.connect(options)
        except ClientError as exc:
            if delay_s is None or not _retryable(exc):
                raise
            logger.info("connect attempt %d failed (%s); retrying in %.2f s", attempt, exc, delay_s)
            if on_retry is not None:
                on_retry(attempt, exc, delay_s)
            await asyncio.sleep(delay_s)
    raise AssertionError("unreachable")  # the loop always returns or raises


def _delays(attempts: int, options: ClientOptions, rng: random.Random) -> Iterator[float]:
    """:func:`backoff_delays`, lazily (a deadline-bounded retry may make many attempts)."""
    for k in range(attempts):
        nominal = min(options.max_backoff_s, options.initial_backoff_s * 2 ** min(k, 30))
        yield nominal / 2 + rng.uniform(0, nominal / 2)
