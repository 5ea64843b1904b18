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
of audio (one thread), the resident memory they add, and, with ``--latency-s`` > 0, one
real-time client's final latency against a ``streamer serve --diarize-model`` with the
stream option diarize on and off in alternation (one server, one run).

    python -m bench.diarization --out bench/out/diarization --latency-s 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

from bench import common
from streamer.core.diarization import DiarizationOptions
from streamer.testkit import diarizer as kit

CONVERSATIONS = [
    (("reader", "cards"), 0),
    (("reader", "digits"), 1),
    (("cards", "alsa"), 2),
    (("reader", "cards", "digits"), 3),
    (("reader", "cards", "digits", "alsa"), 4),
]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _score(reference: list, hypothesis: list) -> dict[str, Any]:
    out = {}
    for name, collar in (("no_collar", 0.0), ("collar_0.25", 0.25)):
        s = kit.der(reference, hypothesis, collar_s=collar)
        out[name] = {
            "der": round(s.der, 4),
            "missed": round(s.missed, 4),
            "false_alarm": round(s.false_alarm, 4),
            "confusion": round(s.confusion, 4),
        }
    return out


def measure_der(models: Any, out: Path, turns: int) -> list[dict[str, Any]]:
    options = DiarizationOptions()
    rows = []
    for voices, seed in CONVERSATIONS:
        pcm, reference = kit.conversation(list(voices), turns, seed=seed, overlap_every=4)
        name = "-".join(voices)
        (out / f"{name}.rttm").write_text(kit.rttm(name, reference))
        started = time.process_time()
        run = kit.diarize_stream(models, pcm, options)
        cpu_s = time.process_time() - started
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
            "process_cpu_s_per_audio_s": round(cpu_s / audio_s, 4),
        }
        rows.append(row)
        print(json.dumps(row))
    return rows


async def _latency(args: argparse.Namespace, out: Path, diarizer_dir: Path) -> dict[str, Any]:
    from streamer.client.connection import ClientOptions
    from streamer.client.streaming import transcribe
    from streamer.core.protocol import StreamOptions

    pcm, _ = kit.conversation(["reader", "cards"], 12, seed=0)
    extra = ("--diarize-model", str(diarizer_dir))
    finals: dict[str, list[float]] = {"off": [], "on": []}
    unlabelled = 0
    with common.started_server(args, out / "server.log", extra_args=extra) as server:
        deadline = time.monotonic() + args.latency_s
        turn = 0
        while time.monotonic() < deadline:
            mode = ("off", "on")[turn % 2]
            stream = StreamOptions(diarize=mode == "on")
            result = await transcribe(
                ClientOptions(url=server.url, stream=stream), pcm, 16000, speed=1.0
            )
            finals[mode].extend(result.final_latencies_s())
            if mode == "on":
                unlabelled += sum(1 for f in result.finals if f.text and f.speaker is None)
            turn += 1
        metrics = _metrics(server.url)
    summary: dict[str, Any] = {"unlabelled_finals_on": unlabelled, "server_metrics": metrics}
    for mode, values in finals.items():
        if values:
            ordered = sorted(values)
            summary[mode] = {
                "finals": len(values),
                "p50_s": round(statistics.median(ordered), 3),
                "p95_s": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 3),
            }
    return summary


def _metrics(url: str) -> dict[str, float]:
    """The server's speaker-model time and audio, from /metrics (speculation included)."""
    import urllib.request

    base = url.replace("ws://", "http://").split("/v1/")[0]
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    wanted = {
        "streamer_diarization_analysis_seconds_sum": "speaker_analysis_s",
        "streamer_diarization_analysis_seconds_count": "speaker_analyses",
        "streamer_audio_seconds_total": "audio_s",
    }
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in wanted:
            out[wanted[name]] = out.get(wanted[name], 0.0) + float(line.split()[-1])
    if out.get("audio_s"):
        out["speaker_s_per_audio_s"] = round(out.get("speaker_analysis_s", 0.0) / out["audio_s"], 4)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_server_args(parser)
    common.add_output_args(parser, out="bench/out/diarization")
    parser.add_argument("--turns", type=int, default=16, help="turns per conversation")
    parser.add_argument(
        "--latency-s", type=float, default=0.0, help="seconds of the on/off latency run (0: none)"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from streamer.model.speakers.layout import resolve_diarizer
    from streamer.model.speakers.models import SpeakerModels

    directory = kit.ensure_diarizer(args.cache_dir)
    before = _rss_mb()
    models = SpeakerModels(resolve_diarizer(str(directory), args.cache_dir))
    loaded = _rss_mb()
    results: dict[str, Any] = {"conversations": measure_der(models, out, args.turns)}
    results["memory_mb"] = {
        "rss_before": round(before, 1),
        "rss_after_load": round(loaded, 1),
        "rss_after_runs": round(_rss_mb(), 1),
        "peak": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if args.latency_s > 0:
        results["latency_1_client"] = asyncio.run(_latency(args, out, directory))
    print(json.dumps({k: v for k, v in results.items() if k != "conversations"}, indent=1))
    common.write_results(out, results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
