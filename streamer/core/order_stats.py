"""Percentiles of a sliding window, kept sorted as values come and go (I/O-free).

The segmenter re-estimates its dip threshold from a percentile of the last 10 s of
frame energies and the median of a segment's speech energies. ``np.percentile`` over
a fresh array costs about 100 µs (mostly numpy's Python-level set-up), every 10 frames
of every stream; keeping the values sorted as they arrive costs a bisection and a
short memmove per frame, and the percentile is then two lookups.

The results are exactly ``np.percentile(values, q)`` and ``np.median(values)`` (numpy's
default ``linear`` method, float64), computed with the same floating-point operations
in the same order: tests/test_order_stats.py checks them bit for bit.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque


def percentile_of_sorted(values: list[float], q: float) -> float:
    """``np.percentile(values, q)`` for ascending, non-empty, NaN-free ``values``."""
    n = len(values)
    virtual = (n - 1) * (q / 100)  # numpy: q / 100, then (n - 1) * q
    if virtual >= n - 1:
        return values[-1]
    previous = math.floor(virtual)
    a, b = values[previous], values[previous + 1]
    gamma = virtual - previous
    diff = b - a
    if gamma >= 0.5:  # numpy's _lerp: the form that is exact at the upper end
        return b - diff * (1 - gamma)
    return a + diff * gamma


def median_of_sorted(values: list[float]) -> float:
    """``np.median(values)`` for ascending, non-empty, NaN-free ``values``."""
    n = len(values)
    half = n // 2
    if n % 2:
        return values[half]
    return (values[half - 1] + values[half]) / 2


class SortedWindow:
    """The last ``size`` values pushed, also kept in ascending order."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError("size must be positive")
        self.size = size
        self._fifo: deque[float] = deque()
        self.sorted: list[float] = []  # ascending; read it, do not change it

    def __len__(self) -> int:
        return len(self._fifo)

    def push(self, value: float) -> None:
        """Add ``value``; the oldest value leaves once the window is full."""
        if len(self._fifo) == self.size:
            oldest = self._fifo.popleft()
            del self.sorted[bisect_left(self.sorted, oldest)]
        self._fifo.append(value)
        insort(self.sorted, value)
