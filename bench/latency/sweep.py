"""The sweep: variants (quantization, partials) times client counts, against one or more
servers, each step measured by the load generator and the monitor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import ManagedServer, ServerOptions, http_base
from bench.latency import metrics, prom, report
from bench.latency.audio import SAMPLE_RATE, BenchAudio
from bench.latency.load import ClientRecord, StepOptions, plan_clients, run_step, warm_up
from bench.latency.monitor import Monitor, other_cpu_now, scrape
from streamer.core.protocol import End

logger = logging.getLogger(__name__)

PRECISIONS = ("int8", "fp32", "fp16", "bf16")  # int8: dynamic quantization (CPU)


DRAIN_WAIT_S = 30.0  # after a step, how long the server may take to finish its work
QUIET_SAMPLES = 4  # consecutive quiet samples before a step starts (--quiet-cpu-pct)
QUIET_SAMPLE_S = 2.5  # length of each


@dataclass(frozen=True)
class Variant:
    """One line of the comparison: how the server is built and what clients ask."""

    name: str  # as given on the command line, e.g. "int8" or "fp32:nopartials"
    precision: str | None  # one of PRECISIONS; None for a given server (--url)
    partials: bool  # clients ask for partial results

    def server_options(self, base: ServerOptions) -> ServerOptions:
        """``base`` with this variant's precision (--quantize / --dtype)."""
        if self.precision == "int8":
            return dataclasses.replace(base, quantize="int8", dtype=None)
        if self.precision in ("fp16", "bf16"):
            return dataclasses.replace(base, quantize=None, dtype=self.precision)
        return dataclasses.replace(base, quantize=None, dtype=None)


def parse_variant(spec: str) -> Variant:
    """``int8``, ``fp32``, ``fp16``, ``bf16`` or ``server`` (a given URL), each optionally
    followed by ``:nopartials``."""
    base, _, flag = spec.partition(":")
    if base not in (*PRECISIONS, "server"):
        raise ValueError(
            f"variant {spec!r}: expected {', '.join(PRECISIONS)} or server, with :nopartials"
        )
    if flag not in ("", "nopartials", "partials"):
        raise ValueError(f"variant {spec!r}: unknown flag {flag!r} (use :nopartials)")
    return Variant(spec, None if base == "server" else base, flag != "nopartials")


def parse_clients(spec: str) -> list[int] | None:
    """``1,2,4,8`` -> the list; ``auto`` -> None (double until saturated, then bisect)."""
    if spec.strip() == "auto":
        return None
    counts = sorted({int(x) for x in spec.split(",") if x.strip()})
    if not counts or counts[0] < 1:
        raise ValueError(f"client counts must be positive integers, got {spec!r}")
    return counts


@dataclass
class _Target:
    """The server a group of variants runs against; a started one can be restarted."""

    url: str
    pid: int | None
    options: ServerOptions | None = None  # None: a given server (--url), never restarted
    key: str | None = None  # precision, names its log file
    server: ManagedServer | None = None
    restarts: int = 0


@dataclass(frozen=True)
class SweepOptions:
    """Everything a run needs besides the audio."""

    url: str | None  # a running server, or None to start one per quantization
    server_pid: int | None  # the running server's pid (CPU/memory), when known
    server: ServerOptions  # used when url is None (quantize comes from each variant)
    variants: tuple[Variant, ...]  # the first is the main sweep, the others comparisons
    clients: list[int] | None  # main sweep's client counts; None: automatic
    compare_clients: list[int] | None  # where the other variants run; None: main's counts
    max_clients: int  # upper bound of the automatic sweep
    step: StepOptions  # template: url and clients are filled per step
    saturation_final_p95_s: float  # the limit that defines "carried"
    stop_when_saturated: bool  # end the main sweep at the first step over the limit
    out_dir: Path
    pause_s: float = 2.0  # between steps, so one step's stragglers do not load the next
    quiet_cpu_pct: float | None = None  # other load above which a step waits and is redone
    quiet_wait_s: float = 300.0  # longest wait for the machine to become quiet
    step_retries: int = 2  # redos of a step that ran while other work used the CPU


def step_result(
    records: list[ClientRecord], clients: int, monitor: dict[str, Any]
) -> dict[str, Any]:
    """One step's JSON: every segment, every session, and the pooled summary."""
    segments: list[dict[str, Any]] = []
    pooled: list[metrics.SegmentLatency] = []
    lags = []
    sessions = []
    ends: list[End] = []
    for record in records:
        log = record.send_log()
        lag = metrics.send_lags(log)
        lags.extend(lag.tolist())
        plan = record.plan
        for seg in metrics.segment_latencies(record.arrivals, log, plan.speech_spans):
            pooled.append(seg)
            segments.append({"client": plan.index, **dataclasses.asdict(seg)})
        if record.end is not None:
            ends.append(record.end)
        sessions.append({
            "client": plan.index,
            "start_delay_s": plan.delay_s,
            "first_clip": plan.first_clip,
            "audio_s": plan.track.size / SAMPLE_RATE,
            "connect_s": record.connect_s,
            "chunks_sent": len(record.sends),
            "send_lag_max_s": float(lag.max()) if lag.size else None,
            "end": dataclasses.asdict(record.end) if record.end else None,
            "error": record.error,
        })  # fmt: skip
    return {
        "clients": clients,
        "summary": metrics.summarize_segments(pooled),
        "skip_share": metrics.skip_share(ends),
        "send_lag_s": {**metrics.percentiles(lags), "max": max(lags) if lags else None},
        "errors": [s["error"] for s in sessions if s["error"]],
        "monitor": monitor,
        "sessions": sessions,
        "segments": segments,
    }


def step_ok(step: dict[str, Any], limit_s: float) -> bool:
    p95 = step["summary"]["final_s"]["p95"]
    return not step["errors"] and p95 is not None and p95 <= limit_s


class Sweep:
    """Runs every variant's steps; results accumulate in :attr:`results`."""

    def __init__(
        self,
        options: SweepOptions,
        audio: BenchAudio,
        results: dict[str, Any],
        on_update: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.options = options
        self.audio = audio
        self.results = results
        self.on_update = on_update  # called after each step (e.g. to save partial results)

    async def run(self) -> None:
        groups: dict[str | None, list[Variant]] = {}
        for variant in self.options.variants:
            groups.setdefault(variant.precision, []).append(variant)
        main = self.options.variants[0]
        for variant in self.options.variants:
            self._entry(variant)  # results list the variants in the order given
        for key, variants in groups.items():
            if self.options.url is not None:
                target = _Target(self.options.url, self.options.server_pid)
                await self._run_group(target, variants, main)
                continue
            target = _Target("", None, variants[0].server_options(self.options.server), key)
            try:
                await self._start_server(target, variants)
                await self._run_group(target, variants, main)
            finally:
                if target.server is not None:
                    await asyncio.to_thread(target.server.stop)

    async def _start_server(self, target: _Target, variants: list[Variant]) -> None:
        assert target.options is not None
        suffix = f"-{target.restarts}" if target.restarts else ""
        log_path = self.options.out_dir / f"server-{target.key}{suffix}.log"
        server = ManagedServer(target.options, log_path)
        await asyncio.to_thread(server.__enter__)
        target.server, target.url, target.pid = server, server.url, server.pid
        for variant in variants:
            self._entry(variant)["server"].setdefault("load_s", []).append(server.load_s)
        await warm_up(target.url, self.audio)

    async def _settle(self, target: _Target) -> bool:
        """Let the server finish the last step's work; restart a started server that
        cannot (sessions or jobs left over from an overloaded step would load the next).
        Returns True when the server was restarted."""
        if await _drained(target.url, DRAIN_WAIT_S):
            return False
        if target.server is None:
            logger.warning("server still busy from the last step after %.0f s", DRAIN_WAIT_S)
            return False
        logger.warning("server still busy from the last step after %.0f s: restarting it",
                       DRAIN_WAIT_S)  # fmt: skip
        await asyncio.to_thread(target.server.stop)
        target.restarts += 1
        variants = [v for v in self.options.variants if v.precision == target.key]
        await self._start_server(target, variants)
        return True

    def _entry(self, variant: Variant) -> dict[str, Any]:
        for entry in self.results["variants"]:
            if entry["name"] == variant.name:
                return entry
        server = dataclasses.asdict(variant.server_options(self.options.server))
        entry = {"name": variant.name, "partials": variant.partials, "steps": [],
                 "server": {"url": self.options.url} if self.options.url else server,
                 "carried_clients": None}  # fmt: skip
        self.results["variants"].append(entry)
        return entry

    async def _run_group(self, target: _Target, variants: list[Variant], main: Variant) -> None:
        if target.server is None:
            await warm_up(target.url, self.audio)
        others = [v for v in variants if v != main]
        # Comparisons at fixed counts go first: the main sweep ends by overloading the server.
        if self.options.compare_clients is not None:
            for variant in others:
                for n in self.options.compare_clients:
                    await self._step(target, variant, self._entry(variant), n)
        if main in variants:
            await self._main_sweep(target, main, self._entry(main))
        if self.options.compare_clients is None:
            counts = sorted(s["clients"] for s in self._entry(main)["steps"])
            for variant in others:
                for n in counts:
                    await self._step(target, variant, self._entry(variant), n)

    async def _main_sweep(self, target: _Target, variant: Variant, entry: dict[str, Any]) -> None:
        limit = self.options.saturation_final_p95_s
        if self.options.clients is not None:
            for n in self.options.clients:
                step = await self._step(target, variant, entry, n)
                if self.options.stop_when_saturated and not step_ok(step, limit):
                    logger.info("%s saturated at %d clients; sweep ends", variant.name, n)
                    break
        else:
            tried: dict[int, bool] = {}
            while (n := metrics.next_client_count(tried, self.options.max_clients)) is not None:
                step = await self._step(target, variant, entry, n)
                tried[n] = step_ok(step, limit)

    async def _wait_quiet(self, pid: int | None) -> None:
        """Wait (bounded) until other work has used less than the threshold for
        :data:`QUIET_SAMPLES` samples in a row (short gaps between jobs do not count)."""
        threshold = self.options.quiet_cpu_pct
        if threshold is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.quiet_wait_s
        quiet = 0
        while quiet < QUIET_SAMPLES:
            busy = await asyncio.to_thread(other_cpu_now, pid, QUIET_SAMPLE_S)
            quiet = quiet + 1 if busy <= threshold else 0
            if quiet == 0 and loop.time() > deadline:
                logger.warning("machine still busy (%.0f%% CPU by others); going on", busy)
                return
            if quiet == 0:
                logger.info("machine busy (%.0f%% CPU by others); waiting", busy)

    async def _step(
        self, target: _Target, variant: Variant, entry: dict[str, Any], clients: int
    ) -> dict[str, Any]:
        for attempt in range(self.options.step_retries + 1):
            restarted = await self._settle(target)
            await self._wait_quiet(target.pid)
            step = await self._run_step(target.url, target.pid, variant, clients)
            step["server_restarted_before"] = restarted
            other = report.other_cpu_pct(step["monitor"])
            step["other_cpu_pct"] = other
            step["attempt"] = attempt + 1
            threshold = self.options.quiet_cpu_pct
            if threshold is None or other is None or other <= threshold:
                break
            if attempt < self.options.step_retries:
                logger.warning(
                    "%s x%d ran beside other work (%.0f%% CPU); redoing it",
                    variant.name, clients, other,
                )  # fmt: skip
        entry["steps"].append(step)
        entry["steps"].sort(key=lambda s: s["clients"])
        p95 = {
            s["clients"]: (None if s["errors"] else s["summary"]["final_s"]["p95"])
            for s in entry["steps"]
        }
        entry["carried_clients"] = metrics.carried_clients(p95, self.options.saturation_final_p95_s)
        s = step["summary"]
        logger.info(
            "%s x%d: ttft p50 %s ms, final p50 %s ms p95 %s ms, errors %d",
            variant.name, clients, report.ms(s["first_token_s"]["p50"]),
            report.ms(s["final_s"]["p50"]), report.ms(s["final_s"]["p95"]), len(step["errors"]),
        )  # fmt: skip
        if self.on_update is not None:
            self.on_update(self.results)
        await asyncio.sleep(self.options.pause_s)
        return step

    async def _run_step(
        self, url: str, pid: int | None, variant: Variant, clients: int
    ) -> dict[str, Any]:
        options = dataclasses.replace(
            self.options.step, url=url, clients=clients, partials=variant.partials
        )
        monitor = Monitor(http_base(url), pid)
        plans = plan_clients(options, self.audio)
        await monitor.start()
        try:
            records = await run_step(options, plans)
        finally:
            summary = await monitor.stop()
        return step_result(records, clients, summary)


async def _drained(url: str, timeout_s: float) -> bool:
    """Wait until ``/metrics`` shows no open session and no queued job (True), or the
    timeout passes (False). A server without those metrics counts as drained."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        samples = await asyncio.to_thread(scrape, http_base(url))
        sessions = prom.value(samples, "streamer_sessions_active") or 0.0
        queued = prom.value(samples, "streamer_worker_queue_depth") or 0.0
        if sessions == 0 and queued == 0:
            return True
        if loop.time() > deadline:
            logger.info("server not drained: %d sessions, %d queued jobs", sessions, queued)
            return False
        await asyncio.sleep(1.0)
