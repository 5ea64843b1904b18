"""Transcript writers: plain text, JSON lines, SubRip (srt) and WebVTT (vtt).

Each writer takes server messages as they arrive (:meth:`CaptionWriter.write`) and writes
to a text stream incrementally, so an interrupted run still leaves a valid file. Only
finals with non-empty text become captions; the ``jsonl`` writer keeps every message.

The cues and their srt/vtt text come from :mod:`streamer.core.captions` (the file
transcription endpoints answer with the same); :func:`render` is what tests check.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, TextIO

import orjson

from streamer.core.captions import (
    MAX_LINE_CHARS,
    MAX_LINES,
    VTT_HEADER,
    Cue,
    caption_cues,
    display_width,
    format_timestamp,
    speaker_cues,
    srt_block,
    vtt_block,
    wrap_caption,
)
from streamer.core.protocol import Final, ServerMessage, message_dict
from streamer.errors import ConfigError

__all__ = [
    "FORMATS",
    "MAX_LINE_CHARS",
    "MAX_LINES",
    "Cue",
    "CaptionWriter",
    "format_for",
    "format_timestamp",
    "display_width",
    "wrap_caption",
    "caption_cues",
    "render",
    "make_writer",
]

FORMATS = ("txt", "jsonl", "srt", "vtt")
_SUFFIX_FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".srt": "srt", ".vtt": "vtt"}


def format_for(path: str | Path | None, explicit_format: str | None) -> str:
    """The output format: ``explicit_format`` when given, else from the file extension.

    Raises :class:`ConfigError` for an unknown format or extension (tell the user to pass
    ``--format``).
    """
    if explicit_format:
        fmt = explicit_format.lower()
        if fmt not in FORMATS:
            raise ConfigError(f"unknown format {explicit_format!r} (choose {', '.join(FORMATS)})")
        return fmt
    if path is None or str(path) == "-":
        return "txt"
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIX_FORMATS:
        raise ConfigError(
            f"cannot tell the format of {path} from its extension; pass --format"
            f" ({', '.join(FORMATS)})"
        )
    return _SUFFIX_FORMATS[suffix]


def _jsonl_line(message: ServerMessage, arrival_s: float) -> str:
    record = {"arrival_s": round(arrival_s, 6), **message_dict(message)}
    return orjson.dumps(record).decode() + "\n"


class CaptionWriter(Protocol):
    """Something that records server messages; call :meth:`close` at the end."""

    def write(self, message: ServerMessage, arrival_s: float) -> None:
        """Record one message; ``arrival_s`` is its arrival time since the stream began."""

    def close(self) -> None:
        """Flush what is buffered (the underlying stream is not closed)."""

    def describe(self) -> str:
        """What was written, in words for the summary ("15 subtitle cues from 6
        utterances")."""


class _StreamWriter:
    def __init__(self, stream: TextIO, fmt: str) -> None:
        self._stream = stream
        self._fmt = fmt
        self._cues = 0
        self._finals = 0  # finals with text
        self._records = 0  # jsonl lines
        if fmt == "vtt":
            stream.write(VTT_HEADER)

    def describe(self) -> str:
        if self._fmt == "jsonl":
            return _count(self._records, "message")
        utterances = _count(self._finals, "utterance")
        if self._fmt == "txt":
            return f"{utterances}, a line each"
        split = ", long ones split to be readable" if self._cues > self._finals else ""
        return f"{_count(self._cues, 'subtitle cue')} from {utterances}{split}"

    def write(self, message: ServerMessage, arrival_s: float) -> None:
        if self._fmt == "jsonl":
            self._records += 1
            self._stream.write(_jsonl_line(message, arrival_s))
        elif isinstance(message, Final) and message.text.strip():
            self._finals += 1
            if self._fmt == "txt":
                self._stream.write(message.text.strip() + "\n")
            else:
                for cue in speaker_cues(message):  # caption_cues, per speaker if diarized
                    self._cues += 1
                    block = srt_block(self._cues, cue) if self._fmt == "srt" else vtt_block(cue)
                    self._stream.write(block)
        else:
            return
        self._stream.flush()

    def close(self) -> None:
        self._stream.flush()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def make_writer(stream: TextIO, fmt: str) -> CaptionWriter:
    """A writer of format ``fmt`` (one of :data:`FORMATS`) over an open text stream."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r} (choose {', '.join(FORMATS)})")
    return _StreamWriter(stream, fmt)


def render(messages: Iterable[tuple[ServerMessage, float]], fmt: str) -> str:
    """The whole document of format ``fmt`` for ``(message, arrival_s)`` pairs."""
    buffer = io.StringIO()
    writer = make_writer(buffer, fmt)
    for message, arrival_s in messages:
        writer.write(message, arrival_s)
    writer.close()
    return buffer.getvalue()
