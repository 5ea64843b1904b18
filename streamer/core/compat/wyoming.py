"""Wyoming, Home Assistant's local speech protocol, for speech to text (I/O-free).

Wyoming runs over plain TCP. One event is a JSON header line ``{"type", "version",
"data"?, "data_length"?, "payload_length"?}`` and a newline, then ``data_length`` bytes of
JSON merged over the header's ``data``, then ``payload_length`` bytes of payload (audio).
:class:`EventParser` cuts a byte stream into :class:`WyomingEvent` objects within
:class:`EventLimits`; :func:`encode_event` writes one as wyoming 1.10 does.

:class:`WyomingAdapter` serves one connection, in Home Assistant's call sequence:

* ``describe`` → ``info`` (the model and its languages), at any time;
* ``transcribe`` (``language``), ``audio-start`` (``rate``, ``width``, ``channels``: the
  audio is converted to 16-bit mono and resampled), ``audio-chunk``\\* (PCM payload),
  ``audio-stop`` → ``transcript-start``, ``transcript-chunk``\\* (streamed while the audio
  flows: growth of our partials' stable text), ``transcript`` (every utterance heard,
  joined), ``transcript-stop``; then the connection closes, as wyoming-faster-whisper does.
  An ``audio-chunk`` without ``audio-start`` starts the stream in its own format.
* ``ping`` → ``pong``; other events are ignored, as the specification asks.

Bad input (a header that is not JSON, a line, data or payload over its limit, an audio
format we cannot convert) is answered with ``error {text, code}`` after the transcript
of what was heard, and the connection closes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from streamer.core import protocol
from streamer.core.compat.common import core_language
from streamer.core.compat.textjoin import AppendOnlyText, separator
from streamer.core.protocol import End, Error, Final, Notice, Partial, SpeechStart
from streamer.core.session import Session, State
from streamer.core.wire import OutFrame, WireAdapter, count_only
from streamer.errors import (
    InvalidOption,
    MalformedMessage,
    MessageTooBig,
    ProtocolError,
    UnsupportedSampleRate,
)

WYOMING_VERSION = "1.10.2"  # the protocol version we write in every header
SAMPLE_WIDTHS = (1, 2, 4)  # bytes per sample we convert: u8, s16le, s32le
MAX_CHANNELS = 8  # more channels than this are refused


@dataclass(frozen=True)
class WyomingEvent:
    """One event: its type, its data (header ``data`` merged with the data block), payload."""

    type: str
    data: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""


@dataclass(frozen=True)
class EventLimits:
    """How large each part of one event may be; larger input ends the connection."""

    max_line_bytes: int = 64 * 1024  # the JSON header line, newline included
    max_data_bytes: int = 64 * 1024  # the data block
    max_payload_bytes: int = 1 << 20  # the payload (Home Assistant sends 1 KiB audio chunks)


def encode_event(event: WyomingEvent) -> bytes:
    """The bytes of one event, framed as wyoming 1.10 writes them."""
    header: dict[str, Any] = {"type": event.type, "version": WYOMING_VERSION}
    data = orjson.dumps(event.data) if event.data else b""
    if data:
        header["data_length"] = len(data)
    if event.payload:
        header["payload_length"] = len(event.payload)
    return orjson.dumps(header) + b"\n" + data + event.payload


def _length(header: dict[str, Any], name: str, limit: int) -> int:
    value = header.get(name)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedMessage(f"{name} must be a non-negative integer, got {value!r}")
    if value > limit:
        raise MessageTooBig(f"{name} {value} exceeds the limit of {limit} bytes")
    return value


class EventParser:
    """Cuts a TCP byte stream into events. :meth:`feed` raises ProtocolError on bad input.

    Memory is bounded by the limits: at most one header line, one data block and one
    payload are buffered.
    """

    def __init__(self, limits: EventLimits | None = None) -> None:
        self.limits = limits or EventLimits()
        self._buffer = bytearray()
        self._header: dict[str, Any] | None = None  # parsed header awaiting its data/payload
        self._data_length = 0
        self._payload_length = 0

    def feed(self, data: bytes) -> list[WyomingEvent]:
        """The events ``data`` completes (the rest of it is kept for the next call)."""
        self._buffer += data
        events: list[WyomingEvent] = []
        while True:
            if self._header is None and not self._read_header():
                return events
            need = self._data_length + self._payload_length
            if len(self._buffer) < need:
                return events
            events.append(self._complete())

    def _read_header(self) -> bool:
        newline = self._buffer.find(b"\n", 0, self.limits.max_line_bytes)
        if newline < 0:
            if len(self._buffer) >= self.limits.max_line_bytes:
                raise MessageTooBig(
                    f"an event header line exceeds {self.limits.max_line_bytes} bytes"
                )
            return False
        line = bytes(self._buffer[:newline])
        del self._buffer[: newline + 1]
        try:
            header = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise MalformedMessage(f"an event header must be one line of JSON: {exc}") from None
        if not isinstance(header, dict) or not isinstance(header.get("type"), str):
            raise MalformedMessage('an event header must be a JSON object with a "type"')
        self._data_length = _length(header, "data_length", self.limits.max_data_bytes)
        self._payload_length = _length(header, "payload_length", self.limits.max_payload_bytes)
        self._header = header
        return True

    def _complete(self) -> WyomingEvent:
        header = self._header
        assert header is not None
        data = header.get("data")
        data = dict(data) if isinstance(data, dict) else {}
        if self._data_length:
            try:
                extra = orjson.loads(bytes(self._buffer[: self._data_length]))
            except orjson.JSONDecodeError as exc:
                raise MalformedMessage(f"event data must be a JSON object: {exc}") from None
            if not isinstance(extra, dict):
                raise MalformedMessage("event data must be a JSON object")
            data.update(extra)
        end = self._data_length + self._payload_length
        payload = bytes(self._buffer[self._data_length : end])
        del self._buffer[:end]
        self._header = None
        return WyomingEvent(type=header["type"], data=data, payload=payload)


@dataclass(frozen=True)
class WyomingInfo:
    """What ``describe`` answers: wyoming's Info schema with one ASR program and model."""

    model_name: str  # the model the worker decodes with
    version: str  # sensevoice-streamer's version
    languages: tuple[str, ...] = tuple(code for code in protocol.LANGUAGES if code != "auto")
    program_name: str = "sensevoice-streamer"

    def event(self) -> WyomingEvent:
        attribution = {"name": "FunAudioLLM", "url": "https://github.com/FunAudioLLM/SenseVoice"}
        model = {
            "name": self.model_name,
            "description": "SenseVoiceSmall: zh, en, yue, ja, ko, with emotion and events",
            "attribution": attribution,
            "installed": True,
            "version": None,
            "languages": list(self.languages),
        }
        program = {
            "name": self.program_name,
            "description": "SenseVoiceSmall streaming speech recognition",
            "attribution": attribution,
            "installed": True,
            "version": self.version,
            "models": [model],
            "supports_transcript_streaming": True,
            "requires_external_vad": True,
        }
        empty: list[Any] = []
        data = {"asr": [program], "tts": empty, "handle": empty, "intent": empty}
        return WyomingEvent("info", data | {"wake": empty, "mic": empty, "snd": empty})


@dataclass(frozen=True)
class AudioFormat:
    """The PCM format of ``audio-start`` / ``audio-chunk``."""

    rate: int  # Hz
    width: int  # bytes per sample
    channels: int

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> AudioFormat:
        """Raises ProtocolError for a format we cannot convert to 16-bit mono."""
        try:
            rate, width, channels = (int(data[k]) for k in ("rate", "width", "channels"))
        except (KeyError, TypeError, ValueError):
            raise InvalidOption("audio events need integer rate, width and channels") from None
        if rate not in protocol.SUPPORTED_SAMPLE_RATES:
            rates = ", ".join(map(str, protocol.SUPPORTED_SAMPLE_RATES))
            raise UnsupportedSampleRate(f"rate {rate} Hz is not supported (supported: {rates})")
        if width not in SAMPLE_WIDTHS:
            raise InvalidOption(f"width {width} is not supported (1, 2 or 4 bytes per sample)")
        if not 1 <= channels <= MAX_CHANNELS:
            raise InvalidOption(f"channels must be within 1..{MAX_CHANNELS}, got {channels}")
        return cls(rate, width, channels)


class PcmConverter:
    """PCM of any supported width and channel count → s16le mono, across chunks."""

    def __init__(self, audio_format: AudioFormat) -> None:
        self.format = audio_format
        self._frame_bytes = audio_format.width * audio_format.channels
        self._rest = b""

    def push(self, data: bytes) -> bytes:
        if self._frame_bytes == 2:
            return data  # already s16le mono: the session carries odd bytes itself
        data = self._rest + data
        usable = len(data) - len(data) % self._frame_bytes
        self._rest = data[usable:]
        width = self.format.width
        if width == 1:
            samples = (np.frombuffer(data[:usable], np.uint8).astype(np.int32) - 128) << 8
        elif width == 2:
            samples = np.frombuffer(data[:usable], "<i2").astype(np.int32)
        else:
            samples = np.frombuffer(data[:usable], "<i4") >> 16
        mono = samples.reshape(-1, self.format.channels).mean(axis=1)
        return np.clip(np.rint(mono), -32768, 32767).astype("<i2").tobytes()


def sessionless_answer(event: WyomingEvent, info: WyomingInfo) -> WyomingEvent | None:
    """The answer to an event that needs no session (``describe``: ``info``, ``ping``:
    ``pong``); None for the others. Also given on a refused connection."""
    if event.type == "describe":
        return info.event()
    if event.type == "ping":
        return WyomingEvent("pong", {"text": event.data.get("text")})
    return None


class WyomingAdapter(WireAdapter):
    """One Wyoming connection over a :class:`Session` (see the module docstring).

    :meth:`receive_bytes` takes raw TCP bytes; :meth:`drain` returns encoded events
    (``OutFrame.text`` is meaningless here). Once :attr:`close_code` is set, close the
    connection after sending them.
    """

    name = "wyoming"

    def __init__(
        self, session: Session, info: WyomingInfo, limits: EventLimits | None = None
    ) -> None:
        super().__init__(session)
        self.info = info
        self._parser = EventParser(limits)
        self._frames: list[OutFrame] = []
        self._language = "auto"  # from transcribe
        self._converter: PcmConverter | None = None  # set by audio-start
        self._streamed = AppendOnlyText()  # what transcript-chunk events carried
        self._committed = ""  # the finished utterances, joined
        self._languages: Counter[str] = Counter()  # detected language per utterance
        self._transcript_started = False
        self._failure: Error | None = None
        self._closed = False

    # -- input -------------------------------------------------------------------------

    def start(self) -> None:
        self.session.start()  # its ready message has no Wyoming equivalent: dropped

    def receive_bytes(self, data: bytes) -> None:
        if self._failure is not None or self._closed:
            return
        try:
            for event in self._parser.feed(data):
                self._handle(event)
                if self._failure is not None:
                    return
        except ProtocolError as error:
            self._fail(error)

    def receive_text(self, text: str) -> None:
        self.receive_bytes(text.encode())

    def _handle(self, event: WyomingEvent) -> None:
        kind = event.type
        streaming = self.session.state in (State.CONFIGURING, State.STREAMING)
        if (answer := sessionless_answer(event, self.info)) is not None:
            self._send(answer)
        elif kind == "transcribe":
            if self.session.state is State.CONFIGURING:
                self._language = core_language(event.data.get("language"))
        elif kind == "audio-start" and streaming:
            self._start_audio(AudioFormat.from_data(event.data))
        elif kind == "audio-chunk" and streaming:
            audio_format = AudioFormat.from_data(event.data)
            if self._converter is None:
                self._start_audio(audio_format)
            assert self._converter is not None
            if audio_format != self._converter.format:
                raise InvalidOption("the audio format changed within one stream")
            if event.payload:
                self.session.receive_audio(self._converter.push(event.payload))
        elif kind == "audio-stop" and streaming:
            self.session.stop()

    def end_of_input(self) -> None:
        """The client closed its side of the connection: a stream it started (audio-start
        or a first chunk) ends as if audio-stop had come, so its transcript is not lost
        (a half-closed client still reads it)."""
        if self._converter is not None and self.session.state is State.STREAMING:
            self.session.stop()

    def _start_audio(self, audio_format: AudioFormat) -> None:
        if self._converter is not None:
            if audio_format != self._converter.format:
                raise InvalidOption("audio-start changed the format of a running stream")
            return
        self.session.configure({"sample_rate": audio_format.rate, "language": self._language})
        self._converter = PcmConverter(audio_format)

    def _fail(self, error: ProtocolError) -> None:
        """End the stream because of ``error``: the transcript heard so far, then the error."""
        self._failure = Error(code=error.code, message=error.message, fatal=True)
        self.session.expire(error.code, error.message)

    # -- output ------------------------------------------------------------------------

    def _send(self, event: WyomingEvent, message: protocol.ServerMessage | None = None) -> None:
        self._frames.append(OutFrame(encode_event(event), text=False, message=message))

    def _count(self, message: protocol.ServerMessage) -> None:
        self._frames.append(count_only(message))  # no event for it, still counted

    def _chunk(self, text: str, message: protocol.ServerMessage) -> None:
        delta = self._streamed.extend_to(text)
        if not delta:
            self._count(message)  # a final the chunks already told: still a segment
            return
        self._start_transcript()
        self._send(WyomingEvent("transcript-chunk", {"text": delta}), message)

    def _start_transcript(self) -> None:
        if not self._transcript_started:
            self._transcript_started = True
            data = {"language": self._language} if self._language != "auto" else {}
            self._send(WyomingEvent("transcript-start", data))

    def drain(self) -> list[OutFrame]:
        for message in self.session.messages_to_send():
            if isinstance(message, SpeechStart):
                self._count(message)
            elif isinstance(message, Partial):
                head = self._committed + separator(self._committed, message.stable_text)
                self._chunk(head + message.stable_text, message)
            elif isinstance(message, Final):
                if message.text:
                    self._committed += separator(self._committed, message.text) + message.text
                    if message.language:
                        self._languages[message.language] += 1
                self._chunk(self._committed, message)
            elif isinstance(message, Error):
                if message.fatal and self._failure is None:
                    self._failure = message  # a server limit (idle timeout, duration)
            elif isinstance(message, Notice):
                self._count(message)  # Wyoming has no warning event: counted, never sent
            elif isinstance(message, End):
                self._finish()
        frames, self._frames = self._frames, []
        return frames

    def _finish(self) -> None:
        self._closed = True
        if self._failure is None or self._committed:
            self._start_transcript()
            data: dict[str, Any] = {"text": self._committed}
            language = self._transcript_language()
            if language is not None:
                data["language"] = language
            self._send(WyomingEvent("transcript", data))
            self._send(WyomingEvent("transcript-stop"))
        if self._failure is not None:
            failure = self._failure
            self._send(
                WyomingEvent("error", {"text": failure.message, "code": failure.code}), failure
            )

    def _transcript_language(self) -> str | None:
        if self._language != "auto":
            return self._language
        if self._languages:
            return self._languages.most_common(1)[0][0]
        return None


__all__ = [
    "WYOMING_VERSION",
    "WyomingEvent",
    "EventLimits",
    "EventParser",
    "encode_event",
    "WyomingInfo",
    "AudioFormat",
    "PcmConverter",
    "WyomingAdapter",
]
