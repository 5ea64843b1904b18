"""int8 weight types on the CPU at hand: decode time and agreement with fp32 (issue 24).

ONNX Runtime's dynamic quantization turns each MatMul into ``DynamicQuantizeLinear``
(activations to uint8 at run time, always) and ``MatMulInteger`` against weights stored as
QInt8 or QUInt8, per tensor or per output channel, with the full 8-bit range or 7 bits
(``reduce_range``). Which kernel runs depends on the CPU: u8 x s8 uses VNNI where there is
one and AVX2's VPMADDUBSW (16-bit intermediate sums, which may saturate) where not; u8 x u8
takes another path. This bench quantizes one fp32 export every way below, loads them all in
one process and decodes 1, 3 and 7 s of speech, configurations interleaved within each
repetition so the machine's noise hits all alike; then token agreement with ONNX fp32
(token-identical to torch fp32, bench/RESULTS.md) on segments of 0.3-7 s.

    python -m bench.int8_types                          # random:small, 2 threads
    python -m bench.int8_types --reps 3 --segments 6    # shorter

Random weights show speed faithfully (the same shapes and kernels as the real model) and
agreement only as an upper bound: their posteriors are flat, so any rounding flips tokens.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bench import common
from bench.bench_backends import (
    LENGTHS_S,
    _edit_distance,
    agreement_segments,
    random_window,
    speech_signal,
)
from streamer.model.files import locate_model
from streamer.model.onnx_backend import OnnxRecognizer, onnx_model_dir
from streamer.model.onnx_export import cached_export, default_int8_weight_type, quantize_int8
from streamer.model.options import RecognizerOptions
from streamer.testkit.models import RANDOM_MODELS

logger = logging.getLogger("bench.int8_types")


@dataclass(frozen=True)
class Variant:
    """One way of quantizing the MatMul weights (None: the fp32 graph itself)."""

    name: str
    weight_type: str | None
    per_channel: bool = False
    reduce_range: bool = False


VARIANTS = (
    Variant("fp32", None),
    Variant("QUInt8", "QUInt8"),
    Variant("QInt8", "QInt8"),
    Variant("QInt8 reduce_range", "QInt8", reduce_range=True),
    Variant("QInt8 per_channel", "QInt8", per_channel=True),
    Variant("QUInt8 per_channel", "QUInt8", per_channel=True),
)


def load_all(args: argparse.Namespace, work: Path) -> dict[str, OnnxRecognizer]:
    source = Path(locate_model(args.model, "ms", args.cache_dir, RANDOM_MODELS))
    export = cached_export(source, args.cache_dir)
    fp32 = onnx_model_dir(export, quantized=False)
    options = RecognizerOptions(
        model=args.model,
        backend="onnx",
        device="cpu",
        threads=args.threads,
        warmup=False,
        cache_dir=args.cache_dir,
        random_models=RANDOM_MODELS,
    )
    loaded = {}
    for variant in VARIANTS:
        if variant.name not in args.variants:
            continue
        model_dir = fp32
        if variant.weight_type is not None:
            graph = work / f"{variant.name.replace(' ', '-')}.onnx"
            started = time.perf_counter()
            quantize_int8(
                fp32.graph,
                graph,
                variant.weight_type,
                per_channel=variant.per_channel,
                reduce_range=variant.reduce_range,
            )
            logger.info("quantized %s in %.0f s", variant.name, time.perf_counter() - started)
            model_dir = replace(fp32, graph=graph)
        quantize = None if variant.weight_type is None else "int8"
        recognizer = OnnxRecognizer(replace(options, quantize=quantize), model_dir=model_dir)
        recognizer.warmup()
        loaded[variant.name] = recognizer
    return loaded


def timed_ms(recognizer: OnnxRecognizer, pcm: np.ndarray) -> float:
    started = time.perf_counter()
    recognizer.decode(pcm)
    return (time.perf_counter() - started) * 1000


def measure(args: argparse.Namespace, recognizers: dict[str, OnnxRecognizer]) -> str:
    speech = speech_signal(args.cache_dir)
    rng = np.random.default_rng(0)
    names = list(recognizers)
    times: dict[tuple[str, float], list[float]] = {}
    for rep in range(args.reps):
        for seconds in LENGTHS_S:
            pcm = random_window(speech, seconds, rng)
            for name in names if rep % 2 == 0 else reversed(names):
                times.setdefault((name, seconds), []).append(timed_ms(recognizers[name], pcm))
        logger.info("repetition %d of %d done", rep + 1, args.reps)
    segments = agreement_segments(speech, args.segments, rng)
    languages = ("auto", "en", "zh")

    def tokens(name: str, i: int) -> tuple[int, ...]:
        language, itn = languages[i % 3], i % 2 == 0
        return recognizers[name].decode(segments[i], language=language, use_itn=itn).token_ids

    reference = [tokens("fp32", i) for i in range(len(segments))]
    lines = [
        f"Decode time, ms: median (max) of {args.reps} interleaved repetitions; agreement with",
        f"ONNX fp32 on {len(segments)} segments of 0.3-7 s (languages auto/en/zh, ITN on/off).",
        "",
        "| weights | "
        + " | ".join(f"{s:g} s" for s in LENGTHS_S)
        + " | 7 s vs QUInt8 | identical | token error rate |",
        "|---|" + "---|" * (len(LENGTHS_S) + 3),
    ]
    base = statistics.median(times[("QUInt8" if "QUInt8" in names else names[0], LENGTHS_S[-1])])
    for name in names:
        cells = [
            f"{statistics.median(times[(name, s)]):.0f} ({max(times[(name, s)]):.0f})"
            for s in LENGTHS_S
        ]
        ratio = statistics.median(times[(name, LENGTHS_S[-1])]) / base
        same = errors = total = 0
        for i, expected in enumerate(reference):
            got = tokens(name, i)
            same += got == expected
            errors += _edit_distance(got, expected)
            total += len(expected)
        agreement = f"{same}/{len(segments)} | {100 * errors / max(1, total):.2f} %"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f}x | {agreement} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--model", default="random:small")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--segments", type=int, default=12)
    parser.add_argument("--cache-dir", type=Path, default=None)
    names = [v.name.replace(" ", "-") for v in VARIANTS]
    parser.add_argument(
        "--variants",
        default=",".join(names),
        help=f"comma list of {', '.join(names)} (fp32, the reference, is always loaded)",
    )
    args = parser.parse_args(argv)
    args.variants = {"fp32", *(name.replace("-", " ") for name in args.variants.split(","))}
    if args.cache_dir is None:
        default = os.environ.get("STREAMER_CACHE_DIR", "~/.cache/sensevoice-streamer")
        args.cache_dir = Path(default).expanduser()
    common.setup_logging()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="int8-types-") as work:
        table = measure(args, load_all(args, Path(work)))
    sys.stdout.write(
        f"Command: `{common.command_line('bench.int8_types', argv)}` "
        f"({time.perf_counter() - started:.0f} s); {common.cpu_name()}, {os.cpu_count()} CPUs; "
        f"{args.threads} threads; model {args.model}; the export's "
        f"default here: {default_int8_weight_type()}\n\n{table}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
