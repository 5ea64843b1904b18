"""Reading the server's ``/metrics`` (Prometheus text) between two scrapes, free of I/O.

The bench scrapes before and after each step and works on the difference, so counters
and histograms that grew during earlier steps do not leak into this one. Every metric is
optional: a server without a given name yields ``None`` for it, never an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# sample name + sorted labels -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_samples(text: str) -> Samples:
    """Every sample of a scrape, keyed by ``(name, sorted label pairs)``."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            samples[key] = float(sample.value)
    return samples


def _matches(labels: tuple[tuple[str, str], ...], wanted: Mapping[str, str]) -> bool:
    have = dict(labels)
    return all(have.get(k) == v for k, v in wanted.items())


def value(samples: Samples, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """Sum of the samples called ``name`` whose labels include ``labels``; None if absent."""
    found = [v for (n, ls), v in samples.items() if n == name and _matches(ls, labels or {})]
    return sum(found) if found else None


def delta(
    before: Samples, after: Samples, name: str, labels: Mapping[str, str] | None = None
) -> float | None:
    """How much a counter grew between two scrapes (None when the server lacks it)."""
    end = value(after, name, labels)
    if end is None:
        return None
    return end - (value(before, name, labels) or 0.0)


@dataclass(frozen=True)
class HistogramDelta:
    """What a histogram recorded between two scrapes."""

    count: float  # observations
    sum: float  # their total (seconds for *_seconds histograms)
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), rising

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, self.buckets)


def histogram_delta(
    before: Samples, after: Samples, name: str, labels: Mapping[str, str] | None = None
) -> HistogramDelta | None:
    """The observations a histogram ``name`` gained between scrapes; None if absent."""
    count = delta(before, after, f"{name}_count", labels)
    total = delta(before, after, f"{name}_sum", labels)
    if count is None or total is None:
        return None
    bounds: dict[float, float] = {}
    for (n, ls), _ in after.items():
        if n != f"{name}_bucket" or not _matches(ls, labels or {}):
            continue
        le = dict(ls).get("le")
        if le is None:
            continue
        bound = float(le)
        if bound in bounds:
            continue
        bucket_labels = {**(labels or {}), "le": le}
        bounds[bound] = delta(before, after, f"{name}_bucket", bucket_labels) or 0.0
    buckets = tuple(sorted(bounds.items()))
    return HistogramDelta(count=count, sum=total, buckets=buckets)


def histogram_quantile(q: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative ``(le, count)`` buckets.

    Linear interpolation inside the bucket that holds the quantile; a quantile that falls
    in the ``+Inf`` bucket answers the highest finite bound. None without observations.
    """
    if not buckets or not 0.0 <= q <= 1.0:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return previous_bound
            in_bucket = count - previous_count
            if in_bucket <= 0:
                return bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / in_bucket
        previous_bound, previous_count = bound, count
    return previous_bound
