"""The per-segment state of a session (I/O-free): the segment being spoken, and the
speculative decode of its final made in a pause."""

from __future__ import annotations

from dataclasses import dataclass, field

from streamer.core.jobs import DecodeResult


@dataclass
class OpenSegment:
    """The segment being spoken, and how far its partials have got (in samples)."""

    segment_id: int
    start_sample: int
    revision: int = 0  # partials sent for it so far
    last_partial_text: str = ""
    partial_mark: int = field(init=False)  # where the last partial tick happened
    partial_submitted_end: int = field(init=False)  # the end of the last partial's audio

    def __post_init__(self) -> None:
        self.partial_mark = self.start_sample
        self.partial_submitted_end = self.start_sample


@dataclass
class Speculation:
    """The speculative final of the last pause: its range, and its result once decoded."""

    range: tuple[int, int] | None = None  # (start_sample, end_sample) submitted
    result: DecodeResult | None = None
    failed: bool = False  # the speculation of ``range`` was dropped or failed

    def reset(self, to: tuple[int, int] | None = None) -> None:
        self.range, self.result, self.failed = to, None, False
