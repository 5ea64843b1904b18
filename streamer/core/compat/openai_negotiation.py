"""OpenAI Realtime's handshake and session configuration (I/O-free).

What the upgrade request decides (GA or beta shape, the model name, the key), how a
``session.update`` (GA) or ``transcription_session.update`` (beta) changes the
transcription configuration, and the session object that answers it.
:mod:`streamer.core.compat.openai_realtime` translates the events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from streamer.core import protocol
from streamer.core.compat import common
from streamer.errors import InvalidOption, ProtocolError

PATH = "/v1/realtime"
INTENT = "transcription"
PCM_SAMPLE_RATE = 24000  # audio/pcm (beta: pcm16) is 24 kHz mono
G711_SAMPLE_RATE = 8000
HOLD_BEFORE_UPDATE_MS = 1000  # audio held while waiting for the first session.update
BETA_HEADER_VALUE = "realtime=v1"
SUBPROTOCOL = "realtime"  # the browser SDK offers it with the key and beta flag
KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"

# GA format type <-> beta input_audio_format
FORMATS = {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}
BETAFORMATS = {beta: ga for ga, beta in FORMATS.items()}
ENCODINGS = {"audio/pcm": "linear16", "audio/pcmu": "mulaw", "audio/pcma": "alaw"}
_VAD_TYPES = ("server_vad", "semantic_vad")
DEFAULT_TURN_DETECTION = {
    "type": "server_vad",
    "threshold": 0.5,
    "prefix_padding_ms": 300,
    "silence_duration_ms": 500,
}


@dataclass(frozen=True)
class RealtimeOptions:
    """What the handshake decides."""

    beta: bool = False  # the beta event and session shapes
    model: str | None = None  # ?model= of the URL, echoed in the session object


def parse_realtime_handshake(
    query: Mapping[str, str], beta_header: str | None, subprotocols: Sequence[str]
) -> RealtimeOptions:
    """Raises :class:`InvalidOption` unless ``intent=transcription``: conversation
    sessions (speech in, model responses out) are not served."""
    intent = query.get("intent")
    if intent != INTENT:
        raise InvalidOption(
            f"only transcription sessions are served: connect to {PATH}?intent={INTENT} "
            f"(got intent={intent!r})"
        )
    beta = BETA_HEADER_VALUE in (beta_header or "") or BETA_SUBPROTOCOL in subprotocols
    return RealtimeOptions(beta=beta, model=query.get("model") or None)


def presented_key(authorization: str | None, subprotocols: Sequence[str]) -> str | None:
    """``Authorization: Bearer K``, or a browser's ``openai-insecure-api-key.K`` subprotocol."""
    if authorization:
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and key.strip():
            return key.strip()
    for offered in subprotocols:
        if offered.startswith(KEY_SUBPROTOCOL_PREFIX):
            return offered[len(KEY_SUBPROTOCOL_PREFIX) :]
    return None


def select_subprotocol(offered: Sequence[str]) -> str | None:
    return SUBPROTOCOL if SUBPROTOCOL in offered else None


def refusal_body(code: str, message: str) -> dict[str, Any]:
    """OpenAI's error shape for a refused handshake."""
    return {
        "error": {"message": message, "type": "invalid_request_error", "code": code, "param": None}
    }


@dataclass(frozen=True)
class TranscriptionConfig:
    """The transcription session's configuration as the client sees it."""

    format_type: str = "audio/pcm"  # GA format type, a key of FORMATS
    rate: int = PCM_SAMPLE_RATE  # audio/pcm only; G.711 is always 8 kHz
    model: str | None = None
    language: str | None = None
    prompt: str = ""
    languages: list[str] | None = None  # the audio's possible languages; [0] is forced
    keywords: list[str] | None = None  # phrases to favour (hotwords), as the prompt's terms
    turn_detection: dict[str, Any] | None = field(
        default_factory=lambda: dict(DEFAULT_TURN_DETECTION)
    )  # None: manual commits
    noise_reduction: Any = None
    include: list[Any] = field(default_factory=list)

    @property
    def server_vad(self) -> bool:
        td = self.turn_detection
        return isinstance(td, dict) and td.get("type") in _VAD_TYPES

    @property
    def forced_language(self) -> str | None:
        """The language asked for: ``language``, else the first of ``languages``."""
        if self.language:
            return self.language
        return self.languages[0] if self.languages else None

    @property
    def sample_rate(self) -> int:
        return self.rate if self.format_type == "audio/pcm" else G711_SAMPLE_RATE


class UpdateRejected(ProtocolError):
    """A session.update that cannot be applied (the error event names ``param``)."""

    code = "invalid_value"
    fatal = False

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


_JSON_TYPES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    float: "a number",
    bool: "true or false",
}


def _typed(value: object, kind: type, param: str, example: str = "") -> Any:
    """``value`` when it is JSON null or of ``kind`` (a float is any number); else the
    update is refused (a list where a string belongs must not reach a dict lookup)."""
    if value is None:
        return None
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        hint = f" such as {example}" if example else ""
        raise UpdateRejected(
            f"{param} must be {_JSON_TYPES[kind]}{hint}, got {value!r}"[:200], param
        )
    return value


def parse_update(session: object, base: TranscriptionConfig) -> TranscriptionConfig:
    """``session`` of a GA ``session.update`` or a beta ``transcription_session.update``
    over ``base``; unknown fields are ignored, a known one of the wrong JSON type is
    refused. Raises :class:`UpdateRejected`."""
    if not isinstance(session, dict):
        raise UpdateRejected("'session' must be an object", "session")
    kind = _typed(session.get("type"), str, "session.type")
    if kind not in (None, "transcription"):
        raise UpdateRejected(
            f"only transcription sessions are served (session.type {kind!r})", "session.type"
        )
    changes: dict[str, Any] = {}
    audio = _typed(session.get("audio"), dict, "session.audio", '{"input": {...}}')
    audio_in = None if audio is None else _typed(audio.get("input"), dict, "session.audio.input")
    if audio_in is not None:  # GA
        fmt = _typed(
            audio_in.get("format"),
            dict,
            "session.audio.input.format",
            '{"type": "audio/pcm", "rate": 24000}',
        )
        transcription = audio_in.get("transcription")
        if fmt is not None:
            changes.update(_ga_format(fmt))
        if "turn_detection" in audio_in:
            changes["turn_detection"] = _turn_detection(audio_in["turn_detection"])
        if "noise_reduction" in audio_in:
            changes["noise_reduction"] = _typed(
                audio_in["noise_reduction"], dict, "session.audio.input.noise_reduction"
            )
    else:  # beta
        transcription = session.get("input_audio_transcription")
        if "input_audio_format" in session:
            beta_format = _typed(session["input_audio_format"], str, "session.input_audio_format")
            if beta_format not in BETAFORMATS:
                raise UpdateRejected(
                    f"input_audio_format {beta_format!r} is not supported "
                    f"(supported: {', '.join(BETAFORMATS)})",
                    "session.input_audio_format",
                )
            changes["format_type"] = BETAFORMATS[beta_format]
            changes["rate"] = PCM_SAMPLE_RATE
        if "turn_detection" in session:
            changes["turn_detection"] = _turn_detection(session["turn_detection"])
        if "input_audio_noise_reduction" in session:
            changes["noise_reduction"] = _typed(
                session["input_audio_noise_reduction"], dict, "session.input_audio_noise_reduction"
            )
    transcription = _typed(transcription, dict, "transcription", '{"language": "en"}')
    if transcription is not None:
        for name in ("model", "language", "prompt"):
            if name in transcription:
                value = _typed(transcription[name], str, f"transcription.{name}")
                changes[name] = "" if name == "prompt" and value is None else value
        for name in ("languages", "keywords"):
            if name in transcription:
                items = _typed(transcription[name], list, f"transcription.{name}")
                changes[name] = [v for v in items if isinstance(v, str)] if items else None
    if "include" in session:
        changes["include"] = _typed(session["include"], list, "session.include") or []
    return replace(base, **changes)


def _ga_format(fmt: dict[str, Any]) -> dict[str, Any]:
    param = "session.audio.input.format.type"
    kind = _typed(fmt.get("type", "audio/pcm"), str, param) or "audio/pcm"
    if kind not in FORMATS:
        raise UpdateRejected(
            f"audio format {kind!r} is not supported (supported: {', '.join(FORMATS)})", param
        )
    if kind != "audio/pcm":
        return {"format_type": kind, "rate": G711_SAMPLE_RATE}
    rate = common.lenient_int(fmt.get("rate", PCM_SAMPLE_RATE))
    if rate not in protocol.SUPPORTED_SAMPLE_RATES:
        raise UpdateRejected(
            f"audio/pcm rate {fmt.get('rate')!r} is not supported (use {PCM_SAMPLE_RATE})"[:200],
            "session.audio.input.format.rate",
        )
    return {"format_type": kind, "rate": rate}


def _turn_detection(value: object) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise UpdateRejected("turn_detection must be an object or null", "turn_detection")
    kind = _typed(value.get("type"), str, "turn_detection.type") or "server_vad"  # the default
    if kind not in _VAD_TYPES:  # a typo must not turn the session into manual commits
        raise UpdateRejected(
            f"turn_detection.type {kind!r} is not supported (supported: "
            f"{', '.join(_VAD_TYPES)}; null for manual commits)",
            "turn_detection.type",
        )
    silence_ms = value.get("silence_duration_ms")
    if silence_ms is not None and common.lenient_int(silence_ms) is None:
        raise UpdateRejected(
            f"turn_detection.silence_duration_ms must be a number of ms, got {silence_ms!r}"[:200],
            "turn_detection.silence_duration_ms",
        )
    for name in ("threshold", "prefix_padding_ms"):
        _typed(value.get(name), float, f"turn_detection.{name}")
    for name in ("create_response", "interrupt_response"):
        _typed(value.get(name), bool, f"turn_detection.{name}")
    return {**value, "type": kind}


def session_object(c: TranscriptionConfig, session_id: str, beta: bool) -> dict[str, Any]:
    """The session object of ``session.created``/``updated`` (beta: flat)."""
    transcription: dict[str, Any] = {"model": c.model, "language": c.language, "prompt": c.prompt}
    if c.languages is not None:
        transcription["languages"] = c.languages
    if c.keywords is not None:
        transcription["keywords"] = c.keywords
    if beta:
        return {
            "id": session_id,
            "object": "realtime.transcription_session",
            "input_audio_format": FORMATS[c.format_type],
            "input_audio_transcription": transcription,
            "turn_detection": c.turn_detection,
            "input_audio_noise_reduction": c.noise_reduction,
            "include": c.include or None,
        }
    audio_format: dict[str, Any] = {"type": c.format_type}
    if c.format_type == "audio/pcm":
        audio_format["rate"] = c.rate
    return {
        "id": session_id,
        "object": "realtime.transcription_session",
        "type": "transcription",
        "audio": {
            "input": {
                "format": audio_format,
                "transcription": transcription,
                "noise_reduction": c.noise_reduction,
                "turn_detection": c.turn_detection,
            }
        },
        "include": c.include,
    }
