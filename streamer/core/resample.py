"""Streaming resampling of client audio to 16 kHz with soxr (I/O-free)."""

from __future__ import annotations

import numpy as np
import soxr


class StreamResampler:
    """Resamples an int16 stream chunk by chunk; state is kept between chunks."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="int16", quality="HQ")

    def push(self, samples: np.ndarray) -> np.ndarray:
        return self._stream.resample_chunk(samples.astype(np.int16, copy=False), last=False)

    def flush(self) -> np.ndarray:
        """The samples still inside the filter (call once at end of stream)."""
        return self._stream.resample_chunk(np.zeros(0, dtype=np.int16), last=True)
