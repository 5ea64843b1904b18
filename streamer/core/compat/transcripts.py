"""The answers of the file transcription endpoints, built from a file's finals (I/O-free).

A file's upload is cut and decoded as a stream is; its finals (in segment order) and the
decoded audio's duration are all these builders need:

- OpenAI's ``POST /v1/audio/transcriptions``: :func:`transcription_body` answers every
  ``response_format`` (``json``, ``text``, ``srt``, ``vtt``, ``verbose_json``);
  :class:`TranscriptStream` gives the ``stream=true`` events (a
  ``transcript.text.delta`` per final, then ``transcript.text.done``) and
  :func:`sse_frame` frames one; :func:`openai_error_body` is OpenAI's error shape.
- Deepgram's prerecorded ``POST /v1/listen``: :func:`parse_listen_file_query` reads the
  query as the live endpoint does (plus ``utterances`` and ``detect_language``), and
  :func:`listen_response` builds the response the SDKs parse, with the live endpoint's
  words (:func:`streamer.core.compat.deepgram.result_words`); :func:`listen_error_body`
  is Deepgram's error shape.

Finals with no text (noise the VAD let through, a failed decode) give no segment, word,
cue or delta; the caller decides what a final's ``error`` means for the whole request.
Times are seconds, rounded to the millisecond and kept inside ``[0, duration_s]``.
"""

from __future__ import annotations

import math
import uuid
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson

from streamer.core.captions import srt_document, vtt_document
from streamer.core.compat import common, deepgram
from streamer.core.compat.deepgram import ListenOptions
from streamer.core.protocol import MAX_ERROR_MESSAGE_CHARS, Final, Notice, StreamOptions
from streamer.core.session_speakers import speaker_parts, speaker_runs
from streamer.core.words import join_words

__all__ = [
    "RESPONSE_FORMATS",
    "GRANULARITIES",
    "WHISPER_LANGUAGE_NAMES",
    "UNKNOWN_LANGUAGE",
    "transcription_body",
    "transcription_json",
    "transcription_verbose_json",
    "transcription_text",
    "whisper_language",
    "inside_audio",
    "TranscriptStream",
    "sse_frame",
    "openai_error_body",
    "ListenFileOptions",
    "parse_listen_file_query",
    "listen_response",
    "listen_error_body",
]

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json", "diarized_json")  # OpenAI's
DIARIZED = "diarized_json"  # the format that asks for speakers (TranscriptionDiarized)
UNKNOWN_SPEAKER = "unknown"  # a diarized segment whose speakers came too late or failed
GRANULARITIES = ("segment", "word")  # timestamp_granularities[] values
# what OpenAI's verbose_json calls each language (whisper's names)
WHISPER_LANGUAGE_NAMES = {
    "en": "english",
    "zh": "chinese",
    "yue": "cantonese",
    "ja": "japanese",
    "ko": "korean",
}
UNKNOWN_LANGUAGE = "unknown"  # verbose_json's language when nothing was spoken (auto)
JSON_TYPE = "application/json"
CONTENT_TYPES = {
    "json": JSON_TYPE,
    "verbose_json": JSON_TYPE,
    "text": "text/plain; charset=utf-8",
    "srt": "text/plain; charset=utf-8",  # OpenAI's; there is no registered SubRip type
    "vtt": "text/vtt; charset=utf-8",
    DIARIZED: JSON_TYPE,
}
MIN_CONFIDENCE = 1e-6  # a word's confidence floor before its log (avg_logprob)
_UTTERANCE_NAMESPACE = uuid.UUID("0d7f5c2e-5c1b-4f57-9f39-6a3e3e1f7b20")  # utterance ids


# -- OpenAI: /v1/audio/transcriptions ---------------------------------------------------


def transcription_body(
    finals: Sequence[Final],
    *,
    response_format: str,
    duration_s: float,
    granularities: Sequence[str] = (),
    language: str = "auto",
) -> tuple[bytes, str]:
    """The body and its content type for ``response_format`` (one of
    :data:`RESPONSE_FORMATS`, which the caller has checked). ``granularities`` and the
    request's ``language`` (a model language: ``auto``, ``en``, ...) matter to
    ``verbose_json`` only."""
    finals = inside_audio(finals, duration_s)
    if response_format == "json":
        body: bytes = orjson.dumps(transcription_json(finals, duration_s=duration_s))
    elif response_format == "verbose_json":
        verbose = transcription_verbose_json(
            finals, duration_s=duration_s, granularities=granularities, language=language
        )
        body = orjson.dumps(verbose)
    elif response_format == "text":
        body = (transcription_text(finals) + "\n").encode()
    elif response_format == "srt":
        body = srt_document(finals).encode()
    elif response_format == "vtt":
        body = vtt_document(finals).encode()
    elif response_format == DIARIZED:
        body = orjson.dumps(transcription_diarized_json(finals, duration_s=duration_s))
    else:
        raise ValueError(f"unknown response_format {response_format!r}")
    return body, CONTENT_TYPES[response_format]


def transcription_diarized_json(finals: Sequence[Final], *, duration_s: float) -> dict[str, Any]:
    """OpenAI's ``TranscriptionDiarized``: the text and one segment per speaker's run."""
    segments: list[dict[str, Any]] = []
    for final in finals:
        segments.extend(diarized_segments(final, first_index=len(segments)))
    return {
        "task": "transcribe",
        "duration": round(max(0.0, duration_s), 3),
        "text": transcription_text(finals),
        "segments": segments,
        "usage": _usage(duration_s),
    }


def diarized_segments(final: Final, *, first_index: int) -> list[dict[str, Any]]:
    """A final as ``transcript.text.segment`` objects, cut where its speaker changes
    (numbered from ``first_index``; a final sent without speakers is ``unknown``'s)."""
    return [
        {
            "type": "transcript.text.segment",
            "id": f"seg_{first_index + i}",
            "start": _seconds(part.start_ms),
            "end": _seconds(part.end_ms),
            "text": part.text,
            "speaker": part.speaker or UNKNOWN_SPEAKER,
        }
        for i, part in enumerate(p for p in speaker_parts(final) if p.text.strip())
    ]


def transcription_text(finals: Sequence[Final]) -> str:
    """The whole text: the finals joined as the live protocols join them."""
    return common.join_texts([final.text for final in finals])


def transcription_json(finals: Sequence[Final], *, duration_s: float) -> dict[str, Any]:
    """``response_format=json``: the text, the languages heard (as ``gpt-transcribe``
    names them) and the usage by duration (``whisper-1``'s)."""
    body: dict[str, Any] = {"text": transcription_text(finals)}
    languages = _languages(finals)
    if languages:
        body["languages"] = [{"code": code} for code in languages]
    body["usage"] = _usage(duration_s)
    return body


def transcription_verbose_json(
    finals: Sequence[Final],
    *,
    duration_s: float,
    granularities: Sequence[str] = (),
    language: str = "auto",
) -> dict[str, Any]:
    """``response_format=verbose_json``, as whisper's: ``task``, ``language`` (whisper's
    name of the language spoken most, else of the requested one, else
    :data:`UNKNOWN_LANGUAGE`), ``duration``, ``text``, ``segments`` (unless only words
    are asked for) and ``words`` (with ``word`` in ``granularities``).

    A segment is a final. Whisper's decoding statistics get what SenseVoice has:
    ``avg_logprob`` is the mean log of its words' confidences (CTC posteriors),
    ``compression_ratio`` is whisper's own measure of the text, ``temperature`` 0 (greedy
    CTC decoding), ``no_speech_prob`` 0 (the VAD found speech there), ``seek`` the start
    in 10 ms frames, ``tokens`` empty (no token ids are kept). SenseVoice's own tags are
    the extra fields ``emotion``, ``event`` and ``sensevoice_language``.
    """
    spoken = [final for final in inside_audio(finals, duration_s) if final.text.strip()]
    body: dict[str, Any] = {
        "task": "transcribe",
        "language": whisper_language(spoken, language),
        "duration": round(max(0.0, duration_s), 3),
        "text": transcription_text(spoken),
    }
    if "segment" in granularities or "word" not in granularities:
        body["segments"] = [_segment(i, final) for i, final in enumerate(spoken)]
    if "word" in granularities:
        body["words"] = [
            {
                "word": word.text,
                "start": _seconds(word.start_ms),
                "end": _seconds(word.end_ms),
            }
            for final in spoken
            for word in common.message_words(final)
        ]
    body["usage"] = _usage(duration_s)
    return body


def whisper_language(finals: Sequence[Final], requested: str = "auto") -> str:
    """Whisper's name for the requested language when the request forced one (the model
    decoded in it, whatever its language tag says), else for the language most of the
    text is in (by characters), else :data:`UNKNOWN_LANGUAGE`."""
    for code in (requested, *_languages(finals)):
        if code in WHISPER_LANGUAGE_NAMES:
            return WHISPER_LANGUAGE_NAMES[code]
    return UNKNOWN_LANGUAGE


def _languages(finals: Sequence[Final]) -> list[str]:
    """The model languages heard, most text first."""
    chars: Counter[str] = Counter()
    for final in finals:
        if final.language in WHISPER_LANGUAGE_NAMES and final.text.strip():
            chars[final.language] += len(final.text.strip())
    return [code for code, _ in chars.most_common()]


def _segment(index: int, final: Final) -> dict[str, Any]:
    words = common.message_words(final)
    logs = [math.log(max(MIN_CONFIDENCE, word.confidence)) for word in words]
    text_bytes = final.text.encode()
    return {
        "id": index,
        "seek": int(max(0.0, final.start_ms) // 10),
        "start": _seconds(final.start_ms),
        "end": _seconds(final.end_ms),
        "text": final.text,
        "tokens": [],
        "temperature": 0.0,
        "avg_logprob": round(sum(logs) / len(logs), 6) if logs else 0.0,
        "compression_ratio": round(len(text_bytes) / len(zlib.compress(text_bytes)), 6),
        "no_speech_prob": 0.0,
        "emotion": final.emotion,
        "event": final.event,
        "sensevoice_language": final.language,
    }


def _usage(duration_s: float) -> dict[str, Any]:
    return {"type": "duration", "seconds": round(max(0.0, duration_s), 3)}


def _seconds(ms: float) -> float:
    return round(ms / 1000, 3)


def inside_audio(finals: Sequence[Final], duration_s: float) -> list[Final]:
    """``finals`` with their times (and their words') kept inside ``[0, duration_s]``:
    a segment's end may lie past the decoded audio's (the segmenter's padding)."""
    end_ms = max(0.0, duration_s * 1000)

    def inside(ms: float) -> float:
        return min(max(0.0, ms), end_ms)

    out = []
    for final in finals:
        words = final.words
        if words is not None:
            words = tuple(
                replace(w, start_ms=inside(w.start_ms), end_ms=inside(w.end_ms)) for w in words
            )
        out.append(
            replace(
                final, start_ms=inside(final.start_ms), end_ms=inside(final.end_ms), words=words
            )
        )
    return out


class TranscriptStream:
    """The ``stream=true`` events of one transcription: :meth:`delta` for each final as
    it is decoded (in segment order), then :meth:`done`. The deltas, concatenated, are
    the done event's text (the space between two finals goes in the later delta)."""

    def __init__(self, *, segments: bool = False, diarized: bool = False) -> None:
        self._texts: list[str] = []
        self.text = ""  # what the deltas have said so far
        # include[]=segments (ours): each delta also carries its utterance as
        # verbose_json's segment (times, SenseVoice's tags), for captions as they come
        self._segments = segments
        self.diarized = diarized  # diarized_json: segment events instead of deltas
        self._segment_count = 0  # diarized segments sent

    def events(self, final: Final) -> list[dict[str, Any]]:
        """The events for one final: its delta, or (diarized) its segments, which carry
        the same text cut per speaker."""
        delta = self.delta(final)
        if not self.diarized or delta is None:
            return [delta] if delta is not None else []
        segments = diarized_segments(final, first_index=self._segment_count)
        self._segment_count += len(segments)
        return segments

    def delta(self, final: Final) -> dict[str, Any] | None:
        """A ``transcript.text.delta`` event, or None for a final with no text."""
        if not final.text.strip():
            return None
        self._texts.append(final.text)
        text = common.join_texts(self._texts)
        delta, self.text = text[len(self.text) :], text
        event: dict[str, Any] = {"type": "transcript.text.delta", "delta": delta}
        if self._segments:
            event["segment"] = _segment(len(self._texts) - 1, final)
        return event

    def done(self) -> dict[str, Any]:
        """The closing ``transcript.text.done`` event, with the whole text."""
        return {"type": "transcript.text.done", "text": self.text}


def sse_frame(event: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying ``event`` as JSON (OpenAI sends data lines only; an
    error mid-stream is an event whose data is :func:`openai_error_body`)."""
    return b"data: " + orjson.dumps(event) + b"\n\n"


def openai_error_body(
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    error_type: str = "invalid_request_error",
) -> dict[str, Any]:
    """OpenAI's error shape. ``error_type`` as OpenAI uses it: ``invalid_request_error``
    (400, 401, 404, 413), ``rate_limit_exceeded`` (429), ``server_error`` (5xx). The
    message is cut to :data:`~streamer.core.protocol.MAX_ERROR_MESSAGE_CHARS`: errors
    never echo unbounded input."""
    return {
        "error": {
            "message": _bounded(message),
            "type": error_type,
            "param": param,
            "code": code,
        }
    }


def _bounded(message: str) -> str:
    if len(message) <= MAX_ERROR_MESSAGE_CHARS:
        return message
    return message[: MAX_ERROR_MESSAGE_CHARS - 3] + "..."


# -- Deepgram: prerecorded /v1/listen ---------------------------------------------------


@dataclass(frozen=True)
class ListenFileOptions:
    """A prerecorded request's options, read from its query."""

    listen: ListenOptions  # what the live endpoint reads from the same query
    utterances: bool = False  # results.utterances: one per spoken final
    detect_language: bool = False  # detected_language on the channel


def parse_listen_file_query(
    query: Mapping[str, str],
    defaults: StreamOptions,
    *,
    keywords: Sequence[str] = (),
    keyterms: Sequence[str] = (),
) -> ListenFileOptions:
    """The options of ``POST /v1/listen?...``: the live endpoint's
    (:func:`~streamer.core.compat.deepgram.parse_listen_query`, which raises what it
    raises), plus ``utterances`` and ``detect_language``. ``detect_language=true`` with
    no ``language`` lets the model detect it, as ``language=multi`` does."""
    listen = deepgram.parse_listen_query(query, defaults, keywords=keywords, keyterms=keyterms)
    detect = common.lenient_bool(query.get("detect_language"), False)
    if detect and "language" not in query:
        listen = replace(listen, stream=replace(listen.stream, language="auto"))
    return ListenFileOptions(
        listen=listen,
        utterances=common.lenient_bool(query.get("utterances"), False),
        detect_language=detect,
    )


def listen_response(
    finals: Sequence[Final],
    *,
    duration_s: float,
    options: ListenFileOptions,
    request_id: str,
    created: str,
    sha256: str,
    model: str,
    channels: int = 1,
    notices: Sequence[Notice] = (),
) -> dict[str, Any]:
    """Deepgram's prerecorded response: ``metadata`` (``created`` is ISO 8601 UTC from
    the server's clock, ``sha256`` the upload's, ``channels`` the file's) and
    ``results.channels[0].alternatives[0]`` with the whole transcript and every word;
    ``results.utterances`` (a spoken final each) with ``utterances=true``. With
    ``diarize=true`` the words carry ``speaker`` and ``speaker_confidence``, and a final
    whose speaker changes is as many utterances, one per speaker's run of words, each
    with its ``speaker``, as Deepgram splits them."""
    spoken = [final for final in inside_audio(finals, duration_s) if final.text.strip()]
    punctuated = options.listen.punctuated_words
    multi = options.listen.detect_language  # language=multi: languages on every result
    speakers = deepgram.SpeakerIndex() if options.listen.stream.diarize else None
    all_words: list[dict[str, Any]] = []
    utterances: list[dict[str, Any]] = []
    for final in spoken:
        language = final.language if multi else None
        words = deepgram.result_words(
            final, punctuated=punctuated, language=language, speakers=speakers
        )
        all_words.extend(words)
        for part in _speaker_runs(final, words):
            utterance: dict[str, Any] = {**part, "channel": 0}
            utterance["id"] = str(
                uuid.uuid5(_UTTERANCE_NAMESPACE, f"{request_id}/{len(utterances)}")
            )
            if language:
                utterance["languages"] = [language]
            utterances.append(utterance)
    alternative: dict[str, Any] = {
        "transcript": transcription_text(spoken),
        "confidence": _mean_confidence(all_words),
        "words": all_words,
    }
    languages = _languages(spoken)
    if multi:
        alternative["languages"] = languages
    channel: dict[str, Any] = {"alternatives": [alternative]}
    if options.detect_language and languages:
        channel["detected_language"] = languages[0]
    results: dict[str, Any] = {"channels": [channel]}
    if options.utterances:
        results["utterances"] = utterances
    uuid_ = deepgram.model_uuid(model)
    metadata = {
        "transaction_key": "deprecated",
        "request_id": request_id,
        "sha256": sha256,
        "created": created,
        "duration": round(max(0.0, duration_s), 3),
        "channels": channels,
        "models": [uuid_],
        "model_info": {uuid_: deepgram.model_info(model)},
    }
    if notices:  # keywords the model could not use (the session's notices)
        metadata["warnings"] = deepgram.warnings(notices)
    return {"metadata": metadata, "results": results}


def _speaker_runs(final: Final, words: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A final as utterances: itself, or (diarized) one per run of one speaker's words."""
    if final.turns is None or not words or "speaker" not in words[0]:
        return [
            {
                "start": _seconds(final.start_ms),
                "end": _seconds(final.end_ms),
                "confidence": common.message_confidence(final),
                "transcript": final.text,
                "words": words,
            }
        ]
    runs = speaker_runs([word.get("speaker") for word in words])
    if len(runs) == 1:
        return [
            {**_speaker_runs(replace(final, turns=None), words)[0], "speaker": words[0]["speaker"]}
        ]
    core_words = final.words or ()
    parts = []
    for a, b in runs:
        run = words[a:b]
        text = join_words(core_words[a:b]) if len(core_words) == len(words) else ""
        parts.append(
            {
                "start": run[0]["start"],
                "end": run[-1]["end"],
                "confidence": _mean_confidence(run),
                "transcript": text or " ".join(w["word"] for w in run),
                "words": run,
                "speaker": run[0]["speaker"],
            }
        )
    return parts


def _mean_confidence(words: Sequence[Mapping[str, Any]]) -> float:
    if not words:
        return 0.0
    return round(sum(float(word["confidence"]) for word in words) / len(words), 4)


def listen_error_body(code: str, message: str, request_id: str) -> dict[str, str]:
    """Deepgram's REST error shape (``err_code`` is ``code`` upper-cased, as the live
    endpoint's refusals write it); the message is bounded as OpenAI's is."""
    return deepgram.refusal_body(code, _bounded(message), request_id)
