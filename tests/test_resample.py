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


@pytest.mark.parametrize("in_rate", [8000, 22050, 44100, 48000])
def test_drain_gives_the_held_back_samples_and_the_stream_goes_on(in_rate: int) -> None:
    """soxr holds back up to ~115 ms of output; a finalize's drain gives it at once
    (what a flush would give, within 1 LSB) without ending or changing the stream."""
    rng = np.random.default_rng(3)
    pcm = (rng.standard_normal(in_rate * 2) * 4000).astype(np.int16)
    cut = in_rate + 1234  # not on a chunk edge nor a period edge
    plain = resampled(pcm, [in_rate // 50], in_rate)

    flushed = StreamResampler(in_rate, 16000)
    head = np.concatenate([flushed.push(pcm[:cut]), flushed.flush()])
    assert head.size == round(cut * 16000 / in_rate)

    drained = StreamResampler(in_rate, 16000)
    before = drained.push(pcm[:cut])
    held = drained.drain()
    assert before.size + held.size == head.size == drained.out_samples
    assert held.size > 0 and drained.drain().size == 0  # nothing twice
    assert np.array_equal(before, head[: before.size])
    assert np.abs(held.astype(int) - head[before.size :]).max() <= 1
    rest = [drained.push(pcm[i : i + 777]) for i in range(cut, pcm.size, 777)]
    after = np.concatenate([before, held, *rest, drained.flush()])
    assert after.size == plain.size == drained.out_samples
    # past the drained samples, the stream is exactly the undrained one
    assert np.array_equal(after[head.size :], plain[head.size :])
    assert np.array_equal(after[: before.size], plain[: before.size])
