"""FunASR's runtime WebSocket protocol, as its C++ 2pass server speaks it (I/O-free).

The clients: funasr-client, funasr-python, FunASR's html5 demo and ``funasr_wss_client.py``
(``docs/funasr.md`` says how to point each at the server).

Client → server:

* the first text frame, a JSON object without ``type``: ``mode`` (``2pass``, ``online``,
  ``offline``), ``audio_fs``, ``wav_name``, ``wav_format``, ``svs_lang``, ``svs_itn`` /
  ``itn``, ``hotwords`` (a JSON string of phrase -> weight: the weight / 10 is the
  boost, ``core/hotwords.py``). Everything else (``chunk_size``, ``chunk_interval``,
  ``*_look_back``) is ignored, and so are the fields of later JSON frames;
* binary frames: PCM s16le mono at ``audio_fs`` (a WAV header at the start is skipped);
* ``{"is_speaking": false}`` ends the input (``is_end: true`` asks for an acknowledgement).
  It may come twice: a second one with no audio in between is ignored. Audio after it
  starts a new round, whose own end of input is answered by its own last message, even
  while the previous round's last message is still decoding.

Server → client (what the C++ 2pass server sends, which both client libraries parse):

* ``2pass``: ``2pass-online`` messages carry the growth of our partials' stable text (the
  clients append them), ``2pass-offline`` messages one finished utterance each, with
  ``is_final: false``;
* ``online``: ``online`` messages only, each a piece to append; ``offline``: nothing until
  the end, then one ``offline`` message with the whole text;
* after the end of input: exactly one last message with ``is_final: true`` (it carries the
  utterance the end of input closed, or empty text), then the ``is_end`` acknowledgement if
  asked. The server does not close: the client does (or the idle timeout does).

Every result has ``mode``, ``text``, ``wav_name`` and ``is_final``; utterances add
``timestamp``, a JSON *string* ``"[[start_ms,end_ms],...]"`` with one span per word (per
character in Chinese and Japanese), and ``stamp_sents``. Errors are a last message
``{"text": "ERROR. ...", "is_final": true, "error": {"code", "message"}}`` (the C++
server's shape, plus the ``error`` object funasr-python looks for), after the finals of
the speech heard so far; the connection then closes with 1008.
"""

from __future__ import annotations

import unicodedata
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from streamer.core import protocol
from streamer.core.compat.common import core_language, finals_submitted
from streamer.core.compat.textjoin import AppendOnlyText, separator
from streamer.core.containers import PCM, AudioInput, DecoderFactory
from streamer.core.hotwords import Hotwords, as_v1
from streamer.core.hotwords import parse_funasr as parse_funasr_hotwords
from streamer.core.protocol import (
    End,
    Error,
    Final,
    Notice,
    Partial,
    ServerMessage,
    SpeechStart,
    Word,
)
from streamer.core.session import Session, State
from streamer.core.wire import OutFrame, WireAdapter, count_only
from streamer.errors import (
    CLOSE_NORMAL,
    CLOSE_POLICY_VIOLATION,
    InvalidOption,
    MalformedMessage,
    ProtocolError,
    UndecodableAudio,
    UnexpectedMessage,
    UnsupportedSampleRate,
)

MODES = ("2pass", "online", "offline")
DEFAULT_WAV_NAME = "wav-default-id"  # what the C++ server calls a stream that names none
MAX_WAV_NAME_CHARS = 256  # a longer wav_name is cut (it is echoed in every message)
PCM_FORMATS = ("pcm", "wav")  # wav_format values we accept: raw PCM (a WAV header is skipped)
# the compressed wav_format values FunASR's clients send (offline mode: whole files), and
# the container each is; the server decodes them in any mode, as they arrive
COMPRESSED_FORMATS = {"mp3": "mp3", "ogg": "ogg", "opus": "ogg", "flac": "flac", "webm": "webm"}
# Where the html5 demo splits text into timestamped units (handleWithTimestamp in main.js).
_UNIT_SEPARATORS = frozenset("。？，、?. ,")
_SENTENCE_PUNCTUATION = frozenset("。？！，、,.?!;；")
_WAV_HEADER_SEARCH_BYTES = 4096  # how far into the first frame a WAV "data" chunk is looked for

# What the output mode is called in each input mode: (streamed text, finished utterance).
_OUT_MODES = {
    "2pass": ("2pass-online", "2pass-offline"),
    "online": ("online", "online"),
    "offline": ("offline", "offline"),
}


@dataclass(frozen=True)
class FunAsrConfig:
    """What the first JSON frame asked for."""

    mode: str = "2pass"  # "2pass", "online" or "offline"
    wav_name: str = DEFAULT_WAV_NAME  # echoed in every message
    sample_rate: int = protocol.NATIVE_SAMPLE_RATE  # audio_fs, Hz
    language: str = "auto"  # from svs_lang
    itn: bool | None = None  # from svs_itn (else itn); None keeps the server's default
    container: str = PCM  # PCM, or the container a compressed wav_format names
    hotwords: Hotwords = ()  # from hotwords (its JSON string of phrase -> weight)


def _lenient_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
        return False
    return None


def wav_name_of(obj: Mapping[str, Any]) -> str:
    """The stream's name as the client gave it (cut to MAX_WAV_NAME_CHARS)."""
    wav_name = obj.get("wav_name")
    return DEFAULT_WAV_NAME if wav_name is None else str(wav_name)[:MAX_WAV_NAME_CHARS]


def parse_config(obj: Mapping[str, Any]) -> FunAsrConfig:
    """The first JSON frame as a :class:`FunAsrConfig`; raises ProtocolError if unusable.

    Unknown fields and unknown modes are ignored (the clients send a dozen fields meant
    for other models); only a sample rate or format we cannot decode is refused.
    """
    mode = obj.get("mode")
    mode = mode.strip().lower() if isinstance(mode, str) else "2pass"
    if mode not in MODES:
        mode = "2pass"
    wav_name = wav_name_of(obj)
    wav_format = obj.get("wav_format")
    form = "pcm" if wav_format is None else str(wav_format).strip().lower()
    if form not in PCM_FORMATS and form not in COMPRESSED_FORMATS:
        known = ", ".join((*PCM_FORMATS, *COMPRESSED_FORMATS))
        raise InvalidOption(f"wav_format {wav_format!r} is not supported (supported: {known})")
    rate = protocol.NATIVE_SAMPLE_RATE
    audio_fs = obj.get("audio_fs")
    if audio_fs is not None:
        try:
            if isinstance(audio_fs, bool):  # JSON true is not 1 Hz
                raise TypeError(audio_fs)
            if isinstance(audio_fs, float) and not audio_fs.is_integer():
                raise ValueError(audio_fs)  # 16000.7 Hz is not 16000 Hz
            rate = int(audio_fs)
        except (TypeError, ValueError):
            raise InvalidOption(f"audio_fs must be a number of Hz, got {audio_fs!r}") from None
        if rate not in protocol.SUPPORTED_SAMPLE_RATES:
            rates = ", ".join(map(str, protocol.SUPPORTED_SAMPLE_RATES))
            raise UnsupportedSampleRate(f"audio_fs {rate} Hz is not supported (supported: {rates})")
    itn = _lenient_bool(obj.get("svs_itn"))
    if itn is None:
        itn = _lenient_bool(obj.get("itn"))
    return FunAsrConfig(
        mode=mode,
        wav_name=wav_name,
        sample_rate=rate,
        language=core_language(obj.get("svs_lang")),
        itn=itn,
        container=COMPRESSED_FORMATS.get(form, PCM),
        hotwords=parse_funasr_hotwords(obj.get("hotwords")),
    )


# -- timestamps ----------------------------------------------------------------------


def timestamp_units(text: str) -> list[str]:
    """The units FunASR gives one timestamp each: a word of ASCII letters, else a character.

    The split is the html5 demo's (it indexes the timestamp list with it, so a list
    shorter than its count of units breaks the page): tokens between ``。？，、?.`` , spaces
    and commas; a token of ASCII letters only is one unit, any other token one unit per
    UTF-16 code unit (JavaScript's ``length``).
    """
    units: list[str] = []
    token = ""
    for char in text + " ":
        if char in _UNIT_SEPARATORS:
            if token.isascii() and token.isalpha():
                units.append(token)
            else:
                for c in token:
                    units.extend([c, ""] if ord(c) > 0xFFFF else [c])
            token = ""
        else:
            token += char
    return units


def spread_spans(units: list[str], start_ms: float, end_ms: float) -> list[list[int]]:
    """One ``[start_ms, end_ms]`` per unit, spread over the utterance by unit length.

    The fallback of :func:`utterance_spans` for finals without word timings.
    """
    if not units:
        return []
    weights = [max(1, len(u)) for u in units]
    total = sum(weights)
    start, length = float(start_ms), max(0.0, float(end_ms) - float(start_ms))
    spans: list[list[int]] = []
    done = 0
    for weight in weights:
        begin = round(start + length * done / total)
        done += weight
        spans.append([begin, round(start + length * done / total)])
    return spans


def utterance_spans(final: Final, text: str) -> list[list[int]]:
    """The timestamp spans of one utterance's ``text``: one per :func:`timestamp_units`.

    From the final's word timings (CTC frames of the model's tokens): each unit runs
    from its first character's time to its last's, a word's characters sharing its span
    evenly. Spread over the utterance (:func:`spread_spans`) when the final has no words
    or they do not spell ``text``.
    """
    units = timestamp_units(text)
    timed = _character_times(final.words or ())
    spans: list[list[int]] = []
    position = 0
    for unit in units:
        if not unit:  # the second UTF-16 half of a character: it shares the first's span
            spans.append(list(spans[-1]) if spans else [int(final.start_ms)] * 2)
            continue
        while position < len(timed) and timed[position][0] != unit[0]:
            position += 1  # separators (punctuation, spaces) the units leave out
        last = position + len(unit) - 1
        if last >= len(timed) or "".join(c for c, _, _ in timed[position : last + 1]) != unit:
            return spread_spans(units, final.start_ms, final.end_ms)
        spans.append([int(timed[position][1]), int(timed[last][2])])
        position = last + 1
    return spans


def _character_times(words: Sequence[Word]) -> list[tuple[str, float, float]]:
    """Each non-space character of ``words`` with its share of its word's time span.

    Punctuation has no time of its own (FunASR's comes from a punctuation model after
    recognition): it sits at the end of its word, which its letters span.
    """
    out: list[tuple[str, float, float]] = []
    for word in words:
        chars = [c for c in word.word if not c.isspace()]
        letters = [c for c in chars if not unicodedata.category(c).startswith("P")]
        length = (word.end_ms - word.start_ms) / max(1, len(letters))
        done = 0
        for char in chars:
            if unicodedata.category(char).startswith("P"):
                out.append((char, word.end_ms, word.end_ms))
                continue
            out.append((char, word.start_ms + done * length, word.start_ms + (done + 1) * length))
            done += 1
    return out


def stamp_sentence(text: str, spans: list[list[int]]) -> dict[str, Any]:
    """One ``stamp_sents`` entry: the units spaced out, the closing punctuation, the spans."""
    units = [u for u in timestamp_units(text) if u]
    punc = text[-1] if text and text[-1] in _SENTENCE_PUNCTUATION else ""
    return {
        "text_seg": " ".join(units),
        "punc": punc,
        "start": spans[0][0] if spans else 0,
        "end": spans[-1][1] if spans else 0,
        "ts_list": spans,
    }


def strip_wav_header(data: bytes) -> bytes:
    """``data`` without a leading RIFF/WAVE header (the html5 demo sends whole WAV files)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return data
    position = 12
    while position + 8 <= min(len(data), _WAV_HEADER_SEARCH_BYTES):
        size = int.from_bytes(data[position + 4 : position + 8], "little")
        if data[position : position + 4] == b"data":
            return data[position + 8 :]
        position += 8 + size + (size & 1)
    return data[44:]  # a canonical header without a data chunk in reach


# -- the adapter -----------------------------------------------------------------------


@dataclass
class _Item:
    """One outgoing result, before it is encoded."""

    body: dict[str, Any]
    from_final: bool = False  # it carries (the end of) an utterance
    message: ServerMessage | None = None  # the core message it translates (for metrics)
    last: bool = False  # it answers an end of input (sent even when empty)


@dataclass
class _Round:
    """An end of input waiting for its last message."""

    after_finals: int  # answered once this many finals have been translated
    ack: bool  # is_end: the acknowledgement follows the last message


class FunAsrAdapter(WireAdapter):
    """One FunASR connection over a :class:`Session` (see the module docstring)."""

    name = "funasr"

    def __init__(
        self,
        session: Session,
        open_decoder: DecoderFactory | None = None,
        *,
        offline_final: bool = True,
    ) -> None:
        super().__init__(session)
        self._open_decoder = open_decoder
        self._input: AudioInput | None = None  # a compressed file being decoded
        # the offline result's is_final: funasr-python (and funasr-client) stop at the
        # first true; the C++ server sends false, which FunASR's html5 demo waits for in
        # file mode (docs/funasr.md, "Two dialects")
        self.offline_final = offline_final
        self.config: FunAsrConfig | None = None  # set by the first JSON frame
        self._wav_name = DEFAULT_WAV_NAME  # the first JSON frame's, even one refused
        self._frames: list[OutFrame] = []
        self._first_audio = True
        self._rounds: deque[_Round] = deque()  # ends of input not answered yet, in order
        self._audio_since_end = True  # audio (or none yet) since the last end of input
        self._finals_seen = 0  # finals translated so far
        self._last_sent = False  # every end of input is answered and no audio came since
        self._streamed = AppendOnlyText()  # the open utterance's text sent as pieces
        self._previous = ""  # the last utterance's text (what the next one is joined to)
        self._held: list[tuple[Final, str]] = []  # offline mode: utterances until the end
        self._failure: Error | None = None  # the fatal error the stream ends with

    # -- input -------------------------------------------------------------------------

    def start(self) -> None:
        self.session.start()  # its ready message has no FunASR equivalent: dropped

    def _closed_to_input(self) -> bool:
        return self._failure is not None or self.session.state in (State.STOPPING, State.ENDED)

    def receive_text(self, text: str) -> None:
        if self._closed_to_input():
            return
        try:
            if len(text) > self.session.options.max_text_message_bytes:
                raise MalformedMessage(
                    f"a text frame of {len(text)} bytes exceeds "
                    f"{self.session.options.max_text_message_bytes}"
                )
            obj = protocol.json_object(text)
            if self.config is None:
                self._wav_name = wav_name_of(obj)  # echoed in an error about the frame too
                self._configure(parse_config(obj))
            if obj.get("is_speaking") is False or obj.get("is_finished") is True:
                self._end_of_input(ack=obj.get("is_end") is True)
        except ProtocolError as error:
            self._fail(error)

    def receive_bytes(self, data: bytes) -> None:
        if self._closed_to_input():
            return
        if self.config is None:
            self._fail(
                UnexpectedMessage(
                    "audio arrived before the first JSON message "
                    '(send {"mode": "2pass", "audio_fs": 16000, ...} first)'
                )
            )
            return
        if self.config.container != PCM:
            try:
                data = self._compressed(data)
            except UndecodableAudio as error:
                self._fail(error)
                return
        elif self._first_audio:
            self._first_audio = False
            data = strip_wav_header(data)
        if data:
            self._last_sent = False
            self._audio_since_end = True
            self.session.receive_audio(data)

    def _compressed(self, data: bytes) -> bytes:
        """A compressed file's bytes (each round of input is a file of its own)."""
        assert self.config is not None
        if self._input is None:
            rate = self.session.stream.sample_rate
            self._input = AudioInput(self.config.container, rate, self._open_decoder)
        self._audio_since_end = True  # a header alone is input too
        return self._input.push(data)

    def _flush_file(self) -> None:
        """The end of a round: the decoder's tail, then a fresh decoder for the next file."""
        audio, self._input = self._input, None
        if audio is None:
            return
        try:
            pcm = audio.flush()
        finally:
            audio.close()
        if pcm:
            self.session.receive_audio(pcm)

    def release(self) -> None:
        if self._input is not None:
            self._input.close()

    def _configure(self, config: FunAsrConfig) -> None:
        params: dict[str, object] = {
            "sample_rate": config.sample_rate,
            "language": config.language,
            "partials": config.mode != "offline",
        }
        if config.itn is not None:
            params["itn"] = config.itn
        if config.hotwords:
            params["hotwords"] = as_v1(config.hotwords)
        self.session.configure(params)
        self.config = config

    def _end_of_input(self, *, ack: bool) -> None:
        self._flush_file()
        if not self._audio_since_end:
            # the second {"is_speaking": false} that funasr-client's close() sends
            if ack and self._rounds:
                self._rounds[-1].ack = True
            elif ack:
                self._frames.append(OutFrame(orjson.dumps(self._end_ack())))
            return
        self._audio_since_end = False
        self.session.finalize(at_pause=False)  # end of input: nothing more will come
        self._rounds.append(_Round(after_finals=finals_submitted(self.session), ack=ack))

    def _fail(self, error: ProtocolError) -> None:
        """End the stream because of ``error``: finals of the speech heard, then the error."""
        self._failure = Error(code=error.code, message=error.message, fatal=True)
        self.session.expire(error.code, error.message)

    # -- output ------------------------------------------------------------------------

    def drain(self) -> list[OutFrame]:
        items: list[_Item] = []
        ended = False
        for message in self.session.messages_to_send():
            if isinstance(message, SpeechStart):
                self._streamed.reset()
                self._frames.append(count_only(message))  # no event for it, still counted
            elif isinstance(message, Partial):
                self._on_partial(message, items)
            elif isinstance(message, Final):
                self._on_final(message, items)
                self._finals_seen += 1
                self._answer_rounds(items)  # before the next round's finals
            elif isinstance(message, Error):
                if message.fatal and self._failure is None and not self._last_sent:
                    self._failure = message  # a server limit (idle timeout, duration)
            elif isinstance(message, Notice):
                # FunASR's protocol has no warning: hotwords it cannot use are counted
                self._frames.append(count_only(message))
            elif isinstance(message, End):
                ended = True
        if ended:
            self._finish(items)
        else:
            self._answer_rounds(items)  # those whose audio held no utterance
        frames, self._frames = self._frames, []
        for item in items:
            if item.body.get("is_final") or item.body.get("text") or item.last:
                frames.append(OutFrame(orjson.dumps(item.body), message=item.message))
            elif isinstance(item.message, Final):
                frames.append(count_only(item.message))  # an empty final: still a segment
        return frames

    @property
    def close_code(self) -> int | None:
        code = self.session.close_code
        if code == CLOSE_POLICY_VIOLATION and self._last_sent and self._failure is None:
            return CLOSE_NORMAL  # idle after its last result: the client simply stayed
        return code

    @property
    def _mode(self) -> str:
        return self.config.mode if self.config is not None else "2pass"

    def _result(self, mode: str, text: str) -> dict[str, Any]:
        wav_name = self.config.wav_name if self.config is not None else self._wav_name
        return {"mode": mode, "text": text, "wav_name": wav_name, "is_final": False}

    def _piece(self, text: str) -> str:
        """The growth of the open utterance's ``text``; its first piece has the separator."""
        first = not self._streamed.sent
        delta = self._streamed.extend_to(text)
        if delta and first:
            delta = separator(self._previous, delta) + delta
        return delta

    def _on_partial(self, partial: Partial, items: list[_Item]) -> None:
        if self._mode == "offline":
            return
        delta = self._piece(partial.stable_text)
        if delta:
            online_mode, _ = _OUT_MODES[self._mode]
            items.append(_Item(self._result(online_mode, delta), message=partial))

    def _on_final(self, final: Final, items: list[_Item]) -> None:
        text = final.text
        _, done_mode = _OUT_MODES[self._mode]
        if self._mode == "offline":
            if text:
                self._held.append((final, text))
            return
        if self._mode == "online":
            body = self._result(done_mode, self._piece(text))  # what the pieces lacked
        else:
            body = self._result(done_mode, separator(self._previous, text) + text)
            if text:
                spans = utterance_spans(final, text)
                body["timestamp"] = orjson.dumps(spans).decode()
                body["stamp_sents"] = [stamp_sentence(text, spans)]
        self._streamed.reset()
        if text:
            self._previous = text
        items.append(_Item(body, from_final=True, message=final))

    def _offline_result(self, *, final: bool) -> dict[str, Any]:
        texts = [text for _, text in self._held]
        body = self._result("offline", "")
        spans: list[list[int]] = []
        sentences = []
        for utterance, text in self._held:
            lead = separator(body["text"] or self._previous, text)  # after an earlier round's
            body["text"] += lead + text
            self._previous = text
            own = utterance_spans(utterance, text)
            spans.extend(own)
            sentences.append(stamp_sentence(text, own))
        if texts:
            body["timestamp"] = orjson.dumps(spans).decode()
            body["stamp_sents"] = sentences
        body["is_final"] = final
        self._held.clear()
        return body

    def _answer_rounds(self, items: list[_Item]) -> None:
        while self._rounds and self._rounds[0].after_finals <= self._finals_seen:
            self._send_last(items, ack=self._rounds.popleft().ack)

    def _send_last(self, items: list[_Item], *, ack: bool) -> None:
        """The one ``is_final: true`` message that answers an end of input."""
        if self._mode == "offline":
            items.append(_Item(self._offline_result(final=self.offline_final), last=True))
        elif items and items[-1].from_final and not items[-1].body["is_final"]:
            items[-1].body["is_final"] = True  # the utterance the end of input closed
        else:
            _, done_mode = _OUT_MODES[self._mode]
            items.append(_Item(self._result(done_mode, "") | {"is_final": True}))
        if ack:
            items.append(_Item(self._end_ack()))
        self._last_sent = not self._rounds and not self._audio_since_end

    def _finish(self, items: list[_Item]) -> None:
        """The session ended (error, server limit, shutdown): one last message, then close."""
        if self._last_sent:
            return  # the client already has its last message and stayed: nothing to add
        failure = self._failure
        if failure is None:
            # every final is in: each end of input gets its answer, and audio after the
            # last one (the session ended without one) a last message of its own
            while self._rounds:
                self._send_last(items, ack=self._rounds.popleft().ack)
            if not self._last_sent:
                self._send_last(items, ack=False)
            return
        if self._mode == "offline" and self._held:
            items.append(_Item(self._offline_result(final=False)))
        done_mode = _OUT_MODES[self._mode][1]
        body = self._result(done_mode, f"ERROR. {failure.message}") | {"is_final": True}
        body["error"] = {"code": failure.code, "message": failure.message}
        items.append(_Item(body, message=failure))
        self._last_sent = True

    def _end_ack(self) -> dict[str, Any]:
        return self._result(self._mode, "") | {"is_final": True, "is_end": True}


__all__ = [
    "MODES",
    "FunAsrConfig",
    "FunAsrAdapter",
    "parse_config",
    "timestamp_units",
    "spread_spans",
    "utterance_spans",
    "stamp_sentence",
    "strip_wav_header",
]
