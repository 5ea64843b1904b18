"""OpenAI's file API: ``POST /v1/audio/transcriptions`` (multipart, as the openai SDK,
Open WebUI, LibreChat, n8n and Home Assistant send it).

The form is parsed as it arrives (``multipart``'s push parser): small fields are kept,
the ``file`` part goes to a spool with the upload limit. The key and the server's state
are checked before the body is read. The transcript is the file's protocol v1 finals
(:func:`streamer.server.uploads.transcribe_file`) in the asked ``response_format``;
``stream=true`` answers ``text/event-stream``: one ``transcript.text.delta`` per final
as soon as it is decoded, then ``transcript.text.done``. Errors have OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import http
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import IO

import multipart

from streamer.core import hotwords
from streamer.core.compat import common, openai_negotiation, transcripts
from streamer.core.protocol import Final, StreamOptions
from streamer.core.session import Session
from streamer.errors import FileRefused, InvalidOption, UndecodableAudio
from streamer.server.admission import RETRY_AFTER_S
from streamer.server.file_routes import (
    ApiError,
    FileApi,
    FileRoutes,
    Upload,
    new_spool,
    too_large,
)
from streamer.server.http_exchange import HttpExchange, HttpRequest
from streamer.server.known_speakers import enrol, known_speakers
from streamer.server.uploads import FileJob, media_chunks, transcribe_file

logger = logging.getLogger(__name__)

PATH = "/v1/audio/transcriptions"
TRANSLATIONS_PATH = "/v1/audio/translations"
RESPONSE_FORMATS = transcripts.RESPONSE_FORMATS
GRANULARITIES = transcripts.GRANULARITIES
MAX_FIELD_BYTES = 64 * 1024  # a form field other than the file
MAX_PARTS = 64  # parts of a form; more is a 400
MAX_PART_HEADERS = 16  # headers of one part; more is a 400
MAX_PART_HEADER_BYTES = 8192  # one part's headers together
# a known speaker's reference: a data URL of a 2-10 s sample (a 4 s 16 kHz WAV is 170 KB;
# 10 s of 48 kHz stereo WAV, base64, is 2.6 MB)
MAX_REFERENCE_FIELD_BYTES = 4 * 1024 * 1024
REFERENCE_FIELDS = ("known_speaker_references[]", "known_speaker_references")
NAME_FIELDS = ("known_speaker_names[]", "known_speaker_names")
SSE_KEEPALIVE_S = 15.0  # a comment line while no event is due
TRANSLATION_REFUSAL = (
    "SenseVoice transcribes speech in its own language and does not translate; "
    f"use {PATH} (the transcript keeps the spoken language)"
)


@dataclass
class Form:
    """An upload's form: its fields (repeatable ones in order) and its file."""

    fields: dict[str, list[str]] = field(default_factory=dict)
    file: IO[bytes] | None = None
    file_bytes: int = 0

    def value(self, name: str) -> str | None:
        values = self.fields.get(name)
        return values[-1] if values else None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


@dataclass(frozen=True)
class Request:
    """What the form asks for."""

    model: str
    response_format: str
    stream: bool
    granularities: tuple[str, ...]
    language: str  # the core's ("auto" when absent or unknown)
    hotwords: hotwords.Hotwords
    segments: bool = False  # include[]=segments (ours): stream deltas carry their segment
    diarize: bool = False  # diarized_json: speakers on the segments
    known_names: tuple[str, ...] = ()  # known_speaker_names[], paired with the references
    known_references: tuple[str, ...] = ()  # known_speaker_references[] (data URLs)


def _invalid(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(http.HTTPStatus.BAD_REQUEST, code, message, param=param)


async def read_form(upload: Upload, request: HttpRequest, limit_bytes: int) -> Form:
    """The multipart form, its file spooled (raises :class:`ApiError`). The ``file``
    part is the audio with or without a filename (``curl -F file=<audio.wav`` sends
    none)."""
    content_type = request.headers.get("Content-Type") or ""
    kind, params = multipart.parse_options_header(content_type)
    boundary = params.get("boundary")
    if kind != "multipart/form-data" or not boundary:
        raise _invalid(
            "the request must be multipart/form-data with a 'file' part (as the openai SDK "
            "sends it)",
            None,
            "invalid_request",
        )
    form = Form()
    part: multipart.MultipartSegment | None = None
    buffer = bytearray()
    try:
        parser = multipart.PushMultipartParser(
            boundary,
            max_segment_count=MAX_PARTS,
            max_header_size=MAX_PART_HEADER_BYTES,
            max_header_count=MAX_PART_HEADERS,
        )
        while True:
            data = await upload.read()
            for event in parser.parse(data):
                if isinstance(event, multipart.MultipartSegment):
                    part = event
                    buffer.clear()
                    if part.name == "file":
                        form.close()
                        form.file = new_spool()
                        form.file_bytes = 0
                elif event is None:
                    if part is not None and part.name != "file":
                        text = bytes(buffer).decode("utf-8", "replace")
                        form.fields.setdefault(part.name, []).append(text)
                    part = None
                elif part is not None:
                    if part.name == "file" and form.file is not None:
                        form.file_bytes += len(event)
                        if form.file_bytes > limit_bytes:
                            raise too_large(limit_bytes)
                        form.file.write(event)
                    else:
                        buffer += event
                        limit = (
                            MAX_REFERENCE_FIELD_BYTES
                            if part.name in REFERENCE_FIELDS
                            else MAX_FIELD_BYTES
                        )
                        if len(buffer) > limit:
                            raise _invalid(
                                f"the form field {printable(part.name)} is longer than "
                                f"{limit} bytes",
                                printable(part.name, quoted=False),
                            )
            if not data:
                break
        if not parser.closed:
            raise _invalid("the multipart body ended early", None, "invalid_request")
    except multipart.MultipartError as error:  # malformed, or past one of our limits
        form.close()
        raise _invalid(
            f"the multipart body is malformed or too large ({_multipart_reason(error)})",
            None,
            "invalid_request",
        ) from None
    except BaseException:
        form.close()
        raise
    if form.file is None:
        raise _invalid("the form has no 'file' part with the audio", "file", "missing_file")
    if form.file_bytes == 0:
        form.close()
        raise _invalid("the uploaded file is empty", "file")
    form.file.seek(0)
    return form


def printable(text: str, *, quoted: bool = True, limit: int = 40) -> str:
    """A client's name (a form field's) as it may be echoed: printable ASCII, anything
    else escaped, at most ``limit`` characters; quoted unless ``quoted`` is false."""
    escaped = text[:limit].encode("ascii", "backslashreplace").decode("ascii")
    escaped = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in escaped)
    return f"'{escaped}'" if quoted else escaped


def _multipart_reason(error: Exception) -> str:
    """The parser's own words (a fixed sentence), never the bytes it choked on."""
    reason = error.args[0] if error.args and isinstance(error.args[0], str) else ""
    return printable(reason, quoted=False, limit=80) or type(error).__name__


def parse_request(form: Form, defaults: StreamOptions) -> Request:
    response_format = (form.value("response_format") or "json").strip().lower()
    if response_format not in RESPONSE_FORMATS:
        raise _invalid(
            f"response_format must be one of {', '.join(RESPONSE_FORMATS)}",
            "response_format",
        )
    granularities: list[str] = []
    for name in ("timestamp_granularities[]", "timestamp_granularities"):
        for value in form.fields.get(name, []):
            value = value.strip().lower()
            if value not in GRANULARITIES:
                raise _invalid(
                    "timestamp_granularities must be 'segment' and/or 'word'",
                    "timestamp_granularities",
                )
            if value not in granularities:
                granularities.append(value)
    stream = common.lenient_bool(form.value("stream"), False)
    # newer clients (openai 3.60, LiveKit) send the possible languages instead: the
    # first is forced, as `language` would be
    language = form.value("language") or next(iter(_values(form, "languages")), None)
    # free text and keywords alike become hotwords (never an error: what the model
    # cannot spell is skipped, logged at debug and counted)
    terms = hotwords.merge(
        hotwords.parse_prompt(form.value("prompt") or ""),
        hotwords.parse_terms(_values(form, "keywords")),
    )
    includes = _values(form, "include")
    for include in includes:
        if include != "segments":
            # logprobs: OpenAI's are a decoder's token log-probabilities; a CTC model has
            # per-frame posteriors instead (each word's confidence, in Deepgram's answers)
            logger.debug("include[]=%.40s is not answered (ignored)", include)
    return Request(
        model=(form.value("model") or "sensevoice").strip()[:100],
        response_format=response_format,
        stream=stream,
        granularities=tuple(granularities) or ("segment",),
        language=common.core_language(language) if language else defaults.language,
        hotwords=terms,
        segments="segments" in includes,
        diarize=response_format == transcripts.DIARIZED,
        known_names=tuple(v for name in NAME_FIELDS for v in form.fields.get(name, [])),
        known_references=tuple(v for name in REFERENCE_FIELDS for v in form.fields.get(name, [])),
    )


def _values(form: Form, name: str) -> list[str]:
    """A list field as the openai SDK sends it (``name[]`` parts) or plainly repeated."""
    return [v.strip() for key in (f"{name}[]", name) for v in form.fields.get(key, [])]


def _presented_key(request: HttpRequest) -> str | None:
    return openai_negotiation.presented_key(request.headers.get("Authorization"), ())


def _error_shape(error: ApiError) -> dict[str, object]:
    return transcripts.openai_error_body(error.message, code=error.code, param=error.param)


async def serve(routes: FileRoutes, exchange: HttpExchange) -> None:
    request = exchange.request
    assert request is not None
    upload = routes.admit(OPENAI_FILES, exchange)  # before a byte of the body is read
    form: Form | None = None
    try:
        form = await read_form(upload, request, routes.options.max_upload_bytes)
        asked = parse_request(form, routes.admission.options.default_stream)
        stream = replace(
            routes.admission.options.default_stream,
            language=asked.language,
            hotwords=asked.hotwords,
            words="word" in asked.granularities or routes.admission.options.default_stream.words,
            diarize=asked.diarize,
        )
        setup = await _known_speakers(routes, asked)
        cors = routes.cors_headers(request)
        job = upload.start()  # the body is here: now a transcription slot
        logger.info(
            "transcribing an upload from %s (%d bytes, %s%s)",
            request.peer,
            form.file_bytes,
            asked.response_format,
            ", streamed" if asked.stream else "",
        )
        assert form.file is not None
        try:  # a file that is not audio is refused before anything is sent
            chunks, _ = await media_chunks(form.file, routes.options.max_duration_s)
        except UndecodableAudio as error:
            raise _invalid(error.message, "file", "invalid_file") from None
        if asked.stream:
            await _stream(
                routes,
                exchange,
                job,
                chunks,
                stream,
                cors,
                setup,
                asked.diarize,
                segments=asked.segments,
            )
            return
        try:
            transcript = await transcribe_file(routes.admission, job, chunks, stream, setup=setup)
        except UndecodableAudio as error:
            raise _invalid(error.message, "file", "invalid_file") from None
        except FileRefused as error:
            raise _unavailable(error) from None
        body, content_type = transcripts.transcription_body(
            transcript.finals,
            response_format=asked.response_format,
            duration_s=transcript.duration_s,
            granularities=asked.granularities,
            language=asked.language,
        )
        await exchange.respond(http.HTTPStatus.OK, content_type, body, cors)
    finally:
        upload.close()
        if form is not None:
            form.close()


async def _known_speakers(routes: FileRoutes, asked: Request) -> Callable[[Session], None] | None:
    """diarized_json: refused without speaker models; the known speakers' embeddings,
    enrolled into the upload's session by the returned setup."""
    if not asked.diarize:
        if asked.known_names or asked.known_references:
            raise _invalid(
                "known speakers need response_format=diarized_json", "known_speaker_names"
            )
        return None
    queue = getattr(routes.admission.worker, "speakers", None)
    if queue is None or routes.admission.options.session.diarization is None:
        raise _invalid(
            "response_format=diarized_json needs a server started with --diarize-model",
            "response_format",
        )
    try:
        known = await known_speakers(asked.known_names, asked.known_references, queue)
    except InvalidOption as error:
        raise _invalid(error.message, "known_speaker_references") from None
    return lambda session: enrol(session, known)


def _unavailable(error: FileRefused) -> ApiError:
    return ApiError(
        http.HTTPStatus.SERVICE_UNAVAILABLE, error.code, error.message, retry_after_s=RETRY_AFTER_S
    )


async def _stream(
    routes: FileRoutes,
    exchange: HttpExchange,
    job: FileJob,
    chunks: Callable[[], Iterator[bytes]],
    stream: StreamOptions,
    cors: dict[str, str],
    setup: Callable[[Session], None] | None = None,
    diarized: bool = False,
    *,
    segments: bool = False,
) -> None:
    """``stream=true``: server-sent events, a delta per final as soon as it is decoded
    (diarized_json: its ``transcript.text.segment`` events), and a comment line while
    none comes for :data:`SSE_KEEPALIVE_S` (so that proxies do not time the stream out
    while live work goes first)."""
    events = transcripts.TranscriptStream(segments=segments, diarized=diarized)
    await exchange.start(
        http.HTTPStatus.OK, "text/event-stream", {"X-Accel-Buffering": "no", **cors}
    )

    async def on_final(final: Final) -> None:
        for event in events.events(final):
            await exchange.write(transcripts.sse_frame(event))

    async def keepalive() -> None:
        while True:
            await asyncio.sleep(SSE_KEEPALIVE_S)
            await exchange.write(b": keepalive\n\n")

    pinger = asyncio.create_task(keepalive(), name="sse keepalive")
    try:
        await transcribe_file(routes.admission, job, chunks, stream, on_final=on_final, setup=setup)
    except UndecodableAudio as error:  # met after the start: the last event says it
        last = _error_shape(_invalid(error.message, "file", "invalid_file"))
    except FileRefused as error:
        last = _error_shape(_unavailable(error))
    else:
        last = events.done()
    finally:
        pinger.cancel()
    await exchange.write(transcripts.sse_frame(last))
    await exchange.finish()


OPENAI_FILES = FileApi(
    name="openai-files",
    path=PATH,
    handler=serve,
    presented_token=_presented_key,
    error_shape=_error_shape,
)
