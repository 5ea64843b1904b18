"""Deepgram's prerecorded API: ``POST /v1/listen`` with the audio as the body.

The query takes the live endpoint's parameters (``language``, ``punctuate``,
``smart_format``, ``keyterm``, ``encoding`` and ``sample_rate`` for raw audio, ...) plus
``utterances``. A body in a container (WAV, MP3, FLAC, Ogg, M4A, WebM; any
``Content-Type``) is decoded by :mod:`streamer.media.files`; raw ``encoding=linear16``
(or ``mulaw``, ``alaw``) audio at ``sample_rate`` is taken as it is. A JSON body naming
a ``url`` is refused unless the operator allows remote fetches (``--allow-url-fetch``):
fetching what a request names is a server-side request forgery otherwise.
"""

from __future__ import annotations

import asyncio
import hashlib
import http
import logging
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import IO

import orjson

from streamer.core.compat import common, deepgram, transcripts
from streamer.core.compat.audio import BYTES_PER_SAMPLE
from streamer.core.containers import AUTO, PCM, SNIFF_BYTES, container_in_pcm, pcm_refusal
from streamer.errors import FileRefused, ProtocolError, UndecodableAudio
from streamer.server.admission import RETRY_AFTER_S
from streamer.server.compat import now_iso
from streamer.server.file_routes import ApiError, FileApi, FileRoutes, Upload, spool
from streamer.server.http_exchange import HttpExchange, HttpRequest
from streamer.server.remote_fetch import FetchLimits, fetch_url
from streamer.server.uploads import media_chunks, raw_chunks, transcribe_file

logger = logging.getLogger(__name__)

MAX_URL_BODY_BYTES = 64 * 1024  # a {"url": ...} body
_CODES = {
    "invalid_api_key": "INVALID_AUTH",
    "file_too_large": "PAYLOAD_TOO_LARGE",
    "too_many_files": "TOO_MANY_REQUESTS",
}


def _error_shape(error: ApiError) -> Mapping[str, object]:
    code = _CODES.get(error.code, error.code.upper())
    return transcripts.listen_error_body(code, error.message, str(uuid.uuid4()))


def _error_headers(error: ApiError) -> dict[str, str]:
    return {"dg-error": error.message[:200]}


def _presented_key(request: HttpRequest) -> str | None:
    return deepgram.presented_key(request.headers.get("Authorization"), ())


def _invalid(message: str, code: str = "Bad Request") -> ApiError:
    return ApiError(http.HTTPStatus.BAD_REQUEST, code, message)


async def serve(routes: FileRoutes, exchange: HttpExchange) -> None:
    request = exchange.request
    assert request is not None
    defaults = routes.admission.options.default_stream
    try:
        options = transcripts.parse_listen_file_query(
            request.query,
            defaults,
            keywords=[v for k, v in request.query_pairs if k == "keywords"],
            keyterms=[v for k, v in request.query_pairs if k == "keyterm"],
        )
    except ProtocolError as error:
        raise _invalid(error.message) from None
    upload = routes.admit(DEEPGRAM_FILES, exchange)  # before a byte of the body is read
    source: IO[bytes] | None = None
    try:
        content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if content_type == "application/json":
            source = await _fetched(routes, upload)
        else:
            source = await spool(upload, routes.options.max_upload_bytes)
        job = upload.start()  # the body is here: now a transcription slot
        digest = await asyncio.to_thread(_sha256, source)
        listen = options.listen
        stream = replace(listen.stream, words=True)
        chunks: Callable[[], Iterator[bytes]]
        try:
            if listen.container == PCM:  # raw audio, as encoding and sample_rate say
                chunks = _raw(source, listen, routes.options.max_duration_s)
            else:
                try:
                    chunks, info = await media_chunks(source, routes.options.max_duration_s)
                except UndecodableAudio as error:
                    if listen.container != AUTO:
                        raise
                    # raw PCM has no header to recognise: say how to send it
                    raise UndecodableAudio(
                        f"{error.message} (raw PCM? say so: encoding=linear16&sample_rate=N)"
                    ) from None
                if info.channels > 1 and common.lenient_bool(
                    request.query.get("multichannel"), False
                ):
                    raise _invalid(
                        f"multichannel=true is not supported: the file's {info.channels} "
                        "channels would each need a transcript; omit it to transcribe them "
                        "mixed to one"
                    )
                stream = replace(stream, sample_rate=16000)
            transcript = await transcribe_file(routes.admission, job, chunks, stream)
        except UndecodableAudio as error:
            raise _invalid(error.message) from None
        except FileRefused as error:
            raise ApiError(
                http.HTTPStatus.SERVICE_UNAVAILABLE,
                error.code,
                error.message,
                retry_after_s=RETRY_AFTER_S,
            ) from None
        request_id = str(uuid.uuid4())
        body = transcripts.listen_response(
            transcript.finals,
            duration_s=transcript.duration_s,
            options=options,
            request_id=request_id,
            created=now_iso(),
            sha256=digest,
            model=routes.admission.worker.model_name,
            notices=transcript.notices,
        )
        headers = {"dg-request-id": request_id, **routes.cors_headers(request)}
        await exchange.respond(http.HTTPStatus.OK, "application/json", orjson.dumps(body), headers)
    finally:
        upload.close()
        if source is not None:
            source.close()


def _raw(
    source: IO[bytes], options: deepgram.ListenOptions, max_duration_s: float
) -> Callable[[], Iterator[bytes]]:
    head = source.read(SNIFF_BYTES)
    if (found := container_in_pcm(head)) is not None:
        hint = "omit encoding (the file's container is recognised)"
        raise _invalid(pcm_refusal(found, hint).message)
    source.seek(0, 2)
    size = source.tell()
    source.seek(0)
    bytes_per_s = options.stream.sample_rate * options.channels * BYTES_PER_SAMPLE[options.encoding]
    if size / bytes_per_s > max_duration_s:
        raise _invalid(
            f"the audio is {size / bytes_per_s:.0f} s long; at most {max_duration_s:g} s "
            "are transcribed"
        )
    return lambda: raw_chunks(source, options.encoding, options.channels)


async def _fetched(routes: FileRoutes, upload: Upload) -> IO[bytes]:
    body = await spool(upload, MAX_URL_BODY_BYTES, flag=False)
    try:
        url = orjson.loads(body.read()).get("url")
    except (orjson.JSONDecodeError, AttributeError):
        url = None
    finally:
        body.close()
    if not isinstance(url, str) or not url:
        raise _invalid('a JSON body must be {"url": "..."}; send audio as the body instead')
    if not routes.options.allow_url_fetch:
        raise ApiError(
            http.HTTPStatus.BAD_REQUEST,
            "REMOTE_CONTENT_ERROR",
            "this server does not fetch audio from URLs (the operator can allow it with "
            "--allow-url-fetch); send the audio as the request body",
        )
    options = routes.options
    limits = FetchLimits(
        max_bytes=options.max_upload_bytes,
        read_timeout_s=options.read_timeout_s,
        deadline_s=options.upload_deadline_s,
        allow_private=options.allow_url_fetch_private,
    )
    return await fetch_url(url, limits)


def _sha256(source: IO[bytes]) -> str:
    digest = hashlib.sha256()
    source.seek(0)
    while data := source.read(1 << 20):
        digest.update(data)
    source.seek(0)
    return digest.hexdigest()


DEEPGRAM_FILES = FileApi(
    name="deepgram-files",
    path=deepgram.PATH,
    handler=serve,
    presented_token=_presented_key,
    error_shape=_error_shape,
    error_headers=_error_headers,
)
