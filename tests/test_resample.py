"""The streaming resampler: the same stream gives the same samples however it is cut."""

from __future__ import annotations

import numpy as np
import pytest

from streamer.core.resample import StreamResampler


def resampled(pcm: np.ndarray, chunks: list[int], in_rate: int) -> np.ndarray:
    resampler = StreamResampler(in_rate, 16000)
    out, start = [], 0
    while start < pcm.size:
        for size in chunks:
            out.append(resampler.push(pcm[start : start + size]))
            start += size
    out.append(resampler.flush())
    return np.concatenate(out)


@pytest.mark.parametrize("in_rate", [8000, 24000, 48000])
def test_two_chunkings_and_two_runs_give_identical_samples(in_rate: int) -> None:
    rng = np.random.default_rng(7)
    pcm = (rng.standard_normal(in_rate * 3) * 4000).astype(np.int16)
    even = resampled(pcm, [in_rate // 50], in_rate)  # 20 ms chunks
    ragged = resampled(pcm, [37, 1001, 3, 480], in_rate)  # what a TCP stream may do
    assert even.size == ragged.size == pcm.size * 16000 // in_rate
    assert np.array_equal(even, ragged)  # int16 output was dithered: up to 2 LSB apart
    assert np.array_equal(even, resampled(pcm, [in_rate // 50], in_rate))


def test_full_scale_input_is_clipped_not_wrapped() -> None:
    square = np.tile(np.array([32767] * 40 + [-32768] * 40, dtype=np.int16), 100)
    out = resampled(square, [160], 8000)
    assert out.max() == 32767 and out.min() == -32768  # ringing is clipped
