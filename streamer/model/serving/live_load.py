"""What a worker measured of its live work, for capacity (no threads, no clock).

:mod:`streamer.core.capacity` decides from cumulative figures sampled a few times a
second: the live finals' decode time (a speculative decode counts as the final it may
become), their count, audio and squared decode times (a final's mean wait behind
another is ``E[S^2] / 2E[S]``), what they waited per ``WAIT_BINS_MS`` bin, and the time
spent on live partials (a final waits behind one unless it stops it). File uploads'
jobs are not counted: their wait behind live work is by design. The worker holds its
lock around every call.
"""

from __future__ import annotations

import bisect
from dataclasses import replace

from streamer.core.audio import SAMPLE_RATE
from streamer.core.capacity import WAIT_BINS_MS, LiveFigures
from streamer.core.jobs import DecodeResult
from streamer.model.serving.job_queue import is_live_final, is_refresh


class LiveLoad:
    """Counts one worker's live decodes into its :class:`LiveFigures` (cumulative)."""

    def __init__(self) -> None:
        self.figures = LiveFigures(interruptible=False, final_waits=(0,) * (len(WAIT_BINS_MS) + 1))

    def record(self, result: DecodeResult) -> None:
        """Count one answered job (a batch's time is shared by its jobs)."""
        job, f = result.job, self.figures
        share_ms = result.decode_ms / max(1, result.batch_size)
        if is_live_final(job) and not result.dropped:
            waits = list(f.final_waits)
            waits[bisect.bisect_left(WAIT_BINS_MS, result.queue_ms)] += 1
            self.figures = replace(
                f,
                final_decode_ms_total=f.final_decode_ms_total + share_ms,
                finals_total=f.finals_total + 1,
                final_audio_ms_total=f.final_audio_ms_total + job.pcm.size * 1000 / SAMPLE_RATE,
                final_decode_sq_ms_total=f.final_decode_sq_ms_total + share_ms * share_ms,
                final_waits=tuple(waits),
            )
        elif is_refresh(job) and (result.interrupted or not result.dropped):
            self.figures = replace(f, partial_decode_ms_total=f.partial_decode_ms_total + share_ms)

    def interrupted(self, partials: int) -> None:
        """Count ``partials`` decodes stopped so that a final went first."""
        self.figures = replace(
            self.figures, partials_interrupted=self.figures.partials_interrupted + partials
        )
