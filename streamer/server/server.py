"""The server's lifecycle: bind, admit sessions, shut down gracefully.

Protocol logic lives in :mod:`streamer.core` (one :class:`Session` per connection, behind
a :class:`~streamer.core.wire.WireAdapter`); :mod:`streamer.server.connection` moves one
socket's frames; :mod:`streamer.server.http` answers plain HTTP on the same port
(``/``, ``/healthz``, ``/readyz``, ``/metrics``) and holds the admission rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http
import importlib.resources
import logging
import secrets
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from streamer.core import protocol
from streamer.core.pacing import DEFAULT_MAX_BYTES_PER_S, DEFAULT_MAX_MESSAGES_PER_S, PacingLimits
from streamer.core.protocol import Error, StreamOptions
from streamer.core.session import Session, SessionOptions, State
from streamer.core.vad import DEFAULT_AGGRESSIVENESS, FrameClassifier, webrtc_classifier
from streamer.errors import (
    CLOSE_INTERNAL_ERROR,
    CLOSE_TRY_AGAIN_LATER,
    ConfigError,
    ModelError,
    ProtocolError,
    close_code_for,
)
from streamer.model.pool import WorkerPool
from streamer.model.worker import ModelWorker
from streamer.server.compat import COMPAT_ENDPOINTS
from streamer.server.connection import (
    WS_MAX_QUEUE_FRAMES,
    Connection,
    ConnectionLimits,
    session_memory_bound_bytes,
)
from streamer.server.funasr_listener import FunAsrListener
from streamer.server.http import (
    V1_ENDPOINT,
    BadRequest,
    Endpoint,
    StaticFiles,
    bytes_response,
    json_response,
    safe_response,
    single_header,
    token_matches,
    unavailable_response,
    without_body,
)
from streamer.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from streamer.server.metrics import Metrics
from streamer.server.wyoming import WyomingListener

if TYPE_CHECKING:
    from streamer.model.loading import LoadProgress

Listener = FunAsrListener | WyomingListener

logger = logging.getLogger(__name__)

LOOP_LAG_PROBE_S = 0.1  # how often the event-loop lag is sampled
RETRY_AFTER_S = 5  # what 503 answers tell clients to wait
SERVED_METHODS = ("GET", "HEAD")
SINGLE_HEADERS = ("Authorization", "Origin", "Host")  # a repeated one is a 400
FAILED_GRACE_S = 2.0  # shutdown grace once the model has failed (nothing left to decode)


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
    drain_s: float = 5.0  # drain(): refuse new sessions, serve open ones this long at most
    max_backlog_bytes: int = 1 << 20  # per session, audio read ahead of the model (32 s)
    ping_interval_s: float = 20.0  # keepalive pings detect vanished clients
    ping_timeout_s: float = 20.0  # a pong must arrive within this
    close_timeout_s: float = 5.0  # wait this long for the client's close acknowledgement
    max_outbox_bytes: int = 1 << 20  # per session, frames waiting to be sent (else 1008)
    write_timeout_s: float = 15.0  # a client that reads nothing for this long is closed (1008)
    # one client is read no faster than this (beyond a 1 s burst): streamer.core.pacing
    max_input_messages_per_s: float = DEFAULT_MAX_MESSAGES_PER_S
    max_input_bytes_per_s: float = DEFAULT_MAX_BYTES_PER_S
    public_metrics: bool = False  # serve /metrics without the token when one is set
    vad_aggressiveness: int = DEFAULT_AGGRESSIVENESS  # webrtcvad mode 0..3
    default_stream: StreamOptions = field(default_factory=StreamOptions)  # client defaults
    session: SessionOptions = field(default_factory=SessionOptions)  # VAD and partial timing
    web_root: Path | None = None  # folder served at "/"; None serves the bundled web demo
    funasr_port: int | None = None  # FunASR runtime protocol (docs/funasr.md); None: off
    wyoming_port: int | None = None  # Wyoming, Home Assistant's protocol (docs/wyoming.md)
    wyoming_insecure: bool = False  # serve Wyoming (which has no auth) despite a token

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
        if self.drain_s < 0 or self.shutdown_grace_s < 0:
            raise ConfigError("drain_s and shutdown_grace_s must not be negative")
        if self.token is not None and self.wyoming_port is not None and not self.wyoming_insecure:
            raise ConfigError(
                "Wyoming clients cannot send a token: with --token, serve --wyoming-port only "
                "on a trusted network and confirm with --wyoming-insecure (docs/wyoming.md)"
            )
        if self.max_outbox_bytes < 1 or self.write_timeout_s <= 0:
            raise ConfigError("max_outbox_bytes and write_timeout_s must be positive")
        _ = self.pacing  # validates the rates (raises ConfigError)

    @property
    def pacing(self) -> PacingLimits:
        return PacingLimits(self.max_input_messages_per_s, self.max_input_bytes_per_s)

    @property
    def session_memory_bound_bytes(self) -> int:
        """The most client-controlled memory one session can hold."""
        return session_memory_bound_bytes(
            self.max_backlog_bytes,
            self.max_message_bytes,
            self.max_outbox_bytes,
            self.max_pending_finals,
        )


def _listen_error(host: str, port: int, flag: str, error: OSError) -> ConfigError:
    if error.errno == errno.EADDRINUSE:
        return ConfigError(
            f"cannot listen on {host}:{port}: the port is already in use "
            f"(another server is running there?); choose another with {flag}"
        )
    return ConfigError(f"cannot listen on {host}:{port} ({flag}): {error.strerror or error}")


class StreamingServer:
    """The server's lifecycle: :meth:`start`, then :meth:`shutdown` (or ``async with``).

    ``worker`` (a :class:`WorkerPool`, or one :class:`ModelWorker`, which is wrapped in
    a pool of one) must be started by the caller (it loads the model in its own
    threads); the server answers ``/readyz`` with 503 and refuses sessions until it is
    ready. A pool's decode hook should be ``metrics.observe_worker_decode`` of the
    ``metrics`` passed here.
    """

    def __init__(
        self,
        options: ServerOptions,
        worker: WorkerPool | ModelWorker,
        *,
        metrics: Metrics | None = None,
        classifier_factory: Callable[[], FrameClassifier] | None = None,
        loading: LoadProgress | None = None,
    ) -> None:
        self.options = options
        self._loading = loading  # the model's loading stage, shown by /readyz until ready
        self.metrics = metrics or Metrics()
        if isinstance(worker, ModelWorker):
            worker = WorkerPool.adopt(worker, on_decoded=self.metrics.observe_worker_decode)
        self.worker = worker
        self._classifier_factory = classifier_factory or (
            lambda: webrtc_classifier(options.vad_aggressiveness)
        )
        self._connections: set[Connection] = set()
        self._no_connections = asyncio.Event()
        self._grace_cut = asyncio.Event()  # stop waiting for open sessions (a 2nd signal)
        self._no_connections.set()
        self._server: Server | None = None
        self._shutting_down = False
        self._draining = False  # new sessions refused, open ones served (start_draining)
        self._lag_task: asyncio.Task[None] | None = None
        web_root = options.web_root or Path(str(importlib.resources.files("streamer.web_demo")))
        self._static = StaticFiles(web_root)
        self._endpoints: dict[str, Endpoint] = {protocol.PATH: V1_ENDPOINT, **COMPAT_ENDPOINTS}
        for endpoint in self._endpoints.values():
            self.metrics.sessions_active.labels(endpoint.name)  # exported at 0 from the start
        self._limits = ConnectionLimits(
            max_pending_finals=options.max_pending_finals,
            max_backlog_bytes=options.max_backlog_bytes,
            idle_timeout_s=options.idle_timeout_s,
            max_session_s=options.max_session_s,
            close_timeout_s=options.close_timeout_s,
            max_outbox_bytes=options.max_outbox_bytes,
            write_timeout_s=options.write_timeout_s,
            ping_interval_s=options.ping_interval_s,
            ping_timeout_s=options.ping_timeout_s,
            pacing=options.pacing,
        )
        self.metrics.sessions_capacity.set(options.max_sessions)
        self._failure: str | None = None  # why the model failed; the process must restart
        self._failed = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_failure(reason: str) -> None:  # called in the worker's thread
            loop.call_soon_threadsafe(self._model_failed, reason)

        worker.on_failure = on_failure
        self.ssl_context: ssl.SSLContext | None = None  # set by start() when TLS is on
        # The other protocols' ports, sharing admission, --max-sessions and the worker.
        self.listeners: dict[str, Listener] = {}
        if options.funasr_port is not None:
            self.listeners["funasr"] = FunAsrListener(self, options.funasr_port)
        if options.wyoming_port is not None:
            self.listeners["wyoming"] = WyomingListener(self, options.wyoming_port)
        for name in self.listeners:
            self.metrics.sessions_active.labels(name)  # exported at 0 from the start

    # -- lifecycle -------------------------------------------------------------

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def ready(self) -> bool:
        return (
            self.worker.ready.is_set()
            and self.worker.load_error is None
            and self._failure is None
            and self.worker.restarting is None
        )

    @property
    def failure(self) -> str | None:
        """Why the model failed for good (a hung decode, a dead worker); None while healthy."""
        return self._failure

    async def wait_failed(self) -> str:
        """Wait until the model fails for good; returns why. The caller should exit non-zero."""
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    def _model_failed(self, reason: str) -> None:
        if self._failure is not None:
            return
        self._failure = reason
        self.metrics.model_ready.set(0)
        logger.error("model failed (%s): unready; every session is told and closed", reason)
        for connection in list(self._connections):
            self._model_failed_for(connection)
        self._failed.set()

    @property
    def session_count(self) -> int:
        return len(self._connections)

    async def start(self) -> None:
        """Bind and listen (sessions are refused until the worker is ready)."""
        o = self.options
        ssl_context = None
        if o.certfile is not None and o.keyfile is not None:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            try:
                ssl_context.load_cert_chain(o.certfile, o.keyfile)
            except (OSError, ssl.SSLError) as error:
                raise ConfigError(
                    f"cannot load the TLS certificate {o.certfile} and key {o.keyfile}: "
                    f"{getattr(error, 'strerror', None) or error}"
                ) from error
        self.ssl_context = ssl_context
        try:
            self._server = await serve(
                self._handle,
                o.host,
                o.port,
                ssl=ssl_context,
                process_request=self._process_request,
                process_response=self._process_response,
                select_subprotocol=self._select_subprotocol,
                compression=None,  # PCM does not compress; deflate would only cost CPU
                max_size=o.max_message_bytes,
                max_queue=WS_MAX_QUEUE_FRAMES,
                ping_interval=None,  # each Connection runs a keepalive that knows back-pressure
                close_timeout=o.close_timeout_s,
                server_header="sensevoice-streamer",
            )
        except OSError as error:
            raise _listen_error(o.host, o.port, "--port", error) from error
        self._lag_task = asyncio.create_task(self._watch_loop_lag(), name="loop-lag")
        scheme = "wss" if ssl_context else "ws"
        logger.info(
            "listening on %s://%s:%d%s (sessions wait for the model to be ready)",
            scheme,
            o.host,
            self.port,
            ", ".join(self._endpoints),
        )
        for name, listener in self.listeners.items():
            try:
                await listener.start()
            except OSError as error:
                port = getattr(o, f"{name}_port")
                raise _listen_error(o.host, port, f"--{name}-port", error) from error

    async def wait_ready(self) -> None:
        """Wait until the model is loaded and warmed; raises its loading error."""
        loop = asyncio.get_running_loop()
        loaded = asyncio.Event()

        def wait_in_thread() -> None:
            self.worker.ready.wait()
            with contextlib.suppress(RuntimeError):  # the loop closed first: nobody waits
                loop.call_soon_threadsafe(loaded.set)

        # a daemon thread, not the loop's executor: the executor would make the loop's
        # shutdown wait for a model that is still loading
        threading.Thread(target=wait_in_thread, name="wait-ready", daemon=True).start()
        await loaded.wait()
        if self.worker.load_error is not None:
            error = self.worker.load_error
            if isinstance(error, ModelError | ConfigError):
                raise error
            raise ModelError(
                f"loading the model failed: {type(error).__name__}: {error}"
            ) from error
        self.metrics.model_ready.set(1)
        logger.info("model ready: %s", self.worker.model_name)

    @property
    def draining(self) -> bool:
        return self._draining

    def start_draining(self) -> None:
        """Refuse new sessions (HTTP 503 ``draining``; ``/readyz`` 503) and serve open ones.

        A load balancer that checks ``/readyz``, or retries a 503 on another server,
        sends new sessions elsewhere meanwhile. :meth:`stop_draining` undoes it.
        """
        if not self._draining:
            logger.info("draining: refusing new sessions; %d open", len(self._connections))
        self._draining = True
        self.metrics.draining.set(1)

    def stop_draining(self) -> None:
        """Admit new sessions again (after :meth:`start_draining`; not once shutting down)."""
        if self._draining and not self._shutting_down:
            logger.info("no longer draining: admitting new sessions")
            self._draining = False
            self.metrics.draining.set(0)

    async def drain(self, timeout_s: float | None = None) -> None:
        """:meth:`start_draining`, then wait until every open session has ended by itself
        or ``timeout_s`` (default ``options.drain_s``) has passed. :meth:`shutdown` next."""
        timeout_s = self.options.drain_s if timeout_s is None else timeout_s
        self.start_draining()
        try:
            async with asyncio.timeout(timeout_s):
                await self._no_connections.wait()
            logger.info("drained: no session is open")
        except TimeoutError:
            logger.info("drain period over: %d sessions still open", len(self._connections))

    async def shutdown(self) -> None:
        """Refuse new sessions, finish open segments, send ``end``, close with 1001."""
        if self._shutting_down:
            return
        self._shutting_down = True
        logger.info("shutting down: %d open sessions", len(self._connections))
        # still listening during the grace period: /readyz answers 503 (with the reason)
        # and new sessions are refused with 503 + Retry-After instead of a reset; the
        # other protocols' ports have no such answer and stop accepting
        for listener in self.listeners.values():
            listener.stop_accepting()
        for connection in list(self._connections):
            connection.shutdown()
        # after a model failure, sessions only wait for their close: no decode will come
        loop = asyncio.get_running_loop()
        started = loop.time()
        grace_s = self.options.shutdown_grace_s
        if self._failure is not None:
            grace_s = min(grace_s, FAILED_GRACE_S)
        waits = {
            asyncio.ensure_future(self._no_connections.wait()),
            asyncio.ensure_future(self._grace_cut.wait()),
        }
        await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        if self._connections and not self._grace_cut.is_set():
            logger.warning("grace period over: aborting %d sessions", len(self._connections))
        if self._failure is not None and not self._grace_cut.is_set():
            # stay up (unready) for the whole grace period, so that probes see the 503
            # and its reason before the supervisor sees the exit
            await asyncio.sleep(max(0.0, started + grace_s - loop.time()))
        # Nothing below waits on a peer: what is left is aborted, not closed politely
        # (a client that does not read would block a close handshake forever).
        for connection in list(self._connections):
            connection.abort()
        if self._server is not None:
            for ws in list(self._server.connections):
                ws.transport.abort()
            self._server.close(close_connections=False)
            try:
                async with asyncio.timeout(self.options.close_timeout_s):
                    await self._server.wait_closed()
            except TimeoutError:
                logger.warning("connections still open after the grace period; exiting anyway")
        for name, listener in self.listeners.items():
            try:
                async with asyncio.timeout(self.options.close_timeout_s):
                    await listener.close()
            except TimeoutError:
                logger.warning("the %s port did not close in time; exiting anyway", name)
        if self._lag_task is not None:
            self._lag_task.cancel()
        self.metrics.model_ready.set(0)

    def cut_grace_short(self) -> None:
        """Stop waiting for open sessions: :meth:`shutdown` aborts them now (SIGTERM or
        SIGINT again while it waits)."""
        if self._shutting_down and not self._grace_cut.is_set():
            logger.warning("shutting down at once: aborting %d sessions", len(self._connections))
        self._grace_cut.set()

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
            self.metrics.loop_lag_seconds.observe(lag)
            stats = self.worker.stats()
            self.metrics.observe_workers(self.worker.loads())
            self.metrics.queue_depth.labels("final").set(stats.queued_finals)
            self.metrics.queue_depth.labels("partial").set(stats.queued_partials)

    # -- HTTP ------------------------------------------------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        """Every plain HTTP answer; None goes on with a WebSocket handshake.

        Malformed requests get 400 and nothing of the request is echoed back; anything
        unexpected is logged with its traceback and answered 500 without details.
        """
        try:
            return self._route(request)
        except BadRequest as error:
            return json_response(
                http.HTTPStatus.BAD_REQUEST, {"error": "bad_request", "message": error.message}
            )
        except Exception:
            logger.exception("answering an HTTP request failed")
            return json_response(
                http.HTTPStatus.INTERNAL_SERVER_ERROR,
                {"error": "internal_error", "message": "see the server log"},
            )

    def _process_response(
        self, connection: ServerConnection, request: Request, response: Response
    ) -> Response | None:
        """websockets' own refusals (426, ...) are replaced by ours; HEAD gets no body."""
        response = safe_response(response)
        return without_body(response) if request.method == "HEAD" else response

    def _route(self, request: Request) -> Response | None:
        if request.method not in SERVED_METHODS:
            response = json_response(
                http.HTTPStatus.METHOD_NOT_ALLOWED,
                {"error": "method_not_allowed", "message": "only GET and HEAD are served"},
            )
            response.headers["Allow"] = ", ".join(SERVED_METHODS)
            return response
        try:
            url = urlsplit(request.path)
        except ValueError:
            raise BadRequest("the request target is not a valid URL") from None
        path = url.path
        if "\x00" in path or any(len(part) > 255 for part in path.split("/")):
            raise BadRequest("the request path is not valid")
        for name in SINGLE_HEADERS:
            single_header(request, name)  # raises BadRequest when repeated
        query = dict(parse_qsl(url.query))
        if path == "/healthz":
            return json_response(http.HTTPStatus.OK, {"status": "ok", "workers": self._workers()})
        if path == "/readyz":
            if self.ready and not self._shutting_down:
                return self._readiness()
            body: dict[str, object] = {"status": "loading"}
            if self._failure is not None:
                body = {"status": "model_stalled", "reason": self._failure}
            elif self._shutting_down:
                body = {"status": "shutting_down"}
            elif (restarting := self.worker.restarting) is not None:
                body = {"status": "restarting", "reason": restarting}
            elif self.worker.ready.is_set():
                body = {"status": "failed", "message": "the model failed to load"}
            elif self._loading is not None:
                body.update(self._loading.snapshot())
            body["workers"] = self._workers()
            return unavailable_response(body, RETRY_AFTER_S)
        if path == "/metrics":
            token = self.options.token
            if (
                token is not None
                and not self.options.public_metrics
                and not token_matches(V1_ENDPOINT.presented_token(request, query), token)
            ):
                return self._refuse(
                    http.HTTPStatus.UNAUTHORIZED, "unauthorized", V1_ENDPOINT.auth_hint, V1_ENDPOINT
                )
            self.metrics.observe_workers(self.worker.loads())  # current, not a probe old
            return bytes_response(http.HTTPStatus.OK, METRICS_CONTENT_TYPE, self.metrics.render())
        endpoint = self._endpoints.get(path)
        if endpoint is not None:
            if request.method != "GET":
                response = json_response(
                    http.HTTPStatus.METHOD_NOT_ALLOWED,
                    {"error": "method_not_allowed", "message": "WebSocket handshakes use GET"},
                )
                response.headers["Allow"] = "GET"
                return response
            return self._admit(request, endpoint, query)
        found = self._static.response(path)
        if found is None:
            return json_response(
                http.HTTPStatus.NOT_FOUND, {"error": "not_found", "message": "no such path"}
            )
        return found

    def _readiness(self) -> Response:
        """``/readyz`` once the model is ready: 200 only while a new session is admitted."""
        counts = {"sessions": len(self._connections), "max_sessions": self.options.max_sessions}
        status = "ready"
        if self._draining:
            status = "draining"
        elif len(self._connections) >= self.options.max_sessions:
            status = "full"
        if status != "ready":  # about admission alone: the workers are listed when ready
            return unavailable_response({"status": status, **counts}, RETRY_AFTER_S)
        return json_response(
            http.HTTPStatus.OK,
            {
                "status": status,
                "model": self.worker.model_name,
                **counts,
                "workers": self._workers(),
            },
        )

    def _workers(self) -> list[dict[str, object]]:
        """Each model worker, for ``/readyz`` and ``/healthz``."""
        return [
            {
                "worker": load.slot.index,
                "device": load.slot.device,
                "state": load.state,
                "restarts": load.restarts,
                "sessions": load.sessions,
                "queued": load.stats.queued_finals + load.stats.queued_partials,
            }
            for load in self.worker.loads()
        ]

    def _refuse(
        self, status: http.HTTPStatus, code: str, message: str, endpoint: Endpoint
    ) -> Response:
        self.metrics.rejected_total.labels(code, endpoint.name).inc()
        logger.info("refused a %s session: %s (%s)", endpoint.name, code, message)
        response = endpoint.refuse(status, code, message)
        if status is http.HTTPStatus.SERVICE_UNAVAILABLE:
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    def _select_subprotocol(
        self, connection: ServerConnection, offered: Sequence[Subprotocol]
    ) -> Subprotocol | None:
        request = connection.request
        endpoint = self._endpoints.get(urlsplit(request.path).path) if request else None
        if endpoint is None or endpoint.select_subprotocol is None:
            return None  # proceed without one, whatever the client offered
        chosen = endpoint.select_subprotocol(offered)
        return Subprotocol(chosen) if chosen is not None else None

    def _admit(
        self, request: Request, endpoint: Endpoint, query: dict[str, str]
    ) -> Response | None:
        o = self.options
        if o.token is not None:
            if not token_matches(endpoint.presented_token(request, query), o.token):
                return self._refuse(
                    http.HTTPStatus.UNAUTHORIZED, "unauthorized", endpoint.auth_hint, endpoint
                )
        origin = single_header(request, "Origin")
        if o.allowed_origins and origin is not None and origin not in o.allowed_origins:
            return self._refuse(
                http.HTTPStatus.FORBIDDEN,
                "origin_not_allowed",
                "this origin is not allowed",
                endpoint,
            )
        if endpoint.negotiate is not None:
            # options we cannot serve are refused before the upgrade: a 4xx tells the
            # clients not to retry
            try:
                endpoint.negotiation(request, query, o.default_stream)
            except ProtocolError as error:
                return self._refuse(
                    http.HTTPStatus.BAD_REQUEST, error.code, error.message, endpoint
                )
        refusal = self.refusal()
        if refusal is not None:
            return self._refuse(http.HTTPStatus.SERVICE_UNAVAILABLE, *refusal, endpoint)
        return None

    def refusal(self) -> tuple[str, str] | None:
        """Why a new session of any protocol is refused now: ``(code, message)``, or None."""
        if self._shutting_down:
            return "shutting_down", "the server is shutting down"
        if self._draining:
            return (
                "draining",
                "the server is draining before a restart; connect again (another server)",
            )
        if self._failure is not None:
            return "model_stalled", "the model stopped answering; the server is restarting"
        if self.worker.restarting is not None:
            return "not_ready", "the model is starting again after a failure; retry shortly"
        if not self.ready:
            return "not_ready", "the model is still loading; retry shortly"
        if len(self._connections) >= self.options.max_sessions:
            limit = self.options.max_sessions
            return "server_full", f"the server is at its limit of {limit} sessions"
        return None

    # -- sessions of the ports without WebSocket (Wyoming) -----------------------

    def new_session(self, stream: StreamOptions) -> Session:
        """A session with the server's options, its VAD and a fresh id."""
        session_options = replace(self.options.session, model_name=self.worker.model_name)
        return Session(secrets.token_hex(6), session_options, stream, self._classifier_factory())

    def track(self, connection: Any, protocol_name: str) -> None:
        """Count an open connection (it must have ``shutdown()``) until :meth:`untrack`."""
        self._connections.add(connection)
        self._no_connections.clear()
        self.metrics.sessions_total.labels(protocol_name).inc()
        self.metrics.sessions_active.labels(protocol_name).inc()

    def untrack(self, connection: Any, protocol_name: str) -> None:
        self._connections.discard(connection)
        if not self._connections:
            self._no_connections.set()
        self.metrics.sessions_active.labels(protocol_name).dec()

    # -- WebSocket -------------------------------------------------------------

    def _model_failed_for(self, connection: Connection) -> None:
        connection.expire(
            "model_stalled",
            "the model stopped answering; the server is restarting (retry shortly)",
            CLOSE_INTERNAL_ERROR,
        )

    async def _handle(self, ws: ServerConnection, endpoint: Endpoint | None = None) -> None:
        """Serve one WebSocket; ``endpoint`` is given by ports with one protocol (FunASR)."""
        assert ws.request is not None  # the handshake is over
        url = urlsplit(ws.request.path)
        endpoint = endpoint or self._endpoints.get(url.path, V1_ENDPOINT)
        if len(self._connections) >= self.options.max_sessions or self._shutting_down:
            # lost a race with other handshakes admitted at the same time
            self.metrics.rejected_total.labels("server_full", endpoint.name).inc()
            try:
                async with asyncio.timeout(self.options.close_timeout_s):
                    await ws.close(CLOSE_TRY_AGAIN_LATER, "server full")
            except TimeoutError:
                ws.transport.abort()
            return
        session_id = secrets.token_hex(6)
        query = dict(parse_qsl(url.query))
        session_options = replace(self.options.session, model_name=self.worker.model_name)
        try:
            negotiation = endpoint.negotiation(ws.request, query, self.options.default_stream)
        except ProtocolError as error:
            logger.info("session %s refused: %s", session_id, error.message)
            self.metrics.errors_total.labels(error.code).inc()
            message = Error(code=error.code, message=error.message, fatal=True)
            try:
                async with asyncio.timeout(self.options.close_timeout_s):
                    if endpoint.negotiate is None:  # the others refused it before the upgrade
                        await ws.send(protocol.encode(message), text=True)
                    await ws.close(close_code_for(error), error.code)
            except (ConnectionClosed, TimeoutError):
                ws.transport.abort()
            return
        stream = negotiation.stream
        session = Session(session_id, session_options, stream, self._classifier_factory())
        adapter = negotiation.make_adapter(session)
        adapter.start()
        connection = Connection(ws, adapter, self.worker, self.metrics, self._limits)
        self._connections.add(connection)
        self._no_connections.clear()
        self.metrics.sessions_total.labels(endpoint.name).inc()
        self.metrics.sessions_active.labels(endpoint.name).inc()
        peer = ws.remote_address[0] if ws.remote_address else "?"
        forwarded = ws.request.headers.get("X-Forwarded-For") if ws.request else None
        if forwarded:  # behind a proxy (deploy/nginx.conf); logged, never trusted for limits
            peer = f"{peer} for {forwarded[:200]}"
        connection.log.info(
            "session %s opened from %s (%s: %s)",
            session_id,
            peer,
            endpoint.name,
            ", ".join(f"{k}={v}" for k, v in stream.to_dict().items()),
        )
        try:
            if self._failure is not None:
                self._model_failed_for(connection)
            elif self._shutting_down:
                connection.shutdown()
            await connection.run()
        except Exception:
            connection.log.exception("session %s failed", session_id)
        finally:
            self._connections.discard(connection)
            if not self._connections:
                self._no_connections.set()
            self.metrics.sessions_active.labels(endpoint.name).dec()
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
