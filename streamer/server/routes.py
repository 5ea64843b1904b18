"""The main port's plain HTTP: ``/healthz``, ``/readyz``, ``/metrics``, the web demo, and
the upgrade requests handed to :class:`~streamer.server.admission.Admission`.

:func:`answering` makes a route's failures answers: a malformed request is a 400 and an
unexpected error a 500, and neither echoes anything of the request; :func:`final_response`
is the last word on every answer of a WebSocket port;
:func:`check_request_line` is the validation every port shares (method, target, headers
that must not repeat).
"""

from __future__ import annotations

import http
import logging
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING
from urllib.parse import SplitResult, parse_qsl, urlsplit

from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from streamer.core.compat.transcripts import openai_error_body
from streamer.model.serving.pool import WorkerPool
from streamer.server import models_page
from streamer.server.admission import ORIGIN_NOT_ALLOWED, RETRY_AFTER_S, Admission, authorize
from streamer.server.http import (
    V1_ENDPOINT,
    BadRequest,
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
from streamer.server.route_table import PLAIN as SERVED_METHODS
from streamer.server.route_table import RouteTable

if TYPE_CHECKING:
    from streamer.model.backends.loading import LoadProgress

logger = logging.getLogger(__name__)

SINGLE_HEADERS = ("Authorization", "Origin", "Host")  # a repeated one is a 400

Route = Callable[[Request], Response | None]


def answering(route: Route) -> Route:
    """``route``, whose failures are answers: None goes on with the handshake.

    Malformed requests get 400 and nothing of the request is echoed back; anything
    unexpected is logged with its traceback and answered 500 without details.
    """

    def answer(request: Request) -> Response | None:
        try:
            return route(request)
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


def method_not_allowed(allowed: tuple[str, ...], message: str) -> Response:
    response = json_response(
        http.HTTPStatus.METHOD_NOT_ALLOWED, {"error": "method_not_allowed", "message": message}
    )
    response.headers["Allow"] = ", ".join(allowed)
    return response


def check_request_line(request: Request) -> SplitResult:
    """The request's URL once its target and single headers are valid (else BadRequest)."""
    try:
        url = urlsplit(request.path)
    except ValueError:
        raise BadRequest("the request target is not a valid URL") from None
    path = url.path
    if "\x00" in path or any(len(part) > 255 for part in path.split("/")):
        raise BadRequest("the request path is not valid")
    for name in SINGLE_HEADERS:
        single_header(request, name)  # raises BadRequest when repeated
    return url


class Routes:
    """Every plain HTTP answer of the main port."""

    def __init__(
        self,
        admission: Admission,
        endpoints: dict[str, Endpoint],
        static: StaticFiles,
        loading: LoadProgress | None = None,
        upload_paths: Collection[str] = (),
    ) -> None:
        """``upload_paths``: the file APIs' (POST) paths, for the port's :class:`RouteTable`."""
        self.admission = admission
        self.endpoints = endpoints
        self.static = static
        self.loading = loading  # the model's loading stage, shown by /readyz until ready
        # every (method, path) of the port: the 405 answers of both dispatchers
        self.table = RouteTable(endpoints, upload_paths)

    @property
    def worker(self) -> WorkerPool:
        return self.admission.worker

    @property
    def metrics(self) -> Metrics:
        return self.admission.metrics

    def route(self, request: Request) -> Response | None:
        url = check_request_line(request)
        path = url.path
        allowed = self.table.allowed(path)
        if request.method not in SERVED_METHODS:
            return method_not_allowed(allowed, "only GET and HEAD are served")
        query = dict(parse_qsl(url.query))
        if path == "/healthz":
            return json_response(http.HTTPStatus.OK, {"status": "ok", "workers": self.workers()})
        if path == "/readyz":
            return self.readyz()
        if path == "/metrics":
            return self.metrics_page(request, query)
        if path == models_page.PATH or path.startswith(models_page.PATH + "/"):
            return self.models(request, query, path)
        endpoint = self.endpoints.get(path)
        if endpoint is not None:
            if request.method != "GET":
                return method_not_allowed(allowed, "WebSocket handshakes use GET")
            return self.admission.check_request(request, endpoint, query)
        if request.method not in allowed:  # an upload's path
            return method_not_allowed(allowed, f"{path} takes POST")
        found = self.static.response(path)
        if found is None:
            return json_response(
                http.HTTPStatus.NOT_FOUND, {"error": "not_found", "message": "no such path"}
            )
        return found

    def metrics_page(self, request: Request, query: dict[str, str]) -> Response:
        options = self.admission.options
        if (
            not options.public_metrics
            and authorize(options, V1_ENDPOINT.presented_token(request, query), None) is not None
        ):
            return self.admission.refuse(
                http.HTTPStatus.UNAUTHORIZED, "unauthorized", V1_ENDPOINT.auth_hint, V1_ENDPOINT
            )
        self.metrics.observe_workers(self.worker.loads())  # current, not a probe old
        return bytes_response(http.HTTPStatus.OK, METRICS_CONTENT_TYPE, self.metrics.render())

    def models(self, request: Request, query: dict[str, str], path: str) -> Response:
        """``/v1/models`` (and ``/v1/models/{id}``) in OpenAI's shape, with OpenAI's key."""
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
