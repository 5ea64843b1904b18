"""Timed words from SenseVoice's CTC tokens (I/O-free).

A transcript's tokens carry their tokenizer piece, the encoder frame where each one's CTC
run starts, one past its run's last frame, and its posterior (see
:class:`~streamer.core.transcript.Transcript`). :func:`transcript_words` groups them into
words in the session's timeline:

- **Words.** sentencepiece's ``▁`` (a space) starts a word, as in the text; every CJK
  character (Han ideographs, hiragana, katakana) is a word of its own, since Chinese,
  Cantonese and Japanese are written without spaces. Korean, written with spaces, is
  split at ``▁`` like English. Tags (``<|en|>``, ``<|Speech|>``) are no text: they end
  the word before them, as they become a space in the text.
- **Punctuation** stays on the word before it (``fox,``; ``好。``), or, with no word
  before it in the same run of text, goes onto the next one (``"hello``). It never moves a
  word's time: a word ends where the token after its last letter starts.
- **Times.** A word starts where its first token starts and ends where the next token
  starts; the last token ends with its CTC run. Frame ``f >= 4`` begins at
  ``(f - 4) * 60`` ms of the decoded audio (frames 0-3 are the model's query frames), so
  a word's time is that plus the segment's start in the session, clamped to the segment.
  A token holding several CJK characters shares its time evenly between them. So the
  words are ordered and never overlap, and the time between two words belongs to the
  first: CTC marks where a token is recognised, not where its sound ends.
- **Confidence** is the lowest posterior among the tokens that spell the word: a word is
  right only when each of its pieces is, and unlike a product or a mean it does not
  depend on how many pieces the tokenizer cut the word into. Punctuation does not count
  (a word alone made of punctuation takes its own tokens').

The words come from the very tokens the text was decoded from (with or without ITN:
SenseVoice's ``withitn`` output is punctuated text from the same CTC tokens), so
:func:`join_words` gives back the transcript's text, with one exception: it puts no space
next to CJK text (a Han or kana character, or CJK punctuation such as ``。``, looking past
other punctuation), so a space the model wrote there is not restored (code-switched text:
``我喜欢 python`` joins as ``我喜欢python``).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

from streamer.core.protocol import Word
from streamer.core.transcript import Transcript

QUERY_FRAMES = 4  # encoder frames 0-3 carry the tags; audio starts at frame 4
FRAME_MS = 60  # audio per encoder frame (one low-frame-rate frame: 6 x 10 ms)
SPACE_PIECE = "▁"  # sentencepiece's word-start mark (U+2581)

# Letters of scripts written without spaces, each one a word: hiragana and katakana (and
# their phonetic extensions), CJK ideographs (extension A, the main block, compatibility
# ideographs, extensions B-G); and, written without spaces next to them, CJK punctuation
# and the full-width forms.
_CJK_LETTERS = (
    "\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
)
_CJK_LETTER = re.compile(f"[{_CJK_LETTERS}]")
_NO_SPACE = re.compile(f"[{_CJK_LETTERS}\u3000-\u303f\uff00-\uffef]")


def is_cjk_letter(char: str) -> bool:
    """A Han ideograph, hiragana or katakana: a word of its own."""
    return _CJK_LETTER.match(char) is not None


def _no_space(char: str) -> bool:
    return _NO_SPACE.match(char) is not None


def _is_punctuation(char: str) -> bool:
    return unicodedata.category(char).startswith("P")


@dataclass(slots=True)
class _Draft:
    """A word being spelled: its text, frame span and the lowest posterior so far."""

    text: str
    start: float  # frame (fractional when a token holds several CJK characters)
    end: float
    confidence: float


class _Builder:
    """Words as they are spelled, character by character, with frame times."""

    def __init__(self) -> None:
        self.words: list[_Draft] = []
        self._open = False  # the last word takes more letters (no space since, not CJK)
        self._attach = False  # punctuation goes onto the last word (no space since it)
        self._prefix: _Draft | None = None  # punctuation waiting for the next word

    def space(self) -> None:
        self._open = self._attach = False
        if self._prefix is not None:  # punctuation between spaces: a word of its own
            self.words.append(self._prefix)
            self._prefix = None

    def punctuation(self, char: str, start: float, end: float, confidence: float) -> None:
        if self._attach:
            self.words[-1].text += char
        elif self._prefix is None:
            self._prefix = _Draft(char, start, end, confidence)
        else:
            self._prefix.text += char
            self._prefix.end = end
            self._prefix.confidence = min(self._prefix.confidence, confidence)

    def letter(self, chars: str, start: float, end: float, confidence: float, cjk: bool) -> None:
        """One CJK letter, or letters of other scripts spelled together."""
        if self._open and not cjk:
            word = self.words[-1]
            word.text += chars
            word.end = end
            word.confidence = min(word.confidence, confidence)
            return
        prefix = self._prefix.text if self._prefix is not None else ""
        self.words.append(_Draft(prefix + chars, start, end, confidence))
        self._prefix = None
        self._open = not cjk
        self._attach = True


def transcript_words(transcript: Transcript, start_ms: float, end_ms: float) -> tuple[Word, ...]:
    """The timed words of ``transcript``, decoded from audio ``start_ms``..``end_ms`` of
    the session (the segment's bounds: every time is clamped to them).

    Empty when the transcript has no text, or when its recognizer reported no token
    pieces or frames (then callers may spread the text over the segment instead).
    """
    pieces = transcript.token_pieces
    frames = transcript.token_frames
    count = len(pieces)
    if not count or len(frames) != count or len(transcript.token_confidences) != count:
        return ()
    confidences = transcript.token_confidences
    run_ends = transcript.token_end_frames
    last_end = run_ends[-1] if len(run_ends) == count else frames[-1] + 1
    builder = _Builder()
    for index, piece in enumerate(pieces):
        if piece[:2] == "<|" and piece[-2:] == "|>":  # a tag: a space in the text
            builder.space()
            continue
        start = float(frames[index])
        end = float(frames[index + 1] if index + 1 < count else max(last_end, frames[index] + 1))
        confidence = confidences[index]
        if piece.startswith(SPACE_PIECE):
            builder.space()
            piece = piece[1:]
        if piece.isalnum():  # most pieces: letters of one word, or one CJK character
            if piece.isascii() or not _CJK_LETTER.search(piece):
                builder.letter(piece, start, end, confidence, False)
                continue
            if len(piece) == 1:
                builder.letter(piece, start, end, confidence, True)
                continue
        text = piece.replace(SPACE_PIECE, " ")
        letters = sum(1 for c in text if not c.isspace() and not _is_punctuation(c))
        step = (end - start) / letters if letters else 0.0
        done = 0
        for char in text:
            if char.isspace():
                builder.space()
            elif _is_punctuation(char):
                builder.punctuation(char, start, end, confidence)
            else:
                part_start, done = start + step * done, done + 1
                builder.letter(
                    char, part_start, start + step * done, confidence, is_cjk_letter(char)
                )
    builder.space()
    high = max(start_ms, end_ms)
    words = []
    for draft in builder.words:
        first = start_ms + max(0.0, (draft.start - QUERY_FRAMES) * FRAME_MS)
        last = start_ms + max(0.0, (draft.end - QUERY_FRAMES) * FRAME_MS)
        words.append(
            Word(
                word=draft.text,
                start_ms=round(min(first, high), 1),
                end_ms=round(min(last, high), 1),
                confidence=round(draft.confidence, 4),
            )
        )
    return tuple(words)


def join_words(words: Sequence[Word]) -> str:
    """The text the words spell: one space between words, none next to CJK text (see
    the module docstring for the one case where that differs from the transcript's)."""
    out: list[str] = []
    previous = ""
    for word in words:
        text = word.word
        if not text:
            continue
        if previous and not (_no_space(_last_letter(previous)) or _no_space(_first_letter(text))):
            out.append(" ")
        out.append(text)
        previous = text
    return "".join(out)


def _first_letter(text: str) -> str:
    return next((c for c in text if not _is_punctuation(c)), text[0])


def _last_letter(text: str) -> str:
    return next((c for c in reversed(text) if not _is_punctuation(c)), text[-1])


def words_confidence(words: Sequence[Word]) -> float:
    """One confidence for a whole transcript: the mean of its words' (0.0 without words)."""
    if not words:
        return 0.0
    return round(sum(w.confidence for w in words) / len(words), 4)
