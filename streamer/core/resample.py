"""Streaming resampling of client audio to 16 kHz with soxr (I/O-free).

soxr's int16 output is dithered: the same stream came out up to 2 LSB different from
run to run and with the chunking, and so did the text of an 8 kHz stream. The filter
runs in float32 instead (deterministic, and the same whatever the chunks: its state is
carried between them) and its output is rounded to int16 here, without dither.
"""

from __future__ import annotations

import numpy as np
import soxr

INT16_SCALE = 32768.0


class StreamResampler:
    """Resamples an int16 stream chunk by chunk; state is kept between chunks, so the
    output does not depend on how the stream was cut."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality="HQ")

    def push(self, samples: np.ndarray) -> np.ndarray:
        floats = samples.astype(np.float32) / INT16_SCALE
        return _to_int16(self._stream.resample_chunk(floats, last=False))

    def flush(self) -> np.ndarray:
        """The samples still inside the filter (call once at end of stream)."""
        return _to_int16(self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True))


def _to_int16(floats: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(floats * INT16_SCALE), -32768, 32767).astype(np.int16)
