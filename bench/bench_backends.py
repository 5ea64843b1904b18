"""torch against ONNX Runtime: decode time, token agreement, start-up, memory, contention.

Three parts, each printed as a markdown table:

1. ``decode``: one process loads every configuration (torch fp32/int8, ONNX fp32, ONNX
   int8 with QUInt8 and with QInt8 weights; ``onnx-int8`` elsewhere is what this CPU gets
   by default) and decodes 1, 3 and 7 s of speech, the configurations interleaved within
   each repetition so that machine noise hits all alike; then token agreement of each
   with torch fp32 on speech segments of 0.3-7 s.
2. ``startup``: ``streamer serve`` per configuration, from process start to ``/readyz``
   answering 200 (cached model and export), its resident memory then and its peak.
3. ``contention``: 1 and 7 s decodes while two busy processes spin on the CPUs, ONNX
   Runtime with and without spin-waiting threads against torch, and the same idle.

    python -m bench.bench_backends                       # random:small, 2 threads
    python -m bench.bench_backends --parts decode --reps 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import REPO, ManagedServer, ServerOptions
from streamer.testkit.speech import SAMPLE_RATE, SENTENCES, speak

logger = logging.getLogger("bench_backends")

LENGTHS_S = (1.0, 3.0, 7.0)
CONFIGS = ("torch-fp32", "torch-int8", "onnx-fp32", "onnx-int8-quint8", "onnx-int8-qint8")
STARTUP_CONFIGS = ("torch-fp32", "torch-int8", "onnx-fp32", "onnx-int8")


def speech_signal(cache_dir: Path, seconds: float = 30) -> np.ndarray:
    """At least ``seconds`` of espeak speech (en and zh, 200 ms gaps), repeated."""
    clips = [speak(t, "en", cache_dir=cache_dir / "speech") for t in SENTENCES["en"]]
    clips += [speak(t, "zh", cache_dir=cache_dir / "speech") for t in SENTENCES["zh"]]
    gap = np.zeros(SAMPLE_RATE // 5, np.int16)
    signal = np.concatenate([part for clip in clips for part in (clip, gap)])
    while signal.size < seconds * SAMPLE_RATE:
        signal = np.concatenate([signal, signal])
    return signal


def random_window(speech: np.ndarray, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """``seconds`` of ``speech`` from a random place."""
    start = int(rng.integers(0, speech.size - int(seconds * SAMPLE_RATE)))
    return speech[start : start + int(seconds * SAMPLE_RATE)]


def agreement_segments(
    speech: np.ndarray, count: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """``count`` windows of ``speech`` from 0.3 to 7 s long, for token agreement."""
    return [
        random_window(speech, 0.3 + 6.7 * index / max(1, count - 1), rng) for index in range(count)
    ]


def _load(config: str, args: argparse.Namespace, **onnx_kwargs: Any) -> Any:
    from streamer.model.files import locate_model
    from streamer.model.onnx_backend import OnnxRecognizer, onnx_model_dir
    from streamer.model.onnx_export import cached_export
    from streamer.model.options import RecognizerOptions
    from streamer.model.torch_backend import Recognizer
    from streamer.testkit.models import RANDOM_MODELS

    backend, _, precision = config.partition("-")
    quantize = "int8" if precision.startswith("int8") else None
    options = RecognizerOptions(
        model=args.model,
        backend=backend,
        device="cpu",
        quantize=quantize,
        threads=args.threads,
        warmup=False,
        cache_dir=args.cache_dir,
        random_models=RANDOM_MODELS,
    )
    if backend == "torch":
        recognizer = Recognizer(options)
    else:
        source = locate_model(args.model, "ms", args.cache_dir, RANDOM_MODELS)
        weight_type = {"int8-qint8": "QInt8", "int8-quint8": "QUInt8"}.get(precision)
        export = cached_export(Path(source), args.cache_dir, int8_weight_type=weight_type)
        model_dir = onnx_model_dir(export, quantized=quantize is not None)
        recognizer = OnnxRecognizer(options, model_dir=model_dir, **onnx_kwargs)
    recognizer.warmup()
    return recognizer


def _timed(recognizer: Any, pcm: np.ndarray) -> float:
    started = time.perf_counter()
    recognizer.decode(pcm)
    return (time.perf_counter() - started) * 1000


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({max(values):.0f})"


def part_decode(args: argparse.Namespace) -> None:
    speech = speech_signal(args.cache_dir)
    recognizers = {}
    for config in CONFIGS:
        started = time.perf_counter()
        recognizers[config] = _load(config, args)
        logger.info("loaded %s in %.1f s", config, time.perf_counter() - started)
    times: dict[tuple[str, float], list[float]] = {}
    rng = np.random.default_rng(0)
    for rep in range(args.reps):
        for seconds in LENGTHS_S:
            pcm = random_window(speech, seconds, rng)
            order = list(CONFIGS) if rep % 2 == 0 else list(reversed(CONFIGS))
            for config in order:
                times.setdefault((config, seconds), []).append(_timed(recognizers[config], pcm))
    print("\n### Decode time, ms: median (max) of", args.reps, "interleaved repetitions\n")
    print("| configuration | " + " | ".join(f"{s:g} s" for s in LENGTHS_S) + " |")
    print("|---|" + "---|" * len(LENGTHS_S))
    for config in CONFIGS:
        cells = [_summary(times[(config, s)]) for s in LENGTHS_S]
        print(f"| {config} | " + " | ".join(cells) + " |")
    base = {s: statistics.median(times[("torch-int8", s)]) for s in LENGTHS_S}
    print("\nratio to torch-int8 (medians): ")
    for config in CONFIGS:
        ratios = [statistics.median(times[(config, s)]) / base[s] for s in LENGTHS_S]
        print(
            f"- {config}: "
            + ", ".join(f"{s:g} s {r:.2f}x" for s, r in zip(LENGTHS_S, ratios, strict=True))
        )

    # token agreement with torch fp32 on segments of several lengths
    segments = agreement_segments(speech, args.segments, rng)
    languages = ("auto", "en", "zh")
    reference = [
        recognizers["torch-fp32"].decode(pcm, language=languages[i % 3], use_itn=i % 2 == 0)
        for i, pcm in enumerate(segments)
    ]
    print(f"\n### Agreement with torch fp32 on {len(segments)} segments of 0.3-7 s\n")
    print("| configuration | identical token sequences | token error rate vs torch fp32 |")
    print("|---|---|---|")
    for config in CONFIGS[1:]:
        same = errors = total = 0
        for i, pcm in enumerate(segments):
            got = recognizers[config].decode(pcm, language=languages[i % 3], use_itn=i % 2 == 0)
            expected = reference[i].token_ids
            same += got.token_ids == expected
            errors += _edit_distance(got.token_ids, expected)
            total += len(expected)
        print(f"| {config} | {same}/{len(segments)} | {100 * errors / max(1, total):.2f} % |")


def _edit_distance(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


# --- start-up ---------------------------------------------------------------------------------


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def part_startup(args: argparse.Namespace) -> None:
    rows = []
    for rep in range(args.startup_reps):
        for config in STARTUP_CONFIGS if rep % 2 == 0 else reversed(STARTUP_CONFIGS):
            backend, _, precision = config.partition("-")
            extra = ["--backend", backend, "--threads", str(args.threads)]
            extra += ["--cache-dir", str(args.cache_dir)]
            options = ServerOptions(
                model=args.model,
                quantize="int8" if precision == "int8" else None,
                extra_args=tuple(extra),
                code_dir=REPO,
                ready_poll_s=0.05,
            )
            with ManagedServer(options, args.out / f"server-{config}.log") as server:
                assert server.pid is not None and server.load_s is not None
                ready_s = server.load_s
                rss = _status_kib(server.pid, "VmRSS")
                peak = _status_kib(server.pid, "VmHWM")  # the kernel's peak through the start
            rows.append((config, ready_s, rss / 1024, peak / 1024))
            logger.info("%s: ready in %.1f s, %.0f MiB", config, ready_s, rss / 1024)
    print("\n### Start-up: `streamer serve` to /readyz 200 (model and export cached)\n")
    print("| configuration | start to ready, s | resident when ready, MiB | peak, MiB |")
    print("|---|---|---|---|")
    for config in STARTUP_CONFIGS:
        mine = [r for r in rows if r[0] == config]
        ready = ", ".join(f"{r[1]:.1f}" for r in mine)
        print(
            f"| {config} | {ready} | {statistics.median(r[2] for r in mine):.0f} | "
            f"{max(r[3] for r in mine):.0f} |"
        )


# --- contention ---------------------------------------------------------------------------


def part_contention(args: argparse.Namespace) -> None:
    speech = speech_signal(args.cache_dir)
    recognizers = {
        "onnx-int8, no spinning": _load("onnx-int8", args),
        "onnx-int8, spinning": _load("onnx-int8", args, spin_wait=True),
        "onnx-fp32, no spinning": _load("onnx-fp32", args),
        "torch-int8": _load("torch-int8", args),
    }
    results: dict[tuple[str, str, float], list[float]] = {}
    for load in ("idle", "2 busy processes"):
        spinners = []
        if load != "idle":  # two processes that never sleep: as busy as 2 cores get
            spin = [sys.executable, "-c", "while True: pass"]
            spinners = [subprocess.Popen(spin) for _ in range(2)]
            time.sleep(1.0)
        try:
            for rep in range(args.contention_reps):
                for seconds in (1.0, 7.0):
                    pcm = speech[rep * 1000 : rep * 1000 + int(seconds * SAMPLE_RATE)]
                    for name, recognizer in recognizers.items():
                        key = (load, name, seconds)
                        results.setdefault(key, []).append(_timed(recognizer, pcm))
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
    print(
        f"\n### Contention: decode ms, median (max) of {args.contention_reps}, "
        f"{args.threads} threads\n"
    )
    print("| configuration | idle 1 s | idle 7 s | busy 1 s | busy 7 s |")
    print("|---|---|---|---|---|")
    for name in recognizers:
        cells = [
            _summary(results[(load, name, s)])
            for load in ("idle", "2 busy processes")
            for s in (1.0, 7.0)
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:small")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--segments", type=int, default=24)
    parser.add_argument("--startup-reps", type=int, default=2)
    parser.add_argument("--contention-reps", type=int, default=6)
    parser.add_argument("--parts", default="decode,startup,contention")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench/out/bench_backends"))
    args = parser.parse_args()
    from streamer.model.files import default_cache_dir

    args.cache_dir = args.cache_dir or default_cache_dir()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("streamer").setLevel(logging.ERROR)
    print(json.dumps({"model": args.model, "threads": args.threads, "cpus": os.cpu_count()}))
    for part in args.parts.split(","):
        {"decode": part_decode, "startup": part_startup, "contention": part_contention}[part](args)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
