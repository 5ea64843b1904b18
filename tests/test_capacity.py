"""Capacity: whether one more session can be served without the others falling behind."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request

import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from streamer.core.capacity import (
    LAGGING,
    LOADED,
    WAIT_BINS_MS,
    CapacityEstimator,
    CapacityOptions,
    LoadSample,
)
from streamer.errors import ConfigError
from tests.fakes import FakeRecognizer
from tests.server_fixtures import messages_until_close
from tests.test_compat_ports import Wyoming, make_ports_server, speech  # noqa: F401
from tests.timing import timeout_s


def run(
    estimator: CapacityEstimator,
    seconds: float,
    *,
    load: float,
    sessions: int,
    start_s: float = 0.0,
    decoded_ms: float = 0.0,
    oldest_ms: float = 0.0,
) -> tuple[float, float]:
    """Feed 10 samples a second of a worker busy ``load`` of the time with finals."""
    now = start_s
    for _ in range(int(seconds * 10)):
        now += 0.1
        decoded_ms += load * 100
        estimator.observe(LoadSample(now, decoded_ms, oldest_ms, sessions))
    return now, decoded_ms


def test_a_server_with_room_admits_and_one_that_would_overload_refuses() -> None:
    estimator = CapacityEstimator(CapacityOptions(max_final_load=0.5, window_s=10))
    # two sessions keep the worker 20 % busy with finals: 10 % each
    run(estimator, 20, load=0.2, sessions=2)
    assert estimator.current.session_load == pytest.approx(0.1, rel=0.02)
    assert estimator.current.saturated is None
    assert estimator.refusal(2) is None  # a third: 30 %
    assert estimator.refusal(3) is None  # a fourth: 40 %
    # sessions admitted since the last sample count at the mean session's cost
    assert estimator.refusal(5) == LOADED  # a sixth: 60 %


def test_a_final_waiting_too_long_saturates_at_once_and_recovery_needs_margin() -> None:
    estimator = CapacityEstimator(
        CapacityOptions(max_final_lag_ms=1000, max_final_load=0.9, recover_ratio=0.5)
    )
    now, total = run(estimator, 10, load=0.1, sessions=1)
    assert estimator.refusal(1) is None
    now, total = run(estimator, 0.1, load=0.1, sessions=1, start_s=now, decoded_ms=total,
                     oldest_ms=1500)  # fmt: skip
    assert estimator.current.saturated == LAGGING and estimator.refusal(1) == LAGGING
    # below the limit but not below half of it: still saturated (no flapping)
    now, total = run(estimator, 1, load=0.1, sessions=1, start_s=now, decoded_ms=total,
                     oldest_ms=800)  # fmt: skip
    assert estimator.current.saturated == LAGGING
    run(estimator, 1, load=0.1, sessions=1, start_s=now, decoded_ms=total, oldest_ms=100)
    assert estimator.current.saturated is None and estimator.refusal(1) is None
    assert estimator.saturations == 1


def test_a_loaded_server_recovers_when_sessions_end() -> None:
    estimator = CapacityEstimator(
        CapacityOptions(max_final_load=0.5, recover_ratio=0.8, window_s=10)
    )
    now, total = run(estimator, 20, load=0.6, sessions=4)
    assert estimator.current.saturated == LOADED
    # two sessions leave: 30 % now, and with a third 45 %: above 0.8 x 50 %, still refused
    now, total = run(estimator, 20, load=0.3, sessions=2, start_s=now, decoded_ms=total)
    assert estimator.current.saturated == LOADED
    # one more leaves: 15 %, with a second 30 %
    run(estimator, 20, load=0.15, sessions=1, start_s=now, decoded_ms=total)
    assert estimator.current.saturated is None


def test_the_load_of_sessions_gone_refuses_no_new_one() -> None:
    estimator = CapacityEstimator(CapacityOptions(max_final_load=0.5, window_s=10))
    run(estimator, 20, load=0.9, sessions=1)  # one unpaced client, say
    assert estimator.current.saturated == LOADED and estimator.refusal(1) == LOADED
    assert estimator.refusal(0) is None  # it has left: the next one is admitted


def test_nothing_is_projected_from_too_short_a_window_or_from_no_sessions() -> None:
    estimator = CapacityEstimator(CapacityOptions(max_final_load=0.5, window_s=10))
    run(estimator, 1, load=1.0, sessions=1)  # 1 s of a 10 s window
    assert estimator.current.final_load == 0.0 and estimator.refusal(1) is None
    idle = CapacityEstimator(CapacityOptions(max_final_load=0.5, window_s=10))
    run(idle, 20, load=0.0, sessions=0)
    assert idle.refusal(0) is None


def test_the_load_is_the_workers_average() -> None:
    estimator = CapacityEstimator(CapacityOptions(max_final_load=0.55, window_s=10))
    decoded, now = 0.0, 0.0
    for _ in range(200):  # two workers, each 40 % busy with finals
        now += 0.1
        decoded += 80
        estimator.observe(LoadSample(now, decoded, 0.0, 4, workers=2))
    assert estimator.current.final_load == pytest.approx(0.4, rel=0.02)
    assert estimator.refusal(4) is None and estimator.refusal(5) == LOADED  # 50 %, 60 %


def test_disabled_admits_whatever_the_load() -> None:
    estimator = CapacityEstimator(CapacityOptions(enabled=False))
    run(estimator, 20, load=1.0, sessions=1, oldest_ms=60_000)
    assert estimator.current.saturated is None and estimator.refusal(100) is None


def feed(
    estimator: CapacityEstimator,
    seconds: float,
    *,
    load: float,
    rtf: float,
    decode_ms: float,
    sessions: int,
    partial_load: float = 0.0,
    interruptible: bool = True,
    start: LoadSample | None = None,
) -> LoadSample:
    """10 samples a second of finals taking ``load`` of the worker's time, each decoded
    in ``decode_ms`` at ``rtf`` decode time per audio time; the last sample."""
    s = start or LoadSample(0.0, 0.0, 0.0, sessions)
    for _ in range(int(seconds * 10)):
        busy_ms = load * 100
        s = LoadSample(
            s.now_s + 0.1,
            s.final_decode_ms_total + busy_ms,
            0.0,
            sessions,
            final_audio_ms_total=s.final_audio_ms_total + busy_ms / rtf,
            final_decode_sq_ms_total=s.final_decode_sq_ms_total + busy_ms * decode_ms,
            partial_decode_ms_total=s.partial_decode_ms_total + partial_load * 100,
            interruptible=interruptible,
        )
        estimator.observe(s)
    return s


def test_new_sessions_count_at_the_real_time_factor_until_the_window_has_measured_them():
    """Ten clients joining one a second had not spoken yet when the next came: counted
    at the mean measured per open session they diluted it, and six were admitted where
    one fitted (bench/RESULTS.md). Now each counts at the finals' real-time factor (a
    session that speaks all the time) until the window has measured it."""
    options = CapacityOptions(max_final_load=0.5, max_final_wait_ms=1e9, window_s=10)
    estimator = CapacityEstimator(options)
    last = feed(estimator, 20, load=0.1, rtf=0.1, decode_ms=100, sessions=1)
    assert estimator.current.session_load == pytest.approx(0.1)
    for joined in (2, 3, 4):
        estimator.admitted(last.now_s)
        last = feed(estimator, 1, load=0.1, rtf=0.1, decode_ms=100, sessions=joined, start=last)
    assert estimator.current.young == 3
    assert estimator.refusal(4) is None  # 0.1 measured + 4 x 0.1 = 0.5: at the limit
    estimator.admitted(last.now_s)
    last = feed(estimator, 1, load=0.1, rtf=0.1, decode_ms=100, sessions=5, start=last)
    assert estimator.refusal(5) == LOADED and estimator.current.saturated == LOADED
    # they stay silent: once the window has measured them (no load), they cost nothing
    feed(estimator, 12, load=0.1, rtf=0.1, decode_ms=100, sessions=5, start=last)
    assert estimator.current.young == 0
    assert estimator.current.saturated is None and estimator.refusal(5) is None


def test_the_wait_rule_admits_where_a_collision_is_short_and_refuses_where_it_is_long():
    """2 CPU cores, the real-size model: a final takes up to 0.4 s, and one more session
    makes the others' finals wait behind its own. A GPU's 30 ms decodes at 30 % load
    make no final wait long."""
    cpu = dict(load=0.075, rtf=0.06, decode_ms=400, sessions=1)
    lenient = CapacityEstimator(CapacityOptions(max_final_wait_ms=100))
    # the one session measured 0.075, more than the real-time factor: the new one
    # counts at that: p95 = 200 / (1 - 0.15) x ln(0.075 / 0.05) = 95 ms
    feed(lenient, 20, **cpu)
    assert lenient.current.projected_wait_ms == pytest.approx(95.4, abs=0.5)
    assert lenient.refusal(1) is None
    strict = CapacityEstimator(CapacityOptions(max_final_wait_ms=50))
    feed(strict, 20, **cpu)
    assert strict.refusal(1) == LOADED and strict.current.saturated == LOADED
    assert strict.current.as_dict()["projected_wait_ms"] == 95
    gpu = CapacityEstimator(CapacityOptions(max_final_wait_ms=100))
    feed(gpu, 20, load=0.3, rtf=0.005, decode_ms=30, sessions=60)
    assert 0 < gpu.current.projected_wait_ms < 50 and gpu.refusal(60) is None
    alone = CapacityEstimator(CapacityOptions(max_final_wait_ms=1))  # nobody to wait for
    feed(alone, 20, load=0.5, rtf=0.5, decode_ms=400, sessions=0)
    assert alone.refusal(0) is None


def test_partials_count_in_the_wait_where_a_final_cannot_stop_them():
    busy = dict(load=0.075, rtf=0.06, decode_ms=400, sessions=1, partial_load=0.5)
    stopped = CapacityEstimator(CapacityOptions(max_final_wait_ms=100))
    feed(stopped, 20, **busy, interruptible=True)
    assert stopped.refusal(1) is None  # ONNX Runtime: a final stops a partial's decode
    waits = CapacityEstimator(CapacityOptions(max_final_wait_ms=100))
    feed(waits, 20, **busy, interruptible=False)  # busy 0.575 of the time: ln(11.5)
    assert waits.current.projected_wait_ms == pytest.approx(575, abs=2)
    assert waits.refusal(1) == LOADED


def test_what_the_finals_measured_they_waited_refuses_when_the_projection_says_less():
    """The projection is a model; the finals' measured waits are the check on it: a
    p95 over the limit refuses one more session whatever the model says, and fewer than
    MIN_MEASURED_FINALS finals in the window say nothing."""
    bins = len(WAIT_BINS_MS) + 1
    over = WAIT_BINS_MS.index(150)  # the bin of waits of 101-150 ms

    def waits(short: int, long: int) -> tuple[int, ...]:
        counts = [0] * bins
        counts[0], counts[over] = short, long
        return tuple(counts)

    estimator = CapacityEstimator(CapacityOptions(max_final_wait_ms=100, window_s=10))
    now = 0.0
    for step in range(100):  # 10 s: a final each 0.1 s, every tenth waits 101-150 ms
        now += 0.1
        finals = step + 1
        counted = waits(finals - finals // 10, finals // 10)
        estimator.observe(LoadSample(now, 0.0, 0.0, 2, final_waits=counted))
    assert estimator.current.measured_wait_ms == 150
    assert estimator.current.projected_wait_ms == 0  # no decode time: the model sees none
    assert estimator.refusal(2) == LOADED
    assert estimator.current.as_dict()["measured_wait_ms"] == 150
    few = CapacityEstimator(CapacityOptions(max_final_wait_ms=100, window_s=10))
    for step in range(100):  # the same share over 10 finals
        few.observe(LoadSample(step * 0.1, 0.0, 0.0, 2, final_waits=waits(9, step // 50)))
    assert few.current.measured_wait_ms == 0 and few.refusal(2) is None
    fine = CapacityEstimator(CapacityOptions(max_final_wait_ms=100, window_s=10))
    for step in range(100):  # one in thirty waits long: under 5 %
        fine.observe(LoadSample(step * 0.1, 0.0, 0.0, 2, final_waits=waits(step, step // 30)))
    assert fine.current.measured_wait_ms == 10 and fine.refusal(2) is None


@pytest.mark.parametrize(
    "options",
    [
        {"max_final_wait_ms": 0},
        {"max_final_lag_ms": 0},
        {"max_final_load": 0},
        {"max_final_load": 1.5},
        {"window_s": 0},
        {"recover_ratio": 0},
        {"max_final_lag_ms": float("nan")},
    ],
)
def test_impossible_options_are_refused(options: dict) -> None:
    with pytest.raises(ConfigError):
        CapacityOptions(**options)


# -- the server: refused on every protocol while saturated, admitted again after ----------


class GatedRecognizer(FakeRecognizer):
    """Decodes only while :attr:`gate` is open (a model far slower than real time)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def decode(self, pcm, *, language="auto", use_itn=True):
        self.gate.wait(timeout_s(60))
        return super().decode(pcm, language=language, use_itn=use_itn)


def http_get(url: str) -> tuple[int, dict, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s(5)) as response:
            return response.status, orjson.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, orjson.loads(error.read()), dict(error.headers)


async def test_a_server_whose_finals_wait_refuses_new_sessions_until_it_catches_up(
    make_ports_server,  # noqa: F811  (the fixture)
) -> None:
    recognizer = GatedRecognizer()
    server = make_ports_server(lambda: recognizer, capacity=CapacityOptions(max_final_lag_ms=300))
    readyz = f"{server.http_url}/readyz"
    assert (await asyncio.to_thread(http_get, readyz))[0] == 200
    async with connect(server.url + "?partials=false") as ws:
        assert orjson.loads(await ws.recv())["type"] == "ready"
        # two utterances: the first final is decoding (held), the second waits in the queue
        await ws.send(speech(2).tobytes())
        deadline = time.monotonic() + timeout_s(10)
        while (status := await asyncio.to_thread(http_get, readyz))[0] == 200:
            assert time.monotonic() < deadline, f"never saturated: {status}"
            await asyncio.sleep(0.05)
        code, body, headers = status
        assert (code, body["status"], body["reason"]) == (503, "saturated", LAGGING)
        assert body["oldest_final_age_ms"] > 300 and headers["Retry-After"]
        with pytest.raises(InvalidStatus) as refused:
            await connect(server.url)
        assert refused.value.response.status_code == 503
        assert refused.value.response.headers["Retry-After"]
        assert orjson.loads(refused.value.response.body)["error"] == "saturated"
        refused_wyoming = await Wyoming.open(server)
        (error,) = await refused_wyoming.events()
        assert (error.type, error.data["code"]) == ("error", "saturated")
        refused_wyoming.writer.close()
        metrics = await asyncio.to_thread(
            lambda: urllib.request.urlopen(
                server.http_url + "/metrics", timeout=timeout_s(5)
            ).read()
        )
        assert b"streamer_saturated 1.0" in metrics
        assert b'streamer_handshakes_rejected_total{protocol="v1",reason="saturated"}' in metrics
        # the open session is served on: its finals come once the model catches up
        recognizer.gate.set()
        await ws.send('{"type":"stop"}')
        messages, close_code = await messages_until_close(ws)
    assert close_code == 1000
    assert [m["type"] for m in messages].count("final") == 2
    deadline = time.monotonic() + timeout_s(10)
    while (await asyncio.to_thread(http_get, readyz))[0] != 200:
        assert time.monotonic() < deadline, "never admitted again"
        await asyncio.sleep(0.05)
    async with connect(server.url) as ws:
        assert orjson.loads(await ws.recv())["type"] == "ready"
