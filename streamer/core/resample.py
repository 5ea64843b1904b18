"""Streaming resampling of client audio to 16 kHz with soxr (I/O-free).

soxr's int16 output is dithered: the same stream came out up to 2 LSB different from
run to run and with the chunking, and so did the text of an 8 kHz stream. The filter
runs in float32 instead (deterministic, and the same whatever the chunks: its state is
carried between them) and its output is rounded to int16 here, without dither.

soxr holds back up to about 115 ms of output (8 kHz in; 35-60 ms from the other rates)
until more input comes. :meth:`StreamResampler.drain` gives that held-back audio at
once, for a finalize that must answer for every sample sent, without ending the stream.
"""

from __future__ import annotations

from math import ceil, gcd

import numpy as np
import soxr

INT16_SCALE = 32768.0
QUALITY = "HQ"
# How far back the filter reaches, in seconds of input: a drain computed from this much
# history before the held-back output is within 1 LSB of flushing the stream itself
# (measured for every supported rate; 10 ms of history was 1 LSB too, 5 ms up to 83).
FILTER_REACH_S = 0.02


class StreamResampler:
    """Resamples an int16 stream chunk by chunk; state is kept between chunks, so the
    output does not depend on how the stream was cut."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = _new_stream(in_rate, out_rate)
        common = gcd(in_rate, out_rate)
        # a whole number of output samples per period: a drain restarts on a period edge,
        # so its output lands on the stream's own sample grid
        self._period_in_samples = in_rate // common
        self._period_out_samples = out_rate // common
        self._reach_in_samples = ceil(in_rate * FILTER_REACH_S)
        self._history = np.zeros(0, dtype=np.float32)  # the last input samples, for drain
        self._in_samples = 0
        self._made_samples = 0  # what the stream has put out
        self._given_samples = 0  # what the caller has: a drain gives ahead of the stream

    @property
    def out_samples(self) -> int:
        """The samples given so far (by push, drain and flush)."""
        return self._given_samples

    def push(self, samples: np.ndarray) -> np.ndarray:
        floats = samples.astype(np.float32) / INT16_SCALE
        self._in_samples += floats.size
        out = self._give(self._stream.resample_chunk(floats, last=False))
        self._keep_history(floats)
        return out

    def drain(self) -> np.ndarray:
        """The samples the filter still holds, as if the stream ended here; the stream
        goes on, and what it puts out for these positions later is not given again.

        Computed by a second resampler over the last input samples, so the stream's own
        state, and everything it gives after, is what it would have been without the
        drain. Only the last few milliseconds differ from the stream's eventual output
        (they were computed without the input that follows).
        """
        pending_in = ceil(self._stream.delay() * self.in_rate / self.out_rate)
        need = pending_in + self._reach_in_samples
        start = max(0, (self._in_samples - need) // self._period_in_samples)
        start *= self._period_in_samples
        history_start = self._in_samples - self._history.size
        assert start >= history_start, "_keep_history keeps what a drain replays"
        base = start // self._period_in_samples * self._period_out_samples
        replay = _new_stream(self.in_rate, self.out_rate)
        out = np.concatenate(
            [
                replay.resample_chunk(self._history[start - history_start :], last=False),
                replay.resample_chunk(np.zeros(0, dtype=np.float32), last=True),
            ]
        )
        end = base + out.size
        fresh = out[self._given_samples - base :]
        self._given_samples = max(self._given_samples, end)
        return _to_int16(fresh)

    def flush(self) -> np.ndarray:
        """The samples still inside the filter (call once at end of stream)."""
        return self._give(self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True))

    def _give(self, floats: np.ndarray) -> np.ndarray:
        """The stream's new output, less the samples a drain already gave."""
        already = max(0, self._given_samples - self._made_samples)
        self._made_samples += floats.size
        self._given_samples = max(self._given_samples, self._made_samples)
        return _to_int16(floats[already:])

    def _keep_history(self, floats: np.ndarray) -> None:
        # what drain replays: the held-back output's input, the filter's reach before
        # it, and up to one period to start on the grid
        keep = ceil(self._stream.delay() * self.in_rate / self.out_rate)
        keep += self._reach_in_samples + self._period_in_samples
        history = np.concatenate([self._history, floats]) if self._history.size else floats
        self._history = history[-keep:] if history.size > keep else history


def _new_stream(in_rate: int, out_rate: int) -> soxr.ResampleStream:
    return soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality=QUALITY)


def _to_int16(floats: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(floats * INT16_SCALE), -32768, 32767).astype(np.int16)
