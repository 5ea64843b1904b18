"""The main port's plain HTTP: ``/healthz``, ``/readyz``, ``/metrics``, ``/v1/models``,
the web demo, and the upgrade requests handed to
:class:`~streamer.server.admission.Admission`, each registered in the port's
:class:`~streamer.server.route_table.RouteTable`.

:func:`answering` makes a route's failures answers: a refusal (:class:`HttpError`: a
malformed request's 400, the table's 404 and 405) is its status and body, an unexpected
error a 500, and neither echoes anything of the request; :func:`final_response` is the
last word on every answer of a WebSocket port.
"""

from __future__ import annotations

import http
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING
from urllib.parse import SplitResult, parse_qsl, urlsplit

from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from streamer.core.compat.transcripts import openai_error_body
from streamer.errors import HttpError
from streamer.model.serving.pool import WorkerPool
from streamer.server import models_page
from streamer.server.admission import ORIGIN_NOT_ALLOWED, RETRY_AFTER_S, Admission, authorize
from streamer.server.http import (
    V1_ENDPOINT,
    Endpoint,
    StaticFiles,
    bytes_response,
    json_response,
    safe_response,
    single_header,
    unavailable_response,
    without_body,
)
from streamer.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from streamer.server.metrics import Metrics
from streamer.server.route_table import NOT_FOUND, RouteTable

if TYPE_CHECKING:
    from streamer.model.backends.loading import LoadProgress

logger = logging.getLogger(__name__)

Route = Callable[[Request], Response | None]


def answering(route: Route) -> Route:
    """``route``, whose failures are answers: None goes on with the handshake.

    A refusal is answered with its status, body and headers (a malformed request's 400,
    the table's 404 and 405), and nothing of the request is echoed back; anything
    unexpected is logged with its traceback and answered 500 without details.
    """

    def answer(request: Request) -> Response | None:
        try:
            return route(request)
        except HttpError as error:
            response = json_response(error.status, error.body)
            for name, value in error.headers.items():
                response.headers[name] = value
            return response
        except Exception:
            logger.exception("answering an HTTP request failed")
            return json_response(
                http.HTTPStatus.INTERNAL_SERVER_ERROR,
                {"error": "internal_error", "message": "see the server log"},
            )

    return answer


def final_response(request: Request, response: Response) -> Response:
    """websockets' own refusals (426, ...) are replaced by ours; HEAD gets no body; a plain
    HTTP answer says ``Connection: close``, which websockets does after it (without it,
    an HTTP client's pool sends its next request, an upload after ``GET /v1/models``, on
    a connection that is closing)."""
    response = safe_response(response)
    if response.status_code != 101 and "Connection" not in response.headers:
        response.headers["Connection"] = "close"
    return without_body(response) if request.method == "HEAD" else response


class Routes:
    """Every plain HTTP answer of the main port."""

    def __init__(
        self,
        admission: Admission,
        endpoints: dict[str, Endpoint],
        static: StaticFiles,
        loading: LoadProgress | None = None,
    ) -> None:
        """Makes the port's :attr:`table` with these routes in it (the file APIs add
        theirs: :class:`~streamer.server.file_routes.FileRoutes`)."""
        self.admission = admission
        self.endpoints = endpoints
        self.static = static
        self.loading = loading  # the model's loading stage, shown by /readyz until ready
        # every (method, path) of the port; a path not in it is the web demo's file
        self.table = table = RouteTable(fallback=self.static_file)
        table.page("/healthz", self.healthz)
        table.page("/readyz", lambda request, url: self.readyz())
        table.page("/metrics", self.metrics_page)
        table.page(models_page.PATH, self.models)
        table.page(models_page.PATH + "/", self.models, prefix=True)  # /v1/models/{id}
        table.page("/", self.static_file)  # the web demo
        for path, endpoint in endpoints.items():
            table.upgrade(path, partial(self.handshake, endpoint))

    @property
    def worker(self) -> WorkerPool:
        return self.admission.worker

    @property
    def metrics(self) -> Metrics:
        return self.admission.metrics

    def healthz(self, request: Request, url: SplitResult) -> Response:
        return json_response(http.HTTPStatus.OK, {"status": "ok", "workers": self.workers()})

    def handshake(self, endpoint: Endpoint, request: Request, url: SplitResult) -> Response | None:
        """A WebSocket endpoint's upgrade request: its refusal, or None (it goes on)."""
        return self.admission.check_request(request, endpoint, dict(parse_qsl(url.query)))

    def static_file(self, request: Request, url: SplitResult) -> Response:
        """The web demo's file at the path, or 404."""
        found = self.static.response(url.path)
        return json_response(http.HTTPStatus.NOT_FOUND, NOT_FOUND) if found is None else found

    def metrics_page(self, request: Request, url: SplitResult) -> Response:
        options = self.admission.options
        query = dict(parse_qsl(url.query))
        if (
            not options.public_metrics
            and authorize(options, V1_ENDPOINT.presented_token(request, query), None) is not None
        ):
            return self.admission.refuse(
                http.HTTPStatus.UNAUTHORIZED, "unauthorized", V1_ENDPOINT.auth_hint, V1_ENDPOINT
            )
        self.metrics.observe_workers(self.worker.loads())  # current, not a probe old
        return bytes_response(http.HTTPStatus.OK, METRICS_CONTENT_TYPE, self.metrics.render())

    def models(self, request: Request, url: SplitResult) -> Response:
        """``/v1/models`` (and ``/v1/models/{id}``) in OpenAI's shape, with OpenAI's key."""
        path, query = url.path, dict(parse_qsl(url.query))
        presented = V1_ENDPOINT.presented_token(request, query)  # OpenAI's Bearer key
        refused = authorize(self.admission.options, presented, single_header(request, "Origin"))
        if refused == ORIGIN_NOT_ALLOWED:
            return json_response(
                http.HTTPStatus.FORBIDDEN,
                openai_error_body("this origin is not allowed", code=ORIGIN_NOT_ALLOWED),
            )
        if refused is not None:
            return json_response(
                http.HTTPStatus.UNAUTHORIZED,
                openai_error_body("a valid key is required", code="invalid_api_key"),
            )
        name = self.worker.model_name
        if path == models_page.PATH:
            return json_response(http.HTTPStatus.OK, models_page.model_list(name))
        if models_page.requested_model(path) != name:
            return json_response(
                http.HTTPStatus.NOT_FOUND,
                openai_error_body(f"this server serves one model: {name}", code="model_not_found"),
            )
        return json_response(http.HTTPStatus.OK, models_page.model_entry(name))

    def readyz(self) -> Response:
        admission = self.admission
        if admission.ready and not admission.shutting_down:
            return self.readiness()
        body: dict[str, object] = {"status": "loading"}
        if admission.failure is not None:
            body = {"status": "model_stalled", "reason": admission.failure}
        elif admission.shutting_down:
            body = {"status": "shutting_down"}
        elif (restarting := self.worker.restarting) is not None:
            body = {"status": "restarting", "reason": restarting}
        elif self.worker.ready.is_set():
            body = {"status": "failed", "message": "the model failed to load"}
        elif self.loading is not None:
            body.update(self.loading.snapshot())
        body["workers"] = self.workers()
        return unavailable_response(body, RETRY_AFTER_S)

    def readiness(self) -> Response:
        """``/readyz`` once the model is ready: 200 only while a new session is admitted."""
        admission = self.admission
        counts: dict[str, object] = {
            "sessions": len(admission.connections),
            "max_sessions": admission.options.max_sessions,
        }
        status = "ready"
        if admission.draining:
            status = "draining"
        elif admission.full:
            status = "full"
        elif (saturated := admission.saturated) is not None:
            status = "saturated"  # a balancer routes elsewhere while the model is behind
            counts |= {"reason": saturated, **admission.capacity.current.as_dict()}
        if status != "ready":  # about admission alone: the workers are listed when ready
            return unavailable_response({"status": status, **counts}, RETRY_AFTER_S)
        return json_response(
            http.HTTPStatus.OK,
            {
                "status": status,
                "model": self.worker.model_name,
                **counts,
                "workers": self.workers(),
            },
        )

    def workers(self) -> list[dict[str, object]]:
        """Each model worker, for ``/readyz`` and ``/healthz``."""
        return [
            {
                "worker": load.slot.index,
                "device": load.slot.device,
                "state": load.state,
                "restarts": load.restarts,
                "sessions": load.sessions,
                "queued": load.stats.queued_finals
                + load.stats.queued_partials
                + load.stats.queued_background,
                "file_worker": load.slot.background,
            }
            for load in self.worker.loads()
        ]

    def select_subprotocol(
        self, request: Request, offered: Sequence[Subprotocol]
    ) -> Subprotocol | None:
        endpoint = self.endpoints.get(urlsplit(request.path).path)
        if endpoint is None or endpoint.select_subprotocol is None:
            return None  # proceed without one, whatever the client offered
        chosen = endpoint.select_subprotocol(offered)
        return Subprotocol(chosen) if chosen is not None else None
