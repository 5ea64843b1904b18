"""A live final's wait in the model worker while a file upload's finals are queued.

One :class:`~streamer.model.worker.ModelWorker` with the real recognizer (random:small
int8 ONNX by default, the CPU's batch 1). A "live" session submits one final of
``--live-segment-s`` of speech every ``--live-interval-s``; its latency is submission
to answer (queue wait + decode). Three phases, side by side in one run:

* ``alone``: the live finals only;
* ``background``: an upload's finals of ``--file-segment-s`` each, kept queued
  (``DecodeJob.background``: decoded after live work, so a live final waits for at most
  the one decode already running);
* ``fifo``: the same upload's finals as ordinary live finals (what the queue did before
  background jobs: the live final waits behind every file final queued before it);
* ``niced``: the upload's finals on a second worker with a model of its own, whose
  thread and ONNX Runtime threads run at nice 19: the kernel, not the queue, gives the
  live decode the CPU (a second model in memory; an experiment, not what the server does).

It prints each phase's live p50/p95/max and the upload's throughput (audio seconds per
wall second).

    python -m bench.background_queue --seconds 24
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_backends import speech_signal
from streamer.core.jobs import DecodeJob, DecodeResult
from streamer.model.worker import ModelWorker
from streamer.testkit.speech import SAMPLE_RATE

logger = logging.getLogger("background_queue")

FILE_QUEUE_DEPTH = 8  # the upload's finals kept waiting (its session's pending finals)


def load(model: str, threads: int, cache_dir: Path, quantize: str | None) -> Any:
    from streamer.model.loading import load_recognizer
    from streamer.model.options import RecognizerOptions
    from streamer.testkit.models import RANDOM_MODELS

    options = RecognizerOptions(
        model=model,
        backend="onnx",
        device="cpu",
        quantize=quantize,
        threads=threads,
        cache_dir=cache_dir,
        random_models=RANDOM_MODELS,
        warmup=True,
    )
    return load_recognizer(options)


def final(session: str, segment: int, pcm: np.ndarray, background: bool) -> DecodeJob:
    return DecodeJob(
        session, segment, "final", pcm, 0, pcm.size, "auto", True, background=background
    )


def niced(load_model: Any) -> Any:
    """``load_model`` in the calling (worker) thread at nice 19: the threads ONNX Runtime
    starts while loading inherit it (Linux: nice is per thread)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    return load_model()


def phase(
    worker: ModelWorker,
    signal: np.ndarray,
    args: argparse.Namespace,
    file_mode: str | None,
    file_worker: ModelWorker | None = None,
) -> dict[str, Any]:
    """One phase: live finals at their interval; the upload's kept queued unless None."""
    live_samples = int(args.live_segment_s * SAMPLE_RATE)
    file_samples = int(args.file_segment_s * SAMPLE_RATE)
    latencies_ms: list[float] = []
    file_done = threading.Semaphore(0)
    file_audio_s = [0.0]
    lock = threading.Lock()
    stop = threading.Event()

    def file_answer(result: DecodeResult) -> None:
        with lock:
            file_audio_s[0] += result.job.pcm.size / SAMPLE_RATE
        file_done.release()

    def feed_file() -> None:
        segment = 0
        background = file_mode in ("background", "niced")
        target = file_worker if file_mode == "niced" and file_worker is not None else worker
        while not stop.is_set():
            start = (segment * 7919 * 16) % (signal.size - file_samples)
            job = final("file", segment, signal[start : start + file_samples], background)
            target.submit(job, file_answer)
            segment += 1
            if segment >= FILE_QUEUE_DEPTH:
                file_done.acquire(timeout=60)

    feeder = threading.Thread(target=feed_file, daemon=True)
    started = time.perf_counter()
    if file_mode is not None:
        feeder.start()
        time.sleep(args.live_interval_s)  # the upload's queue fills first
    answered = threading.Condition()
    pending: dict[int, float] = {}
    count = int(args.seconds / args.live_interval_s)
    for index in range(count):
        start = (index * 4001 * 16) % (signal.size - live_samples)
        job = final("live", index, signal[start : start + live_samples], False)

        def live_answer(result: DecodeResult, index: int = index) -> None:
            with answered:
                latencies_ms.append((time.perf_counter() - pending.pop(index)) * 1000)
                answered.notify_all()

        with answered:
            pending[index] = time.perf_counter()
        worker.submit(job, live_answer)
        time.sleep(args.live_interval_s)
    with answered:
        answered.wait_for(lambda: not pending, timeout=120)
    stop.set()
    wall_s = time.perf_counter() - started
    if file_mode is not None:
        file_done.release()
        feeder.join(10)
    latencies_ms.sort()
    p95 = latencies_ms[min(len(latencies_ms) - 1, int(0.95 * len(latencies_ms)))]
    with lock:
        file_rate = file_audio_s[0] / wall_s
    # let what is left of the upload drain before the next phase
    for w in (worker, file_worker):
        while w is not None and (w.stats().queued_background or w.stats().queued_finals):
            time.sleep(0.05)
    return {
        "live_finals": len(latencies_ms),
        "p50_ms": round(statistics.median(latencies_ms), 1),
        "p95_ms": round(p95, 1),
        "max_ms": round(latencies_ms[-1], 1),
        "file_audio_s_per_s": round(file_rate, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="random:small")
    parser.add_argument("--quantize", default="int8", help="int8, or none for fp32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0, help="each phase's live part")
    parser.add_argument("--live-interval-s", type=float, default=1.5)
    parser.add_argument("--live-segment-s", type=float, default=2.5)
    parser.add_argument("--file-segment-s", type=float, default=7.0)
    parser.add_argument("--phases", default="alone,background,fifo")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cache_dir = Path(os.environ.get("STREAMER_CACHE_DIR", "~/.cache/streamer")).expanduser()
    signal = speech_signal(cache_dir, seconds=60)
    quantize = None if args.quantize == "none" else args.quantize
    recognizer = load(args.model, args.threads, cache_dir, quantize)
    worker = ModelWorker(lambda: recognizer, decode_timeout_s=None)
    worker.start()
    worker.ready.wait(600)
    file_worker = None
    if "niced" in args.phases.split(","):
        file_worker = ModelWorker(
            lambda: niced(lambda: load(args.model, args.threads, cache_dir, quantize)),
            decode_timeout_s=None,
        )
        file_worker.start()
        file_worker.ready.wait(600)
    report: dict[str, Any] = {"load_average_before": os.getloadavg()[0], "args": vars(args)}
    try:
        for name in args.phases.split(","):
            mode = None if name == "alone" else name
            result = phase(worker, signal, args, mode, file_worker)
            report[name] = result
            print(
                f"{name}: live final p50 {result['p50_ms']} ms, p95 {result['p95_ms']} ms, "
                f"max {result['max_ms']} ms ({result['live_finals']} finals); "
                f"upload {result['file_audio_s_per_s']} audio s/s",
                flush=True,
            )
    finally:
        worker.stop()
        if file_worker is not None:
            file_worker.stop()
    report["load_average_after"] = os.getloadavg()[0]
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
