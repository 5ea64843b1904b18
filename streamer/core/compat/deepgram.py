"""Deepgram's live-streaming protocol, ``GET /v1/listen``, over the core session (I/O-free).

What the clients send (``docs/deepgram.md`` has the details): options as query
parameters, then binary audio, and three text messages, ``KeepAlive``, ``Finalize`` and
``CloseStream``. What they get: ``Results`` (interim and final), ``SpeechStarted``,
``UtteranceEnd``, ``Metadata`` and, for a message we cannot read, ``Error``. The mapping
from the core's messages:

- ``speech_start`` -> ``SpeechStarted`` (only with ``vad_events=true``);
- ``partial`` -> ``Results`` with ``is_final: false`` (only with ``interim_results=true``;
  an interim replaces the previous one, as a partial does);
- ``final`` -> ``Results`` with ``is_final: true``; ``speech_final`` when silence (or the
  end of the stream) ended it, ``from_finalize`` when a ``Finalize`` did; then
  ``UtteranceEnd`` when ``utterance_end_ms`` was given and the utterance had words;
- ``Finalize`` with no open utterance is answered with an empty ``from_finalize`` result,
  in order after the finals still decoding (pipecat waits for one after every Finalize);
- ``CloseStream`` -> every final, then ``Metadata``, then close 1000.

Audio: with no ``encoding`` the container is recognised by its first bytes, as Deepgram
does (WebM, Ogg, FLAC, WAV, MP3: :mod:`streamer.core.containers`), else it is
``linear16``; ``encoding=opus`` and ``ogg-opus`` are Ogg Opus, ``flac`` FLAC. Bytes that
are not what was declared or detected, or a corrupt container, get an ``Error``
(``DATA-0000``, Deepgram's) after the finals of what was decoded, then close 1008.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson

from streamer.core import protocol
from streamer.core.compat import common
from streamer.core.compat.audio import ENCODINGS, AudioDecoder
from streamer.core.containers import AUTO, PCM, AudioInput, DecoderFactory
from streamer.core.hotwords import parse_deepgram
from streamer.core.protocol import (
    DIARIZE_UNAVAILABLE,
    End,
    Error,
    Final,
    Notice,
    Partial,
    ServerMessage,
    SpeechStart,
    StreamOptions,
)
from streamer.core.session import Session, State
from streamer.core.wire import OutFrame, WireAdapter, count_only
from streamer.errors import (
    CLOSE_POLICY_VIOLATION,
    InvalidOption,
    UndecodableAudio,
    UnexpectedMessage,
    UnsupportedSampleRate,
)

PATH = "/v1/listen"
MAX_CHANNELS = 8  # more interleaved channels than this are refused
TELEPHONY_SAMPLE_RATE = 8000  # the default rate of mulaw and alaw
SUBPROTOCOL = "token"  # browsers send ["token", KEY] and need "token" echoed
CONTAINER_ENCODINGS = {"opus": "ogg", "ogg-opus": "ogg", "flac": "flac"}  # Deepgram's names
NOTICE_PCM_ASSUMED = "pcm_assumed"  # no encoding, no container header: read as linear16
_ERROR_VARIANTS = {"undecodable_audio": "DATA-0000"}  # what Deepgram calls the core's codes
_MODEL_NAMESPACE = uuid.UUID("5b0e7f6a-2c51-4e8e-9a43-0a6c1f1c9d11")  # model_uuid from its name


@dataclass(frozen=True)
class ListenOptions:
    """A Deepgram session's options, read from the handshake's query."""

    stream: StreamOptions  # what the core session gets (the rate is the decoded audio's)
    encoding: str = "linear16"  # one of ENCODINGS: the raw audio's, when it is raw
    container: str = PCM  # PCM (raw, as encoding says), AUTO (no encoding given) or one
    channels: int = 1  # interleaved channels, averaged to mono
    vad_events: bool = False  # send SpeechStarted
    utterance_end_ms: int | None = None  # send UtteranceEnd after each spoken utterance
    detect_language: bool = False  # language=multi: report the detected one per result
    punctuated_words: bool = False  # punctuate or smart_format: words get punctuated_word


def parse_listen_query(
    query: Mapping[str, str],
    defaults: StreamOptions,
    *,
    keywords: Sequence[str] = (),
    keyterms: Sequence[str] = (),
) -> ListenOptions:
    """The options of ``GET /v1/listen?...``; raises :class:`InvalidOption` only for
    audio we cannot decode (an unknown encoding, too many channels, a bad sample rate)
    and for ``keywords`` (``phrase:intensifier``) or ``keyterm`` values that are not
    hotwords (:class:`~streamer.errors.InvalidHotwords`). Both are repeatable, so the
    server passes every value of them (``query`` holds one value per name).

    ``diarize=true`` asks for speakers (``words[].speaker``; nothing changes on a server
    without speaker models). Unknown parameters (``model``, ``filler_words``...) are
    ignored; ``endpointing`` is clamped to what the segmenter accepts.
    """
    given = query.get("encoding")
    encoding = "linear16" if given is None else given.strip().lower()
    container = AUTO if given is None else CONTAINER_ENCODINGS.get(encoding, PCM)
    if container == PCM and encoding not in ENCODINGS:
        supported = ", ".join((*ENCODINGS, *CONTAINER_ENCODINGS))
        raise InvalidOption(
            f"encoding {encoding!r} is not supported (supported: {supported}; "
            "omit it for a container such as WebM, Ogg, MP3, FLAC or WAV)"
        )
    if container not in (PCM, AUTO):
        encoding = "linear16"  # what the decoder makes of it
    default_rate = protocol.NATIVE_SAMPLE_RATE if encoding == "linear16" else TELEPHONY_SAMPLE_RATE
    rate = common.lenient_int(query.get("sample_rate", default_rate))
    if container not in (PCM, AUTO):
        rate = protocol.NATIVE_SAMPLE_RATE  # a container says its own; decoded to 16 kHz
    if rate not in protocol.SUPPORTED_SAMPLE_RATES:
        rates = ", ".join(map(str, protocol.SUPPORTED_SAMPLE_RATES))
        raise UnsupportedSampleRate(
            f"sample_rate {query.get('sample_rate')!r} is not supported (supported: {rates})"
        )
    channels = common.lenient_int(query.get("channels", 1))
    if channels is None or not 1 <= channels <= MAX_CHANNELS:
        raise InvalidOption(f"channels must be 1..{MAX_CHANNELS}, got {query.get('channels')!r}")
    if channels > 1 and common.lenient_bool(query.get("multichannel"), False):
        raise InvalidOption(
            "multichannel=true is not supported: each channel would need its own "
            "transcript; omit it to transcribe the channels mixed to one"
        )
    changes: dict[str, Any] = {"sample_rate": rate}
    if keywords or keyterms:
        changes["hotwords"] = parse_deepgram(keywords, keyterms)
    language = query.get("language")
    if language is not None:
        changes["language"] = common.core_language(language)
    formatting = [query[k] for k in ("punctuate", "smart_format") if k in query]
    if formatting:
        changes["itn"] = any(common.lenient_bool(v, False) for v in formatting)
    changes["partials"] = common.lenient_bool(query.get("interim_results"), False)
    changes["words"] = changes["partials"]  # interim results carry words too
    endpointing = common.lenient_int(query.get("endpointing"))
    if endpointing is not None:
        changes["endpoint_ms"] = common.clamp_endpoint_ms(endpointing)
    if common.lenient_bool(query.get("diarize"), False):
        changes["diarize"] = True
    utterance_end_ms = common.lenient_int(query.get("utterance_end_ms"))
    return ListenOptions(
        stream=replace(defaults, **changes),
        encoding=encoding,
        container=container,
        channels=channels,
        vad_events=common.lenient_bool(query.get("vad_events"), False),
        utterance_end_ms=utterance_end_ms if utterance_end_ms and utterance_end_ms > 0 else None,
        detect_language=language is not None and changes["language"] == "auto",
        punctuated_words=any(common.lenient_bool(v, False) for v in formatting),
    )


def presented_key(authorization: str | None, subprotocols: Sequence[str]) -> str | None:
    """The API key a Deepgram client presents: ``Authorization: Token K`` (or
    ``Bearer K``), or a browser's ``Sec-WebSocket-Protocol: token, K``."""
    if authorization:
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() in ("token", "bearer") and key.strip():
            return key.strip()
    if len(subprotocols) >= 2 and subprotocols[0] == SUBPROTOCOL:
        return subprotocols[1]
    return None


def select_subprotocol(offered: Sequence[str]) -> str | None:
    """Echo ``token`` when a browser offers it (its key is the next entry)."""
    return SUBPROTOCOL if SUBPROTOCOL in offered else None


def refusal_body(code: str, message: str, request_id: str) -> dict[str, str]:
    """Deepgram's shape for a refused handshake (also sent in its ``dg-error`` header)."""
    return {"err_code": code.upper(), "err_msg": message, "request_id": request_id}


@dataclass(frozen=True)
class _FinalizeAnswer:
    after_finals: int  # answer once this many finals have been translated


class DeepgramAdapter(WireAdapter):
    """One Deepgram live session. ``request_id`` and ``created`` (ISO 8601, UTC) come
    from the server, which owns the clock and the randomness."""

    name = "deepgram"

    def __init__(
        self,
        session: Session,
        options: ListenOptions,
        *,
        request_id: str,
        created: str,
        open_decoder: DecoderFactory | None = None,
    ) -> None:
        super().__init__(session)
        self.options = options
        self.speakers = SpeakerIndex()  # diarize: labels as Deepgram's speaker numbers
        self.request_id = request_id
        self.created = created
        model = session.options.model_name
        self._model_uuid = model_uuid(model)
        self._metadata = {
            "request_id": request_id,
            "model_info": model_info(model),
            "model_uuid": self._model_uuid,
        }
        self._decoder = AudioDecoder(options.encoding, options.channels)
        self._input = AudioInput(
            options.container,
            session.stream.sample_rate,
            open_decoder,
            pcm_hint="omit encoding (a container is recognised by its first bytes)",
        )
        self._pcm_told = options.container != AUTO  # raw PCM without encoding: a hint
        self._sha256 = hashlib.sha256()
        self._frames: list[OutFrame] = []
        self._finals_seen = 0
        self._finalize_answers: deque[_FinalizeAnswer] = deque()
        self._close_requested = False  # CloseStream received: Metadata goes before the close
        self._fatal: Error | None = None  # sent last, right before the close
        self._notices: list[Notice] = []  # told in Metadata's warnings (Deepgram's place)

    # -- client -> server ------------------------------------------------------

    def receive_bytes(self, data: bytes) -> None:
        if self._close_requested or self.session.state in (State.STOPPING, State.ENDED):
            return  # Deepgram ignores audio after CloseStream
        self._sha256.update(data)
        try:
            self._receive_audio(self._input.push(data))
        except UndecodableAudio as error:
            self._undecodable(error)

    def _receive_audio(self, data: bytes) -> None:
        """Raw audio, or what the container decoded to (mono s16le already)."""
        if not self._pcm_told and self._input.detected == PCM:
            self._pcm_told = True
            notice = Notice(code=NOTICE_PCM_ASSUMED, message=self._pcm_hint())
            self._notices.append(notice)  # told in Metadata's warnings, counted now
            self._frames.append(count_only(notice))
        pcm = data if self._input.container else self._decoder.push(data)
        if pcm:
            self.session.receive_audio(pcm)

    def _undecodable(self, error: UndecodableAudio) -> None:
        self._input.close()
        self.session.expire(error.code, error.message, CLOSE_POLICY_VIOLATION)

    def release(self) -> None:
        self._input.close()

    def receive_text(self, text: str) -> None:
        if self.session.state is State.ENDED:
            return
        try:
            message = orjson.loads(text)
        except orjson.JSONDecodeError:
            message = None
        kind = message.get("type") if isinstance(message, dict) else None
        if not isinstance(kind, str):
            self._send_error(
                "SchemaError", "text messages must be JSON objects with a 'type'", text
            )
            return
        if kind == "Finalize":
            self._finalize()
        elif kind == "CloseStream":
            self._close_stream()
        # KeepAlive resets the server's idle timer, which any message does; unknown types
        # (Configure and those of newer API versions) are ignored like unknown options

    def _finalize(self) -> None:
        before = common.finals_submitted(self.session)
        try:
            self.session.finalize(at_pause=False)
        except UnexpectedMessage:
            pass  # after CloseStream: still answered
        if common.finals_submitted(self.session) == before:
            # nothing was open: an empty from_finalize result answers it, after the
            # finals already decoding so the order holds
            self._finalize_answers.append(_FinalizeAnswer(after_finals=before))

    def _close_stream(self) -> None:
        if self._close_requested:
            return
        self._close_requested = True
        if self.session.state in (State.CONFIGURING, State.STREAMING):
            try:  # the decoder's tail goes before the end
                self._receive_audio(self._input.flush())
            except UndecodableAudio as error:
                self._undecodable(error)
                return
        try:
            self.session.stop()
        except UnexpectedMessage:
            pass  # the server already stopped the session (shutdown, limit)

    # -- server -> client ------------------------------------------------------

    def drain(self) -> list[OutFrame]:
        for message in self.session.messages_to_send():
            self._translate(message)
        self._answer_finalizes()
        frames, self._frames = self._frames, []
        return frames

    def _translate(self, message: ServerMessage) -> None:
        if isinstance(message, SpeechStart):
            if self.options.vad_events:
                self._send(
                    {
                        "type": "SpeechStarted",
                        "channel": [0, 1],
                        "timestamp": _seconds(message.start_ms),
                    },
                    message,
                )
            else:
                self._frames.append(count_only(message))  # no event for it, still counted
        elif isinstance(message, Partial):
            self._send(self._results(message, is_final=False), message)
        elif isinstance(message, Final):
            self._finals_seen += 1
            self._send(self._results(message, is_final=True), message)
            if (
                self.options.utterance_end_ms is not None
                and message.reason in ("silence", "stop")
                and message.text
            ):
                self._send(
                    {
                        "type": "UtteranceEnd",
                        "channel": [0, 1],
                        "last_word_end": _seconds(message.end_ms),
                    }
                )
        elif isinstance(message, Error):
            if message.fatal:
                self._fatal = message
            elif message.code == DIARIZE_UNAVAILABLE:
                # Deepgram clients send diarize=true by habit: without speaker models the
                # words simply carry no speaker, as they did before
                self._frames.append(count_only(message))
            else:
                self._send_error(message.code, message.message, message=message)
        elif isinstance(message, Notice):
            self._notices.append(message)
            self._frames.append(count_only(message))  # told in Metadata, counted now
        elif isinstance(message, End):
            self._answer_finalizes()
            if self._close_requested:
                self._send(self._metadata_message(message))
            if self._fatal is not None:
                self._send_error(self._fatal.code, self._fatal.message, message=self._fatal)

    def _answer_finalizes(self) -> None:
        ended = self.session.state is State.ENDED
        while self._finalize_answers and (
            ended or self._finalize_answers[0].after_finals <= self._finals_seen
        ):
            self._finalize_answers.popleft()
            self._send(self._empty_finalize_result())

    def _results(self, message: Partial | Final, *, is_final: bool) -> dict[str, Any]:
        start_s = _seconds(message.start_ms)
        language = message.language if self.options.detect_language else None
        words = result_words(
            message,
            punctuated=self.options.punctuated_words,
            language=language,
            speakers=self.speakers,
        )
        alternative: dict[str, Any] = {
            "transcript": message.text,
            "confidence": common.message_confidence(message),
            "words": words,
        }
        if language:
            alternative["languages"] = [language]
        reason = message.reason if isinstance(message, Final) else None
        return {
            "type": "Results",
            "channel_index": [0, 1],
            "duration": round(_seconds(message.end_ms) - start_s, 3),
            "start": start_s,
            "is_final": is_final,
            "speech_final": reason in ("silence", "stop"),
            "from_finalize": reason == "finalize",
            "channel": {"alternatives": [alternative]},
            "metadata": self._metadata,
        }

    def _empty_finalize_result(self) -> dict[str, Any]:
        at_s = round(self.session.audio_ms / 1000, 3)
        return {
            "type": "Results",
            "channel_index": [0, 1],
            "duration": 0.0,
            "start": at_s,
            "is_final": True,
            "speech_final": False,
            "from_finalize": True,
            "channel": {"alternatives": [{"transcript": "", "confidence": 0.0, "words": []}]},
            "metadata": self._metadata,
        }

    def _pcm_hint(self) -> str:
        return (
            "no encoding was given and the audio has no container header: it is read as "
            f"raw linear16 at {self.session.stream.sample_rate} Hz, {self.options.channels} "
            "channel(s); send encoding=linear16&sample_rate=N to say what it is"
        )

    def _metadata_message(self, end: End) -> dict[str, Any]:
        model = self.session.options.model_name
        metadata: dict[str, Any] = {
            "type": "Metadata",
            "transaction_key": "deprecated",
            "request_id": self.request_id,
            "sha256": self._sha256.hexdigest(),
            "created": self.created,
            "duration": round(end.audio_ms / 1000, 3),
            "channels": self.options.channels,
            "models": [self._model_uuid],
            "model_info": {self._model_uuid: model_info(model)},
        }
        if self._notices:
            metadata["warnings"] = warnings(self._notices)
        return metadata

    def _send_error(
        self,
        variant: str,
        description: str,
        original: str | None = None,
        message: ServerMessage | None = None,
    ) -> None:
        variant = _ERROR_VARIANTS.get(variant, variant)
        error: dict[str, Any] = {"type": "Error", "variant": variant, "description": description}
        if original is not None:
            error["message"] = original[:1000]
        self._send(error, message)

    def _send(self, obj: dict[str, Any], message: ServerMessage | None = None) -> None:
        self._frames.append(OutFrame(orjson.dumps(obj), message=message))


def warnings(notices: Sequence[Notice]) -> list[dict[str, str]]:
    """Deepgram's ``metadata.warnings`` for the session's notices (its place for a
    parameter that was not fully applied: ``{"parameter", "type", "message"}``)."""
    return [
        {
            "parameter": "encoding" if notice.code == NOTICE_PCM_ASSUMED else "keywords",
            "type": notice.code,
            "message": notice.message,
        }
        for notice in notices
    ]


def model_uuid(model: str) -> str:
    """The ``model_uuid`` Deepgram clients see for ``model`` (the same on every run)."""
    return str(uuid.uuid5(_MODEL_NAMESPACE, model))


def model_info(model: str) -> dict[str, str]:
    """``model_info``'s entry for ``model``."""
    return {"name": model, "version": "1", "arch": "sensevoice"}


def result_words(
    message: Partial | Final,
    *,
    punctuated: bool,
    language: str | None = None,
    speakers: SpeakerIndex | None = None,
) -> list[dict[str, Any]]:
    """A result's ``words``: bare and lower-case as Deepgram writes them, with
    ``punctuated_word`` when ``punctuated`` (punctuate or smart_format), the detected
    ``language`` on each when given (language=multi), and with ``speakers`` a diarized
    final's ``speaker`` (Deepgram's number) and ``speaker_confidence`` (the share of the
    word's time its speaker's turn covers)."""
    labelled = speakers is not None and isinstance(message, Final) and message.turns is not None
    words = []
    for i, w in enumerate(common.message_words(message)):
        word: dict[str, Any] = {
            "word": w.bare,
            "start": _seconds(w.start_ms),
            "end": _seconds(w.end_ms),
            "confidence": w.confidence,
        }
        if punctuated:
            word["punctuated_word"] = w.text
        if language:
            word["language"] = language
        if labelled and speakers is not None and isinstance(message, Final):
            label = message.word_speaker(i)  # common's words are copies without it
            if label is not None:
                word["speaker"] = speakers.index(label)
                word["speaker_confidence"] = turn_share(message, w.start_ms, w.end_ms, label)
        words.append(word)
    return words


class SpeakerIndex:
    """Speaker labels ("A", "B", a known name) as Deepgram's numbers, 0 first, in the
    order they are first heard (one per live session or upload)."""

    def __init__(self) -> None:
        self._numbers: dict[str, int] = {}

    def index(self, label: str) -> int:
        return self._numbers.setdefault(label, len(self._numbers))


def turn_share(final: Final, start_ms: float, end_ms: float, label: str) -> float:
    """The share of [start_ms, end_ms) that ``label``'s turns of ``final`` cover."""
    span = end_ms - start_ms
    if span <= 0:
        return 1.0
    covered = sum(
        max(0.0, min(end_ms, t.end_ms) - max(start_ms, t.start_ms))
        for t in final.turns or ()
        if t.speaker == label
    )
    return round(min(1.0, covered / span), 3)


def _seconds(ms: float) -> float:
    return round(ms / 1000, 3)
