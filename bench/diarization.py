"""Speaker diarization: DER online and offline on conversations of recorded voices, the
speaker models' CPU and memory, and the final latency with diarize on and off.

Conversations are built from recorded voices of different people on this machine
(pocketsphinx-testdata's reader, its cards speaker and its digits speaker, alsa-utils'
voice; ``streamer.testkit.diarizer``): 2-4 voices, 16 short turns, every 4th turn
overlapping the previous by 0.3 s, with their RTTM references written to ``--out``.
Each voice comes from a recording of its own, so the channel differs too: say so beside
any figure. DER (missed, false alarm, confusion apart) with and without a 0.25 s collar,
for the online labels (the live path: a diarized session's finals) and offline (the same
utterances' local speakers clustered together at the end: spectral clustering with the
count given, and with the eigengap's estimate). Then the speaker models' CPU per second
of audio (one thread), as the offline pass spends it and as the live server's worker
does (each utterance's early jobs while it grows, then its analysis: thread CPU seconds,
robust on a loaded machine, and the CAM++ frames embedded, exact anywhere), the resident
memory they add, and, with ``--latency-s`` > 0, one
real-time client's final latency against a ``streamer serve --diarize-model`` with the
stream option diarize on and off in alternation (one server, one run).

    python -m bench.diarization --out bench/out/diarization --latency-s 60

Another checkout's speaker models measured by this bench (it needs only ``streamer`` and
bench/common.py): ``cd OLD && PYTHONPATH=$PWD python NEW/bench/diarization.py ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from streamer.core.diarization import FBANK_BINS, DiarizationOptions
from streamer.testkit import diarizer as kit

DER_FIELDS = ("der", "missed", "false_alarm", "confusion")
PREFIX_STEP_SAMPLES = 6000  # close_ms: an open utterance's audio as early jobs see it grow
CONVERSATIONS = [
    (("reader", "cards"), 0),
    (("reader", "digits"), 1),
    (("cards", "alsa"), 2),
    (("reader", "cards", "digits"), 3),
    (("reader", "cards", "digits", "alsa"), 4),
]


def _score(reference: list, hypothesis: list) -> dict[str, Any]:
    out = {}
    for name, collar in (("no_collar", 0.0), ("collar_0.25", 0.25)):
        s = kit.der(reference, hypothesis, collar_s=collar)
        out[name] = {k: round(getattr(s, k), 4) for k in DER_FIELDS}
    return out


def measure_der(models: Any, out: Path, turns: int) -> list[dict[str, Any]]:
    options = DiarizationOptions()
    rows = []
    for voices, seed in CONVERSATIONS:
        pcm, reference = kit.conversation(list(voices), turns, seed=seed, overlap_every=4)
        name = "-".join(voices)
        (out / f"{name}.rttm").write_text(kit.rttm(name, reference))
        run = kit.diarize_stream(models, pcm, options)
        audio_s = len(pcm) / 16000
        row = {
            "voices": list(voices),
            "audio_s": round(audio_s, 1),
            "utterances": len(run.analyses),
            "online": _score(reference, run.online),
            "offline_count_given": _score(reference, kit.offline_turns(run, options, len(voices))),
            "offline_eigengap": _score(reference, kit.offline_turns(run, options, None)),
            "online_speakers_found": len({t.speaker for t in run.online}),
            "models_s_per_audio_s": round(run.analyse_s / audio_s, 4),
            **live_worker(models, pcm, run),
        }
        rows.append(row)
        print(json.dumps(row))
    return rows


def live_worker(models: Any, pcm: Any, run: kit.DiarizedRun) -> dict[str, Any]:
    """What the live server's speaker worker spends on the utterances (one thread): each
    one's early jobs as it grows, then its analysis (``close_ms``: wall, ``close_cpu_ms``:
    thread CPU, once it has ended, as a worker that keeps up leaves it)."""
    from streamer.model.speakers.models import WindowCache

    session, frames = models._emb, [0]

    class Counted:  # the embedding graph's session, counting the frames it is given
        def run(self, names: Any, feeds: dict[str, Any]) -> Any:
            frames[0] += sum(x.size for x in feeds.values()) // FBANK_BINS  # batch x time
            return session.run(names, feeds)

    models._emb = Counted()
    wall_ms, close_cpu_ms, began = [], [], time.thread_time()
    for start, analysis in run.analyses:
        audio, windows = pcm[start : start + analysis.samples], WindowCache()
        for end in range(PREFIX_STEP_SAMPLES, len(audio), PREFIX_STEP_SAMPLES):
            models.embed_closed(audio[:end], windows)
        started, closing = time.perf_counter(), time.thread_time()
        models.analyse(0, audio, windows)
        wall_ms.append((time.perf_counter() - started) * 1000)
        close_cpu_ms.append((time.thread_time() - closing) * 1000)
    models._emb, audio_s = session, len(pcm) / 16000
    return {
        "close_ms": _quantiles(wall_ms),
        "close_cpu_ms": _quantiles(close_cpu_ms),
        "worker_cpu_s_per_audio_s": round((time.thread_time() - began) / audio_s, 4),
        "campp_frames_per_audio_s": round(frames[0] / audio_s, 1),
    }


def _quantiles(values: list[float], unit: str = "", digits: int = 1) -> dict[str, float]:
    quantiles = common.percentiles(values, (50.0, 95.0))
    return {f"{q}{unit}": round(v or 0.0, digits) for q, v in quantiles.items()}


async def _latency(args: argparse.Namespace, out: Path, diarizer_dir: Path) -> dict[str, Any]:
    from streamer.client.connection import ClientOptions
    from streamer.client.streaming import transcribe
    from streamer.core.protocol import StreamOptions

    pcm, _ = kit.conversation(["reader", "cards"], args.latency_turns, seed=0)
    extra = ("--diarize-model", str(diarizer_dir))
    finals: dict[str, list[float]] = {"off": [], "on": []}
    unlabelled = 0
    with common.started_server(args, out / "server.log", extra_args=extra) as server:
        deadline = time.monotonic() + args.latency_s
        turn = 0
        while time.monotonic() < deadline or turn < 2:  # each mode once at least
            mode = ("off", "on")[turn % 2]
            stream = StreamOptions(diarize=mode == "on")
            result = await transcribe(
                ClientOptions(url=server.url, stream=stream), pcm, 16000, speed=1.0
            )
            finals[mode].extend(result.final_latencies_s())
            if mode == "on":
                unlabelled += sum(1 for f in result.finals if f.text and f.speaker is None)
            turn += 1
    summary: dict[str, Any] = {"unlabelled_finals_on": unlabelled}
    for mode, values in finals.items():
        if values:
            summary[mode] = {"finals": len(values), **_quantiles(values, "_s", 3)}
    return summary


_LOAD_MEMORY = """
import json, os, sys
from bench.common import rss_mb
from streamer.model.speakers.layout import resolve_diarizer
import streamer.model.speakers.models as m
before = rss_mb(os.getpid())
models = m.SpeakerModels(resolve_diarizer(sys.argv[1], sys.argv[2]))
print(json.dumps({"rss_before": round(before, 1), "rss_after_load": round(rss_mb(os.getpid()), 1)}))
"""


def _load_memory_mb(directory: Path, cache_dir: str) -> dict[str, float]:
    """The speaker models' resident cost, loaded in a fresh interpreter: in this process an
    export or an earlier run may have left freed memory that the load reuses unseen."""
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_MEMORY, str(directory), str(cache_dir)],
        capture_output=True, text=True, timeout=300, check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__, prog="python -m bench.diarization")
    common.add_server_args(parser)
    common.add_output_args(parser, out="bench/out/diarization")
    parser.add_argument("--turns", type=int, default=16, help="turns per conversation")
    parser.add_argument(
        "--latency-s", type=float, default=0.0, help="seconds of the on/off latency run (0: none)"
    )
    parser.add_argument(
        "--latency-turns", type=int, default=12, help="turns of the latency run's conversation"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from streamer.model.speakers.layout import resolve_diarizer
    from streamer.model.speakers.models import SpeakerModels

    directory = kit.ensure_diarizer(args.cache_dir)
    models = SpeakerModels(resolve_diarizer(str(directory), args.cache_dir))
    rows = measure_der(models, out, args.turns)
    audio_s = sum(row["audio_s"] for row in rows)  # the live worker on all, by their audio:
    live = ("worker_cpu_s_per_audio_s", "campp_frames_per_audio_s")
    total = {k: round(sum(r[k] * r["audio_s"] for r in rows) / audio_s, 4) for k in live}
    results: dict[str, Any] = {"conversations": rows, "live_worker": total}
    results["memory_mb"] = {
        **_load_memory_mb(directory, args.cache_dir),
        "rss_after_runs": round(common.rss_mb(os.getpid()), 1),
        "peak": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if args.latency_s > 0:
        results["latency_1_client"] = asyncio.run(_latency(args, out, directory))
    print(json.dumps({k: v for k, v in results.items() if k != "conversations"}, indent=1))
    common.write_results(out, results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
