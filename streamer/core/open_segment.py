"""The per-segment state of a session (I/O-free): the segment being spoken, and the
speculative decode of its final made in a pause."""

from __future__ import annotations

from dataclasses import dataclass, field

from streamer.core.jobs import DecodeResult, samples_ms
from streamer.core.partial_window import PartialWindow, PartialWindowOptions, raw_of
from streamer.core.protocol import Partial, stable_prefix


@dataclass
class OpenSegment:
    """The segment being spoken, and how far its partials have got (in samples)."""

    segment_id: int
    start_sample: int
    window_options: PartialWindowOptions = field(default_factory=PartialWindowOptions)
    revision: int = 0  # partials sent for it so far
    last_partial_text: str = ""
    partial_mark: int = field(init=False)  # where the last partial tick happened
    partial_submitted_end: int = field(init=False)  # the end of the last partial's audio
    window: PartialWindow = field(init=False)  # where a refresh's audio starts

    def __post_init__(self) -> None:
        self.partial_mark = self.start_sample
        self.partial_submitted_end = self.start_sample
        self.window = PartialWindow(self.start_sample, self.window_options)

    def partial_of(self, result: DecodeResult, with_words: bool) -> Partial | None:
        """The partial to send for a decoded refresh of this segment; None when its text
        is the last one's."""
        t, job = result.transcript, result.job
        assert t is not None
        text, words = self.window.view(t, job)
        if text == self.last_partial_text:
            return None
        self.revision += 1
        partial = Partial(
            segment_id=job.segment_id,
            revision=self.revision,
            start_ms=samples_ms(self.start_sample),
            end_ms=samples_ms(job.end_sample),
            text=text,
            stable_text=stable_prefix(self.last_partial_text, text),
            language=t.language,
            emotion=t.emotion,
            event=t.event,
            raw=raw_of(t, text),
            words=words if with_words else None,
        )
        self.last_partial_text = text
        return partial


def window_job_fields(segment: OpenSegment, speculative: bool) -> tuple[int, int | None]:
    """A refresh's (start_sample, segment_start_sample): a speculative decode, which may
    become the final, decodes the whole segment; a refresh its bounded window."""
    start = segment.start_sample if speculative else segment.window.start_sample()
    return start, (segment.start_sample if start != segment.start_sample else None)


@dataclass
class Speculation:
    """The speculative final of the last pause: its range, and its result once decoded."""

    range: tuple[int, int] | None = None  # (start_sample, end_sample) submitted
    result: DecodeResult | None = None
    failed: bool = False  # the speculation of ``range`` was dropped or failed

    def reset(self, to: tuple[int, int] | None = None) -> None:
        self.range, self.result, self.failed = to, None, False
