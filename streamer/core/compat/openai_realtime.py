"""OpenAI's Realtime transcription protocol over the core session (I/O-free).

``GET /v1/realtime?intent=transcription``; everything is a JSON text frame. The GA shape
is the default; ``OpenAI-Beta: realtime=v1`` (or the browser subprotocol
``openai-beta.realtime-v1``) selects the beta shape, whose session events are called
``transcription_session.*`` and whose session object is flat. ``docs/openai-realtime.md``
has the client side. The mapping:

- on open, ``session.created``; every ``session.update`` is answered with
  ``session.updated`` carrying the effective configuration;
- ``input_audio_buffer.append`` (base64 PCM16 at 24 kHz, or G.711 at 8 kHz) feeds the
  session. Audio appended before the first update is held (up to
  :data:`HOLD_BEFORE_UPDATE_MS`) so that the update still sets the format and language,
  which the core fixes at the first audio;
- server VAD (the default): ``speech_start`` -> ``input_audio_buffer.speech_started``;
  partials -> ``...transcription.delta`` with only the growth of the stable prefix
  (clients append deltas); ``final`` -> ``speech_stopped``, ``committed``, the rest of
  the text as a last delta, ``...transcription.completed`` (or ``.failed``);
- ``turn_detection: null`` (manual): no VAD events; finals collect until
  ``input_audio_buffer.commit``, answered with ``committed`` and, once every segment
  before the commit is decoded, one ``completed`` for the whole buffer;
  ``input_audio_buffer.clear`` drops the uncommitted audio's text (``cleared``).

``error`` events only for what the client must fix (unreadable JSON, an unknown event,
bad base64, an unsupported format): LiveKit treats any ``error`` as fatal and pipecat
reconnects on each, so nothing benign (an empty commit, a language change mid-stream,
a prompt term the model cannot spell) ever produces one. The prompt is free text: its
terms and ``keywords`` become hotwords (:func:`streamer.core.hotwords.parse_prompt`),
and what the model could not use is told in a ``session.updated`` with ``warnings``.
``languages`` (newer clients send it instead of ``language``) forces its first entry.

The handshake and ``session.update`` parsing are in
:mod:`streamer.core.compat.openai_negotiation` (re-exported here).
"""

from __future__ import annotations

import base64
import binascii
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import orjson

from streamer.core import hotwords
from streamer.core.compat import common
from streamer.core.compat.audio import AudioDecoder
from streamer.core.compat.openai_negotiation import (
    BETA_HEADER_VALUE,
    BETA_SUBPROTOCOL,
    DEFAULT_TURN_DETECTION,
    ENCODINGS,
    G711_SAMPLE_RATE,
    HOLD_BEFORE_UPDATE_MS,
    INTENT,
    KEY_SUBPROTOCOL_PREFIX,
    PATH,
    PCM_SAMPLE_RATE,
    SUBPROTOCOL,
    RealtimeOptions,
    TranscriptionConfig,
    UpdateRejected,
    parse_realtime_handshake,
    parse_update,
    presented_key,
    refusal_body,
    select_subprotocol,
    session_object,
)
from streamer.core.protocol import End, Error, Final, Notice, Partial, ServerMessage, SpeechStart
from streamer.core.session import Session, State
from streamer.core.wire import OutFrame, WireAdapter, count_only
from streamer.errors import InvalidHotwords, ProtocolError, UnexpectedMessage

_PROMPT_PARAM = "session.audio.input.transcription.prompt"  # its terms are the hotwords


@dataclass
class _Commit:
    """A manual commit whose item is complete once ``after_finals`` finals are in."""

    item_id: str
    after_finals: int
    texts: list[str]
    audio_ms: float  # the buffer's length, for usage


__all__ = [
    "BETA_HEADER_VALUE",
    "BETA_SUBPROTOCOL",
    "G711_SAMPLE_RATE",
    "INTENT",
    "KEY_SUBPROTOCOL_PREFIX",
    "PATH",
    "PCM_SAMPLE_RATE",
    "SUBPROTOCOL",
    "RealtimeAdapter",
    "RealtimeOptions",
    "TranscriptionConfig",
    "UpdateRejected",
    "parse_realtime_handshake",
    "parse_update",
    "presented_key",
    "refusal_body",
    "select_subprotocol",
]


class RealtimeAdapter(WireAdapter):
    """One OpenAI Realtime transcription session."""

    name = "openai"

    def __init__(self, session: Session, options: RealtimeOptions) -> None:
        super().__init__(session)
        self.options = options
        self.config = TranscriptionConfig(
            model=options.model or session.options.model_name,
            turn_detection={
                **DEFAULT_TURN_DETECTION,
                "silence_duration_ms": session.stream.endpoint_ms,
            },
        )
        self._session_id = f"sess_{session.session_id}"
        self._events = 0
        self._items = 0
        self._frames: list[OutFrame] = []
        self._decoder = AudioDecoder()
        self._holding = True  # no session.update yet: hold the audio
        self._held: list[bytes] = []  # as the client sent it: the update may change the format
        self._held_bytes = 0
        self._binary_refused = False
        self._previous_item: str | None = None
        self._item_of_segment: dict[int, str] = {}
        self._sent_text: dict[int, str] = {}  # per segment: the text its deltas added up to
        self._finals_seen = 0
        self._discard_before = 0  # finals before this index belong to cleared audio
        self._uncommitted: list[str] = []  # manual mode: finals since the last commit
        self._commits: deque[_Commit] = deque()
        self._committed_audio_ms = 0.0
        self._fatal: Error | None = None
        # what a session.updated is called here (the beta's, or the name the client's
        # update used): a warning goes out as one more of them
        self._updated_kind = "transcription_session.updated" if options.beta else "session.updated"

    # -- client -> server ------------------------------------------------------

    def start(self) -> None:
        self.session.start()
        kind = "transcription_session.created" if self.options.beta else "session.created"
        self._send(
            {
                "type": kind,
                "session": session_object(self.config, self._session_id, self.options.beta),
            }
        )

    def receive_bytes(self, data: bytes) -> None:
        if self._binary_refused:
            return  # said once
        self._binary_refused = True
        self._error(
            "binary frames are not part of this protocol: send input_audio_buffer.append",
            "unsupported_frame",
        )

    def receive_text(self, text: str) -> None:
        if self.session.state is State.ENDED:
            return
        try:
            event = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            self._error(f"the event is not valid JSON: {exc}", "invalid_json")
            return
        kind = event.get("type") if isinstance(event, dict) else None
        if not isinstance(kind, str):
            self._error(
                "events must be JSON objects with a 'type'",
                "invalid_event",
            )
            return
        event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
        if kind in ("session.update", "transcription_session.update"):
            self._update(kind, event.get("session"), event_id)
        elif kind == "input_audio_buffer.append":
            self._append(event.get("audio"), event_id)
        elif kind == "input_audio_buffer.commit":
            self._commit()
        elif kind == "input_audio_buffer.clear":
            self._clear(event_id)
        else:
            self._error(
                f"event type {kind!r} is not served here (transcription sessions take "
                "session.update, input_audio_buffer.append, .commit and .clear)",
                "unknown_event",
                event_id=event_id,
            )

    def _update(self, kind: str, session: object, event_id: str | None) -> None:
        try:
            config = parse_update(session, self.config)
        except UpdateRejected as error:
            self._error(error.message, "invalid_value", error.param, event_id)
            return
        if self.session.state is State.CONFIGURING:
            try:
                self.session.configure(self._stream_params(config))
            except ProtocolError as error:
                param = _PROMPT_PARAM if isinstance(error, InvalidHotwords) else None
                self._error(error.message, "invalid_value", param, event_id)
                return
            self.config = replace(
                config, turn_detection=self._effective_turn_detection(config.turn_detection)
            )
            self._decoder = AudioDecoder(ENCODINGS[config.format_type])
        else:
            if (config.format_type, config.sample_rate) != (
                self.config.format_type,
                self.config.sample_rate,
            ):
                self._error(
                    "the audio format cannot change once audio has been appended",
                    "invalid_value",
                    "session.audio.input.format",
                    event_id,
                )
                return
            # The core fixes language and silence duration at the first audio: keep them
            # (the answer says so) and take what is the adapter's own, the turn mode.
            config = replace(
                config,
                language=self.config.language,
                turn_detection=self._effective_turn_detection(config.turn_detection),
            )
            self.config = config
        self._updated_kind = kind.replace(".update", ".updated")
        self._send(
            {
                "type": self._updated_kind,
                "session": session_object(self.config, self._session_id, self.options.beta),
            }
        )
        self._release_hold()

    def _stream_params(self, config: TranscriptionConfig) -> dict[str, Any]:
        params: dict[str, Any] = {
            "sample_rate": config.sample_rate,
            "language": common.core_language(config.forced_language),
            "partials": config.server_vad,  # deltas only in server VAD mode
        }
        # the prompt's terms and the keywords to favour (docs/openai-realtime.md); what
        # the model cannot spell is skipped and told in a session.updated's warnings
        terms = hotwords.merge(
            hotwords.parse_prompt(config.prompt), hotwords.parse_terms(config.keywords or ())
        )
        if terms:
            params["hotwords"] = hotwords.as_v1(terms)
        td = config.turn_detection
        silence_ms = common.lenient_int(td.get("silence_duration_ms")) if td else None
        if silence_ms is not None:
            params["endpoint_ms"] = common.clamp_endpoint_ms(silence_ms)
        return params

    def _effective_turn_detection(self, td: dict[str, Any] | None) -> dict[str, Any] | None:
        if td is not None and td.get("type") == "server_vad":
            return {**td, "silence_duration_ms": self.session.stream.endpoint_ms}
        return td

    def _append(self, audio: object, event_id: str | None) -> None:
        if not isinstance(audio, str):
            self._error(
                "'audio' must be a base64 string",
                "invalid_value",
                "audio",
                event_id,
            )
            return
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            self._error(
                "'audio' is not valid base64",
                "invalid_value",
                "audio",
                event_id,
            )
            return
        if self.session.state in (State.STOPPING, State.ENDED):
            return
        if self._holding:
            self._held.append(data)
            self._held_bytes += len(data)
            bytes_per_ms = self.config.sample_rate * self._decoder.bytes_per_sample / 1000
            if self._held_bytes >= HOLD_BEFORE_UPDATE_MS * bytes_per_ms:
                self._release_hold()  # no update is coming: go on with the defaults
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        pcm = self._decoder.push(data)
        if pcm:
            self.session.receive_audio(pcm)

    def _release_hold(self) -> None:
        self._holding = False
        held, self._held, self._held_bytes = self._held, [], 0
        for data in held:
            self._feed(data)

    def _commit(self) -> None:
        self._release_hold()
        if self.session.state in (State.STOPPING, State.ENDED):
            return
        try:
            self.session.finalize(at_pause=False)
        except UnexpectedMessage:
            return
        if self.config.server_vad:
            return  # the open segment's final commits its own item, as VAD would
        item_id = self._new_item()
        audio_ms = self.session.audio_ms
        self._commits.append(
            _Commit(
                item_id=item_id,
                after_finals=common.finals_submitted(self.session),
                texts=self._uncommitted,
                audio_ms=audio_ms - self._committed_audio_ms,
            )
        )
        self._uncommitted = []
        self._committed_audio_ms = audio_ms
        self._committed(item_id)

    def _clear(self, event_id: str | None) -> None:
        self._release_hold()
        if self.session.state not in (State.STOPPING, State.ENDED):
            try:
                self.session.finalize(at_pause=False)
            except UnexpectedMessage:
                pass
        self._discard_before = common.finals_submitted(self.session)
        self._uncommitted = []
        self._committed_audio_ms = self.session.audio_ms
        self._send({"type": "input_audio_buffer.cleared"})

    # -- server -> client ------------------------------------------------------

    def drain(self) -> list[OutFrame]:
        for message in self.session.messages_to_send():
            self._translate(message)
        self._complete_commits()
        frames, self._frames = self._frames, []
        return frames

    def _translate(self, message: ServerMessage) -> None:
        if isinstance(message, SpeechStart):
            if self.config.server_vad:
                item_id = self._new_item()
                self._item_of_segment[message.segment_id] = item_id
                self._send(
                    {
                        "type": "input_audio_buffer.speech_started",
                        "audio_start_ms": int(message.start_ms),
                        "item_id": item_id,
                    },
                    message,
                )
            else:
                self._frames.append(count_only(message))  # no event for it, still counted
        elif isinstance(message, Partial):
            open_item = self._item_of_segment.get(message.segment_id)
            if open_item is not None and self.config.server_vad:
                self._delta(open_item, message.segment_id, message.stable_text, message)
        elif isinstance(message, Final):
            self._final(message)
        elif isinstance(message, Error):
            # non-fatal ones are benign here (a failed decode has its own .failed event)
            if message.fatal:
                self._fatal = message
        elif isinstance(message, Notice):
            # never an error event: pipecat reconnects on every one, LiveKit gives up
            self._send(
                {
                    "type": self._updated_kind,
                    "session": session_object(self.config, self._session_id, self.options.beta),
                    "warnings": [
                        {"code": message.code, "message": message.message, "param": _PROMPT_PARAM}
                    ],
                },
                message,
            )
        elif isinstance(message, End):
            self._complete_commits(everything=True)
            if self._fatal is not None:
                # a server limit (idle timeout, maximum duration) ended the session; sent
                # after every transcript so a client that stops at an error loses none
                code = self._fatal.code
                self._error(
                    self._fatal.message,
                    "session_expired" if code == "max_session_duration" else code,
                    core=self._fatal,
                )

    def _delta(self, item_id: str, segment_id: int, stable: str, partial: Partial) -> None:
        """Only growth of the stable prefix: clients append deltas and cannot take back."""
        sent = self._sent_text.get(segment_id, "")
        if len(stable) > len(sent) and stable.startswith(sent):
            self._sent_text[segment_id] = stable
            self._send_delta(item_id, stable[len(sent) :], partial)

    def _send_delta(self, item_id: str, delta: str, partial: Partial | None = None) -> None:
        self._send(
            {
                "type": "conversation.item.input_audio_transcription.delta",
                "item_id": item_id,
                "content_index": 0,
                "delta": delta,
            },
            partial,
        )

    def _final(self, final: Final) -> None:
        index = self._finals_seen
        self._finals_seen += 1
        item_id = self._item_of_segment.pop(final.segment_id, None)
        sent = self._sent_text.pop(final.segment_id, "")
        commit = next((c for c in self._commits if index < c.after_finals), None)
        if commit is not None:
            commit.texts.append(final.text)
            self._complete_commits()
            return
        if index < self._discard_before:
            return  # its audio was cleared
        if not self.config.server_vad:
            self._uncommitted.append(final.text)
            return
        if item_id is None:
            item_id = self._new_item()  # the segment began in manual mode
        self._send(
            {
                "type": "input_audio_buffer.speech_stopped",
                "audio_end_ms": int(final.end_ms),
                "item_id": item_id,
            }
        )
        self._committed(item_id)
        if final.error is not None:
            self._send(
                {
                    "type": "conversation.item.input_audio_transcription.failed",
                    "item_id": item_id,
                    "content_index": 0,
                    "error": {
                        "type": "transcription_error",
                        "code": final.error.get("code"),
                        "message": final.error.get("message"),
                        "param": None,
                    },
                },
                final,
            )
            return
        if len(final.text) > len(sent) and final.text.startswith(sent):
            # the text the deltas have not said yet, when the final still extends them
            self._send_delta(item_id, final.text[len(sent) :])
        self._completed(
            item_id, final.text, (final.end_ms - final.start_ms) / 1000, final.language, final
        )

    def _complete_commits(self, everything: bool = False) -> None:
        while self._commits and (everything or self._commits[0].after_finals <= self._finals_seen):
            commit = self._commits.popleft()
            self._completed(commit.item_id, common.join_texts(commit.texts), commit.audio_ms / 1000)

    def _completed(
        self,
        item_id: str,
        transcript: str,
        seconds: float,
        language: str | None = None,
        message: ServerMessage | None = None,
    ) -> None:
        event: dict[str, Any] = {
            "type": "conversation.item.input_audio_transcription.completed",
            "item_id": item_id,
            "content_index": 0,
            "transcript": transcript,
            "usage": {"type": "duration", "seconds": round(max(0.0, seconds), 3)},
        }
        if language:
            event["languages"] = [{"code": language}]
        self._send(event, message)

    def _new_item(self) -> str:
        self._items += 1
        return f"item_{self.session.session_id}_{self._items:04d}"

    def _error(
        self,
        description: str,
        code: str,
        param: str | None = None,
        event_id: str | None = None,
        *,
        error_type: str = "invalid_request_error",
        core: ServerMessage | None = None,
    ) -> None:
        """An ``error`` event: only for what the client must fix, or the session's end."""
        error = {
            "type": error_type,
            "code": code,
            "message": description,
            "param": param,
            "event_id": event_id,
        }
        self._send({"type": "error", "error": error}, core)

    def _committed(self, item_id: str) -> None:
        """The buffer committed as ``item_id``, chained after the item committed before."""
        self._send(
            {
                "type": "input_audio_buffer.committed",
                "previous_item_id": self._previous_item,
                "item_id": item_id,
            }
        )
        self._previous_item = item_id

    def _send(self, event: dict[str, Any], message: ServerMessage | None = None) -> None:
        self._events += 1
        event = {"type": event.pop("type"), "event_id": f"event_{self._events:06d}", **event}
        self._frames.append(OutFrame(orjson.dumps(event), message=message))
