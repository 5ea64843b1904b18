"""What the bench watches besides its clients: the server process, the GPU, ``/metrics``.

:class:`Monitor` samples in the background of a step (an asyncio task) and returns a
plain summary; every source is optional (no pid, no GPU, no ``/metrics`` name) and
missing ones read as ``None``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import numpy as np
import psutil

from bench.common import http_get, nvidia_smi, tree_rss_mb
from bench.common import machine_info as machine_info  # where bench.latency.cli finds it
from bench.latency import prom

logger = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 1.0  # process / GPU / gauge sampling period


def scrape(http_base: str) -> prom.Samples:
    """The server's ``/metrics`` parsed; empty when it cannot be read."""
    status, body = http_get(f"{http_base}/metrics")
    if status != 200:
        return {}
    try:
        return prom.parse_samples(body)
    except ValueError:
        logger.warning("could not parse %s/metrics", http_base, exc_info=True)
        return {}


def find_listening_pid(port: int) -> int | None:
    """The pid listening on TCP ``port`` on this machine, if it can be seen."""
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                return conn.pid
    except (psutil.AccessDenied, OSError):
        return None
    return None


def _tree_cpu_s(process: psutil.Process | None) -> float:
    if process is None:
        return 0.0
    total = 0.0
    with contextlib.suppress(psutil.NoSuchProcess):
        for proc in [process, *process.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                times = proc.cpu_times()
                total += times.user + times.system
    return total


def other_cpu_now(pid: int | None, interval_s: float = 2.0) -> float:
    """CPU used by everything but the server (``pid`` and children) and this process
    over the next ``interval_s`` (blocking), 100 = one core."""
    server = psutil.Process(pid) if pid and psutil.pid_exists(pid) else None
    me = psutil.Process()
    start = time.monotonic()
    sys_before = psutil.cpu_times()
    mine_before = _tree_cpu_s(server) + _tree_cpu_s(me)
    time.sleep(interval_s)
    sys_after = psutil.cpu_times()
    mine_after = _tree_cpu_s(server) + _tree_cpu_s(me)
    wall = time.monotonic() - start
    busy = (sys_after.user + sys_after.system + getattr(sys_after, "nice", 0.0)) - (
        sys_before.user + sys_before.system + getattr(sys_before, "nice", 0.0)
    )
    return max(0.0, 100.0 * (busy - (mine_after - mine_before)) / wall)


def _summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "max": None}
    return {"mean": sum(values) / len(values), "max": max(values)}


SERIES = (  # what a step's summary reports of the samples, each as its mean and max
    "process_cpu_pct",  # the server's process tree, 100 = one core busy
    "process_rss_mib",
    "system_cpu_pct",  # the whole machine: other load shows here
    "bench_cpu_pct",  # this load generator
    "gpu_util_pct",
    "gpu_mem_mib",
    "sessions_active",
    "worker_queue_depth",
)


class Monitor:
    """Samples the server process, the GPU and ``/metrics`` gauges while a step runs."""

    def __init__(self, http_base: str, pid: int | None) -> None:
        self.http_base = http_base
        self._process = psutil.Process(pid) if pid and psutil.pid_exists(pid) else None
        self._series: dict[str, list[float]] = {name: [] for name in (*SERIES, "loop_lag")}
        self._bench = psutil.Process()
        self._bench.cpu_percent()
        psutil.cpu_percent()
        self._task: asyncio.Task[None] | None = None
        self._before: prom.Samples = {}
        self._last_cpu: tuple[float, float] | None = None

    def _add(self, name: str, value: float | None) -> None:
        if value is not None:
            self._series[name].append(value)

    def _sample(self) -> None:
        now = time.monotonic()
        if self._process is not None:
            cpu_s = _tree_cpu_s(self._process)
            if self._last_cpu is not None and now > self._last_cpu[1]:
                busy = 100.0 * (cpu_s - self._last_cpu[0]) / (now - self._last_cpu[1])
                self._add("process_cpu_pct", busy)
            self._last_cpu = (cpu_s, now)
            self._add("process_rss_mib", tree_rss_mb(self._process.pid))
        self._add("system_cpu_pct", psutil.cpu_percent() * (psutil.cpu_count() or 1))
        self._add("bench_cpu_pct", self._bench.cpu_percent())
        with contextlib.suppress(ValueError):  # utilization (%), memory used (MiB) per GPU
            gpus = np.array(nvidia_smi("utilization.gpu,memory.used", units=False), float)
            if gpus.size:
                self._add("gpu_util_pct", float(gpus[:, 0].max()))
                self._add("gpu_mem_mib", float(gpus[:, 1].sum()))
        samples = scrape(self.http_base)
        self._add("sessions_active", prom.value(samples, "streamer_sessions_active"))
        self._add("loop_lag", prom.value(samples, "streamer_event_loop_lag_seconds"))
        self._add("worker_queue_depth", prom.value(samples, "streamer_worker_queue_depth"))

    async def _run(self) -> None:
        while True:
            await asyncio.to_thread(self._sample)
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    async def start(self) -> None:
        self._before = await asyncio.to_thread(scrape, self.http_base)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> dict[str, Any]:
        """Stop sampling; the step's summary (server metrics as differences over it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        after = await asyncio.to_thread(scrape, self.http_base)
        return {
            **{name: _summary(self._series[name]) for name in SERIES},
            "loadavg_1m": os.getloadavg()[0],
            "server": server_metrics(self._before, after, self._series["loop_lag"]),
        }


def server_metrics(
    before: prom.Samples, after: prom.Samples, loop_lag: list[float] | None = None
) -> dict[str, Any]:
    """The ``streamer_*`` metrics that moved during a step (missing names are None)."""
    out: dict[str, Any] = {"metrics_available": bool(after)}
    for kind in ("partial", "final"):
        hist = prom.histogram_delta(before, after, "streamer_decode_seconds", {"kind": kind})
        out[f"decode_{kind}_s"] = _hist_summary(hist)
    for kind in ("partial", "final"):
        hist = prom.histogram_delta(before, after, "streamer_queue_wait_seconds", {"kind": kind})
        out[f"queue_wait_{kind}_s"] = _hist_summary(hist)
    lag_hist = prom.histogram_delta(before, after, "streamer_event_loop_lag_seconds")
    out["event_loop_lag_s"] = _hist_summary(lag_hist)
    if lag_hist is None and loop_lag is not None:
        out["event_loop_lag_s"] = _summary(loop_lag)  # exposed as a gauge instead
    out["partials_skipped"] = prom.delta(before, after, "streamer_partials_skipped_total")
    out["partials_sent"] = prom.delta(before, after, "streamer_partials_sent_total")
    out["server_ttft_s"] = _hist_summary(
        prom.histogram_delta(before, after, "streamer_time_to_first_partial_seconds")
    )
    return out


def _hist_summary(hist: prom.HistogramDelta | None) -> dict[str, float | None] | None:
    if hist is None:
        return None
    return {
        "count": hist.count,
        "mean": hist.mean,
        "p50": hist.quantile(0.5),
        "p95": hist.quantile(0.95),
        "p99": hist.quantile(0.99),
    }
