"""Append-only text streams, and what goes between two utterances (I/O-free).

Several client protocols append what the server sends instead of replacing it (FunASR's
``2pass-online`` text, Wyoming's ``transcript-chunk``), while our partials replace each
other. :class:`AppendOnlyText` bridges the two: it only ever sends growth of what was
already sent, so a client never shows text it would have to take back.
"""

from __future__ import annotations

# Text in these scripts is written without spaces between words (Korean uses spaces).
_NO_SPACE_RANGES = (
    (0x2E80, 0x2FDF),  # CJK radicals
    (0x3000, 0x303F),  # CJK symbols and punctuation
    (0x3040, 0x30FF),  # hiragana, katakana
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF00, 0xFFEF),  # full-width forms
    (0x20000, 0x2FFFF),  # CJK extensions B and later
)
_NO_SPACE_BEFORE = frozenset(",.!?;:%)]}")


def is_unspaced_script(char: str) -> bool:
    """True for a character of a script written without spaces (Chinese, Japanese)."""
    code = ord(char)
    return any(low <= code <= high for low, high in _NO_SPACE_RANGES)


def separator(left: str, right: str) -> str:
    """What goes between two pieces of transcript: a space, or nothing."""
    if not left or not right:
        return ""
    a, b = left[-1], right[0]
    if a.isspace() or b.isspace() or b in _NO_SPACE_BEFORE:
        return ""
    if is_unspaced_script(a) or is_unspaced_script(b):
        return ""
    return " "


class AppendOnlyText:
    """The text an append-only stream has sent so far."""

    def __init__(self) -> None:
        self.sent = ""

    def extend_to(self, text: str) -> str:
        """The part of ``text`` beyond what was sent ("" when ``text`` does not extend it).

        A ``text`` that contradicts what was sent cannot be taken back: nothing is sent
        until a later ``text`` extends the sent text again (or the stream's own final
        message carries the corrected text).
        """
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent) :]
        self.sent = text
        return delta

    def reset(self) -> None:
        self.sent = ""
