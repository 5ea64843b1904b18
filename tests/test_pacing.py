"""Input pacing: one client is read no faster than its frame and byte rates allow."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from websockets.asyncio.client import connect

from streamer.core.pacing import BudgetLimits, InputBudget, InputPacer, PacingLimits
from streamer.errors import ConfigError
from streamer.server.server import ConnectionLimits
from tests.timing import timeout_s


def test_a_client_within_its_rates_and_burst_is_never_held() -> None:
    pacer = InputPacer(PacingLimits(max_messages_per_s=100, max_bytes_per_s=10_000), 0.0)
    # 100 messages of 100 bytes a second: exactly the rates, for 10 s
    waits = [pacer.charge(i / 100, 100) for i in range(1000)]
    assert max(waits) == 0.0 and pacer.throttled_s == 0.0 and pacer.waits == 0
    # a burst of one second's worth at once is allowed too
    burst = InputPacer(PacingLimits(max_messages_per_s=100, max_bytes_per_s=1e9), 0.0)
    assert [burst.charge(0.0, 1) for _ in range(100)] == [0.0] * 100


def test_past_its_burst_a_flood_is_read_at_the_message_rate() -> None:
    pacer = InputPacer(PacingLimits(max_messages_per_s=100, max_bytes_per_s=1e9), 0.0)
    now = 0.0
    for _ in range(1000):  # the reader waits what it is told, then reads the next at once
        now += pacer.charge(now, 1)
    # 1000 messages: 1 s of burst, then 100 a second
    assert now == pytest.approx(9.0)
    assert pacer.throttled_s == pytest.approx(9.0)
    assert pacer.waits == 900  # every read past the burst


def test_big_frames_are_held_to_the_byte_rate() -> None:
    pacer = InputPacer(PacingLimits(max_messages_per_s=1e6, max_bytes_per_s=32_000), 0.0)
    now = 0.0
    for _ in range(100):  # 100 s of 16 kHz int16 audio in 1 s frames, as fast as allowed
        now += pacer.charge(now, 32_000)
    assert now == pytest.approx(99.0)  # real time, after a 1 s burst


def test_a_client_that_paused_gets_no_credit_beyond_its_burst() -> None:
    pacer = InputPacer(PacingLimits(max_messages_per_s=10, max_bytes_per_s=1e9), 0.0)
    assert pacer.charge(100.0, 1) == 0.0  # after 100 s of silence
    waits = [pacer.charge(100.0, 1) for _ in range(20)]
    # 21 messages at 10 a second, 1 s of burst: the 11th is the first held, the 21st 1.1 s
    assert waits[:9] == [0.0] * 9 and waits[-1] == pytest.approx(1.1)


@pytest.mark.parametrize(
    "limits",
    [
        {"max_messages_per_s": 0},
        {"max_bytes_per_s": -1},
        {"burst_s": -0.5},
    ],
)
def test_impossible_limits_are_refused(limits: dict) -> None:
    with pytest.raises(ConfigError):
        PacingLimits(**limits)
    if "burst_s" not in limits:
        name = next(iter(limits))
        with pytest.raises(ConfigError):
            ConnectionLimits(**{name.replace("max_", "max_input_"): limits[name]})


async def test_a_server_reads_a_flood_of_tiny_frames_at_its_rate_and_loses_none(
    make_fake_server,
) -> None:
    """1-byte frames as fast as the client can send: read at the rate (not faster),
    every byte counted, and /metrics says the client was paced."""
    frames, rate = 600, 200.0
    server = make_fake_server(max_input_messages_per_s=rate)
    started = time.monotonic()
    async with connect(server.url, ping_interval=None) as ws:
        for _ in range(frames):
            await ws.send(b"\x01")
        await ws.send('{"type":"stop"}')
        messages = [json.loads(message) async for message in ws]
    elapsed = time.monotonic() - started
    (end,) = [m for m in messages if m["type"] == "end"]
    # every byte reached the session
    assert end["audio_ms"] == pytest.approx(frames / 2 / 16, abs=0.1)
    # 1 s of burst (200 frames), then 200 a second: 600 frames take at least 2 s
    assert elapsed >= (frames - rate) / rate * 0.95
    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=timeout_s(10)) as response:
        metrics = response.read().decode()
    paced = next(
        float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("streamer_input_paced_seconds_total ")
    )
    assert paced > 1.0


def test_a_flood_within_each_connections_limit_is_held_to_the_total_budget() -> None:
    budget = InputBudget(BudgetLimits(max_messages_per_s=1000, max_bytes_per_s=1e9), 0.0, 9)
    limits = PacingLimits(max_messages_per_s=1000, max_bytes_per_s=1e9)
    flooders = [InputPacer(limits, 0.0, budget) for _ in range(8)]
    healthy = InputPacer(limits, 0.0, budget)
    read = [0.0] * 8  # when each flooder may read next
    healthy_waits = []
    for step in range(1, 1001):  # 10 s in 10 ms steps
        now = step / 100
        for i, pacer in enumerate(flooders):
            while read[i] <= now:  # reads as fast as it is allowed
                read[i] = now + pacer.charge(now, 2)
        healthy_waits.append(healthy.charge(now, 640))  # 100 frames a second
    # the flooders together were held near the total (1000 a second, after the bursts)
    assert budget.throttled_s > 0 and budget.waits > 0
    assert sum(p.waits for p in flooders) > 0
    assert all(w == 0.0 for w in healthy_waits)  # well within its share (111 a second)


def test_a_budget_within_its_rates_holds_nobody_back() -> None:
    budget = InputBudget(BudgetLimits(max_messages_per_s=1000, max_bytes_per_s=1e9), 0.0, 2)
    pacers = [InputPacer(PacingLimits(max_messages_per_s=1e6), 0.0, budget) for _ in range(2)]
    # one connection alone may use the whole budget: 900 a second, for 10 s
    waits = [pacers[0].charge(i / 900, 1) for i in range(9000)]
    assert max(waits) == 0.0 and budget.waits == 0


@pytest.mark.parametrize("limits", [{"max_messages_per_s": 0}, {"max_bytes_per_s": -1}])
def test_impossible_budgets_are_refused(limits: dict) -> None:
    with pytest.raises(ConfigError):
        BudgetLimits(**limits)
