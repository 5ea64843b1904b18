"""What partial refreshes cost against their segment's length (issue 31), in-process.

A :class:`~streamer.core.session.Session` is fed espeak-ng speech (sentences run together
into segments of up to 7 s) and every job it submits is decoded at once by a real
recognizer (no queue, no skipped refresh: the cost of the partials themselves, not of
a loaded server). Per configuration, interleaved within each repetition: the refreshes'
decoded audio and decode time by segment length so far, their sum, and the finals'.
``whole`` decodes every refresh from the segment's first sample (before issue 31);
``window`` is today's default :class:`~streamer.core.partial_window.PartialWindowOptions`.

    python -m bench.latency.refresh_cost --model random:small --quantize int8 --reps 3
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

import numpy as np

from bench import common
from streamer.core.jobs import DecodeResult
from streamer.core.partial_window import PartialWindowOptions
from streamer.core.protocol import StreamOptions
from streamer.core.session import Session, SessionOptions
from streamer.core.vad import webrtc_classifier
from streamer.model.options import RecognizerOptions
from streamer.testkit.speech import join_with_silence, speak

CONFIGS = {"whole": PartialWindowOptions(full_ms=0), "window": PartialWindowOptions()}
CHUNK_SAMPLES = 960  # 60 ms per frame sent
BUCKETS_S = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.5)
PASSAGE = (
    "the quick brown fox jumps over the lazy dog and then it runs along the river bank "
    "until the evening light fades over the hills and the town below grows quiet",
    "streaming speech recognition should feel instant even when many people talk at the "
    "same time on a small machine with only two processor cores to share between them",
    "please turn on the lights in the kitchen and in the hall then close the windows "
    "because the weather report says that a storm is coming later in the night",
)


def run_once(recognizer: Any, pcm: np.ndarray, options: PartialWindowOptions) -> list[dict]:
    session = Session(
        "bench",
        replace(SessionOptions(), partial_window=options),
        StreamOptions(),
        webrtc_classifier(),
    )
    session.start()
    rows: list[dict] = []

    def drain() -> None:
        jobs = session.jobs_to_submit()
        while jobs:
            for job in jobs:
                started = time.perf_counter()
                (transcript,) = recognizer.decode_jobs([job])
                decode_ms = (time.perf_counter() - started) * 1000
                segment_start = job.segment_start_sample or job.start_sample
                rows.append(
                    {
                        "kind": "final" if job.kind == "final" or job.speculative else "refresh",
                        "segment_s": (job.end_sample - segment_start) / 16000,
                        "audio_s": job.pcm.size / 16000,
                        "decode_ms": decode_ms,
                    }
                )
                session.decode_finished(DecodeResult(job=job, transcript=transcript))
            jobs = session.jobs_to_submit()
        session.messages_to_send()

    for at in range(0, pcm.size, CHUNK_SAMPLES):
        session.receive_audio(pcm[at : at + CHUNK_SAMPLES].tobytes())
        drain()
    session.stop()
    drain()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--model", default="random:small")
    parser.add_argument("--quantize", default="int8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cache-dir", type=common.Path, default=common.CACHE_DIR)
    args = parser.parse_args(argv)
    from streamer.model.backends.loading import load_recognizer
    from streamer.testkit.models import RANDOM_MODELS

    recognizer = load_recognizer(
        RecognizerOptions(
            model=args.model,
            backend="onnx",
            quantize=args.quantize or None,
            threads=args.threads,
            cache_dir=args.cache_dir,
            random_models=RANDOM_MODELS,
        )
    )
    clips = [("en", text, speak(text, cache_dir=args.cache_dir)) for text in PASSAGE]
    pcm, _ = join_with_silence(clips, 1000)
    results: dict[str, list[dict]] = defaultdict(list)
    for _ in range(args.reps):
        for name, options in CONFIGS.items():
            results[name].extend(run_once(recognizer, pcm, options))
    load = os.getloadavg()
    print(
        f"{common.cpu_name()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        f"{pcm.size / 16000:.1f} s of speech x {args.reps} reps; {args.model} {args.quantize}"
    )
    print(
        "\n| segment so far | "
        + " | ".join(f"{n}: refreshes, audio s, decode ms median (max)" for n in CONFIGS)
        + " |"
    )
    print("|---|" + "---|" * len(CONFIGS))
    low = 0.0
    for high in BUCKETS_S:
        cells = []
        for name in CONFIGS:
            rows = [
                r for r in results[name] if r["kind"] == "refresh" and low < r["segment_s"] <= high
            ]
            if not rows:
                cells.append("-")
                continue
            ms = [r["decode_ms"] for r in rows]
            audio = statistics.median(r["audio_s"] for r in rows)
            cells.append(f"{len(rows)}, {audio:.2f}, {statistics.median(ms):.0f} ({max(ms):.0f})")
        print(f"| {low:.0f}-{high:.1f} s | " + " | ".join(cells) + " |")
        low = high
    print(
        "\n| configuration | refreshes | refresh audio s | refresh decode s | finals "
        "| final decode s |"
    )
    print("|---|---|---|---|---|---|")
    for name in CONFIGS:
        refresh = [r for r in results[name] if r["kind"] == "refresh"]
        finals = [r for r in results[name] if r["kind"] == "final"]
        print(
            f"| {name} | {len(refresh)} | {sum(r['audio_s'] for r in refresh):.1f} | "
            f"{sum(r['decode_ms'] for r in refresh) / 1000:.2f} | {len(finals)} | "
            f"{sum(r['decode_ms'] for r in finals) / 1000:.2f} |"
        )


if __name__ == "__main__":
    main()
