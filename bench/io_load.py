"""The I/O side at hundreds of streams: what the event loop spends per real-time stream.

**The model here is a test double** (:class:`InstantRecognizer`: it answers every decode
at once with a fixed-rate text), so everything measured is the server's own per-stream
work: WebSocket frames, resampling, framing, webrtcvad, the segmenter, the session's
messages and their JSON, the worker hand-offs. It tells at how many streams one loop
core saturates, independently of how fast any model is.

    python -m bench.io_load --streams 50,100,200 --duration-s 20 --generators 2

* the server runs in a child process (``streamer``'s own loop: uvloop when installed);
  its *main thread's* CPU time is the event loop's (read from /proc), the rest of the
  process (the worker thread, the metrics) is reported apart;
* the load comes from ``--generators`` processes, each running its share of the real-
  time clients with the bench's own load generator (``bench.latency.load``); each
  reports how late it sent its chunks, so an overloaded generator is seen, not hidden;
* ``/healthz`` and ``/readyz`` are probed in turn every 100 ms, each on a new connection,
  during every step: how long they took to answer (p50, p95, max) beside the loop lag;
* ``--features`` makes the test double do the worker's CPU work of a real decode except
  the model (each job's features through the real feature cache), ``--model-process``
  runs it in a model process (``serve --model-process``), whose CPU is reported apart.

Writes ``results.json`` and prints a line per step (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import common
from bench.common import HealthProbes, ManagedServer, ServerOptions, percentiles
from bench.latency import prom
from bench.latency.monitor import scrape
from streamer.model.interface import RecognizerBase

logger = logging.getLogger("bench.io_load")


# -- the server, with the test-double recognizer ------------------------------------


class InstantRecognizer(RecognizerBase):
    """TEST DOUBLE: answers at once, about 3 words per second of audio."""

    name = "instant-test-double"

    def decode(self, pcm: np.ndarray, *, language: str = "auto", use_itn: bool = True) -> Any:
        from streamer.core.transcript import Transcript

        ms = pcm.size / 16
        words = " ".join(["word"] * max(1, int(ms / 330)))
        raw = f"<|en|><|NEUTRAL|><|Speech|><|withitn|>{words}"
        return Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=ms, decode_ms=0.0)


class FeatureRecognizer(InstantRecognizer):
    """TEST DOUBLE that does the worker's CPU work of a real decode except the model:
    each job's features through the real :class:`~streamer.model.decode.features.FeatureCache`
    (filterbank once per sample, LFR, CMVN), then the instant answer."""

    name = "features-test-double"

    def __init__(self) -> None:
        from streamer.model.decode.features import FeatureCache
        from streamer.model.decode.frontend import Cmvn, Frontend
        from streamer.model.sensevoice import FEATURE_DIM

        cmvn = Cmvn(np.zeros(FEATURE_DIM, np.float32), np.ones(FEATURE_DIM, np.float32))
        self.cache = FeatureCache(Frontend(cmvn))

    def decode_jobs(self, jobs: Any) -> list[Any]:
        from streamer.model.decode.decoding import as_waveform
        from streamer.model.sensevoice import MIN_DECODE_SAMPLES

        for job in jobs:
            waveform = as_waveform(job.pcm)
            if waveform.size >= MIN_DECODE_SAMPLES:  # as CtcRecognizer.decode_jobs
                self.cache.features(job, waveform)
        return [self.decode(job.pcm) for job in jobs]

    def forget_session(self, session_id: str) -> None:
        self.cache.forget(session_id)


def _load_double(features: bool, progress: Any = None) -> Any:
    """The test double, built where it decodes (picklable for --model-process)."""
    return FeatureRecognizer() if features else InstantRecognizer()


async def _serve(port: int, features: bool, model_process: bool) -> None:
    from functools import partial

    from streamer.core.capacity import CapacityOptions
    from streamer.model.serving.pool import WorkerHooks, WorkerPool, WorkerSlot
    from streamer.model.serving.process import ProcessRecognizer
    from streamer.model.serving.worker import ModelWorker
    from streamer.server.metrics import Metrics
    from streamer.server.server import ServerOptions, StreamingServer

    metrics = Metrics()
    load = partial(_load_double, features)

    def factory(slot: WorkerSlot, hooks: WorkerHooks) -> ModelWorker:
        return ModelWorker(
            (lambda: ProcessRecognizer(load)) if model_process else load,
            on_decoded=hooks.on_decoded,
            on_failure=hooks.on_failure,
        )

    pool = WorkerPool(
        factory,
        [WorkerSlot(0, "cpu", 1)],
        on_decoded=metrics.observe_worker_decode,
    )
    pool.start()
    # capacity-aware admission off: the double's answers are instant, and what is measured
    # is the loop at this many streams, not how many a real model would admit
    options = ServerOptions(
        host="127.0.0.1", port=port, max_sessions=5000, capacity=CapacityOptions(enabled=False)
    )
    server = StreamingServer(options, pool, metrics=metrics)
    await server.start()
    await server.wait_ready()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await stop.wait()
    await server.shutdown()
    pool.stop(1.0)


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of the process's main thread (the loop) and of all its threads.

    ``loop_system`` is the loop's kernel time (socket calls, and on loopback the TCP
    delivery to the peer), part of ``loop``.
    """

    loop_user, loop_system = common.cpu_s(pid, thread=pid)
    children = [  # of every thread: the worker thread starts the model process
        child for task in Path(f"/proc/{pid}/task").iterdir() for child in _children(task)
    ]
    return {
        "loop": loop_user + loop_system,
        "loop_system": loop_system,
        "process": sum(common.cpu_s(pid)),
        # --model-process: the model processes (and multiprocessing's resource tracker)
        "children": sum(sum(common.cpu_s(int(c))) for c in children if Path(f"/proc/{c}").exists()),
    }


def _children(task: Path) -> list[str]:
    try:
        return (task / "children").read_text().split()
    except OSError:  # the thread has ended
        return []


# -- the load generators --------------------------------------------------------------


def _generate(args: tuple[str, int, int, int, float, float]) -> dict[str, Any]:
    """One generator process: ``count`` clients (indexes from ``first``) of ``total``."""
    url, first, count, total, duration_s, stagger_s = args
    from bench.latency.audio import load_bench_audio
    from bench.latency.load import StepOptions, plan_clients, run_step
    from bench.latency.metrics import send_lags

    audio = load_bench_audio("auto", common.AUDIO_CACHE)
    options = StepOptions(url=url, clients=total, duration_s=duration_s, stagger_s=stagger_s)
    plans = plan_clients(options, audio)[first : first + count]
    started = time.process_time()
    records = asyncio.run(run_step(options, plans))
    cpu_s = time.process_time() - started
    lateness = [x for r in records for x in send_lags(r.send_log()).tolist()]
    return {"clients": count, "errors": [r.error for r in records if r.error], "cpu_s": cpu_s,
            "messages": sum(len(r.arrivals) for r in records), "send_late_s": lateness}  # fmt: skip


def run_step(
    port: int, pid: int, streams: int, duration_s: float, generators: int
) -> dict[str, Any]:
    url = f"ws://127.0.0.1:{port}/v1/asr"
    stagger_s = min(10.0, duration_s / 4)
    shares = [streams // generators + (i < streams % generators) for i in range(generators)]
    jobs, first = [], 0
    for share in shares:
        jobs.append((url, first, share, streams, duration_s, stagger_s))
        first += share
    before_metrics = scrape(f"http://127.0.0.1:{port}")
    before = _thread_cpu_s(pid)
    wall = time.monotonic()
    with (
        HealthProbes(port) as probes,
        multiprocessing.get_context("spawn").Pool(generators) as workers,
    ):
        parts = workers.map(_generate, [j for j in jobs if j[2]])
    wall_s = time.monotonic() - wall
    after = _thread_cpu_s(pid)
    after_metrics = scrape(f"http://127.0.0.1:{port}")
    lag = prom.histogram_delta(before_metrics, after_metrics, "streamer_event_loop_lag_seconds")
    late = np.array([x for p in parts for x in p["send_late_s"]] or [0.0])
    # the audio streamed: each client's track (duration minus its delay, plus the tail)
    stream_s = sum(max(1.0, duration_s - i * stagger_s / streams) for i in range(streams))
    loop_s = after["loop"] - before["loop"]
    process_s = after["process"] - before["process"]
    loop_system_s = after["loop_system"] - before["loop_system"]
    return {
        "streams": streams,
        "generators": generators,
        "wall_s": wall_s,
        "stream_s": stream_s,
        "loop_cpu_s": loop_s,
        "other_threads_cpu_s": process_s - loop_s,
        "children_cpu_s": after["children"] - before["children"],
        "loop_cpu_pct": 100 * loop_s / wall_s,
        "loop_ms_per_stream_s": 1000 * loop_s / stream_s,
        "loop_system_ms_per_stream_s": 1000 * loop_system_s / stream_s,
        "loop_lag_p50_ms": 1000 * (lag.quantile(0.5) or 0) if lag else None,
        "loop_lag_p99_ms": 1000 * (lag.quantile(0.99) or 0) if lag else None,
        "generator_cpu_s": sum(p["cpu_s"] for p in parts),
        "send_late_p95_ms": 1000 * (percentiles(late, (95,))["p95"] or 0.0),
        "send_late_max_ms": float(late.max() * 1000),
        "messages": sum(p["messages"] for p in parts),
        "errors": [e for p in parts for e in p["errors"]][:5],
        "error_count": sum(len(p["errors"]) for p in parts),
        **probes.summary_ms(),
    }


# -- main ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DoubleServerOptions(ServerOptions):
    """This module's test-double server (``--serve``), started like ``streamer serve``."""

    features: bool = False
    model_process: bool = False

    def command(self, port: int) -> list[str]:
        command = [self.python, "-m", "bench.io_load", "--serve", str(port)]
        return command + ["--features"] * self.features + ["--model-process"] * self.model_process


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "python -m bench.io_load")
    p.add_argument("--streams", default="50,100,200", help="comma list of stream counts")
    p.add_argument("--duration-s", type=float, default=20.0, help="audio per stream")
    p.add_argument("--generators", type=int, default=2, help="load-generator processes")
    p.add_argument("--features", action="store_true",
                   help="the double computes each job's features (the feature cache)")  # fmt: skip
    p.add_argument("--model-process", action="store_true",
                   help="the double runs in a model process (serve --model-process)")  # fmt: skip
    common.add_output_args(p, out="bench/out/io_load")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the child server's port
    args = p.parse_args(argv)
    if args.serve is not None:
        from streamer.loop import run

        run(_serve(args.serve, args.features, args.model_process), use_uvloop=True)
        return 0
    logging.basicConfig(level=logging.WARNING)
    results: dict[str, Any] = {"steps": []}
    double = DoubleServerOptions(features=args.features, model_process=args.model_process)
    with ManagedServer(double, args.out / "server.log") as server:
        port, pid = server.port or 0, server.pid or 0
        for streams in (int(s) for s in args.streams.split(",")):
            step = run_step(port, pid, streams, args.duration_s, args.generators)
            results["steps"].append(step)
            shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in step.items()}
            print(json.dumps({k: v for k, v in shown.items() if k != "errors"}), flush=True)
    common.write_results(args.out, results | {"loadavg_after": os.getloadavg()}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
