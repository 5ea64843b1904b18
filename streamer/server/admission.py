"""Who may open a session now: one :class:`Admission` shared by every listener.

It holds the server-wide state a new session depends on (the open sessions of every
protocol, draining, shutting down, a model failure, ``--max-sessions``), answers why a
session is refused (:meth:`Admission.refusal`), checks an upgrade request (token,
origin, the protocol's handshake, capacity) and makes the sessions it admits. The
listeners get this object, never the whole server.
"""

from __future__ import annotations

import asyncio
import http
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Protocol

from websockets.http11 import Request, Response

from streamer.core.capacity import CapacityEstimator, LoadSample
from streamer.core.pacing import InputBudget
from streamer.core.protocol import StreamOptions
from streamer.core.session import Session
from streamer.core.vad import FrameClassifier
from streamer.errors import CLOSE_INTERNAL_ERROR, ProtocolError
from streamer.model.serving.pool import WorkerPool
from streamer.model.serving.worker import WorkerStats
from streamer.server.http import Endpoint, single_header, token_matches
from streamer.server.metrics import Metrics
from streamer.server.options import ServerOptions

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5  # what 503 answers tell clients to wait


UNAUTHORIZED = "unauthorized"  # authorize(): no token, or not the server's
ORIGIN_NOT_ALLOWED = "origin_not_allowed"  # authorize(): an Origin not in --allowed-origins


def authorize(options: ServerOptions, presented: str | None, origin: str | None) -> str | None:
    """Why the server's token and origin rules refuse a request (:data:`UNAUTHORIZED`,
    :data:`ORIGIN_NOT_ALLOWED`), or None. The one check of every route group: each
    passes the token as its protocol presents it (a Bearer header, ``?token=``,
    Deepgram's ``Token``) and answers a refusal in its own shape."""
    if options.token is not None and not token_matches(presented, options.token):
        return UNAUTHORIZED
    if options.allowed_origins and origin is not None and origin not in options.allowed_origins:
        return ORIGIN_NOT_ALLOWED
    return None


class Tracked(Protocol):
    """An open piece of work (a session's connection, a file's transcription, a file
    API's request), as admission and the lifecycle see it."""

    def expire(self, code: str, message: str, close_code: int = ...) -> None: ...

    def shutdown(self) -> None: ...

    def abort(self) -> None: ...


class Admission:
    """The open work of every protocol and the rules for a new session.

    :attr:`open` is every open thing, the one collection that a model failure
    (:meth:`Tracked.expire`) and the shutdown (:meth:`Tracked.shutdown`, then
    :meth:`Tracked.abort`) walk: the sessions of every port (:meth:`track`), and the
    file APIs' requests and transcriptions (:meth:`open_work`). :attr:`connections` are
    the sessions among them, which ``--max-sessions`` and the capacity estimate count.
    """

    def __init__(
        self,
        options: ServerOptions,
        worker: WorkerPool,
        metrics: Metrics,
        classifier_factory: Callable[[], FrameClassifier],
    ) -> None:
        self.options = options
        self.worker = worker
        self.metrics = metrics
        self.classifier_factory = classifier_factory
        self.open: set[Tracked] = set()  # everything open: what shutdown walks
        self.connections: set[Tracked] = set()  # the sessions in it
        self.no_connections = asyncio.Event()
        self.no_connections.set()
        self.draining = False  # new sessions refused, open ones served
        self.shutting_down = False
        self.failure: str | None = None  # why the model failed; the process must restart
        self.failed = asyncio.Event()
        metrics.sessions_capacity.set(options.max_sessions)
        # whether the model keeps up: fed by the server's probe (observe_capacity)
        self.capacity = CapacityEstimator(options.capacity)
        # every connection's reader is charged to it (the event loop's total input work)
        self.input_budget = InputBudget(options.budget, asyncio.get_running_loop().time())

    @property
    def ready(self) -> bool:
        return (
            self.worker.ready.is_set()
            and self.worker.load_error is None
            and self.failure is None
            and self.worker.restarting is None
        )

    @property
    def full(self) -> bool:
        return len(self.connections) >= self.options.max_sessions

    def refusal(self) -> tuple[str, str] | None:
        """Why a new session of any protocol is refused now: ``(code, message)``, or None."""
        if self.shutting_down:
            return "shutting_down", "the server is shutting down"
        if self.draining:
            return (
                "draining",
                "the server is draining before a restart; connect again (another server)",
            )
        if self.failure is not None:
            return "model_stalled", "the model stopped answering; the server is restarting"
        if self.worker.restarting is not None:
            return "not_ready", "the model is starting again after a failure; retry shortly"
        if not self.ready:
            return "not_ready", "the model is still loading; retry shortly"
        if self.full:
            limit = self.options.max_sessions
            return "server_full", f"the server is at its limit of {limit} sessions"
        saturated = self.saturated
        if saturated is not None:
            why = replace(self.capacity.current, saturated=saturated).explain()
            return (
                "saturated",
                f"the server is at capacity ({saturated}: {why}): one more session would "
                "slow the others; retry later or on another server",
            )
        return None

    @property
    def saturated(self) -> str | None:
        """Why the model could not serve one more session in real time (the capacity
        estimate's reason), or None."""
        return self.capacity.refusal(len(self.connections))

    def refuse(
        self, status: http.HTTPStatus, code: str, message: str, endpoint: Endpoint
    ) -> Response:
        """A refused upgrade in the endpoint's error shape, counted and logged."""
        self.metrics.rejected_total.labels(code, endpoint.name).inc()
        logger.info("refused a %s session: %s (%s)", endpoint.name, code, message)
        response = endpoint.refuse(status, code, message)
        if status is http.HTTPStatus.SERVICE_UNAVAILABLE:
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    def check_request(
        self, request: Request, endpoint: Endpoint, query: Mapping[str, str]
    ) -> Response | None:
        """The refusal of one upgrade request (token, origin, handshake, capacity); None
        lets the handshake go on."""
        o = self.options
        refused = authorize(
            o, endpoint.presented_token(request, query), single_header(request, "Origin")
        )
        if refused == UNAUTHORIZED:
            return self.refuse(
                http.HTTPStatus.UNAUTHORIZED, UNAUTHORIZED, endpoint.auth_hint, endpoint
            )
        if refused == ORIGIN_NOT_ALLOWED:
            return self.refuse(
                http.HTTPStatus.FORBIDDEN,
                ORIGIN_NOT_ALLOWED,
                "this origin is not allowed",
                endpoint,
            )
        if endpoint.negotiate is not None:
            # options we cannot serve are refused before the upgrade: a 4xx tells the
            # clients not to retry
            try:
                endpoint.negotiation(request, query, o.default_stream)
            except ProtocolError as error:
                return self.refuse(http.HTTPStatus.BAD_REQUEST, error.code, error.message, endpoint)
        refusal = self.refusal()
        if refusal is not None:
            return self.refuse(http.HTTPStatus.SERVICE_UNAVAILABLE, *refusal, endpoint)
        return None

    def observe_capacity(self, now_s: float, stats: WorkerStats) -> None:
        """One sample of the workers (a few times a second): the capacity estimate, its
        metrics, and a log line when the server becomes saturated or recovers."""
        was = self.capacity.current.saturated
        live = self.metrics.live
        sample = LoadSample(
            now_s,
            len(self.connections),
            stats.live,
            max(1, sum(not slot.background for slot in self.worker.slots)),  # live ones
            final_latencies=live.final.snapshot(),
            ttft_latencies=live.ttft.snapshot(),
            fast_sessions=len(live.fast),
            fast_rate=live.fast_rate,
        )
        capacity = self.capacity.observe(sample)
        self.observe_capacity_metrics()
        if (capacity.saturated is None) == (was is None):
            return  # no change (or only of the reason): one line per episode
        self.metrics.saturated.set(0 if capacity.saturated is None else 1)
        details = capacity.as_dict()
        if capacity.saturated is None:
            logger.info("no longer saturated: admitting new sessions (%s)", details)
            return
        self.metrics.saturations_total.labels(capacity.saturated).inc()
        logger.warning(
            "saturated (%s): refusing new sessions while the model would fall behind; %d open (%s)",
            capacity.saturated,
            len(self.connections),
            details,
        )

    def observe_capacity_metrics(self) -> None:
        """The capacity estimate's gauges: load, latencies against their budgets, and
        the headroom an autoscaler scales on."""
        m, capacity = self.metrics, self.capacity.current
        w = capacity.window
        sessions = len(self.connections)
        m.final_load.set(capacity.final_load)
        m.final_wait_p95.set(min(capacity.projected_wait_ms, 3600_000.0) / 1000)
        for budget, measured, projected, limit in (
            (
                "final",
                w.final_p95_ms,
                capacity.projected_final_ms(sessions + 1),
                capacity.budgets[0],
            ),
            ("ttft", w.ttft_p95_ms, capacity.projected_ttft_ms(sessions + 1), capacity.budgets[1]),
        ):
            m.latency_p95.labels(budget, "measured").set(measured / 1000)
            m.latency_p95.labels(budget, "projected").set(min(projected, 3600_000.0) / 1000)
            m.latency_p95.labels(budget, "budget").set(limit / 1000)
        headroom = 0 if self.saturated is not None else capacity.headroom
        headroom = min(headroom, max(0, self.options.max_sessions - sessions))
        m.capacity_headroom.set(headroom)
        m.capacity_utilization.set(1.0 if headroom == 0 else sessions / (sessions + headroom))
        m.fast_sessions.set(capacity.fast_sessions)

    def new_session(
        self, stream: StreamOptions, session_id: str | None = None, *, background: bool = False
    ) -> Session:
        """A session with the server's options, its VAD and a fresh id. ``background``:
        a file upload's, whose finals are decoded after every live job (see
        :class:`~streamer.core.session.Session`)."""
        session_options = replace(self.options.session, model_name=self.worker.model_name)
        return Session(
            session_id or secrets.token_hex(6),
            session_options,
            stream,
            self.classifier_factory(),
            background=background,
        )

    def track(self, connection: Tracked, protocol_name: str) -> None:
        """Count an open connection until :meth:`untrack`; it hears a failure or a
        shutdown that is already under way."""
        self.connections.add(connection)
        self.open.add(connection)
        self.capacity.admitted(asyncio.get_running_loop().time())  # the probe's clock
        self.input_budget.connections = len(self.connections)
        self.no_connections.clear()
        self.metrics.sessions_total.labels(protocol_name).inc()
        self.metrics.sessions_active.labels(protocol_name).inc()

    def untrack(self, connection: Tracked, protocol_name: str) -> None:
        self.connections.discard(connection)
        self.open.discard(connection)
        self.input_budget.connections = len(self.connections)
        if not self.connections:
            self.no_connections.set()
        self.metrics.sessions_active.labels(protocol_name).dec()

    def open_work(self, work: Tracked) -> None:
        """Keep ``work`` (not a session: a file's request or transcription) in
        :attr:`open` until :meth:`close_work`, for the lifecycle to stop."""
        self.open.add(work)

    def close_work(self, work: Tracked) -> None:
        self.open.discard(work)

    def shutdown_all(self) -> None:
        """The shutdown has begun: every open thing is told (sessions finish their
        segments and close, files being transcribed are refused)."""
        for work in list(self.open):
            work.shutdown()

    def abort_all(self) -> None:
        """The grace period is over: whatever is still open is dropped."""
        for work in list(self.open):
            work.abort()

    def model_failed(self, reason: str) -> None:
        """The model failed for good: unready, and every open session is told and closed."""
        if self.failure is not None:
            return
        self.failure = reason
        self.metrics.model_ready.set(0)
        logger.error("model failed (%s): unready; every session is told and closed", reason)
        for work in list(self.open):  # the files being transcribed too
            expire_for_failure(work)
        self.failed.set()


def expire_for_failure(connection: Tracked) -> None:
    connection.expire(
        "model_stalled",
        "the model stopped answering; the server is restarting (retry shortly)",
        CLOSE_INTERNAL_ERROR,
    )
