"""Protocol v1 wire messages and stream options (I/O-free).

Client → server text frames are parsed by :func:`parse_client_message`; server → client
messages are frozen dataclasses encoded by :func:`encode` and decoded (by the client) with
:func:`decode_server_message`. ``docs/protocol.md`` is the human-readable specification;
this module is its single implementation, shared by the server, the client, the bench
and the tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from streamer.core.audio import SAMPLE_RATE
from streamer.core.containers import ENCODINGS, PCM
from streamer.core.hotwords import Hotwords
from streamer.core.hotwords import parse_v1 as parse_hotwords
from streamer.core.segmenter import EndReason
from streamer.errors import InvalidOption, MalformedMessage, UnsupportedSampleRate

PROTOCOL_VERSION = 1
PATH = "/v1/asr"
NATIVE_SAMPLE_RATE = SAMPLE_RATE  # what the server decodes at; other rates are resampled
SUPPORTED_SAMPLE_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
LANGUAGES = ("auto", "zh", "en", "yue", "ja", "ko")
MIN_ENDPOINT_MS = 100
MAX_ENDPOINT_MS = 5000
MAX_SPEAKERS = 8  # a stream's speakers with diarize, unless the client says fewer
_DIARIZE_OPTIONS = ("diarize", "min_speakers", "max_speakers")

# ---------------------------------------------------------------------------
# Stream options


@dataclass(frozen=True)
class StreamOptions:
    """What a client chooses for its session (query parameters or a ``config`` message)."""

    language: str = "auto"  # one of LANGUAGES; "auto" lets the model detect it
    itn: bool = True  # inverse text normalisation (punctuation, digits)
    sample_rate: int = NATIVE_SAMPLE_RATE  # rate of the PCM the client sends, Hz
    partials: bool = True  # send partial results while a segment is open
    endpoint_ms: int = 500  # trailing non-speech that ends an utterance
    words: bool = False  # word timings on partials too (finals always carry them)
    encoding: str = PCM  # binary frames: pcm_s16le, auto, or a container (ENCODINGS)
    # phrases the decoder favours (core/hotwords.py: "phrase" or {"phrase", "boost"})
    hotwords: Hotwords = ()
    diarize: bool = False  # who speaks: ``speaker`` on finals and words, ``turns``
    min_speakers: int = 1  # with diarize: the fewest speakers expected
    max_speakers: int = MAX_SPEAKERS  # with diarize: past it, the nearest known voice

    def to_dict(self) -> dict[str, Any]:
        """The options as the ready message shows them; the speaker counts only with
        ``diarize`` (a stream without it reads as it did before diarization existed)."""
        fields = dataclasses.asdict(self)
        if not self.diarize:
            for name in _DIARIZE_OPTIONS:
                del fields[name]
        return fields

    def log_fields(self) -> dict[str, Any]:
        """:meth:`to_dict` for the log: hotwords as their count (phrases are user data,
        logged at debug at most)."""
        fields = self.to_dict()
        fields["hotwords"] = len(self.hotwords)
        return fields


OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(StreamOptions)) | {"token"}


def _parse_bool(name: str, value: Any, strings: bool) -> bool:
    if isinstance(value, bool):
        return value
    if not strings:
        raise InvalidOption(f"option {name!r} must be true or false, got {value!r}")
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
        return False
    raise InvalidOption(f"option {name!r} must be true or false, got {value!r}")


def _parse_int(name: str, value: Any, strings: bool) -> int:
    if isinstance(value, bool):
        raise InvalidOption(f"option {name!r} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():  # 16000.0: JSON has one number type
        return int(value)
    if isinstance(value, str) and strings:
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise InvalidOption(f"option {name!r} must be an integer, got {value!r}")


def parse_stream_options(
    params: Mapping[str, Any], base: StreamOptions | None = None, *, strings: bool = False
) -> StreamOptions:
    """Validate ``params`` (a config message's values, or with ``strings`` the URL's
    query parameters, which are all text) over ``base``. A config message's values must
    have their JSON types: ``"300"`` or ``"false"`` there is an :class:`InvalidOption`.

    Unknown names raise :class:`InvalidOption`; a sample rate outside
    :data:`SUPPORTED_SAMPLE_RATES` raises :class:`UnsupportedSampleRate`. ``token`` and
    ``type`` are accepted and ignored here (authentication happens at the handshake).
    """
    options = base or StreamOptions()
    changes: dict[str, Any] = {}
    for name, value in params.items():
        if name in ("type", "token"):
            continue
        if name not in OPTION_NAMES:
            known = ", ".join(sorted(OPTION_NAMES))
            raise InvalidOption(f"unknown option {name!r} (known options: {known})")
        if name == "language":
            if not isinstance(value, str) or value not in LANGUAGES:
                raise InvalidOption(
                    f"option 'language' must be one of {', '.join(LANGUAGES)}, got {value!r}"
                )
            changes[name] = value
        elif name == "hotwords":
            changes[name] = parse_hotwords(value, strings=strings)
        elif name in ("itn", "partials", "words", "diarize"):
            changes[name] = _parse_bool(name, value, strings)
        elif name == "sample_rate":
            rate = _parse_int(name, value, strings)
            if rate not in SUPPORTED_SAMPLE_RATES:
                rates = ", ".join(map(str, SUPPORTED_SAMPLE_RATES))
                raise UnsupportedSampleRate(
                    f"sample rate {rate} Hz is not supported (supported: {rates})"
                )
            changes[name] = rate
        elif name == "encoding":
            if not isinstance(value, str) or value.strip().lower() not in ENCODINGS:
                raise InvalidOption(
                    f"option 'encoding' must be one of {', '.join(ENCODINGS)}, got {value!r}"
                )
            changes[name] = value.strip().lower()
        elif name == "endpoint_ms":
            ms = _parse_int(name, value, strings)
            if not MIN_ENDPOINT_MS <= ms <= MAX_ENDPOINT_MS:
                raise InvalidOption(
                    f"option 'endpoint_ms' must be within {MIN_ENDPOINT_MS}..{MAX_ENDPOINT_MS},"
                    f" got {ms}"
                )
            changes[name] = ms
        elif name in ("min_speakers", "max_speakers"):
            count = _parse_int(name, value, strings)
            if not 1 <= count <= MAX_SPEAKERS:
                raise InvalidOption(
                    f"option {name!r} must be within 1..{MAX_SPEAKERS}, got {count}"
                )
            changes[name] = count
    result = dataclasses.replace(options, **changes)
    if result.min_speakers > result.max_speakers:
        raise InvalidOption("option 'min_speakers' must not exceed 'max_speakers'")
    return result


# ---------------------------------------------------------------------------
# Client → server


@dataclass(frozen=True)
class ConfigMessage:
    """``{"type": "config", ...}``: options, before any audio."""

    params: dict[str, Any]


@dataclass(frozen=True)
class FinalizeMessage:
    """``{"type": "finalize"}``: end the current utterance now."""


@dataclass(frozen=True)
class StopMessage:
    """``{"type": "stop"}``: end of stream."""


@dataclass(frozen=True)
class KeepaliveMessage:
    """``{"type": "keepalive"}``: resets the idle timer."""


ClientMessage = ConfigMessage | FinalizeMessage | StopMessage | KeepaliveMessage

_SIMPLE_CLIENT_MESSAGES: dict[str, ClientMessage] = {
    "finalize": FinalizeMessage(),
    "stop": StopMessage(),
    "keepalive": KeepaliveMessage(),
}


def json_object(data: str | bytes, carrying: str = "") -> dict[str, Any]:
    """One client text frame's JSON object; :class:`MalformedMessage` on anything else
    (``carrying``: what the object must hold, said when the frame is not an object)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise MalformedMessage(f"text frames must be JSON objects: {exc}") from None
    if not isinstance(obj, dict):
        raise MalformedMessage("text frames must be JSON objects" + carrying)
    return obj


def parse_client_message(data: str | bytes) -> ClientMessage:
    """Parse one client text frame; raises :class:`MalformedMessage` on anything else."""
    obj = json_object(data, carrying=" with a 'type'")
    kind = obj.get("type")
    if kind == "config":
        return ConfigMessage(params={k: v for k, v in obj.items() if k != "type"})
    if isinstance(kind, str) and kind in _SIMPLE_CLIENT_MESSAGES:
        return _SIMPLE_CLIENT_MESSAGES[kind]
    raise MalformedMessage(
        f"unknown message type {kind!r} (expected config, finalize, stop or keepalive)"
    )


def client_message_json(message: ClientMessage) -> bytes:
    """Encode a client message (used by :mod:`streamer.client.connection`)."""
    if isinstance(message, ConfigMessage):
        return orjson.dumps({"type": "config", **message.params})
    for name, instance in _SIMPLE_CLIENT_MESSAGES.items():
        if message == instance:
            return orjson.dumps({"type": name})
    raise TypeError(f"not a client message: {message!r}")


# ---------------------------------------------------------------------------
# Server → client


@dataclass(frozen=True)
class Ready:
    type: ClassVar[str] = "ready"
    session_id: str  # opaque id, also in the server's logs
    protocol: int  # PROTOCOL_VERSION
    sample_rate: int  # rate the server expects from this client
    model: str  # model the server decodes with
    options: dict[str, Any]  # the effective StreamOptions


@dataclass(frozen=True)
class SpeechStart:
    type: ClassVar[str] = "speech_start"
    segment_id: int  # 0, 1, 2, ... per session
    start_ms: float  # client audio time where the segment begins (pre-roll included)


@dataclass(frozen=True)
class Word:
    """One word of a transcript and where it was spoken (see streamer/core/words.py)."""

    word: str  # as in the text, punctuation attached ("fox," "好。")
    start_ms: float  # client audio time where the word starts
    end_ms: float  # where the next token starts (the last word: where its CTC run ends)
    confidence: float  # 0..1: the least confident of its tokens' CTC posteriors


@dataclass(frozen=True)
class SpeakerWord(Word):
    """A word of a diarized stream's final: who said it."""

    speaker: str = ""  # the speaker active over the word ("A", "B", ... or a known name)


@dataclass(frozen=True)
class SpeakerTurn:
    """A stretch of one speaker inside a diarized final."""

    start_ms: float  # client audio time
    end_ms: float
    speaker: str


@dataclass(frozen=True)
class Partial:
    type: ClassVar[str] = "partial"
    segment_id: int
    revision: int  # 1, 2, ... within the segment
    start_ms: float
    end_ms: float  # client audio time up to which this partial decoded
    text: str
    stable_text: str  # prefix of text that agreed with the previous revision
    language: str | None
    emotion: str | None
    event: str | None
    raw: str
    words: tuple[Word, ...] | None = None  # only with the stream option words=true


@dataclass(frozen=True)
class Final:
    type: ClassVar[str] = "final"
    segment_id: int
    start_ms: float
    end_ms: float
    text: str
    language: str | None
    emotion: str | None
    event: str | None
    raw: str
    rich: str
    reason: EndReason  # why the segment ended
    decode_ms: float  # model time spent on this final
    queue_ms: float  # time the final waited for the model
    error: dict[str, str] | None = None  # {code, message} when decoding failed
    words: tuple[Word, ...] | None = None  # the text's words in order; None from old servers
    # with the stream option diarize (left out otherwise): the final's main speaker and,
    # in order, its turns; None when the speaker models gave no answer in time
    speaker: str | None = None
    turns: tuple[SpeakerTurn, ...] | None = None

    def word_speaker(self, i: int) -> str | None:
        """Who said the ``i``-th word: its own speaker (a :class:`SpeakerWord`'s), else
        the final's main one (also past the last word, and for a final without words)."""
        word = self.words[i] if self.words and i < len(self.words) else None
        return (word.speaker if isinstance(word, SpeakerWord) else None) or self.speaker


MAX_ERROR_MESSAGE_CHARS = 200  # longer messages are cut: errors never echo unbounded input


def _cap_message(message: Error | Notice) -> None:
    """A message's text cut to MAX_ERROR_MESSAGE_CHARS (its messages never echo unbounded
    input)."""
    if len(message.message) > MAX_ERROR_MESSAGE_CHARS:
        cut = message.message[: MAX_ERROR_MESSAGE_CHARS - 3] + "..."
        object.__setattr__(message, "message", cut)


@dataclass(frozen=True)
class Error:
    type: ClassVar[str] = "error"
    code: str
    message: str  # for people; at most MAX_ERROR_MESSAGE_CHARS characters
    fatal: bool
    suppressed: int = 0  # errors of this code not sent one by one since the last one

    def __post_init__(self) -> None:
        _cap_message(self)


@dataclass(frozen=True)
class Notice:
    """Something the client asked for is not (fully) applied, and the session goes on:
    a warning, never an error (clients that stop at every ``error`` keep working)."""

    type: ClassVar[str] = "warning"
    code: str  # NOTICE_HOTWORDS_UNUSED
    message: str  # for people; counts and reasons, never the client's phrases

    def __post_init__(self) -> None:
        _cap_message(self)


NOTICE_HOTWORDS_UNUSED = "hotwords_unused"  # phrases the model's vocabulary cannot spell
DIARIZE_UNAVAILABLE = "diarize_unavailable"  # diarize asked of a server without speaker models


@dataclass(frozen=True)
class End:
    type: ClassVar[str] = "end"
    segments: int  # finals sent in this session
    audio_ms: float  # client audio received
    partials_sent: int
    partials_skipped: int  # partial decodes skipped because the worker was busy


ServerMessage = Ready | SpeechStart | Partial | Final | Error | Notice | End
_SERVER_TYPES: dict[str, type] = {
    cls.type: cls for cls in (Ready, SpeechStart, Partial, Final, Error, Notice, End)
}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _SERVER_TYPES.values()
}


def message_dict(message: ServerMessage) -> dict[str, Any]:
    """The JSON object of a server message, as :func:`encode` writes it."""
    data: dict[str, Any] = orjson.loads(encode(message))
    return data


def encode(message: ServerMessage) -> bytes:
    """The JSON bytes of a server message (send them as a text frame).

    ``words`` is left out when it is None (partials without the ``words`` option), and so
    are a final's ``speaker`` and ``turns`` (streams without ``diarize``).
    """
    obj: dict[str, Any] = {"type": message.type}
    for name in _FIELD_NAMES[type(message)]:
        obj[name] = getattr(message, name)
    for name in _OMITTED_WHEN_NONE:
        if obj.get(name, ()) is None:
            del obj[name]
    return orjson.dumps(obj)  # orjson writes the Word dataclasses itself


def decode_server_message(data: str | bytes) -> ServerMessage:
    """Parse a server message; unknown fields are ignored so newer servers stay readable.

    Raises MalformedMessage for anything else (not JSON, not an object, unknown type).
    """
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise MalformedMessage(f"not JSON: {exc}") from None
    kind = obj.get("type") if isinstance(obj, dict) else None
    cls = _SERVER_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedMessage(f"not a protocol v1 server message: {data[:200]!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in obj.items() if k in names}
    if kwargs.get("words") is not None:
        kwargs["words"] = _decode_words(kwargs["words"], str(kind))
    if kwargs.get("turns") is not None:
        kwargs["turns"] = _decode_turns(kwargs["turns"])
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise MalformedMessage(f"bad {obj['type']} message: {exc}") from None


_WORD_FIELDS = tuple(f.name for f in dataclasses.fields(Word))
_OMITTED_WHEN_NONE = ("words", "speaker", "turns")


def _decode_words(value: Any, kind: str) -> tuple[Word, ...]:
    if not isinstance(value, list):
        raise MalformedMessage(f"bad {kind} message: 'words' must be a list")
    words: list[Word] = []
    for item in value:
        if not isinstance(item, dict) or not all(name in item for name in _WORD_FIELDS):
            raise MalformedMessage(
                f"bad {kind} message: each word needs {', '.join(_WORD_FIELDS)}: {item!r:.200}"
            )
        fields = {name: item[name] for name in _WORD_FIELDS}
        if isinstance(item.get("speaker"), str):
            words.append(SpeakerWord(**fields, speaker=item["speaker"]))
        else:
            words.append(Word(**fields))
    return tuple(words)


def _decode_turns(value: Any) -> tuple[SpeakerTurn, ...]:
    try:
        return tuple(SpeakerTurn(t["start_ms"], t["end_ms"], str(t["speaker"])) for t in value)
    except (TypeError, KeyError) as exc:
        raise MalformedMessage(f"bad final message: 'turns' ({exc})") from None


def stable_prefix(previous: str, current: str) -> str:
    """The longest prefix of ``current`` that agrees with ``previous``, cut at a word.

    For text without spaces (Chinese, Japanese) the cut is per character.
    """
    n = 0
    limit = min(len(previous), len(current))
    while n < limit and previous[n] == current[n]:
        n += 1
    if n == len(current) or n == 0:
        return current[:n]
    # Do not end the stable text inside a space-separated word that may still change.
    if " " in current[:n] and current[n - 1] != " " and current[n] != " ":
        n = current.rfind(" ", 0, n) + 1
    return current[:n]


__all__ = [
    "PROTOCOL_VERSION",
    "PATH",
    "NATIVE_SAMPLE_RATE",
    "SUPPORTED_SAMPLE_RATES",
    "LANGUAGES",
    "StreamOptions",
    "parse_stream_options",
    "ConfigMessage",
    "FinalizeMessage",
    "StopMessage",
    "KeepaliveMessage",
    "ClientMessage",
    "parse_client_message",
    "client_message_json",
    "Ready",
    "SpeechStart",
    "Word",
    "SpeakerWord",
    "SpeakerTurn",
    "Partial",
    "Final",
    "Error",
    "End",
    "ServerMessage",
    "message_dict",
    "encode",
    "decode_server_message",
    "stable_prefix",
    "field",
]
