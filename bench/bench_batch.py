"""Batched decoding: does a batch give each utterance its batch-1 tokens, and what does it cost?

Two parts, each loading the configurations it names in this process:

* ``agreement``: many segments of 0.1-7 s cut from speech at seeded random offsets are
  decoded alone and in batches (random groups, and groups of similar length as the
  worker forms them); it counts rows whose token ids differ from the same segment
  decoded alone. fp32 should agree everywhere; int8 picks one activation scale per
  tensor, so a batch's other rows (and padding) can change a row.
* ``features``: the time of the features alone (fbank, LFR, CMVN, computed on the
  worker thread) per segment length from scratch, the part of a decode that a faster
  accelerator does not shrink; and over a segment's life (a partial every 0.3 s up to
  7 s, then its final), from scratch for every job against the worker's incremental
  :class:`~streamer.model.features.FeatureCache`, interleaved in one run.
* ``timing``: decode time of one ``decode_batch`` call per batch size and segment length
  (median of interleaved repetitions), so per-segment cost against batch size.

    python -m bench.bench_batch --parts agreement --configs onnx-int8,onnx-fp32
    python -m bench.bench_batch --parts agreement --configs torch-int8,torch-fp32 --segments 16
    python -m bench.bench_batch --parts timing --configs onnx-int8 --sizes 1,2,4,8 --lengths 1,3,7
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_backends import speech_signal
from streamer.testkit.speech import SAMPLE_RATE

logger = logging.getLogger("bench_batch")

CONFIGS = {
    "onnx-int8": ("onnx", "int8"),
    "onnx-fp32": ("onnx", None),
    "torch-int8": ("torch", "int8"),
    "torch-fp32": ("torch", None),
}


def speech(cache_dir: Path) -> np.ndarray:
    return speech_signal(cache_dir, seconds=20)


def load(config: str, model: str, threads: int, cache_dir: Path, device: str) -> Any:
    from streamer.model.loading import load_recognizer
    from streamer.model.options import RecognizerOptions
    from streamer.testkit.models import RANDOM_MODELS

    backend, quantize = CONFIGS[config]
    options = RecognizerOptions(
        model=model,
        backend=backend,
        device=device,
        quantize=quantize,
        threads=threads,
        cache_dir=cache_dir,
        random_models=RANDOM_MODELS,
    )
    return load_recognizer(options)


def segments(signal: np.ndarray, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        samples = int(rng.uniform(0.1, 7.0) * SAMPLE_RATE)
        start = int(rng.integers(0, signal.size - samples))
        out.append(signal[start : start + samples])
    return out


def agreement(recognizer: Any, segs: list[np.ndarray], max_batch: int, seed: int) -> dict:
    alone = [recognizer.decode(s).token_ids for s in segs]
    rng = np.random.default_rng(seed)
    result: dict[str, Any] = {}
    order = {
        "random": list(rng.permutation(len(segs))),
        "by length": list(np.argsort([s.size for s in segs])),
    }
    for name, indices in order.items():
        rows = differ = tokens = token_diff = 0
        for start in range(0, len(indices), max_batch):
            group = [int(i) for i in indices[start : start + max_batch]]
            batch = recognizer.decode_batch(
                [segs[i] for i in group],
                languages=["auto"] * len(group),
                use_itns=[True] * len(group),
            )
            for i, transcript in zip(group, batch, strict=True):
                rows += 1
                ref = alone[i]
                if transcript.token_ids != ref:
                    differ += 1
                tokens += len(ref)
                token_diff += sum(a != b for a, b in zip(transcript.token_ids, ref, strict=False))
                token_diff += abs(len(ref) - len(transcript.token_ids))
        result[name] = {"rows": rows, "differ": differ, "tokens": tokens, "token_diff": token_diff}
    return result


def timing(
    recognizer: Any, signal: np.ndarray, sizes: list[int], lengths: list[float], repeats: int
) -> dict:
    times: dict[tuple[int, float], list[float]] = {(b, s): [] for b in sizes for s in lengths}
    for repeat in range(repeats):
        for seconds in lengths:
            for size in sizes:
                n = int(seconds * SAMPLE_RATE)
                pcms = [
                    signal[(k * 7919 + repeat * 131) % (signal.size - n) :][:n] for k in range(size)
                ]
                started = time.perf_counter()
                recognizer.decode_batch(pcms, languages=["auto"] * size, use_itns=[True] * size)
                times[(size, seconds)].append((time.perf_counter() - started) * 1000)
    return {f"{b}x{s:g}": statistics.median(v) for (b, s), v in times.items()}


def features(recognizer: Any, signal: np.ndarray, lengths: list[float], repeats: int) -> dict:
    from streamer.model.decoding import as_waveform
    from streamer.model.frontend import Frontend

    frontend = getattr(recognizer, "frontend", None)
    if not isinstance(frontend, Frontend):
        return {}
    out = {}
    for seconds in lengths:
        waveform = as_waveform(signal[: int(seconds * SAMPLE_RATE)])
        times = []
        for _ in range(repeats * 4):
            started = time.perf_counter()
            frontend(waveform)
            times.append((time.perf_counter() - started) * 1000)
        out[f"{seconds:g}"] = statistics.median(times)
    return out


def segment_features(
    recognizer: Any, signal: np.ndarray, repeats: int, step_s: float = 0.3, length_s: float = 7.0
) -> dict:
    """One segment's partials every ``step_s`` up to ``length_s``, then its final: the
    features' total and last-partial ms from scratch and through the feature cache."""
    from streamer.core.jobs import DecodeJob
    from streamer.model.decoding import as_waveform
    from streamer.model.features import FeatureCache
    from streamer.model.frontend import Frontend

    frontend = getattr(recognizer, "frontend", None)
    if not isinstance(frontend, Frontend):
        return {}
    step = int(step_s * SAMPLE_RATE)
    ends = list(range(step, int(length_s * SAMPLE_RATE) + 1, step))
    jobs = [
        DecodeJob("s", 0, "partial" if n != ends[-1] else "final", signal[:n], 0, n, "auto", True)
        for n in ends
    ]
    totals: dict[str, list[float]] = {"scratch": [], "cache": []}
    last: dict[str, list[float]] = {"scratch": [], "cache": []}
    for _ in range(repeats):
        for way in totals:
            cache = FeatureCache(frontend)
            spent = []
            for job in jobs:
                waveform = as_waveform(job.pcm)
                started = time.perf_counter()
                if way == "cache":
                    cache.features(job, waveform)
                else:
                    frontend(waveform)
                spent.append((time.perf_counter() - started) * 1000)
            totals[way].append(sum(spent))
            last[way].append(spent[-2])  # the last partial, at length_s - step_s
    return {
        "jobs": len(jobs),
        "total_ms": {way: statistics.median(v) for way, v in totals.items()},
        "last_partial_ms": {way: statistics.median(v) for way, v in last.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="random:small")
    parser.add_argument("--parts", default="agreement,timing")
    parser.add_argument("--configs", default="onnx-int8,onnx-fp32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (fp32 configs only)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--segments", type=int, default=48)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--lengths", default="1,3,7")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cache_dir = Path(os.environ.get("STREAMER_CACHE_DIR", "~/.cache/streamer")).expanduser()
    signal = speech(cache_dir)
    parts = args.parts.split(",")
    report: dict[str, Any] = {"load_average_before": os.getloadavg()[0]}
    for config in args.configs.split(","):
        recognizer = load(config, args.model, args.threads, cache_dir, args.device)
        entry: dict[str, Any] = {}
        if "agreement" in parts:
            segs = segments(signal, args.segments, args.seed)
            entry["agreement"] = agreement(recognizer, segs, args.max_batch, args.seed)
            for name, a in entry["agreement"].items():
                print(
                    f"{config} {name}: {a['differ']}/{a['rows']} rows differ from batch 1, "
                    f"{a['token_diff']}/{a['tokens']} tokens",
                    flush=True,
                )
        if "features" in parts:
            lengths = [float(s) for s in args.lengths.split(",")]
            entry["features_ms"] = features(recognizer, signal, lengths, args.repeats)
            for seconds, ms in entry["features_ms"].items():
                print(f"{config} features of {seconds} s: {ms:.1f} ms", flush=True)
            life = segment_features(recognizer, signal, args.repeats)
            entry["segment_features"] = life
            if life:
                total, last = life["total_ms"], life["last_partial_ms"]
                print(
                    f"{config} one 7 s segment, {life['jobs']} jobs (partials every 0.3 s, "
                    f"final): features {total['scratch']:.1f} ms from scratch, "
                    f"{total['cache']:.1f} ms cached; last partial {last['scratch']:.2f} "
                    f"against {last['cache']:.2f} ms",
                    flush=True,
                )
        if "timing" in parts:
            sizes = [int(s) for s in args.sizes.split(",")]
            lengths = [float(s) for s in args.lengths.split(",")]
            entry["timing_ms"] = timing(recognizer, signal, sizes, lengths, args.repeats)
            print(f"| {config} | batch | " + " | ".join(f"{s:g} s" for s in lengths) + " |")
            for size in sizes:
                cells = []
                for seconds in lengths:
                    ms = entry["timing_ms"][f"{size}x{seconds:g}"]
                    cells.append(f"{ms:.0f} ({ms / size:.0f}/seg)")
                print(f"| {config} | {size} | " + " | ".join(cells) + " |", flush=True)
        report[config] = entry
        del recognizer
    report["load_average_after"] = os.getloadavg()[0]
    print(f"load average {report['load_average_before']:.1f} -> {report['load_average_after']:.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
