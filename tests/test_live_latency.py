"""The live sessions' latencies as users feel them (core/live_latency.py, no server)."""

from __future__ import annotations

import pytest

from streamer.core.live_latency import (
    FAST_AFTER_S,
    FAST_RATE,
    LATENCY_BINS_MS,
    ArrivalLog,
    LatencyCounts,
    LiveLatency,
    p95_between,
)


def test_a_latency_is_counted_after_the_arrival_of_its_audio() -> None:
    log = ArrivalLog()
    for k in range(1, 11):  # 100 ms of audio every 0.1 s, from t = 5 s
        log.arrived(100.0 * k, 5.0 + 0.1 * k)
    assert log.time_of(0.0) == 5.1  # in the first chunk
    assert log.time_of(250.0) == 5.3  # the chunk that held it
    assert log.time_of(1000.0) == 6.0
    assert log.time_of(1000.1) is None  # not arrived yet
    log.arrived(900.0, 7.0)  # no new audio: ignored
    assert log.time_of(1000.0) == 6.0


def test_what_the_log_no_longer_holds_has_no_time() -> None:
    log = ArrivalLog(kept=4)
    for k in range(1, 9):
        log.arrived(100.0 * k, 0.1 * k)
    assert log.time_of(350.0) is None  # dropped with the oldest entries
    assert log.time_of(650.0) == pytest.approx(0.7)


def test_a_session_faster_than_real_time_is_named_and_left_out() -> None:
    real, fast = ArrivalLog(), ArrivalLog()
    for k in range(1, 41):
        real.arrived(100.0 * k, 0.1 * k)
        fast.arrived(1000.0 * k, 0.1 * k)  # ten times real time
    early = ArrivalLog()
    for k in range(1, 21):
        early.arrived(100.0 * k, 0.1 * k)
    assert early.rate(2.0) == 0.0  # too early to judge
    burst = ArrivalLog()
    burst.arrived(3000.0, 10.0)  # a 3 s file sent at once: ahead of real time already
    assert burst.rate(10.05) > FAST_RATE
    assert FAST_AFTER_S < 4.0
    live = LiveLatency()
    assert live.note_rate("a", real.rate(4.1))
    assert not live.note_rate("b", fast.rate(4.1))
    assert live.fast == {"b": fast.rate(4.1)} and 9 < live.fast_rate < 11
    live.forget("b")
    assert live.fast == {}


def test_p95_is_the_upper_edge_of_its_bin_and_needs_enough_values() -> None:
    counts = LatencyCounts()
    before = counts.snapshot()
    for _ in range(19):
        counts.record(250)
    counts.record(4000)
    assert p95_between(before, counts.snapshot()) == 300
    counts.record(4000)  # 2 in 21: past 5 %
    assert p95_between(before, counts.snapshot()) == 5000
    counts.record(60_000)
    assert p95_between(before, counts.snapshot(), min_count=100) == 0
    assert len(counts.snapshot()) == len(LATENCY_BINS_MS) + 1
