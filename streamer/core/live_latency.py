"""The live sessions' latencies as their users feel them (I/O-free, no clock).

A user judges a server by when the first words of an utterance appear (time to first
token, TTFT) and when its final comes, each counted from the moment the audio concerned
left the client: the segment's first sample for TTFT, its last for the final (what
bench.latency measures on the client). The server sees the same moments less the
network: :class:`ArrivalLog` keeps when each stretch of a session's audio arrived,
and a session's pump records, when the first text and the final of a segment go out,
how long after its audio they go (:class:`LiveLatency`). Admission
(:mod:`streamer.core.capacity`) compares their p95 with its budgets.

A session whose audio arrives faster than real time (a file sent unpaced, as test
harnesses and batch tools do) has no such latency: its audio is there long before the
model can reach it. Its figures are left out, and it is listed in
:attr:`LiveLatency.fast` with its rate (audio seconds per second), so that admission
can say why the model is busy; its pump marks its jobs (``DecodeJob.realtime``), and
the worker decodes them after every real-time session's.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

# latencies are counted in these bins (ms; one more bin holds the longer ones): a p95 is
# the upper edge of its bin, so a measured p95 is never below the truth
LATENCY_BINS_MS = (
    100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1250, 1500, 2000, 3000, 5000, 10000,
)  # fmt: skip
MIN_MEASURED = 10  # fewer latencies in the window: their p95 says nothing
ARRIVALS_KEPT = 2048  # entries of a session's arrival log (the oldest go first)
FAST_RATE = 1.3  # audio seconds per second past which a session is not real-time
FAST_AFTER_S = 3.0  # a session's rate is judged after this long (connection bursts)
FAST_LEAD_S = 2.0  # or as soon as its audio is this far ahead of real time


@dataclass
class LatencyCounts:
    """Cumulative counts of latencies per :data:`LATENCY_BINS_MS` bin."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BINS_MS) + 1))

    def record(self, latency_ms: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BINS_MS, latency_ms)] += 1

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self.counts)


def p95_between(
    first: tuple[int, ...],
    last: tuple[int, ...],
    edges: tuple[int, ...] = LATENCY_BINS_MS,
    min_count: int = MIN_MEASURED,
) -> float:
    """The p95 of the values counted between two snapshots of cumulative bins: the upper
    edge of the bin it falls in (the last edge for the open bin); 0 with fewer than
    ``min_count`` values (too few to say)."""
    if len(first) != len(last) or not last:
        return 0.0
    counts = [b - a for a, b in zip(first, last, strict=True)]
    total = sum(counts)
    if total < min_count:
        return 0.0
    seen = 0
    for index, count in enumerate(counts):
        seen += count
        if seen >= 0.95 * total:
            return float(edges[min(index, len(edges) - 1)])
    return float(edges[-1])


class ArrivalLog:
    """When a session's audio arrived: ``(audio_ms, t_s)`` pairs, audio rising."""

    def __init__(self, kept: int = ARRIVALS_KEPT) -> None:
        self._audio_ms: deque[float] = deque(maxlen=kept)
        self._t_s: deque[float] = deque(maxlen=kept)
        self.first_s: float | None = None  # when the first audio arrived

    def arrived(self, audio_ms: float, t_s: float) -> None:
        """By ``t_s`` the session had ``audio_ms`` of audio in all."""
        if self._audio_ms and audio_ms <= self._audio_ms[-1]:
            return
        if self.first_s is None:
            self.first_s = t_s
        self._audio_ms.append(audio_ms)
        self._t_s.append(t_s)

    def time_of(self, audio_ms: float) -> float | None:
        """When the audio at ``audio_ms`` had arrived; None when the log no longer (or
        not yet) holds it."""
        index = bisect.bisect_left(self._audio_ms, audio_ms)
        if index >= len(self._audio_ms) or (index == 0 and len(self._audio_ms) == self.kept):
            return None  # not arrived, or older than what the log keeps
        return self._t_s[index]

    @property
    def kept(self) -> int:
        return self._audio_ms.maxlen or 0

    def rate(self, now_s: float) -> float:
        """Audio seconds received per second since the first arrived (1: real time);
        0 until :data:`FAST_AFTER_S` have passed, unless the audio is already
        :data:`FAST_LEAD_S` ahead of real time (a short file sent at once)."""
        if self.first_s is None:
            return 0.0
        elapsed_s, audio_s = now_s - self.first_s, self._audio_ms[-1] / 1000
        if elapsed_s < FAST_AFTER_S and audio_s - elapsed_s <= FAST_LEAD_S:
            return 0.0
        return audio_s / max(elapsed_s, 0.1)


@dataclass
class LiveLatency:
    """Every live session's latencies, shared by their pumps (on the event loop)."""

    final: LatencyCounts = field(default_factory=LatencyCounts)  # a final after its audio
    ttft: LatencyCounts = field(default_factory=LatencyCounts)  # first text after speech
    fast: dict[str, float] = field(default_factory=dict)  # session -> rate, faster ones

    def note_rate(self, session_id: str, rate: float) -> bool:
        """A session's input rate; True while it is real-time (its latencies count)."""
        if rate > FAST_RATE:
            self.fast[session_id] = rate
            return False
        self.fast.pop(session_id, None)
        return True

    def forget(self, session_id: str) -> None:
        self.fast.pop(session_id, None)

    @property
    def fast_rate(self) -> float:
        """The faster-than-real-time sessions' audio seconds per second, in all."""
        return sum(self.fast.values())
