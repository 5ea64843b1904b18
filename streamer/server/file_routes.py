"""The main port's requests with a body: file uploads (OpenAI's and Deepgram's file APIs).

:class:`FileRoutes` registers each file API's routes in the port's
:class:`~streamer.server.route_table.RouteTable` (``POST`` its API, ``OPTIONS`` the CORS
preflight) and is the handler of every :class:`HttpExchange`: it tracks the request for
the shutdown, checks its line and answers it from the table's route. An API checks the
key and the server's state the way the WebSocket endpoints do
(:mod:`streamer.server.openai_files`, :mod:`streamer.server.deepgram_files`). What both
APIs share lives here: the options
(:class:`FileOptions`), admission of a file (:meth:`FileRoutes.admit`: a slot for
receiving its body, at most half of them per client; :meth:`Upload.start`: the
transcription slot, once the body is complete, so uploads that drip never hold one),
the body's bounds (:meth:`Upload.read`: a minimum average rate and a total deadline),
spooling a body to a temporary file with its size limit (:func:`spool`), CORS.
"""

from __future__ import annotations

import asyncio
import http
import logging
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import IO

import h11

from streamer.core.compat import transcripts
from streamer.errors import ApiError, FileRefused
from streamer.server.admission import (
    ORIGIN_NOT_ALLOWED,
    RETRY_AFTER_S,
    UNAUTHORIZED,
    Admission,
    authorize,
)
from streamer.server.http import single_header
from streamer.server.http_exchange import (
    BodyError,
    HttpError,
    HttpExchange,
    HttpLimits,
    HttpRequest,
)
from streamer.server.options import FileOptions
from streamer.server.route_table import (
    NOT_FOUND,
    BodyHandler,
    BodyRoute,
    RouteTable,
    check_request_line,
)
from streamer.server.uploads import FileJob, FileJobs, Receiving

logger = logging.getLogger(__name__)

SPOOL_MEMORY_BYTES = 8 << 20  # an upload is kept in memory up to this, then on disk
BODY_METHODS = ("POST",)
MULTIPART_OVERHEAD_BYTES = 1 << 20  # an upload's form fields beside its file
UPLOAD_RATE_GRACE_S = 10.0  # the minimum upload rate is an average over this at least


ErrorShape = Callable[[ApiError], Mapping[str, object]]
ApiHandler = Callable[["FileRoutes", HttpExchange], Awaitable[None]]


@dataclass(frozen=True)
class FileApi:
    """One file API: its path, its handler, how it presents keys and shapes errors."""

    name: str  # metrics label
    path: str
    handler: ApiHandler
    presented_token: Callable[[HttpRequest], str | None]
    error_shape: ErrorShape
    error_headers: Callable[[ApiError], Mapping[str, str]] = lambda error: {}

    def http_error(self, error: ApiError) -> HttpError:
        headers = dict(self.error_headers(error))
        if error.retry_after_s is not None:
            headers["Retry-After"] = str(error.retry_after_s)
        return HttpError(error.status, self.error_shape(error), headers)


class OpenRequest:
    """A file API's request being answered, as the lifecycle sees it (one of
    :attr:`Admission.open <streamer.server.admission.Admission.open>`'s things): a
    model failure or the shutdown stops its transcription (the :class:`FileJob`, tracked
    beside it), and when the grace period is over its connection is dropped."""

    def __init__(self, exchange: HttpExchange) -> None:
        self.exchange = exchange

    def expire(self, code: str, message: str, close_code: int = 0) -> None:
        """Nothing to tell: its file job, if it has one, is told."""

    def shutdown(self) -> None:
        """Nothing to tell: its file job, if it has one, is refused."""

    def abort(self) -> None:
        self.exchange.abort()


class FileRoutes:
    """Every request with a body on the main port."""

    def __init__(
        self,
        admission: Admission,
        options: FileOptions,
        apis: tuple[FileApi, ...],
        refused: Mapping[str, tuple[http.HTTPStatus, str]] | None = None,
        table: RouteTable | None = None,
    ) -> None:
        """``table``: the port's routes, in which these APIs' are registered (by default
        a table of these APIs alone); ``refused``: paths known and refused (their POST
        answered with the status and message)."""
        self.admission = admission
        self.options = options
        self.jobs = FileJobs(options.max_jobs)
        self.receiving = Receiving(
            options.max_uploads_receiving, options.max_uploads_receiving_per_client
        )
        self.table = table if table is not None else RouteTable()
        for api in apis:
            self._register(api.path, self._api_handler(api))
        for path, (status, message) in (refused or {}).items():
            self._register(path, partial(_refuse, status, message))

    def _register(self, path: str, handle: BodyHandler) -> None:
        self.table.body(BODY_METHODS, path, handle)
        self.table.body(("OPTIONS",), path, self.preflight)

    def _api_handler(self, api: FileApi) -> BodyHandler:
        """``api``'s handler, its outcome counted and its refusals in its own shape."""

        async def handle(exchange: HttpExchange) -> None:
            metrics = self.admission.metrics
            try:
                await api.handler(self, exchange)
            except ApiError as error:
                metrics.files_total.labels(api.name, error.code).inc()
                logger.info("refused an upload (%s): %s", api.name, error.message)
                raise api.http_error(error) from None
            metrics.files_total.labels(api.name, "ok").inc()

        return handle

    def exchange(self, peer: str, accepted_at: float, connection: h11.Connection) -> HttpExchange:
        """A new exchange for one connection accepted at loop time ``accepted_at``, whose
        head the port's front is reading with ``connection`` (the port's exchange
        factory): its head is due ``read_timeout_s`` after the accept."""
        limits = HttpLimits(
            max_body_bytes=self.options.max_upload_bytes + MULTIPART_OVERHEAD_BYTES,
            read_timeout_s=self.options.read_timeout_s,
            write_timeout_s=self.admission.options.limits.write_timeout_s,
        )
        return HttpExchange(
            self.handle,
            limits,
            peer=peer,
            head_deadline=accepted_at + limits.read_timeout_s,
            connection=connection,
        )

    async def handle(self, exchange: HttpExchange) -> None:
        """Every request with a body: answered by its route in the port's table."""
        request = exchange.request
        assert request is not None
        tracked = OpenRequest(exchange)
        self.admission.open_work(tracked)  # shutdown aborts what is left
        try:
            check_request_line(request.ws_request)  # BadRequest: a 400
            route = self.table.find(request.method, request.path)  # 404, 405
            if not isinstance(route, BodyRoute):
                # a page's method read here (``get``, which h11 reads as ``GET``): as before
                raise HttpError(http.HTTPStatus.NOT_FOUND, NOT_FOUND)
            await route.handle(exchange)
        finally:
            self.admission.close_work(tracked)

    async def preflight(self, exchange: HttpExchange) -> None:
        """A browser's CORS preflight for an upload from another origin (told what the
        port's table lets it send)."""
        request = exchange.request
        assert request is not None
        headers = {
            "Access-Control-Allow-Methods": ", ".join(self.table.preflight_methods(request.path)),
            "Access-Control-Allow-Headers": "Authorization, Content-Type",
            "Access-Control-Max-Age": "600",
            **self.cors_headers(request),
        }
        await exchange.respond(http.HTTPStatus.NO_CONTENT, "text/plain", b"", headers)

    def cors_headers(self, request: HttpRequest) -> dict[str, str]:
        """``Access-Control-Allow-Origin`` for an allowed origin (any, without
        ``--allowed-origins``: the APIs authenticate with a key, never a cookie)."""
        origin = request.headers.get("Origin")
        allowed = self.admission.options.allowed_origins
        if origin is None:
            return {}
        if not allowed:
            return {"Access-Control-Allow-Origin": "*"}
        if origin in allowed:
            return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        return {}

    def admit(self, api: FileApi, exchange: HttpExchange) -> Upload:
        """The request's upload, once its key, origin and the server allow it: a slot for
        receiving its body (raises :class:`ApiError`). Its transcription slot is taken
        by :meth:`Upload.start` once the body is complete."""
        request = exchange.request
        assert request is not None
        self._check(api, request)
        try:
            self.receiving.add(request.peer)
            self.admission.metrics.file_uploads_receiving.set(self.receiving.total)
        except FileRefused as error:
            raise ApiError(
                http.HTTPStatus.TOO_MANY_REQUESTS,
                error.code,
                f"{error}; retry shortly",
                retry_after_s=RETRY_AFTER_S,
            ) from None
        return Upload(self, api, exchange)

    def _check(self, api: FileApi, request: HttpRequest) -> None:
        refused = authorize(
            self.admission.options,
            api.presented_token(request),
            single_header(request.ws_request, "Origin"),
        )
        if refused == UNAUTHORIZED:
            raise ApiError(
                http.HTTPStatus.UNAUTHORIZED, "invalid_api_key", "a valid key is required"
            )
        if refused == ORIGIN_NOT_ALLOWED:
            raise ApiError(
                http.HTTPStatus.FORBIDDEN, ORIGIN_NOT_ALLOWED, "this origin is not allowed"
            )
        self._check_state()
        if self.options.max_jobs == 0:
            raise ApiError(
                http.HTTPStatus.FORBIDDEN,
                "files_disabled",
                "this server takes no file uploads (--max-file-jobs 0); stream the audio",
            )

    def _check_state(self) -> None:
        refusal = self.admission.refusal()
        # a file is background work: a full or saturated server still takes it (its
        # jobs wait behind every live one); the server's own state refuses it
        if refusal is not None and refusal[0] not in ("server_full", "saturated"):
            code, message = refusal
            raise ApiError(
                http.HTTPStatus.SERVICE_UNAVAILABLE, code, message, retry_after_s=RETRY_AFTER_S
            )

    def start_job(self, api: FileApi) -> FileJob:
        """A transcription slot (:meth:`Upload.start` asks for it; raises :class:`ApiError`)."""
        self._check_state()  # the server may have begun draining while the body came
        try:
            job = self.jobs.add(api.name)
        except FileRefused as error:
            raise ApiError(
                http.HTTPStatus.TOO_MANY_REQUESTS,
                "too_many_files",
                f"{error}; retry shortly",
                retry_after_s=RETRY_AFTER_S,
            ) from None
        self.admission.open_work(job)  # a model failure or the shutdown stops it
        self.admission.metrics.file_jobs_active.labels(api.name).inc()
        return job

    def release_job(self, job: FileJob) -> None:
        """The slot of :meth:`start_job`, once the file's request is answered."""
        self.jobs.remove(job)
        self.admission.close_work(job)
        self.admission.metrics.file_jobs_active.labels(job.name).dec()


class Upload:
    """One admitted upload: its body read against its bounds (:meth:`read`), then its
    transcription slot (:meth:`start`); :meth:`close` frees whichever it holds (call it
    in a ``finally``)."""

    def __init__(self, routes: FileRoutes, api: FileApi, exchange: HttpExchange) -> None:
        self.routes = routes
        self.api = api
        self.exchange = exchange
        request = exchange.request
        assert request is not None
        self.peer = request.peer
        self.received_bytes = 0
        self.job: FileJob | None = None
        self._receiving = True
        self._loop = asyncio.get_running_loop()
        self._started_s = self._loop.time()

    async def read(self) -> bytes:
        """The body's next piece (b"" at its end); raises :class:`ApiError` (408) when
        the body comes slower than ``--upload-min-bytes-per-s`` on average (past the
        first :data:`UPLOAD_RATE_GRACE_S`) or is not complete within
        ``--upload-deadline-s``, 413 past the exchange's limit."""
        options = self.routes.options
        deadline_s = self._started_s + options.upload_deadline_s
        due_s = deadline_s
        if options.upload_min_bytes_per_s:
            # when the average rate would fall below the minimum if nothing more came
            needed_s = (self.received_bytes + 1) / options.upload_min_bytes_per_s
            due_s = min(deadline_s, self._started_s + max(UPLOAD_RATE_GRACE_S, needed_s))
        try:
            async with asyncio.timeout_at(due_s):
                data = await read(self.exchange, options.max_upload_bytes)
        except TimeoutError:
            if due_s >= deadline_s:
                message = (
                    f"the upload was not complete within {options.upload_deadline_s:g} s "
                    "(--upload-deadline-s)"
                )
            else:
                message = (
                    "the upload came too slowly: this server needs at least "
                    f"{options.upload_min_bytes_per_s} bytes/s (--upload-min-bytes-per-s)"
                )
            raise ApiError(http.HTTPStatus.REQUEST_TIMEOUT, "upload_too_slow", message) from None
        self.received_bytes += len(data)
        return data

    def start(self) -> FileJob:
        """The body is here: its receiving slot for a transcription slot (raises
        :class:`ApiError` 429 when ``--max-file-jobs`` files are being transcribed, 503
        when the server began draining meanwhile)."""
        self._stop_receiving()
        self.job = self.routes.start_job(self.api)
        return self.job

    def close(self) -> None:
        self._stop_receiving()
        if self.job is not None:
            self.routes.release_job(self.job)
            self.job = None

    def _stop_receiving(self) -> None:
        if self._receiving:
            self._receiving = False
            receiving = self.routes.receiving
            receiving.remove(self.peer)
            self.routes.admission.metrics.file_uploads_receiving.set(receiving.total)


async def _refuse(status: http.HTTPStatus, message: str, exchange: HttpExchange) -> None:
    """A path known and not served (OpenAI's translations): its refusal, in OpenAI's shape."""
    raise HttpError(status, transcripts.openai_error_body(message, code="unsupported"))


def new_spool() -> IO[bytes]:
    """Where an upload waits for its decoder: memory, then a temporary file."""
    return tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)  # noqa: SIM115


async def spool(upload: Upload, limit_bytes: int, *, flag: bool = True) -> IO[bytes]:
    """The whole body in a spool (raises :class:`ApiError` 413 past ``limit_bytes``,
    the ``--max-upload-mb`` limit when ``flag``)."""
    target = new_spool()
    size = 0
    try:
        while data := await upload.read():
            size += len(data)
            if size > limit_bytes:
                raise too_large(limit_bytes, flag=flag)
            target.write(data)
    except BaseException:
        target.close()
        raise
    target.seek(0)
    return target


async def read(exchange: HttpExchange, limit_bytes: int) -> bytes:
    """The body's next piece (b"" at its end); a body that cannot be read is an
    :class:`ApiError` in the API's shape (413 names ``--max-upload-mb``, whose value
    is ``limit_bytes``)."""
    try:
        return await exchange.read()
    except BodyError as error:
        if error.status == http.HTTPStatus.REQUEST_ENTITY_TOO_LARGE:
            raise too_large(limit_bytes) from None
        raise ApiError(error.status, "bad_request", error.message) from None


def too_large(limit_bytes: int, *, flag: bool = True) -> ApiError:
    """413 for a body over ``limit_bytes``: the operator's ``--max-upload-mb`` (said
    with its value, which is what a proxy's body limit must allow), or a fixed limit."""
    megabytes = f"{limit_bytes / (1 << 20):g}"
    limit = f"--max-upload-mb {megabytes}" if flag else f"{limit_bytes} bytes"
    return ApiError(
        http.HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        "file_too_large",
        f"the upload is larger than this server's limit ({limit})",
        param="file",
    )
