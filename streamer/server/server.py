"""The WebSocket server: moves bytes between sockets, sessions and the model worker.

Everything protocol-related happens in :class:`streamer.core.session.Session`; this module
only does I/O: the handshake (auth, origin, admission), reading frames with
back-pressure, writing messages in order, timers, plain HTTP routes on the same port
(``/``, ``/healthz``, ``/readyz``, ``/metrics``) and graceful shutdown.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import importlib.resources
import logging
import mimetypes
import secrets
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import orjson
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from streamer.core import protocol
from streamer.core.jobs import DecodeResult
from streamer.core.protocol import Error, Final, Partial, ServerMessage, SpeechStart, StreamOptions
from streamer.core.session import Session, SessionOptions, State
from streamer.core.vad import DEFAULT_AGGRESSIVENESS, FrameClassifier, webrtc_classifier
from streamer.errors import (
    CLOSE_TRY_AGAIN_LATER,
    ConfigError,
    ModelError,
    ProtocolError,
    close_code_for,
)
from streamer.model.worker import ModelWorker
from streamer.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from streamer.server.metrics import Metrics

logger = logging.getLogger(__name__)

LOOP_LAG_PROBE_S = 0.1  # how often the event-loop lag is sampled
BACKLOG_PIECE_BYTES = 32000  # backlogged audio is fed to the session in 1 s pieces (16 kHz)


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and which limits it enforces."""

    host: str = "127.0.0.1"  # interface to bind ("0.0.0.0" for every interface)
    port: int = 8000  # TCP port; 0 picks a free one
    max_sessions: int = 64  # concurrent sessions; more are refused with HTTP 503
    token: str | None = None  # when set, clients must present it (Bearer header or ?token=)
    allowed_origins: tuple[str, ...] = ()  # accepted Origin headers; empty accepts any
    certfile: Path | None = None  # TLS certificate chain (serves wss:// and https://)
    keyfile: Path | None = None  # TLS private key
    max_message_bytes: int = 1 << 20  # largest frame a client may send (else close 1009)
    max_pending_finals: int = 3  # per session; reading pauses while more are waiting
    idle_timeout_s: float = 60.0  # no audio or keepalive for this long ends the session
    max_session_s: float = 4 * 3600.0  # longest session
    shutdown_grace_s: float = 10.0  # time to finish open segments when stopping
    max_backlog_bytes: int = 1 << 20  # per session, audio read ahead of the model (32 s)
    ping_interval_s: float = 20.0  # keepalive pings detect vanished clients
    ping_timeout_s: float = 20.0  # a pong must arrive within this
    close_timeout_s: float = 5.0  # wait this long for the client's close acknowledgement
    vad_aggressiveness: int = DEFAULT_AGGRESSIVENESS  # webrtcvad mode 0..3
    default_stream: StreamOptions = field(default_factory=StreamOptions)  # client defaults
    session: SessionOptions = field(default_factory=SessionOptions)  # VAD and partial timing
    web_root: Path | None = None  # folder served at "/"; None serves the bundled web demo

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ConfigError("max_sessions must be at least 1")
        if (self.certfile is None) != (self.keyfile is None):
            raise ConfigError("TLS needs both certfile and keyfile")
        if self.idle_timeout_s <= 0 or self.max_session_s <= 0:
            raise ConfigError("idle_timeout_s and max_session_s must be positive")
        if self.max_pending_finals < 1:
            raise ConfigError("max_pending_finals must be at least 1")
        if self.max_backlog_bytes < 1:
            raise ConfigError("max_backlog_bytes must be positive")


def _json_response(status: http.HTTPStatus, body: dict[str, Any]) -> Response:
    headers = Headers()
    headers["Content-Type"] = "application/json"
    headers["Cache-Control"] = "no-store"
    return Response(status.value, status.phrase, headers, orjson.dumps(body))


def _bytes_response(status: http.HTTPStatus, content_type: str, body: bytes) -> Response:
    headers = Headers()
    headers["Content-Type"] = content_type
    headers["Cache-Control"] = "no-cache"
    return Response(status.value, status.phrase, headers, body)


class _Connection:
    """One accepted WebSocket: the session, its writer and its reader."""

    def __init__(self, server: StreamingServer, ws: ServerConnection, session: Session) -> None:
        self.server = server
        self.ws = ws
        self.session = session
        self.log = logging.LoggerAdapter(logger, {"session_id": session.session_id})
        self._loop = asyncio.get_running_loop()
        self._outbox: asyncio.Queue[ServerMessage | None] = asyncio.Queue()
        # Back-pressure: while the session has max_pending_finals finals waiting for the
        # model, what the client sends waits here instead of in the session, and once this
        # backlog reaches max_backlog_bytes the reader stops reading the socket. Reading
        # goes on until then, so keepalive pongs keep flowing while a fast client waits.
        self._backlog: deque[bytes | str] = deque()
        self._backlog_bytes = 0
        self._backlog_has_room = asyncio.Event()
        self._backlog_has_room.set()
        self._closing = False
        self._gone = False  # the client disconnected: ignore late worker results
        self._speech_started: dict[int, float] = {}  # segment_id -> perf_counter()
        self._skipped_seen = 0

    # -- glue between the session and the world --------------------------------

    def pump(self) -> None:
        """Move the session's outputs to the writer and the worker."""
        session = self.session
        for message in session.messages_to_send():
            self._outbox.put_nowait(message)
        for job in session.jobs_to_submit():
            self.server.worker.submit(job, self._result_from_worker)
        metrics = self.server.metrics
        skipped = session.stats.partials_skipped
        if skipped > self._skipped_seen:
            metrics.partials_skipped_total.inc(skipped - self._skipped_seen)
            self._skipped_seen = skipped
        if session.close_code is not None and not self._closing:
            self._closing = True
            self._backlog.clear()
            self._backlog_bytes = 0
            self._backlog_has_room.set()
            self._outbox.put_nowait(None)

    def _session_has_room(self) -> bool:
        return self.session.pending_finals < self.server.options.max_pending_finals

    def _feed(self, item: bytes | str) -> None:
        """Hand one client message (or a piece of one) to the session."""
        if isinstance(item, bytes):
            self.session.receive_audio(item)
        else:
            self.session.receive_text(item)
        self.pump()

    def _receive(self, data: bytes | str) -> None:
        """A message from the socket: queued in order, then fed while the session has room."""
        if isinstance(data, bytes):
            rate = self.session.stream.sample_rate
            self.server.metrics.audio_seconds_total.inc(len(data) / 2 / rate)
            pieces: list[bytes | str] = [
                data[offset : offset + BACKLOG_PIECE_BYTES]
                for offset in range(0, len(data), BACKLOG_PIECE_BYTES)
            ]
        else:
            pieces = [data]
        for piece in pieces:
            self._backlog.append(piece)
            self._backlog_bytes += len(piece)
        self._drain_backlog()

    def _drain_backlog(self) -> None:
        while self._backlog and self._session_has_room() and not self._closing:
            item = self._backlog.popleft()
            self._backlog_bytes -= len(item)
            self._feed(item)
        if self._backlog_bytes < self.server.options.max_backlog_bytes:
            self._backlog_has_room.set()
        else:
            self._backlog_has_room.clear()

    def _result_from_worker(self, result: DecodeResult) -> None:
        # called in the worker thread
        self._loop.call_soon_threadsafe(self._on_result, result)

    def _on_result(self, result: DecodeResult) -> None:
        if self._gone:
            return
        self.session.decode_finished(result)
        self.pump()
        self._drain_backlog()

    # -- tasks -----------------------------------------------------------------

    async def run(self) -> None:
        self.pump()
        sid = self.session.session_id
        writer = asyncio.create_task(self._write(), name=f"write-{sid}")
        reader = asyncio.create_task(self._read(), name=f"read-{sid}")
        # noticed even while reading is paused for back-pressure: a dropped connection
        # must free its slot and its queued jobs at once
        closed = asyncio.create_task(self.ws.wait_closed(), name=f"closed-{sid}")
        limit = self._loop.call_later(
            self.server.options.max_session_s,
            self._expire,
            "max_session_duration",
            "the session reached the server's maximum duration",
        )
        try:
            done, _ = await asyncio.wait(
                {writer, reader, closed}, return_when=asyncio.FIRST_COMPLETED
            )
            if writer in done and not writer.cancelled():
                writer.result()  # the session ended and the close handshake was sent
                await asyncio.wait({reader, closed}, timeout=self.server.options.close_timeout_s)
            elif reader in done:
                reader.result()
        finally:
            limit.cancel()
            self._gone = True  # late worker results have nowhere to go
            for task in (writer, reader, closed):
                task.cancel()
            self.server.worker.drop_session(sid)

    def _expire(self, code: str, message: str) -> None:
        self.session.expire(code, message)
        self.pump()

    def shutdown(self) -> None:
        self.session.shutdown()
        self.pump()

    async def _read(self) -> None:
        session = self.session
        idle_s = self.server.options.idle_timeout_s
        try:
            while not self._closing:
                await self._backlog_has_room.wait()
                if self._closing:
                    break
                timeout = idle_s if session.state in (State.CONFIGURING, State.STREAMING) else None
                try:
                    async with asyncio.timeout(timeout):
                        data = await self.ws.recv()
                except TimeoutError:
                    self._expire("idle_timeout", f"no audio or keepalive for {idle_s:g} s")
                    continue
                self._receive(data)
            # keep reading until the peer acknowledges the close
            while True:
                await self.ws.recv()
        except ConnectionClosed:
            pass

    async def _write(self) -> None:
        session = self.session
        metrics = self.server.metrics
        while True:
            message = await self._outbox.get()
            if message is None:
                await self.ws.close(session.close_code or 1000, session.close_reason[:120])
                return
            self._account(message, metrics)
            try:
                await self.ws.send(protocol.encode(message), text=True)
            except ConnectionClosed:
                self._gone = True
                return

    def _account(self, message: ServerMessage, metrics: Metrics) -> None:
        if isinstance(message, SpeechStart):
            self._speech_started[message.segment_id] = time.perf_counter()
        elif isinstance(message, Partial | Final):
            started = self._speech_started.get(message.segment_id)
            if started is not None and message.text:
                metrics.first_partial_seconds.observe(time.perf_counter() - started)
                del self._speech_started[message.segment_id]
            if isinstance(message, Final):
                self._speech_started.pop(message.segment_id, None)
                metrics.segments_total.labels(message.reason).inc()
            else:
                metrics.partials_sent_total.inc()
        elif isinstance(message, Error):
            metrics.errors_total.labels(message.code).inc()


class StreamingServer:
    """The server's lifecycle: :meth:`start`, then :meth:`shutdown` (or ``async with``).

    ``worker`` must be started by the caller (it loads the model in its own thread);
    the server answers ``/readyz`` with 503 and refuses sessions until it is ready.
    """

    def __init__(
        self,
        options: ServerOptions,
        worker: ModelWorker,
        *,
        metrics: Metrics | None = None,
        classifier_factory: Callable[[], FrameClassifier] | None = None,
    ) -> None:
        self.options = options
        self.worker = worker
        self.metrics = metrics or Metrics()
        self._classifier_factory = classifier_factory or (
            lambda: webrtc_classifier(options.vad_aggressiveness)
        )
        self._connections: set[_Connection] = set()
        self._server: Server | None = None
        self._shutting_down = False
        self._lag_task: asyncio.Task[None] | None = None
        self._web_root = options.web_root or Path(
            str(importlib.resources.files("streamer.web_demo"))
        )
        self.max_loop_lag_s = 0.0
        worker.on_decoded = self.metrics.observe_decode

    # -- lifecycle -------------------------------------------------------------

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.sockets[0].getsockname()[1]

    @property
    def ready(self) -> bool:
        return self.worker.ready.is_set() and self.worker.load_error is None

    @property
    def session_count(self) -> int:
        return len(self._connections)

    async def start(self) -> None:
        """Bind and listen (sessions are refused until the worker is ready)."""
        o = self.options
        ssl_context = None
        if o.certfile is not None and o.keyfile is not None:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(o.certfile, o.keyfile)
        self._server = await serve(
            self._handle,
            o.host,
            o.port,
            ssl=ssl_context,
            process_request=self._process_request,
            compression=None,  # PCM does not compress; deflate would only cost CPU
            max_size=o.max_message_bytes,
            max_queue=16,
            ping_interval=o.ping_interval_s,
            ping_timeout=o.ping_timeout_s,
            close_timeout=o.close_timeout_s,
            server_header="sensevoice-streamer",
        )
        self._lag_task = asyncio.create_task(self._watch_loop_lag(), name="loop-lag")
        scheme = "wss" if ssl_context else "ws"
        logger.info("listening on %s://%s:%d%s", scheme, o.host, self.port, protocol.PATH)

    async def wait_ready(self) -> None:
        """Wait until the model is loaded and warmed; raises its loading error."""
        await asyncio.to_thread(self.worker.ready.wait)
        if self.worker.load_error is not None:
            error = self.worker.load_error
            if isinstance(error, ModelError | ConfigError):
                raise error
            raise ModelError(f"loading the model failed: {error!r}") from error
        self.metrics.model_ready.set(1)
        logger.info("model ready: %s", self.worker.model_name)

    async def shutdown(self) -> None:
        """Refuse new sessions, finish open segments, send ``end``, close with 1001."""
        if self._shutting_down:
            return
        self._shutting_down = True
        logger.info("shutting down: %d open sessions", len(self._connections))
        if self._server is not None:
            self._server.close(close_connections=False)
        for connection in list(self._connections):
            connection.shutdown()
        deadline = time.monotonic() + self.options.shutdown_grace_s
        while self._connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._connections:
            logger.warning("grace period over: closing %d sessions", len(self._connections))
        if self._server is not None:
            self._server.close(close_connections=True)
            await self._server.wait_closed()
        if self._lag_task is not None:
            self._lag_task.cancel()
        self.metrics.model_ready.set(0)

    async def __aenter__(self) -> StreamingServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    async def _watch_loop_lag(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(LOOP_LAG_PROBE_S)
            lag = max(0.0, loop.time() - before - LOOP_LAG_PROBE_S)
            self.max_loop_lag_s = max(self.max_loop_lag_s, lag)
            self.metrics.loop_lag_seconds.observe(lag)
            stats = self.worker.stats()
            self.metrics.queue_depth.labels("final").set(stats.queued_finals)
            self.metrics.queue_depth.labels("partial").set(stats.queued_partials)

    # -- HTTP ------------------------------------------------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        url = urlsplit(request.path)
        path = url.path
        if path == "/healthz":
            return _json_response(http.HTTPStatus.OK, {"status": "ok"})
        if path == "/readyz":
            if self.ready and not self._shutting_down:
                return _json_response(
                    http.HTTPStatus.OK, {"status": "ready", "model": self.worker.model_name}
                )
            state = "shutting_down" if self._shutting_down else "loading"
            return _json_response(http.HTTPStatus.SERVICE_UNAVAILABLE, {"status": state})
        if path == "/metrics":
            return _bytes_response(http.HTTPStatus.OK, METRICS_CONTENT_TYPE, self.metrics.render())
        if path == protocol.PATH:
            return self._admit(request, url.query)
        return self._static(path)

    def _refuse(self, status: http.HTTPStatus, code: str, message: str) -> Response:
        self.metrics.rejected_total.labels(code).inc()
        logger.info("refused a session: %s (%s)", code, message)
        return _json_response(status, {"error": code, "message": message})

    def _admit(self, request: Request, query: str) -> Response | None:
        o = self.options
        if o.token is not None:
            presented = dict(parse_qsl(query)).get("token")
            auth = request.headers.get("Authorization", "")
            if auth.lower().startswith("bearer "):
                presented = auth[7:].strip()
            if presented is None or not hmac.compare_digest(presented.encode(), o.token.encode()):
                return self._refuse(
                    http.HTTPStatus.UNAUTHORIZED,
                    "unauthorized",
                    "a valid token is required (Authorization: Bearer or ?token=)",
                )
        origin = request.headers.get("Origin")
        if o.allowed_origins and origin is not None and origin not in o.allowed_origins:
            return self._refuse(
                http.HTTPStatus.FORBIDDEN, "origin_not_allowed", f"origin {origin!r} is not allowed"
            )
        if self._shutting_down:
            return self._refuse(
                http.HTTPStatus.SERVICE_UNAVAILABLE, "shutting_down", "the server is shutting down"
            )
        if not self.ready:
            return self._refuse(
                http.HTTPStatus.SERVICE_UNAVAILABLE,
                "not_ready",
                "the model is still loading; retry shortly",
            )
        if len(self._connections) >= o.max_sessions:
            return self._refuse(
                http.HTTPStatus.SERVICE_UNAVAILABLE,
                "server_full",
                f"the server is at its limit of {o.max_sessions} sessions",
            )
        return None

    def _static(self, path: str) -> Response:
        name = "index.html" if path in ("", "/") else path.lstrip("/")
        root = self._web_root.resolve()
        target = (root / name).resolve()
        if root not in target.parents or not target.is_file() or target.suffix == ".py":
            return _json_response(
                http.HTTPStatus.NOT_FOUND,
                {"error": "not_found", "message": f"no such path: {path}"},
            )
        content_type = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        if target.suffix == ".js":
            content_type = "text/javascript"
        if content_type.startswith("text/"):
            content_type += "; charset=utf-8"
        return _bytes_response(http.HTTPStatus.OK, content_type, target.read_bytes())

    # -- WebSocket -------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        if len(self._connections) >= self.options.max_sessions or self._shutting_down:
            # lost a race with other handshakes admitted at the same time
            self.metrics.rejected_total.labels("server_full").inc()
            await ws.close(CLOSE_TRY_AGAIN_LATER, "server full")
            return
        session_id = secrets.token_hex(6)
        query = dict(parse_qsl(urlsplit(ws.request.path).query)) if ws.request else {}
        session_options = SessionOptions(
            model_name=self.worker.model_name,
            segmenter=self.options.session.segmenter,
            partial_interval_ms=self.options.session.partial_interval_ms,
            max_text_message_bytes=self.options.session.max_text_message_bytes,
        )
        try:
            stream = protocol.parse_stream_options(query, self.options.default_stream)
        except ProtocolError as error:
            logger.info("session %s refused: %s", session_id, error.message)
            self.metrics.errors_total.labels(error.code).inc()
            message = Error(code=error.code, message=error.message, fatal=True)
            try:
                await ws.send(protocol.encode(message), text=True)
                await ws.close(close_code_for(error), error.code)
            except ConnectionClosed:
                pass
            return
        session = Session(session_id, session_options, stream, self._classifier_factory())
        session.start()
        connection = _Connection(self, ws, session)
        self._connections.add(connection)
        self.metrics.sessions_total.inc()
        self.metrics.sessions_active.set(len(self._connections))
        peer = ws.remote_address[0] if ws.remote_address else "?"
        connection.log.info(
            "session %s opened from %s (%s)",
            session_id,
            peer,
            ", ".join(f"{k}={v}" for k, v in stream.to_dict().items()),
        )
        if self._shutting_down:
            connection.shutdown()
        try:
            await connection.run()
        except Exception:
            connection.log.exception("session %s failed", session_id)
        finally:
            self._connections.discard(connection)
            self.metrics.sessions_active.set(len(self._connections))
            stats = session.stats
            connection.log.info(
                "session %s closed: %d segments, %.1f s audio, %d partials (%d skipped), %s",
                session_id,
                stats.segments,
                session.audio_ms / 1000,
                stats.partials_sent,
                stats.partials_skipped,
                "client gone" if session.state is not State.ENDED else f"code {session.close_code}",
            )
