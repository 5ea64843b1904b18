"""The server's lifecycle: bind, admit sessions, shut down gracefully.

Protocol logic lives in :mod:`streamer.core` (one :class:`Session` per connection, behind
a :class:`~streamer.core.wire.WireAdapter`); :mod:`streamer.server.connection` moves one
socket's frames; :mod:`streamer.server.admission` decides who may open a session (one
state shared by every port); :mod:`streamer.server.routes` answers plain HTTP on the
main port (``/``, ``/healthz``, ``/readyz``, ``/metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http
import importlib.resources
import logging
import signal
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from streamer.core import protocol
from streamer.core.protocol import StreamOptions
from streamer.core.session import Session
from streamer.core.vad import FrameClassifier, webrtc_classifier
from streamer.errors import ConfigError, ModelError
from streamer.model.serving.pool import WorkerPool
from streamer.model.serving.worker import ModelWorker
from streamer.server.admission import Admission
from streamer.server.compat import COMPAT_ENDPOINTS
from streamer.server.connection import serve_websocket
from streamer.server.deepgram_files import DEEPGRAM_FILES
from streamer.server.file_routes import FileRoutes
from streamer.server.funasr_listener import FunAsrListener
from streamer.server.http import V1_ENDPOINT, Endpoint, StaticFiles
from streamer.server.metrics import Metrics
from streamer.server.openai_files import OPENAI_FILES, TRANSLATION_REFUSAL, TRANSLATIONS_PATH
from streamer.server.options import ConnectionLimits, ServerOptions
from streamer.server.port import Port
from streamer.server.routes import Routes
from streamer.server.websocket import WebSocket
from streamer.server.wyoming import WyomingListener

if TYPE_CHECKING:
    from streamer.model.backends.loading import LoadProgress

__all__ = ["ConnectionLimits", "ServerOptions", "StreamingServer"]

Listener = FunAsrListener | WyomingListener

logger = logging.getLogger(__name__)

EXIT_MODEL_FAILED = 3  # run(): the model stalled or its worker died; restart the process
LOOP_LAG_PROBE_S = 0.1  # how often the event-loop lag is sampled
FAILED_GRACE_S = 2.0  # shutdown grace once the model has failed (nothing left to decode)


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
        self.metrics = metrics or Metrics()
        if isinstance(worker, ModelWorker):
            worker = WorkerPool.adopt(worker, on_decoded=self.metrics.observe_worker_decode)
        self.worker = worker
        self.admission = Admission(
            options,
            worker,
            self.metrics,
            classifier_factory or (lambda: webrtc_classifier(options.vad_aggressiveness)),
        )
        self._grace_cut = asyncio.Event()  # stop waiting for open sessions (a 2nd signal)
        self._stop = asyncio.Event()  # run(): stop serving (SIGTERM, SIGINT)
        self._stop_now = asyncio.Event()  # run(): stop without draining (SIGINT, 2nd signal)
        self.listening = asyncio.Event()  # start() has bound every port (run() starts it)
        self._server: Port | None = None  # the main port, once start() has bound it
        self._lag_task: asyncio.Task[None] | None = None
        web_root = options.web_root or Path(str(importlib.resources.files("streamer.web_demo")))
        self._endpoints: dict[str, Endpoint] = {protocol.PATH: V1_ENDPOINT, **COMPAT_ENDPOINTS}
        for endpoint in self._endpoints.values():
            self.metrics.sessions_active.labels(endpoint.name)  # exported at 0 from the start
        self.routes = Routes(self.admission, self._endpoints, StaticFiles(web_root), loading)
        # requests with a body on the main port: the file APIs (docs/files.md)
        self.files = FileRoutes(
            self.admission,
            options.files,
            (OPENAI_FILES, DEEPGRAM_FILES),
            refused={TRANSLATIONS_PATH: (http.HTTPStatus.BAD_REQUEST, TRANSLATION_REFUSAL)},
            table=self.routes.table,
        )
        loop = asyncio.get_running_loop()

        def on_failure(reason: str) -> None:  # called in the worker's thread
            loop.call_soon_threadsafe(self._model_failed, reason)

        worker.on_failure = on_failure
        self.ssl_context: ssl.SSLContext | None = None  # set by start() when TLS is on
        # The other protocols' ports, sharing admission, --max-sessions and the worker.
        self.listeners: dict[str, Listener] = {}
        if options.funasr_port is not None:
            self.listeners["funasr"] = FunAsrListener(self.admission, options.funasr_port)
        if options.wyoming_port is not None:
            self.listeners["wyoming"] = WyomingListener(self.admission, options.wyoming_port)
        for name in self.listeners:
            self.metrics.sessions_active.labels(name)  # exported at 0 from the start

    # -- lifecycle -------------------------------------------------------------

    def _model_failed(self, reason: str) -> None:
        self.admission.model_failed(reason)  # files being transcribed are refused too

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return self._server.port

    @property
    def ready(self) -> bool:
        return self.admission.ready

    @property
    def failure(self) -> str | None:
        """Why the model failed for good (a hung decode, a dead worker); None while healthy."""
        return self.admission.failure

    async def wait_failed(self) -> str:
        """Wait until the model fails for good; returns why. The caller should exit non-zero."""
        await self.admission.failed.wait()
        assert self.admission.failure is not None
        return self.admission.failure

    @property
    def session_count(self) -> int:
        return len(self.admission.connections)

    def refusal(self) -> tuple[str, str] | None:
        """Why a new session of any protocol is refused now: ``(code, message)``, or None."""
        return self.admission.refusal()

    def new_session(self, stream: StreamOptions) -> Session:
        """A session with the server's options, its VAD and a fresh id."""
        return self.admission.new_session(stream)

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
            main = Port(
                o,
                self._handle,
                self.routes.select_subprotocol,
                self.routes.table,
                self.files.exchange,
            )
            await main.start(o.port, ssl_context)
            self._server = main
        except OSError as error:
            raise _listen_error(o.host, o.port, "--port", error) from error
        self._lag_task = asyncio.create_task(self._watch_loop_lag(), name="loop-lag")
        if o.token is None:
            logger.warning(
                "no token set: every client is served without authentication (set --token "
                "or STREAMER_TOKEN unless a proxy in front authenticates them)"
            )
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
                await listener.start(ssl_context)
            except OSError as error:
                port = getattr(o, f"{name}_port")
                raise _listen_error(o.host, port, f"--{name}-port", error) from error
        self.listening.set()

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
        return self.admission.draining

    def start_draining(self) -> None:
        """Refuse new sessions (HTTP 503 ``draining``; ``/readyz`` 503) and serve open ones.

        A load balancer that checks ``/readyz``, or retries a 503 on another server,
        sends new sessions elsewhere meanwhile. :meth:`stop_draining` undoes it.
        """
        if not self.admission.draining:
            logger.info("draining: refusing new sessions; %d open", self.session_count)
        self.admission.draining = True
        self.metrics.draining.set(1)

    def stop_draining(self) -> None:
        """Admit new sessions again (after :meth:`start_draining`; not once shutting down)."""
        if self.admission.draining and not self.admission.shutting_down:
            logger.info("no longer draining: admitting new sessions")
            self.admission.draining = False
            self.metrics.draining.set(0)

    async def drain(self, timeout_s: float | None = None) -> None:
        """:meth:`start_draining`, then wait until every open session has ended by itself
        or ``timeout_s`` (default ``options.drain_s``) has passed. :meth:`shutdown` next."""
        timeout_s = self.options.drain_s if timeout_s is None else timeout_s
        self.start_draining()
        try:
            async with asyncio.timeout(timeout_s):
                await self._all_closed()  # files being transcribed finish too
            logger.info("drained: no session is open")
        except TimeoutError:
            logger.info("drain period over: %d sessions still open", self.session_count)

    async def shutdown(self) -> None:
        """Refuse new sessions, finish open segments, send ``end``, close with 1001."""
        if self.admission.shutting_down:
            return
        self.admission.shutting_down = True
        logger.info("shutting down: %d open sessions", self.session_count)
        # still listening during the grace period: /readyz answers 503 (with the reason)
        # and new sessions are refused with 503 + Retry-After instead of a reset; the
        # other protocols' ports have no such answer and stop accepting
        for listener in self.listeners.values():
            listener.stop_accepting()
        # sessions finish their segments and close; a file not finished in the drain is
        # refused (503: send it again elsewhere)
        self.admission.shutdown_all()
        # after a model failure, sessions only wait for their close: no decode will come
        loop = asyncio.get_running_loop()
        started = loop.time()
        grace_s = self.options.shutdown_grace_s
        if self.admission.failure is not None:
            grace_s = min(grace_s, FAILED_GRACE_S)
        waits = {
            asyncio.ensure_future(self._all_closed()),
            asyncio.ensure_future(self._grace_cut.wait()),
        }
        await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        if self.admission.connections and not self._grace_cut.is_set():
            logger.warning("grace period over: aborting %d sessions", self.session_count)
        if self.admission.failure is not None and not self._grace_cut.is_set():
            # stay up (unready) for the whole grace period, so that probes see the 503
            # and its reason before the supervisor sees the exit
            await asyncio.sleep(max(0.0, started + grace_s - loop.time()))
        # Nothing below waits on a peer: what is left is aborted, not closed politely
        # (a client that does not read would block a close handshake forever).
        self.admission.abort_all()
        if self._server is not None:
            self._server.abort_all()
            try:
                async with asyncio.timeout(self.options.limits.close_timeout_s):
                    await self._server.close()
            except TimeoutError:
                logger.warning("connections still open after the grace period; exiting anyway")
        for name, listener in self.listeners.items():
            try:
                async with asyncio.timeout(self.options.limits.close_timeout_s):
                    await listener.close()
            except TimeoutError:
                logger.warning("the %s port did not close in time; exiting anyway", name)
        if self._lag_task is not None:
            self._lag_task.cancel()
        self.metrics.model_ready.set(0)

    async def _all_closed(self) -> None:
        """Until no session is open and every file job has been answered."""
        await self.admission.no_connections.wait()
        await self.files.jobs.idle.wait()

    def cut_grace_short(self) -> None:
        """Stop waiting for open sessions: :meth:`shutdown` aborts them now (SIGTERM or
        SIGINT again while it waits)."""
        if self.admission.shutting_down and not self._grace_cut.is_set():
            logger.warning("shutting down at once: aborting %d sessions", self.session_count)
        self._grace_cut.set()

    # -- the process's life -----------------------------------------------------

    def request_stop(self, *, now: bool = False) -> None:
        """Make :meth:`run` stop serving: drain first unless ``now`` (or asked before);
        once shutting down, cut the grace period short. What SIGTERM (SIGINT: ``now``)
        does."""
        if self.admission.shutting_down:
            self.cut_grace_short()
            return
        if now or self._stop.is_set():
            self._stop_now.set()
        self._stop.set()

    async def run(self, *, signals: bool = True) -> int:
        """Serve a whole process's life; returns its exit status.

        Binds (``/readyz`` answers 503 with the loading stage meanwhile), starts the
        worker, serves until :meth:`request_stop` (SIGTERM; SIGINT stops without
        draining; either again cuts the drain, then the shutdown's grace period, short)
        or a model failure, then drains, shuts down and stops the worker. With
        ``signals`` the signals are installed (the main thread only); SIGUSR1 starts
        draining and SIGUSR2 undoes it. 0, or :data:`EXIT_MODEL_FAILED` after a model
        failure; raises the model's loading error.
        """
        await self.start()  # bind first: /readyz answers 503 with the stage while loading
        self.worker.start()
        loop = asyncio.get_running_loop()
        handlers: dict[signal.Signals, Callable[[], None]] = {
            signal.SIGINT: lambda: self.request_stop(now=True),
            signal.SIGTERM: self.request_stop,
            # drain by hand (a blue-green switch, a host going into maintenance), then undo
            signal.SIGUSR1: self.start_draining,
            signal.SIGUSR2: lambda: None if self._stop.is_set() else self.stop_draining(),
        }
        for sig, handler in handlers.items() if signals else ():
            loop.add_signal_handler(sig, handler)
        ready = asyncio.create_task(self.wait_ready())
        stopped = asyncio.create_task(self._stop.wait())
        failed = asyncio.create_task(self.wait_failed())
        failed.add_done_callback(lambda _: self._stop.set())
        try:
            await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done():
                ready.result()  # raises the model's loading error
                self._log_ready()
                await stopped
            if self.failure is None:
                logger.info("signal received: stopping")
            if self.failure is None and not self._stop_now.is_set():
                # SIGTERM (an orchestrator, systemd): let the balancer notice before we go
                drained = asyncio.create_task(self.drain())
                interrupted = asyncio.create_task(self._stop_now.wait())
                await asyncio.wait({drained, interrupted}, return_when=asyncio.FIRST_COMPLETED)
                drained.cancel()
                interrupted.cancel()
        finally:
            # from now on SIGTERM or SIGINT (again) ends the grace period: sessions are
            # aborted, and the process still exits through the same clean path
            for sig in (signal.SIGUSR1, signal.SIGUSR2) if signals else ():
                loop.remove_signal_handler(sig)
            ready.cancel()
            stopped.cancel()
            failed.cancel()
            await self.shutdown()
            # a model still loading, or a stalled decode, cannot be interrupted: do not
            # wait for that thread (a daemon, it ends with the process)
            usable = self.worker.ready.is_set() and self.failure is None
            await asyncio.to_thread(self.worker.stop, 5.0 if usable else 0.0)
            for sig in (signal.SIGINT, signal.SIGTERM) if signals else ():
                loop.remove_signal_handler(sig)
        if self.failure is not None:
            logger.error("exiting with status %d: %s", EXIT_MODEL_FAILED, self.failure)
            return EXIT_MODEL_FAILED
        return 0

    def _log_ready(self) -> None:
        o = self.options
        scheme = "https" if o.certfile else "http"
        host = "localhost" if o.host in ("127.0.0.1", "0.0.0.0") else o.host
        logger.info("ready: open %s://%s:%d/ for live captions", scheme, host, self.port)

    async def __aenter__(self) -> StreamingServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    async def _watch_loop_lag(self) -> None:
        loop = asyncio.get_running_loop()
        budget_paced_s = 0.0  # of the input budget's waits, counted in the metrics
        while True:
            before = loop.time()
            await asyncio.sleep(LOOP_LAG_PROBE_S)
            lag = max(0.0, loop.time() - before - LOOP_LAG_PROBE_S)
            self.metrics.loop_lag_seconds.observe(lag)
            stats = self.worker.stats()
            self.metrics.observe_workers(self.worker.loads())
            self.metrics.queue_depth.labels("final").set(stats.queued_finals)
            self.metrics.queue_depth.labels("partial").set(stats.queued_partials)
            self.admission.observe_capacity(loop.time(), stats)
            paced_s = self.admission.input_budget.throttled_s
            self.metrics.input_budget_paced_seconds_total.inc(paced_s - budget_paced_s)
            budget_paced_s = paced_s

    async def _handle(self, ws: WebSocket) -> None:
        path = urlsplit(ws.request.path).path if ws.request is not None else ""
        await serve_websocket(self.admission, ws, self._endpoints.get(path, V1_ENDPOINT))
