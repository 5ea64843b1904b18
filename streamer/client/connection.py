"""The protocol v1 client (asyncio, websockets >= 14).

One implementation for the example clients, the bench and the tests::

    async with await StreamingClient.connect(ClientOptions(url=...)) as client:
        ...  # client.ready is the server's ready message
        await client.send_audio(pcm_int16)
        await client.stop()
        async for message in client.messages():  # ends after `end`
            ...

For a whole signal use :func:`transcribe` (one session, results with arrival times and
the send log) or :func:`stream_file` (the same, reconnecting with backoff when the
connection drops and resuming from the first sample not yet covered by a final).

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
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
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

from streamer.audio_io import load_audio
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
    "SentChunk",
    "SessionResult",
    "PaceSchedule",
    "StreamingClient",
    "session_url",
    "backoff_delays",
    "chunk_bounds",
    "resume_sample",
    "shift_message",
    "connect_with_backoff",
    "stream_pcm",
    "run_session",
    "transcribe",
    "stream_file",
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


@dataclass(frozen=True)
class SentChunk:
    """One audio frame handed to the connection."""

    end_sample: int  # samples of the signal sent so far (end of this chunk)
    sent_s: float  # time.monotonic() right after the send returned


@dataclass(frozen=True)
class SessionResult:
    """Everything a streamed signal produced, on the signal's timeline."""

    ready: Ready  # the (first) session's ready message
    sample_rate: int  # rate of the samples counted in `sends`
    messages: tuple[Received, ...]  # every server message in arrival order
    sends: tuple[SentChunk, ...]  # the send log
    finals: tuple[Final, ...]  # finals in order (non-empty and empty text alike)
    end: End | None  # the end message (combined over reconnections); None if none came
    started_s: float  # time.monotonic() when connecting began
    finished_s: float  # time.monotonic() when the last message arrived
    reconnects: int = 0  # reconnections made by stream_file

    @property
    def text(self) -> str:
        """The finals' text joined by spaces (empty finals skipped)."""
        return " ".join(f.text for f in self.finals if f.text.strip())

    @property
    def partials(self) -> tuple[Partial, ...]:
        return tuple(r.message for r in self.messages if isinstance(r.message, Partial))

    def sent_time_s(self, sample: int) -> float | None:
        """When the chunk carrying ``sample`` was sent (None if it never was)."""
        for chunk in self.sends:
            if chunk.end_sample > sample:
                return chunk.sent_s
        return None

    def time_to_first_partial_s(self) -> float | None:
        """From sending the audio where the first segment starts to its first result.

        The first result is its first partial, or its final when partials are off.
        """
        for item in self.messages:
            if isinstance(item.message, Partial | Final):
                sample = int(item.message.start_ms * self.sample_rate / 1000)
                sent = self.sent_time_s(sample)
                return None if sent is None else item.arrival_s - sent
        return None

    def final_latencies_s(self) -> list[float]:
        """Per final: arrival minus the send time of the audio at its ``end_ms``."""
        latencies = []
        for item in self.messages:
            if isinstance(item.message, Final):
                sample = max(0, int(item.message.end_ms * self.sample_rate / 1000) - 1)
                sent = self.sent_time_s(sample)
                if sent is not None:
                    latencies.append(item.arrival_s - sent)
        return latencies

    def median_final_latency_s(self) -> float | None:
        latencies = self.final_latencies_s()
        return median(latencies) if latencies else None


# ---------------------------------------------------------------------------
# Pure helpers (tested without sockets)


def session_url(options: ClientOptions) -> str:
    """``options.url`` with the non-default stream options added as query parameters."""
    parts = urlsplit(options.url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    defaults = StreamOptions()
    for name, value in dataclasses.asdict(options.stream).items():
        if value != getattr(defaults, name):
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


def chunk_bounds(
    start_sample: int, total_samples: int, chunk_samples: int
) -> list[tuple[int, int]]:
    """``[start, end)`` sample ranges of ``chunk_samples`` from ``start_sample`` to the end."""
    if chunk_samples <= 0:
        raise ValueError("chunk_samples must be positive")
    return [
        (a, min(a + chunk_samples, total_samples))
        for a in range(max(0, start_sample), total_samples, chunk_samples)
    ]


@dataclass(frozen=True)
class PaceSchedule:
    """When each chunk is due, like a live source: sample ``n`` exists at ``origin + n/rate``.

    Due times come from one origin, never from the previous send, so late sends do not
    accumulate drift; a chunk that is already late goes out at once.
    """

    origin_s: float  # monotonic time at which sample `origin_sample` is due
    sample_rate: int  # Hz
    speed: float = 1.0  # 2.0 sends twice as fast as real time
    origin_sample: int = 0

    def due_s(self, end_sample: int) -> float:
        """When the chunk ending at ``end_sample`` may be sent (all of it has "happened")."""
        return self.origin_s + (end_sample - self.origin_sample) / (self.sample_rate * self.speed)


def resume_sample(finals: Sequence[Final], sample_rate: int) -> int:
    """The first sample not covered by a final: where a reconnected stream starts again."""
    if not finals:
        return 0
    return max(0, round(max(f.end_ms for f in finals) * sample_rate / 1000))


def shift_message(message: ServerMessage, offset_ms: float, segment_offset: int) -> ServerMessage:
    """``message`` with its times moved by ``offset_ms`` and its segment id by ``segment_offset``.

    Used to put the messages of a resumed session onto the timeline of the whole signal.
    """
    if offset_ms == 0 and segment_offset == 0:
        return message
    if isinstance(message, SpeechStart):
        return dataclasses.replace(
            message,
            segment_id=message.segment_id + segment_offset,
            start_ms=message.start_ms + offset_ms,
        )
    if isinstance(message, Partial | Final):
        return dataclasses.replace(
            message,
            segment_id=message.segment_id + segment_offset,
            start_ms=message.start_ms + offset_ms,
            end_ms=message.end_ms + offset_ms,
        )
    if isinstance(message, End):
        return dataclasses.replace(message, audio_ms=message.audio_ms + offset_ms)
    return message


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
            except (MalformedMessage, orjson.JSONDecodeError) as exc:
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
    except (MalformedMessage, orjson.JSONDecodeError) as exc:
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


# ---------------------------------------------------------------------------
# Streaming a whole signal

ChunkCallback = Callable[[int, float], None]  # (end_sample, time.monotonic())
MessageCallback = Callable[[Received], None]


async def stream_pcm(
    client: StreamingClient,
    pcm_int16: np.ndarray,
    sample_rate: int,
    *,
    chunk_ms: int = 100,
    speed: float | None = 1.0,
    on_chunk_sent: ChunkCallback | None = None,
    start_sample: int = 0,
    schedule: PaceSchedule | None = None,
    send_stop: bool = True,
) -> None:
    """Send ``pcm_int16[start_sample:]`` in ``chunk_ms`` chunks, then ``stop``.

    ``speed`` paces the chunks like a live source (1.0 real time, 4.0 four times faster;
    ``None`` sends as fast as the connection takes them). A chunk is sent when its last
    sample is due on the ``schedule`` (default: starting now at ``start_sample``).
    ``on_chunk_sent(end_sample, time.monotonic())`` is called right after each send.
    Read the messages from another task meanwhile.
    """
    if sample_rate != client.ready.sample_rate:
        raise ClientError(
            f"the session expects {client.ready.sample_rate} Hz audio, got {sample_rate} Hz;"
            " set ClientOptions.stream.sample_rate or resample first"
        )
    if pcm_int16.dtype != np.int16 or pcm_int16.ndim != 1:
        raise TypeError("stream_pcm needs a 1-D int16 array (see streamer.audio_io.load_audio)")
    if speed is not None and speed <= 0:
        raise ValueError(f"speed must be positive or None, got {speed}")
    chunk_samples = max(1, sample_rate * chunk_ms // 1000)
    if speed is not None and schedule is None:
        schedule = PaceSchedule(time.monotonic(), sample_rate, speed, start_sample)
    for start, end in chunk_bounds(start_sample, pcm_int16.size, chunk_samples):
        if schedule is not None and speed is not None:
            delay_s = schedule.due_s(end) - time.monotonic()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
        await client.send_audio(pcm_int16[start:end])
        sent_s = time.monotonic()
        if on_chunk_sent is not None:
            on_chunk_sent(end, sent_s)
        if speed is None:
            # Let the reader timestamp what arrived while the sends do not block.
            await asyncio.sleep(0)
    if send_stop:
        await client.stop()


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled() and task.exception() is not None:
        logger.debug("sender ended with %r after the session ended", task.exception())


async def run_session(
    client: StreamingClient,
    pcm_int16: np.ndarray,
    sample_rate: int,
    *,
    on_message: MessageCallback,
    chunk_ms: int = 100,
    speed: float | None = 1.0,
    on_chunk_sent: ChunkCallback | None = None,
    start_sample: int = 0,
    schedule: PaceSchedule | None = None,
) -> bool:
    """Stream the signal on an open session while reading its messages concurrently.

    Every message goes to ``on_message`` as it arrives. Returns True when the session
    ended after all audio and ``stop`` were sent, False when the server ended it first
    (shutting down). Raises :class:`ServerClosed` on an abnormal close.
    """
    sender = asyncio.create_task(
        stream_pcm(
            client,
            pcm_int16,
            sample_rate,
            chunk_ms=chunk_ms,
            speed=speed,
            on_chunk_sent=on_chunk_sent,
            start_sample=start_sample,
            schedule=schedule,
        )
    )
    try:
        async for item in client.received():
            on_message(item)
    except BaseException:
        await _cancel(sender)
        raise
    if not sender.done():
        await _cancel(sender)
        return False
    error = sender.exception()
    if isinstance(error, ServerClosed):
        return False  # the session closed normally while audio was still being sent
    if error is not None:
        raise error
    return client.stop_sent


def _result(
    ready: Ready,
    sample_rate: int,
    messages: list[Received],
    sends: list[SentChunk],
    end: End | None,
    started_s: float,
    reconnects: int = 0,
) -> SessionResult:
    return SessionResult(
        ready=ready,
        sample_rate=sample_rate,
        messages=tuple(messages),
        sends=tuple(sends),
        finals=tuple(r.message for r in messages if isinstance(r.message, Final)),
        end=end,
        started_s=started_s,
        finished_s=messages[-1].arrival_s if messages else time.monotonic(),
        reconnects=reconnects,
    )


def _with_rate(options: ClientOptions, sample_rate: int) -> ClientOptions:
    if options.stream.sample_rate == sample_rate:
        return options
    stream = dataclasses.replace(options.stream, sample_rate=sample_rate)
    return dataclasses.replace(options, stream=stream)


async def transcribe(
    options: ClientOptions,
    pcm: np.ndarray,
    sample_rate: int,
    *,
    speed: float | None = None,
    chunk_ms: int = 100,
    on_message: MessageCallback | None = None,
    on_chunk_sent: ChunkCallback | None = None,
) -> SessionResult:
    """Stream ``pcm`` (int16 mono at ``sample_rate``) in one session; no reconnection.

    The session is opened with ``sample_rate`` as its stream rate (the server resamples
    rates other than 16000). ``speed=None`` streams unpaced. Raises like
    :meth:`StreamingClient.connect`, and :class:`ServerClosed` if the session ends
    abnormally or before all audio was sent.
    """
    options = _with_rate(options, sample_rate)
    messages: list[Received] = []
    sends: list[SentChunk] = []

    def record(item: Received) -> None:
        messages.append(item)
        if on_message is not None:
            on_message(item)

    def sent(end_sample: int, sent_s: float) -> None:
        sends.append(SentChunk(end_sample, sent_s))
        if on_chunk_sent is not None:
            on_chunk_sent(end_sample, sent_s)

    async with await StreamingClient.connect(options) as client:
        complete = await run_session(
            client, pcm, sample_rate, on_message=record, chunk_ms=chunk_ms, speed=speed,
            on_chunk_sent=sent,
        )  # fmt: skip
    if not complete:
        raise ServerClosed(1001, "the server ended the session before all audio was sent")
    return _result(client.ready, sample_rate, messages, sends, client.end, client.started_s)


async def stream_file(
    options: ClientOptions,
    source: str | Path | np.ndarray,
    *,
    sample_rate: int | None = None,
    speed: float | None = 1.0,
    chunk_ms: int = 100,
    on_message: MessageCallback | None = None,
    on_chunk_sent: ChunkCallback | None = None,
    on_reconnect: Callable[[int, int, BaseException | None], None] | None = None,
) -> SessionResult:
    """Stream a file (path, or int16 array at ``sample_rate``), reconnecting when dropped.

    When the connection is lost or the server restarts mid-stream (not when it refuses
    or rejects the audio), a new session is opened with :func:`connect_with_backoff` and
    the audio is sent again from the end of the last final; that session's times and
    segment ids are shifted so every message stays on the file's timeline. Pacing keeps
    the original schedule: the resent backlog goes out at once. ``on_reconnect(count,
    resume_sample, error)`` is called before each reconnection. The first connection is
    a single attempt so that a wrong URL fails fast.
    """
    if isinstance(source, np.ndarray):
        if sample_rate is None:
            raise ValueError("pass sample_rate with a PCM array")
        pcm = source
    else:
        sample_rate = sample_rate or options.stream.sample_rate
        pcm = load_audio(source, target_rate=sample_rate)
    options = _with_rate(options, sample_rate)
    messages: list[Received] = []
    sends: list[SentChunk] = []
    finals: list[Final] = []
    offset_sample = 0
    segment_offset = 0
    partials_sent = partials_skipped = 0
    last_end: End | None = None

    def record(item: Received) -> None:
        nonlocal partials_sent, partials_skipped, last_end
        message = shift_message(item.message, offset_sample * 1000 / sample_rate, segment_offset)
        if isinstance(message, Final):
            finals.append(message)
        elif isinstance(message, End):
            partials_sent += message.partials_sent
            partials_skipped += message.partials_skipped
            last_end = message
        shifted = Received(message, item.arrival_s)
        messages.append(shifted)
        if on_message is not None:
            on_message(shifted)

    def sent(end_sample: int, sent_s: float) -> None:
        sends.append(SentChunk(end_sample, sent_s))
        if on_chunk_sent is not None:
            on_chunk_sent(end_sample, sent_s)

    client = await StreamingClient.connect(options)
    first_ready = client.ready
    started_s = client.started_s
    schedule = None if speed is None else PaceSchedule(time.monotonic(), sample_rate, speed)
    reconnects = 0
    while True:
        error: BaseException | None = None
        try:
            async with client:
                complete = await run_session(
                    client, pcm, sample_rate, on_message=record, chunk_ms=chunk_ms, speed=speed,
                    on_chunk_sent=sent, start_sample=offset_sample, schedule=schedule,
                )  # fmt: skip
        except ServerClosed as exc:
            if not _retryable(exc) or reconnects >= options.max_reconnects:
                raise
            complete, error = False, exc
        if complete:
            break
        if reconnects >= options.max_reconnects:
            raise ServerClosed(1001, "the server ended the session before all audio was sent")
        reconnects += 1
        offset_sample = resume_sample(finals, sample_rate)
        segment_offset = len(finals)
        logger.warning(
            "session %s ended early (%s); reconnecting (%d) from %.2f s",
            client.session_id, error or "server ended it", reconnects, offset_sample / sample_rate,
        )  # fmt: skip
        if on_reconnect is not None:
            on_reconnect(reconnects, offset_sample, error)
        client = await connect_with_backoff(options, timeout_s=options.reconnect_timeout_s)
    end = None
    if last_end is not None:
        end = End(
            segments=len(finals),
            audio_ms=last_end.audio_ms,
            partials_sent=partials_sent,
            partials_skipped=partials_skipped,
        )
    return _result(first_ready, sample_rate, messages, sends, end, started_s, reconnects)
