"""What the compatible protocols share: language tags, lenient values, word lists (I/O-free).

The clients of other protocols send a dozen options we do not use and values outside our
ranges; these helpers turn them into core options without refusing anything usable:
unknown language tags become ``auto``, out-of-range numbers are clamped, unreadable
booleans fall back to the default.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from streamer.core import protocol
from streamer.core.protocol import Final, Partial
from streamer.core.session import Session
from streamer.core.words import words_confidence

# BCP-47 primary subtags (and a few region forms) -> the model's languages
_LANGUAGE_ALIASES = {
    "zh": "zh",
    "cmn": "zh",
    "yue": "yue",
    "en": "en",
    "ja": "ja",
    "jp": "ja",
    "ko": "ko",
    "kr": "ko",
}
_CANTONESE_REGIONS = ("zh-hk", "zh-mo", "zh-yue")

_WORD_EDGE = re.compile(r"^[^\w]+|[^\w]+$")


def core_language(tag: object) -> str:
    """A client's language tag as a model language (``en-US`` -> ``en``, ``multi`` -> ``auto``).

    Tags the model does not know also become ``auto``: it detects the language itself,
    which serves the speaker better than refusing the session.
    """
    if not isinstance(tag, str):
        return "auto"
    tag = tag.strip().lower().replace("_", "-")
    if tag.startswith(_CANTONESE_REGIONS):
        return "yue"
    return _LANGUAGE_ALIASES.get(tag.split("-", 1)[0], "auto")


def lenient_bool(value: object, default: bool) -> bool:
    """``true``/``false`` (and 1/0, yes/no, on/off); anything else is ``default``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
    return default


def lenient_int(value: object) -> int | None:
    """An integer from a query value or JSON number; None when it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(float(value.strip()))
        except ValueError:
            return None
    return None


def clamp_endpoint_ms(ms: int) -> int:
    """Trailing silence that ends an utterance, clamped to what the segmenter accepts."""
    return max(protocol.MIN_ENDPOINT_MS, min(protocol.MAX_ENDPOINT_MS, ms))


# Scripts written without spaces between words: CJK ideographs (with their extensions and
# compatibility forms), hiragana, katakana, hangul syllables; and their punctuation.
_CJK_LETTERS = (
    (0x3040, 0x30FF),
    (0x31F0, 0x31FF),
    (0x3400, 0x4DBF),
    (0x4E00, 0x9FFF),
    (0xAC00, 0xD7AF),
    (0xF900, 0xFAFF),
    (0x20000, 0x2FA1F),
)
_CJK_PUNCTUATION = ((0x3000, 0x303F), (0xFF00, 0xFFEF))


def _is_cjk(char: str, ranges: tuple[tuple[int, int], ...] = _CJK_LETTERS) -> bool:
    code = ord(char)
    return code >= 0x3000 and any(lo <= code <= hi for lo, hi in ranges)


def _no_space(char: str) -> bool:
    return _is_cjk(char) or _is_cjk(char, _CJK_PUNCTUATION)


def join_texts(texts: Sequence[str]) -> str:
    """Finals of consecutive segments as one text: a space between words, none between
    CJK characters."""
    out = ""
    for text in texts:
        text = text.strip()
        if not text:
            continue
        if out and not (_no_space(out[-1]) or _no_space(text[0])):
            out += " "
        out += text
    return out


@dataclass(frozen=True, slots=True)
class Word:
    """One word of a transcript with its time in the client's audio."""

    text: str  # the word as it appears in the transcript (punctuation attached)
    start_ms: float
    end_ms: float
    confidence: float

    @property
    def bare(self) -> str:
        """Lower case without leading and trailing punctuation (Deepgram's ``word``)."""
        return _WORD_EDGE.sub("", self.text).lower() or self.text.lower()


# The confidence of words spread over a segment (no timings from the model: a fake
# recognizer, or a tokenizer without a piece table).
UNKNOWN_CONFIDENCE = 1.0


def split_words(text: str) -> list[str]:
    """The words of a transcript: space-separated tokens, and each CJK character alone
    (punctuation stays attached to the word or character before it)."""
    if text.isascii():
        return text.split()
    words: list[str] = []
    for token in text.split():
        current = ""
        after_cjk = False  # the previous character was a CJK word of its own
        for char in token:
            if _is_cjk(char):
                if current:
                    words.append(current)
                words.append(char)
                current, after_cjk = "", True
            elif after_cjk and not char.isalnum():
                words[-1] += char  # "你好。": the full stop stays on 好
            else:
                current += char
                after_cjk = False
        if current:
            words.append(current)
    return words


def spread_words(text: str, start_ms: float, end_ms: float) -> list[Word]:
    """The words of ``text`` with the segment's time spread evenly over them.

    The fallback for results without the model's word timings; the first word starts at
    the segment start and the last one ends at its end, so clients that take a result's
    span from its words still get it right.
    """
    words = split_words(text)
    if not words:
        return []
    step = max(0.0, end_ms - start_ms) / len(words)
    return [
        Word(
            text=word,
            start_ms=round(start_ms + i * step, 1),
            end_ms=round(start_ms + (i + 1) * step, 1),
            confidence=UNKNOWN_CONFIDENCE,
        )
        for i, word in enumerate(words)
    ]


def message_words(message: Partial | Final) -> list[Word]:
    """The timed words of a partial or final: the model's (its ``words``), else the
    segment's span spread over the words of its text."""
    if message.words:
        return [Word(w.word, w.start_ms, w.end_ms, w.confidence) for w in message.words]
    return spread_words(message.text, message.start_ms, message.end_ms)


def message_confidence(message: Partial | Final) -> float:
    """One confidence for a result: the mean of its words' (0.0 for an empty result)."""
    if message.words:
        return words_confidence(message.words)
    return UNKNOWN_CONFIDENCE if message.text else 0.0


def finals_submitted(session: Session) -> int:
    """Finals the session has produced or is decoding: one per segment ended so far.

    Adapters compare it with the finals they have translated to know when every segment
    that ended before a client request (Deepgram's Finalize, OpenAI's commit) is answered.
    """
    return session.stats.segments + session.pending_finals
