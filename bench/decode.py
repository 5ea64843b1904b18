"""Decoding without a server: backends, precisions, batches and hotwords, one ``--parts`` each.

Each part loads the ``--configs`` it needs in this process (``BACKEND-PRECISION``:
``torch-fp32``, ``torch-int8``, ``onnx-fp32``, ``onnx-int8``, ``torch-fp16``/``torch-bf16``
on CUDA; the int8 weight types' ``onnx-int8-qint8`` are at 276f9f2) and
prints a markdown table; timed configurations are interleaved within each repetition so
that machine noise hits all alike. Speech is espeak-ng's (en and zh, 200 ms gaps).

- ``time``: decode time of 1, 3 and 7 s per configuration, median (max) of ``--reps``;
- ``agreement``: token agreement of each configuration with the first on ``--segments``
  segments of 0.3-7 s (languages auto/en/zh, ITN on and off);
- ``batch-timing``: one ``decode_batch`` per batch size (``--sizes``) and length;
- ``hotwords``: a final of 3 and 7 s with no hotwords and with ``--phrases`` phrases (the
  biased beam search with the server's beam and boost), the phrase set's graph built first as a
  session's is. (Settled parts are at ``git show 276f9f2:bench/decode.py``:
  ``generate``, torch's direct path against ``AutoModel.generate()``; ``recall``, what
  hotwords gain on real speech; ``batch``, the rows a batch changes.)

    python -m bench.decode --parts time,agreement            # 4 configurations
    python -m bench.decode --parts batch-timing --configs onnx-int8,onnx-fp32
    python -m bench.decode --parts hotwords --configs onnx-int8 --phrases 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench import common
from bench.latency.audio import looped_speech
from streamer.testkit.speech import SAMPLE_RATE, SENTENCES

LENGTHS_S = (1.0, 3.0, 7.0)
LANGUAGES = ("auto", "en", "zh")
# words for the hotwords' phrases: names and jargon of the kind people boost
_WORDS = (
    "kubernetes anthropic claude sensevoice funasr deepgram pipecat livekit grafana "
    "prometheus terraform ansible postgres redis kafka istio envoy nginx haproxy docker "
    "pytorch onnx cuda tensor vector embedding transformer decoder encoder latency "
    "throughput zurich lisbon nairobi osaka toronto quito hanoi bergen tbilisi mombasa"
).split()


def speech_signal(cache_dir: Path, seconds: float = 32) -> np.ndarray:
    """``seconds`` of espeak speech (en and zh, 200 ms gaps), repeated."""
    sentences = [(lang, text) for lang in ("en", "zh") for text in SENTENCES[lang]]
    return looped_speech(sentences, cache_dir / "speech", seconds, gap_ms=200)


def window(speech: np.ndarray, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """``seconds`` of ``speech`` from a random place."""
    start = int(rng.integers(0, speech.size - int(seconds * SAMPLE_RATE)))
    return speech[start : start + int(seconds * SAMPLE_RATE)]


def options(config: str, args: argparse.Namespace, **fields: Any) -> Any:
    """RecognizerOptions for ``BACKEND-PRECISION``."""
    from streamer.model.options import RecognizerOptions
    from streamer.testkit.models import RANDOM_MODELS

    backend, _, precision = config.partition("-")
    return RecognizerOptions(
        model=args.model, backend=backend, device=args.device, threads=args.threads,
        quantize="int8" if precision == "int8" else None,
        dtype=precision if precision in ("fp16", "bf16") else "fp32",
        cache_dir=args.cache_dir, random_models=RANDOM_MODELS, **fields,
    )  # fmt: skip


def load(config: str, args: argparse.Namespace) -> Any:
    """The recognizer of ``config``, warmed up."""
    from streamer.model.backends.loading import load_recognizer

    return load_recognizer(options(config, args))


def timed_ms(call: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    started = time.perf_counter()
    call(*args, **kwargs)
    return (time.perf_counter() - started) * 1000


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({max(values):.0f})"


def edit_distance(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


# -- backends and precisions ------------------------------------------------------------------


def part_time(args: argparse.Namespace, recognizers: dict[str, Any], speech: np.ndarray) -> None:
    times: dict[tuple[str, float], list[float]] = {}
    rng = np.random.default_rng(0)
    for rep in range(args.reps):
        for seconds in LENGTHS_S:
            pcm = window(speech, seconds, rng)
            for config in recognizers if rep % 2 == 0 else reversed(recognizers):
                ms = timed_ms(recognizers[config].decode, pcm)
                times.setdefault((config, seconds), []).append(ms)
    print(f"\n### Decode time, ms: median (max) of {args.reps} interleaved repetitions\n")
    print("| configuration | " + " | ".join(f"{s:g} s" for s in LENGTHS_S) + " |")
    print("|---|" + "---|" * len(LENGTHS_S))
    for config in recognizers:
        print(f"| {config} | " + " | ".join(cell(times[(config, s)]) for s in LENGTHS_S) + " |")


def part_agreement(
    args: argparse.Namespace, recognizers: dict[str, Any], speech: np.ndarray
) -> None:
    rng = np.random.default_rng(1)
    count = args.segments
    segments = [window(speech, 0.3 + 6.7 * i / max(1, count - 1), rng) for i in range(count)]

    def tokens(config: str) -> list[tuple[int, ...]]:
        return [
            recognizers[config].decode(pcm, language=LANGUAGES[i % 3], use_itn=i % 2 == 0).token_ids
            for i, pcm in enumerate(segments)
        ]

    first, *others = recognizers
    reference = tokens(first)
    print(f"\n### Agreement with {first} on {count} segments of 0.3-7 s\n")
    print(f"| configuration | identical token sequences | token error rate vs {first} |")
    print("|---|---|---|")
    for config in others:
        got = tokens(config)
        same = sum(g == r for g, r in zip(got, reference, strict=True))
        errors = sum(edit_distance(g, r) for g, r in zip(got, reference, strict=True))
        total = max(1, sum(len(r) for r in reference))
        print(f"| {config} | {same}/{count} | {100 * errors / total:.2f} % |")


# -- batches --------------------------------------------------------------------------------


def part_batch_timing(
    args: argparse.Namespace, recognizers: dict[str, Any], speech: np.ndarray
) -> None:
    for config, recognizer in recognizers.items():
        times: dict[tuple[int, float], list[float]] = {}
        for repeat in range(args.reps):
            for seconds in args.lengths:
                n = int(seconds * SAMPLE_RATE)
                for size in args.sizes:
                    pcms = [speech[(k * 7919 + repeat * 131) % (speech.size - n) :][:n]
                            for k in range(size)]  # fmt: skip
                    ms = timed_ms(
                        recognizer.decode_batch, pcms, languages=["auto"] * size,
                        use_itns=[True] * size,
                    )  # fmt: skip
                    times.setdefault((size, seconds), []).append(ms)
        print(f"| {config} | batch | " + " | ".join(f"{s:g} s" for s in args.lengths) + " |")
        for size in args.sizes:
            medians = [statistics.median(times[(size, s)]) for s in args.lengths]
            cells = [f"{ms:.0f} ({ms / size:.0f}/seg)" for ms in medians]
            print(f"| {config} | {size} | " + " | ".join(cells) + " |", flush=True)


def phrases(count: int) -> tuple[Any, ...]:
    """``count`` distinct phrases of one to three words from :data:`_WORDS`."""
    from streamer.core.hotwords import DEFAULT_BOOST, Hotword

    rng = np.random.default_rng(0)
    found: dict[str, Any] = {}
    while len(found) < count:
        text = " ".join(rng.choice(_WORDS, size=int(rng.integers(1, 4)), replace=False))
        found[text] = Hotword(text, DEFAULT_BOOST)
    return tuple(found.values())


def final_ms(
    recognizer: Any, pcm: np.ndarray, words: tuple[Any, ...], segment: int
) -> tuple[float, str]:
    """A final's decode (a new segment each time: no feature-cache reuse) and its text."""
    from streamer.core.jobs import DecodeJob

    job = DecodeJob("bench", segment, "final", pcm, 0, pcm.size, "auto", True, hotwords=words)
    started = time.perf_counter()
    (transcript,) = recognizer.decode_jobs([job])
    return (time.perf_counter() - started) * 1000, transcript.text


def part_hotwords(
    args: argparse.Namespace, recognizers: dict[str, Any], speech: np.ndarray
) -> None:
    from streamer.model.decode.ctc_beam import DEFAULT_BEAM

    words = phrases(args.phrases)
    print(f"\n{len(words)} phrases, beam {DEFAULT_BEAM}, {args.reps} rounds")
    print("| configuration | audio | no hotwords (ms) | with hotwords (ms) | ratio | text changed |"
          "\n|---|---|---|---|---|---|")  # fmt: skip
    segment = 0
    for config, recognizer in recognizers.items():
        for seconds in (3.0, 7.0):
            pcm = speech[: int(seconds * SAMPLE_RATE)]
            for warm in ((), words):  # the graph is built here, once, as per session
                segment += 1
                final_ms(recognizer, pcm, warm, segment)
            times: dict[bool, list[float]] = {False: [], True: []}
            texts: dict[bool, str] = {}
            for _ in range(args.reps):
                for biased in (False, True):
                    segment += 1
                    ms, texts[biased] = final_ms(recognizer, pcm, words if biased else (), segment)
                    times[biased].append(ms)
            a, b = statistics.median(times[False]), statistics.median(times[True])
            changed = "yes" if texts[True] != texts[False] else "no"
            print(f"| {config} | {seconds:.0f} s | {a:.0f} | {b:.0f} | {b / a:.2f}x | {changed} |")


PARTS: dict[str, Callable[[argparse.Namespace, dict[str, Any], np.ndarray], None]] = {
    "time": part_time, "agreement": part_agreement,
    "batch-timing": part_batch_timing, "hotwords": part_hotwords,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    common.add_output_args(parser, out="bench/out/decode")
    parser.add_argument("--parts", default="time,agreement", help=", ".join(PARTS))
    parser.add_argument("--configs", default="torch-fp32,torch-int8,onnx-fp32,onnx-int8",
                        help="comma list of BACKEND-PRECISION")  # fmt: skip
    parser.add_argument("--model", default="random:small")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument("--threads", type=int, default=2, help="0 = one per core (max 8)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions of each timing")
    parser.add_argument("--segments", type=int, default=24, help="for agreement")
    parser.add_argument("--sizes", type=common.int_list, default=[1, 2, 4, 8], help="batch sizes")
    parser.add_argument("--lengths", type=lambda s: [float(x) for x in s.split(",")],
                        default=list(LENGTHS_S), help="seconds, for batch-timing")  # fmt: skip
    parser.add_argument("--phrases", type=int, default=100)
    args = parser.parse_args(argv)
    args.configs = args.configs.split(",")
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    common.setup_logging()
    print(json.dumps({"model": args.model, "threads": args.threads, "cpu": common.cpu_name()}))
    if args.model.startswith("random:"):  # built here, not inside a timed part
        from streamer.testkit.models import ensure_random_model

        ensure_random_model(args.model.partition(":")[2], args.cache_dir)
    speech = speech_signal(args.cache_dir)
    recognizers = {c: load(c, args) for c in args.configs}
    for part in parts:
        PARTS[part](args, recognizers, speech)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
