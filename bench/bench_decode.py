"""Decode path: the recognizer's direct path against ``AutoModel.generate()``.

For each configuration (fp32, and int8 on the CPU) a fresh child process loads the model
(load time and peak RSS are measured there, so one configuration's memory does not hide
another's), then decodes 1, 3 and 7 s of speech through both paths, interleaved so that
machine noise hits both alike, and checks that they return the same tokens. Prints a
markdown table of medians.

    python -m bench.bench_decode                       # random:small on the CPU
    python -m bench.bench_decode --device cuda --modes fp32,fp16
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import REPO
from streamer.testkit.speech import SAMPLE_RATE, SENTENCES, speak

logger = logging.getLogger("bench_decode")

MODES = {
    "fp32": {"dtype": "fp32", "quantize": None},
    "int8": {"dtype": "fp32", "quantize": "int8"},
    "fp16": {"dtype": "fp16", "quantize": None},
    "bf16": {"dtype": "bf16", "quantize": None},
}


def _speech(seconds: float, cache_dir: Path) -> np.ndarray:
    clips = [speak(text, "en", cache_dir=cache_dir / "speech") for text in SENTENCES["en"]]
    clips += [speak(text, "zh", cache_dir=cache_dir / "speech") for text in SENTENCES["zh"]]
    gap = np.zeros(SAMPLE_RATE // 5, np.int16)
    signal = np.concatenate([part for clip in clips for part in (clip, gap)])
    needed = int(seconds * SAMPLE_RATE)
    while signal.size < needed:
        signal = np.concatenate([signal, signal])
    return signal[:needed]


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """Load once and time both paths (runs in the child process)."""
    import psutil

    from streamer.model.funasr_quiet import import_funasr
    from streamer.model.options import RecognizerOptions
    from streamer.model.torch_backend import Recognizer
    from streamer.testkit.models import RANDOM_MODELS

    process = psutil.Process()
    started = time.perf_counter()
    import_funasr()  # about 5 s of imports, the same for any model
    import_s = time.perf_counter() - started
    rss_before = process.memory_info().rss
    started = time.perf_counter()
    recognizer = Recognizer(
        RecognizerOptions(
            model=args.model,
            device=args.device,
            threads=args.threads,
            warmup=False,
            cache_dir=args.cache_dir,
            random_models=RANDOM_MODELS,
            **MODES[mode],
        )
    )
    load_s = time.perf_counter() - started
    rss_after_load = process.memory_info().rss
    warm_started = time.perf_counter()
    recognizer.warmup()
    warmup_s = time.perf_counter() - warm_started

    rows = []
    for seconds in args.seconds:
        pcm = _speech(seconds, args.cache_dir)
        direct: list[float] = []
        reference: list[float] = []
        same: bool | None = True
        for _ in range(args.repeats):
            a = recognizer.decode(pcm)
            direct.append(a.decode_ms)
            if same is None:
                continue
            try:
                b = recognizer.decode_reference(pcm)
            except Exception as error:  # generate() cannot run half precision
                logger.warning("generate() failed in mode %s: %s", mode, error)
                same = None
                continue
            reference.append(b.decode_ms)
            same = same and a.token_ids == b.token_ids
        rows.append(
            {
                "seconds": seconds,
                "direct_ms": statistics.median(direct),
                "generate_ms": statistics.median(reference) if reference else None,
                "same_tokens": same,
            }
        )
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "mode": mode,
        "device": recognizer.device,
        "threads": args.threads,
        "import_s": import_s,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "rss_before_load_mib": rss_before / 2**20,
        "rss_after_load_mib": rss_after_load / 2**20,
        "peak_rss_mib": peak_kib / 1024,
        "rows": rows,
    }


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | audio | direct (median) | generate() (median) | generate / direct "
        "| same tokens |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        for row in result["rows"]:
            generate_ms = row["generate_ms"]
            same = {True: "yes", False: "NO", None: "n/a"}[row["same_tokens"]]
            compared = (
                f"{generate_ms:.1f} ms | {generate_ms / row['direct_ms']:.2f}"
                if generate_ms is not None
                else "failed | n/a"
            )
            lines.append(
                f"| {result['mode']} | {row['seconds']:g} s | {row['direct_ms']:.1f} ms | "
                f"{compared} | {same} |"
            )
    lines += [
        "",
        "| mode | device | import funasr | load | warm-up | RSS after load | peak RSS |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        lines.append(
            f"| {result['mode']} | {result['device']} | {result['import_s']:.1f} s | "
            f"{result['load_s']:.1f} s | "
            f"{result['warmup_s']:.1f} s | {result['rss_after_load_mib'] / 1024:.2f} GiB | "
            f"{result['peak_rss_mib'] / 1024:.2f} GiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:small")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--threads", type=int, default=0, help="0 = one per core (max 8)")
    parser.add_argument(
        "--modes",
        default=None,
        help="comma-separated of fp32,int8,fp16,bf16 (default: fp32,int8 on "
        "the CPU, fp32,fp16 on CUDA)",
    )
    parser.add_argument("--seconds", default="1,3,7", help="audio lengths to decode")
    parser.add_argument("--repeats", type=int, default=10, help="decodes per path and length")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(os.environ.get("STREAMER_CACHE_DIR", REPO / ".cache")),
    )
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--child-mode", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.seconds = [float(s) for s in args.seconds.split(",")]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    if args.child_mode:
        print(json.dumps(run_mode(args, args.child_mode)))
        return 0

    on_cpu = args.device == "cpu"
    modes = (args.modes or ("fp32,int8" if on_cpu else "fp32,fp16")).split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes: {', '.join(unknown)}")
    if args.model.startswith("random:"):  # build it here, not inside a timed child
        from streamer.testkit.models import ensure_random_model

        ensure_random_model(args.model.partition(":")[2], args.cache_dir)
    _speech(max(args.seconds), args.cache_dir)

    load_before = os.getloadavg()[0]
    results = []
    for mode in modes:
        child_argv = [a for a in (argv if argv is not None else sys.argv[1:])]
        completed = subprocess.run(
            [sys.executable, "-m", "bench.bench_decode", *child_argv, "--child-mode", mode],
            check=True,
            capture_output=True,
            text=True,
        )
        sys.stderr.write(completed.stderr)
        results.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    print(
        f"model {args.model}, device {args.device}, threads {args.threads or 'auto'}, "
        f"{args.repeats} decodes per path and length (medians); 1-minute load average "
        f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after\n"
    )
    print(_table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
