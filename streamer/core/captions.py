"""Caption cues from finals, and their SubRip (srt) and WebVTT (vtt) text (I/O-free).

What :mod:`streamer.client.captions` writes as a transcript goes, and what the file
transcription endpoints answer with ``response_format=srt`` or ``vtt``: the pure
helpers (:func:`format_timestamp`, :func:`wrap_caption`, :func:`caption_cues`) and the
blocks of each format (:func:`srt_block`, :func:`vtt_block`, :data:`VTT_HEADER`).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, replace

from streamer.core.protocol import Final
from streamer.core.session_speakers import speaker_parts

__all__ = [
    "MAX_LINE_CHARS",
    "MAX_LINES",
    "VTT_HEADER",
    "Cue",
    "format_timestamp",
    "display_width",
    "wrap_caption",
    "caption_cues",
    "srt_block",
    "vtt_block",
    "srt_document",
    "vtt_document",
]

MAX_LINE_CHARS = 42  # characters per caption line (the usual broadcast limit)
MAX_LINES = 2  # lines per caption; longer text is split into several cues
VTT_HEADER = "WEBVTT\n\n"  # what a WebVTT file starts with


def format_timestamp(ms: float, fmt: str) -> str:
    """``HH:MM:SS,mmm`` for srt, ``HH:MM:SS.mmm`` for vtt (``ms`` rounded to a millisecond)."""
    total_ms = max(0, int(round(ms)))
    hours, rest = divmod(total_ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds, millis = divmod(rest, 1000)
    separator = "," if fmt == "srt" else "."
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{separator}{millis:03d}"


def display_width(text: str) -> int:
    """Terminal/caption columns of ``text``: East Asian wide characters count two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _split_long_word(word: str, width: int) -> list[str]:
    pieces: list[str] = []
    current = ""
    for char in word:
        if current and display_width(current + char) > width:
            pieces.append(current)
            current = ""
        current += char
    if current:
        pieces.append(current)
    return pieces


def wrap_caption(text: str, max_line_chars: int = MAX_LINE_CHARS) -> list[str]:
    """Break ``text`` into lines of at most ``max_line_chars`` display columns.

    Lines break at spaces; a run without spaces (Chinese, Japanese, a very long word) is
    broken between characters, with wide characters counting two columns.
    """
    lines: list[str] = []
    current = ""
    for word in text.split():
        for piece in _split_long_word(word, max_line_chars):
            candidate = f"{current} {piece}" if current else piece
            if display_width(candidate) <= max_line_chars:
                current = candidate
            else:
                lines.append(current)
                current = piece
    if current:
        lines.append(current)
    return lines


@dataclass(frozen=True)
class Cue:
    """One caption on screen."""

    start_ms: float  # audio time the caption appears
    end_ms: float  # audio time it disappears
    lines: tuple[str, ...]  # at most MAX_LINES lines of text
    speaker: str | None = None  # who says it (a diarized final's speaker)


def caption_cues(
    final: Final, max_line_chars: int = MAX_LINE_CHARS, max_lines: int = MAX_LINES
) -> list[Cue]:
    """The cues for one final: none when its text is empty, several when it is long.

    A long final is split into groups of ``max_lines`` lines. Each group is shown from
    its first word's start to its last word's end when the final has word timings;
    without them (an older server) the final's span is shared between the groups in
    proportion to their length.
    """
    lines = wrap_caption(final.text, max_line_chars)
    if not lines:
        return []
    groups = [tuple(lines[i : i + max_lines]) for i in range(0, len(lines), max_lines)]
    if len(groups) > 1 and final.words:
        timed = _word_timed_cues(final, groups)
        if timed is not None:
            return timed
    weights = [sum(display_width(line) for line in group) for group in groups]
    total = sum(weights)
    span_ms = max(0.0, final.end_ms - final.start_ms)
    cues = []
    start_ms = final.start_ms
    done = 0
    for group, weight in zip(groups, weights, strict=True):
        done += weight
        end_ms = final.start_ms + span_ms * done / total
        cues.append(Cue(start_ms, end_ms, group))
        start_ms = end_ms
    return cues


def _word_timed_cues(final: Final, groups: list[tuple[str, ...]]) -> list[Cue] | None:
    """Cues timed by the final's words; None when the words do not spell its text.

    Lines hold the text's characters in order without its spaces, so a group's first and
    last characters are found by counting, and each character lies inside one word (a
    word broken over two cues shares its time between them by characters).
    """
    words = final.words or ()
    text = final.text
    owner: list[int] = []  # for each non-space character of the text: its word
    first_char: list[int] = []  # for each word: the index of its first character there
    position = 0
    for index, word in enumerate(words):
        found = text.find(word.word, position)
        if found < 0 or text[position:found].strip() or not word.word:
            return None
        first_char.append(len(owner))
        owner.extend(index for c in word.word if not c.isspace())
        position = found + len(word.word)
    if text[position:].strip():
        return None

    def time_at(char: int, after: bool) -> float:
        index = owner[char]
        word = words[index]
        end = first_char[index + 1] if index + 1 < len(words) else len(owner)
        share = (char - first_char[index] + (1 if after else 0)) / (end - first_char[index])
        return word.start_ms + (word.end_ms - word.start_ms) * share

    cues = []
    done = 0
    for group in groups:
        count = sum(1 for line in group for c in line if not c.isspace())
        if done + count > len(owner):
            return None
        cues.append(Cue(time_at(done, False), time_at(done + count - 1, True), group))
        done += count
    return cues if done == len(owner) else None


def srt_block(index: int, cue: Cue) -> str:
    start = format_timestamp(cue.start_ms, "srt")
    end = format_timestamp(cue.end_ms, "srt")
    lines = list(cue.lines)
    if cue.speaker and lines:
        lines[0] = f"[{cue.speaker}] {lines[0]}"  # SubRip has no voice tag: the usual bracket
    return f"{index}\n{start} --> {end}\n" + "\n".join(lines) + "\n\n"


def vtt_block(cue: Cue) -> str:
    start = format_timestamp(cue.start_ms, "vtt")
    end = format_timestamp(cue.end_ms, "vtt")
    # "-->" inside a cue's text would end it early in some players.
    text = "\n".join(line.replace("-->", "->") for line in cue.lines)
    if cue.speaker:
        # WebVTT's voice span; ">" and newlines cannot be inside its annotation
        voice = " ".join(cue.speaker.replace(">", "").replace("&", "&amp;").split())
        text = f"<v {voice}>{text}"
    return f"{start} --> {end}\n{text}\n\n"


def speaker_cues(final: Final) -> list[Cue]:
    """:func:`caption_cues`, per speaker for a diarized final (each cue names its own)."""
    return [
        replace(cue, speaker=part.speaker)
        for part in speaker_parts(final)
        if part.text.strip()
        for cue in caption_cues(part)
    ]


def srt_document(finals: Iterable[Final]) -> str:
    """A whole SubRip file for ``finals`` (cues numbered from 1; empty finals skipped; a
    diarized final's cues start with ``[speaker]``)."""
    cues = [cue for final in finals if final.text.strip() for cue in speaker_cues(final)]
    return "".join(srt_block(index, cue) for index, cue in enumerate(cues, start=1))


def vtt_document(finals: Iterable[Final]) -> str:
    """A whole WebVTT file for ``finals`` (the header, then a cue per caption; a diarized
    final's cues are voice spans, ``<v A>``)."""
    cues = [cue for final in finals if final.text.strip() for cue in speaker_cues(final)]
    return VTT_HEADER + "".join(vtt_block(cue) for cue in cues)
