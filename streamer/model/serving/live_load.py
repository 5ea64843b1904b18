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
from dataclasses import dataclass, field

from streamer.core.audio import SAMPLE_RATE
from streamer.core.capacity import WAIT_BINS_MS
from streamer.core.jobs import DecodeResult
from streamer.model.serving.job_queue import is_live_final, is_refresh


@dataclass
class LiveLoad:
    """Cumulative figures of one worker's live decodes."""

    final_decode_ms_total: float = 0.0
    finals_total: int = 0
    final_audio_ms_total: float = 0.0
    final_decode_sq_ms_total: float = 0.0
    partial_decode_ms_total: float = 0.0
    partials_interrupted: int = 0  # partial decodes stopped so that a final went first
    final_waits: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BINS_MS) + 1))

    def record(self, result: DecodeResult) -> None:
        """Count one answered job (a batch's time is shared by its jobs)."""
        job = result.job
        share_ms = result.decode_ms / max(1, result.batch_size)
        if is_live_final(job) and not result.dropped:
            self.final_decode_ms_total += share_ms
            self.finals_total += 1
            self.final_audio_ms_total += job.pcm.size * 1000 / SAMPLE_RATE
            self.final_decode_sq_ms_total += share_ms * share_ms
            self.final_waits[bisect.bisect_left(WAIT_BINS_MS, result.queue_ms)] += 1
        elif is_refresh(job) and (result.interrupted or not result.dropped):
            self.partial_decode_ms_total += share_ms
