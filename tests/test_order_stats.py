"""The sorted-window percentiles equal numpy's, bit for bit (the segmenter relies on it)."""

import random

import numpy as np
import pytest

from streamer.core.order_stats import SortedWindow, median_of_sorted, percentile_of_sorted
from streamer.core.segmenter import Segmenter, SegmenterOptions


def _samples(rng: random.Random, n: int) -> list[float]:
    kind = rng.choice(("wide", "ties", "float32"))
    if kind == "ties":
        return [float(rng.choice((0.0, 1.0, 7.5, 1e6))) for _ in range(n)]
    if kind == "float32":  # what frame_energy returns: float32 values as floats
        return [float(np.float32(rng.lognormvariate(8, 3))) for _ in range(n)]
    return [rng.uniform(0, 1e9) * rng.random() ** 4 for _ in range(n)]


@pytest.mark.parametrize("q", [5, 0, 50, 95, 100, 37.5])
def test_percentile_of_sorted_is_numpys(q):
    rng = random.Random(q)
    for n in list(range(1, 60)) + [499, 500, 501]:
        values = _samples(rng, n)
        expected = float(np.percentile(np.asarray(values, np.float64), q))
        assert percentile_of_sorted(sorted(values), q) == expected, (n, q)


def test_median_of_sorted_is_numpys():
    rng = random.Random(1)
    for n in list(range(1, 80)) + [349, 350]:
        values = _samples(rng, n)
        expected = float(np.median(np.asarray(values, np.float64)))
        assert median_of_sorted(sorted(values)) == expected, n


def test_sorted_window_keeps_the_last_values_sorted():
    rng = random.Random(2)
    window = SortedWindow(7)
    pushed: list[float] = []
    for _ in range(200):
        value = float(rng.choice((1.0, 2.0, 3.0, rng.random())))
        window.push(value)
        pushed.append(value)
        assert window.sorted == sorted(pushed[-7:])
        assert len(window) == min(7, len(pushed))


def _numpy_threshold(seg: Segmenter, history: list[float], speech: list[float]) -> float | None:
    """The dip threshold as the segmenter computed it with numpy before (the reference)."""
    if len(speech) < 25:
        return None
    floor = max(float(np.percentile(np.asarray(history, np.float64), 5)), 1.0)
    level = float(np.median(np.asarray(speech, np.float64)))
    if level < floor * seg._contrast:
        return None
    return float(np.sqrt(floor * level))


def test_segmenter_dip_threshold_is_the_numpy_estimate():
    """Across segments, cuts and dips, every re-estimate equals the numpy formula."""
    rng = random.Random(3)
    options = SegmenterOptions(floor_window_ms=2000)
    seg = Segmenter(options)
    history: list[float] = []
    checked = 0
    for i in range(20000):
        speaking = (i // 300) % 3 != 0  # 6 s of speech, 3 s of quiet
        is_speech = speaking and rng.random() < 0.9
        energy = float(np.float32(rng.lognormvariate(12 if is_speech else 5, 1.5)))
        was_open = seg.in_segment
        seg.push(is_speech, energy)
        history = (history + [energy])[-100:]
        if was_open and seg.in_segment and seg._frame_index % 10 == 0:
            expected = _numpy_threshold(seg, history, seg._speech_energies)
            assert seg._dip_threshold == expected, i
            checked += expected is not None
    assert checked > 100
