"""Latency through the FunASR and Wyoming ports, side by side with protocol v1, in one run.

    python -m bench.compat_latency_ports --clients 1,8 --rounds 6 --json bench/out/compat-ports.json

Starts ``streamer serve --funasr-port P --wyoming-port Q --threads 1`` (default model
``random:tagged``, whose partials and finals are real text for the espeak clips used
here). Per number of concurrent clients, round and scenario, each protocol runs N
sessions (the same seeded start delays within 0.5 s), one protocol after the other in an
order that rotates each round (``--concurrent``: all protocols at once). The "paired
difference" table compares the same round, client slot and utterance across protocols.
Every client asks for English (as Home Assistant does) and streams 60 ms chunks (FunASR's
chunk) at real-time pace from an absolute schedule, with a raw client for its protocol,
so no client library's overhead is measured.
``--cost-only`` times the adapters in process.

Two scenarios:

- **captions** (v1, FunASR 2pass): "the quick brown fox ..." and "hello there" with
  1.2 s pauses. *ttft*: first text of an utterance (v1 ``partial``/``final``; FunASR
  ``2pass-online``/``2pass-offline``) minus the send time of its true speech onset.
  FunASR's online text is append-only, so it starts with a partial's *stable* text; *v1
  stable* (first v1 partial with stable text) is the same trigger in v1, and FunASR ttft
  minus v1 stable is the adapter's cost. *final*: v1 ``final`` / FunASR ``2pass-offline``
  minus the send time of the true speech end.
- **command** (v1, FunASR, Wyoming: Home Assistant's shape): "the quick brown fox ..."
  then 300 ms of silence, then the end of input (v1 ``stop``, ``{"is_speaking": false}``,
  ``audio-stop``). *ttft*: first text (Wyoming: ``transcript-chunk``); *answer*: v1
  ``end``, FunASR's ``is_final`` message, Wyoming's ``transcript``, minus the send time
  of the end of input (the final is decoded after it: 300 ms is under the endpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
from websockets.asyncio.client import connect

from bench.common import REPO
from bench.latency.serverproc import ManagedServer, ServerOptions, free_port
from streamer.core.compat.wyoming import EventParser, WyomingEvent, encode_event
from streamer.testkit import speech as synth

logger = logging.getLogger("bench.compat_ports")

RATE = 16000
CHUNK_SAMPLES = 960  # 60 ms
CHUNK_S = CHUNK_SAMPLES / RATE
STAGGER_S = 0.5
FOX = "the quick brown fox jumps over the lazy dog"
HELLO = "hello there"
WYOMING_FORMAT = {"rate": RATE, "width": 2, "channels": 1}


@dataclass
class Track:
    pcm: np.ndarray
    onsets: list[int]  # true speech onset of each utterance, samples
    ends: list[int]  # true speech end of each utterance, samples


@dataclass
class Run:
    """One session: when each chunk left, what arrived when."""

    sent_s: list[float] = field(default_factory=list)  # per chunk index
    stop_s: float = 0.0  # when the end of input left
    arrived: list[tuple[float, dict]] = field(default_factory=list)

    def sent_at(self, sample: int) -> float:
        return self.sent_s[min(sample // CHUNK_SAMPLES, len(self.sent_s) - 1)]


def make_tracks(cache: Path) -> dict[str, Track]:
    fox = synth.speak(FOX, "en", cache_dir=cache)
    hello = synth.speak(HELLO, "en", cache_dir=cache)
    pcm, truth = synth.join_with_silence([("en", FOX, fox), ("en", HELLO, hello)], 1200)
    captions = Track(pcm, [u.start_sample for u in truth], [u.end_sample for u in truth])
    pcm, truth = synth.join_with_silence([("en", FOX, fox)], 300)
    command = Track(pcm, [u.start_sample for u in truth], [u.end_sample for u in truth])
    return {"captions": captions, "command": command}


async def pace(run: Run, pcm: np.ndarray, send: Callable, start_s: float) -> None:
    data = pcm.astype("<i2").tobytes()
    step = CHUNK_SAMPLES * 2
    for index, offset in enumerate(range(0, len(data), step)):
        delay = start_s + index * CHUNK_S - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        run.sent_s.append(time.perf_counter())
        await send(data[offset : offset + step])


# -- one raw client per protocol ---------------------------------------------------------


async def v1_session(url: str, track: Track, delay_s: float) -> Run:
    run = Run()
    await asyncio.sleep(delay_s)
    async with connect(url + "?partials=true&language=en", compression=None) as ws:
        orjson.loads(await ws.recv())  # ready

        async def receive() -> None:
            async for message in ws:
                obj = orjson.loads(message)
                run.arrived.append((time.perf_counter(), obj))
                if obj["type"] == "end":
                    return

        receiver = asyncio.create_task(receive())
        await pace(run, track.pcm, ws.send, time.perf_counter())
        run.stop_s = time.perf_counter()
        await ws.send('{"type": "stop"}')
        await asyncio.wait_for(receiver, 60)
    return run


async def funasr_session(uri: str, track: Track, delay_s: float) -> Run:
    run = Run()
    await asyncio.sleep(delay_s)
    async with connect(uri, subprotocols=["binary"], compression=None) as ws:
        await ws.send(
            json.dumps(
                {
                    "mode": "2pass",
                    "audio_fs": RATE,
                    "wav_name": "bench",
                    "chunk_size": [5, 10, 5],
                    "svs_lang": "en",
                    "is_speaking": True,
                }
            )
        )

        async def receive() -> None:
            async for message in ws:
                obj = orjson.loads(message)
                run.arrived.append((time.perf_counter(), obj))
                if obj["is_final"]:
                    return

        receiver = asyncio.create_task(receive())
        await pace(run, track.pcm, ws.send, time.perf_counter())
        run.stop_s = time.perf_counter()
        await ws.send('{"is_speaking": false}')
        await asyncio.wait_for(receiver, 60)
    return run


async def wyoming_session(port: int, track: Track, delay_s: float) -> Run:
    run = Run()
    await asyncio.sleep(delay_s)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    parser = EventParser()

    async def send(event: WyomingEvent) -> None:
        writer.write(encode_event(event))
        await writer.drain()

    async def receive() -> None:
        while data := await reader.read(65536):
            now = time.perf_counter()
            for event in parser.feed(data):
                run.arrived.append((now, {"type": event.type, **event.data}))
                if event.type == "transcript":
                    return

    await send(WyomingEvent("transcribe", {"language": "en"}))
    await send(WyomingEvent("audio-start", WYOMING_FORMAT))
    receiver = asyncio.create_task(receive())

    async def chunk(piece: bytes) -> None:
        await send(WyomingEvent("audio-chunk", WYOMING_FORMAT, piece))

    await pace(run, track.pcm, chunk, time.perf_counter())
    run.stop_s = time.perf_counter()
    await send(WyomingEvent("audio-stop"))
    await asyncio.wait_for(receiver, 60)
    writer.close()
    return run


# -- what each run measured ----------------------------------------------------------
# Each figure is a list with one entry per utterance (None where it did not happen), so
# that the same client slot and utterance can be paired across protocols.

Figures = dict[str, list[float | None]]


def has_text(obj: dict) -> bool:
    return bool(obj.get("text", "").strip())


def v1_figures(run: Run, track: Track) -> Figures:
    out: Figures = {"ttft": [], "stable": [], "final": []}
    finals = [(t, m) for t, m in run.arrived if m["type"] == "final" and m["text"]]
    for k, (onset, end) in enumerate(zip(track.onsets, track.ends, strict=True)):
        seg = finals[k][1]["segment_id"] if k < len(finals) else None
        mine = [(t, m) for t, m in run.arrived if m.get("segment_id") == seg]
        first = next((t for t, m in mine if m["type"] in ("partial", "final") and m["text"]), None)
        stable = next(
            (
                t
                for t, m in mine
                if (m["type"] == "partial" and m["stable_text"]) or m["type"] == "final"
            ),
            None,
        )
        out["ttft"].append(None if first is None else first - run.sent_at(onset))
        out["stable"].append(None if stable is None else stable - run.sent_at(onset))
        out["final"].append(finals[k][0] - run.sent_at(end) if k < len(finals) else None)
    end_time = next(t for t, m in run.arrived if m["type"] == "end")
    return out | {"answer": [end_time - run.stop_s]}


def funasr_figures(run: Run, track: Track) -> Figures:
    n = len(track.onsets)
    out: Figures = {"ttft": [None] * n, "final": [None] * n}
    utterance = 0
    for t, m in run.arrived:
        if utterance >= n or not has_text(m):
            continue
        if out["ttft"][utterance] is None:
            out["ttft"][utterance] = t - run.sent_at(track.onsets[utterance])
        if m["mode"] == "2pass-offline":
            out["final"][utterance] = t - run.sent_at(track.ends[utterance])
            utterance += 1
    return out | {"answer": [run.arrived[-1][0] - run.stop_s]}


def wyoming_figures(run: Run, track: Track) -> Figures:
    first = next((t for t, m in run.arrived if m["type"] == "transcript-chunk"), None)
    transcript = next(t for t, m in run.arrived if m["type"] == "transcript")
    ttft = None if first is None else first - run.sent_at(track.onsets[0])
    return {"ttft": [ttft], "answer": [transcript - run.stop_s]}


# -- the adapters' own cost, in process ---------------------------------------------------


def adapter_cost(sessions: int = 200) -> dict[str, dict[str, float]]:
    """CPU time of ``drain()`` (translating and encoding the session's messages) per adapter.

    Every adapter drives the same session logic on the same audio, answered at once by a
    stand-in worker; only ``drain()`` is timed, which is where an adapter differs from v1.
    """
    from streamer.core.compat.funasr import FunAsrAdapter
    from streamer.core.compat.wyoming import WyomingAdapter, WyomingInfo
    from streamer.core.jobs import DecodeResult
    from streamer.core.protocol import StreamOptions
    from streamer.core.session import Session, SessionOptions
    from streamer.core.transcript import Transcript
    from streamer.core.wire import V1Adapter

    t = np.arange(RATE * 2) / RATE
    loud = (8000 * np.sin(2 * np.pi * 220 * t)).astype(np.int16)
    pcm = np.concatenate([np.zeros(4800, np.int16), loud, np.zeros(16000, np.int16)] * 2)
    data = pcm.tobytes()
    words = FOX.split()

    def classify(frame: np.ndarray) -> bool:
        return float(np.abs(frame.astype(np.int32)).mean()) > 500

    def build(kind: str):
        session = Session("b", SessionOptions(model_name="bench"), StreamOptions(), classify)
        if kind == "v1":
            return V1Adapter(session)
        if kind == "funasr":
            return FunAsrAdapter(session)
        return WyomingAdapter(session, WyomingInfo(model_name="bench", version="0"))

    def answer(session: Session) -> None:
        while jobs := session.jobs_to_submit():
            for job in jobs:
                n = len(words) if job.kind == "final" else 1 + (job.end_sample // 4800) % 9
                raw = "<|en|><|NEUTRAL|><|Speech|><|woitn|>" + " ".join(words[:n])
                tr = Transcript.from_raw(raw, rich=raw, token_ids=(), audio_ms=0, decode_ms=0)
                session.decode_finished(DecodeResult(job=job, transcript=tr))

    out: dict[str, dict[str, float]] = {}
    for kind in ("v1", "funasr", "wyoming"):
        per_session: list[float] = []
        with_input: list[float] = []
        frames = 0
        for _ in range(sessions):
            adapter = build(kind)
            adapter.start()
            if kind == "funasr":
                adapter.receive_text('{"mode": "2pass", "audio_fs": 16000}')
            elif kind == "wyoming":
                adapter.receive_bytes(encode_event(WyomingEvent("audio-start", WYOMING_FORMAT)))
            spent = received = 0.0
            for offset in range(0, len(data), CHUNK_SAMPLES * 2):
                piece = data[offset : offset + CHUNK_SAMPLES * 2]
                if kind == "wyoming":
                    piece = encode_event(WyomingEvent("audio-chunk", WYOMING_FORMAT, piece))
                started = time.perf_counter()
                adapter.receive_bytes(piece)  # the session's VAD and framing: the same work
                received += time.perf_counter() - started
                answer(adapter.session)
                started = time.perf_counter()
                frames += sum(1 for f in adapter.drain() if f.data)  # count-only: not sent
                spent += time.perf_counter() - started
            per_session.append(spent)
            with_input.append(spent + received)
        out[kind] = {
            "frames_per_session": frames / sessions,
            "drain_p50_us": percentile(per_session, 50) * 1e6,
            "drain_p95_us": percentile(per_session, 95) * 1e6,
            "in_out_p50_us": percentile(with_input, 50) * 1e6,
        }
    return out


# -- the run ---------------------------------------------------------------------------

SCENARIOS = {"captions": ("v1", "funasr"), "command": ("v1", "funasr", "wyoming")}
# (scenario, protocol, its figure, v1's figure): protocol minus v1, same client and utterance.
# FunASR's and Wyoming's first text is a partial's stable text: v1's "stable" is that trigger.
PAIRS = (
    ("captions", "funasr", "ttft", "stable"),
    ("captions", "funasr", "final", "final"),
    ("command", "funasr", "ttft", "stable"),
    ("command", "funasr", "answer", "answer"),
    ("command", "wyoming", "ttft", "stable"),
    ("command", "wyoming", "answer", "answer"),
)
Results = dict[str, dict[str, list[float]]]


async def measure(
    server: ManagedServer,
    ports: dict[str, int],
    tracks: dict[str, Track],
    clients: int,
    rounds: int,
    seed: int,
    concurrent: bool,
    scenarios: tuple[str, ...] = tuple(SCENARIOS),
) -> tuple[Results, Results]:
    """Per scenario, each protocol's ``clients`` sessions, one protocol after the other
    (or all at once with ``concurrent``); returns (figures, paired differences)."""
    funasr_uri = f"ws://127.0.0.1:{ports['funasr']}/"
    sessions = {
        "v1": lambda track, delay: v1_session(server.url, track, delay),
        "funasr": lambda track, delay: funasr_session(funasr_uri, track, delay),
        "wyoming": lambda track, delay: wyoming_session(ports["wyoming"], track, delay),
    }
    figures_of = {"v1": v1_figures, "funasr": funasr_figures, "wyoming": wyoming_figures}
    results: Results = {}
    paired: Results = {}
    rng = random.Random(seed)
    for round_index in range(rounds):
        delays = [rng.uniform(0, STAGGER_S) for _ in range(clients)]
        for scenario, protocols in SCENARIOS.items():
            if scenario not in scenarios:
                continue
            track = tracks[scenario]
            figures: dict[str, list[Figures]] = {}
            if concurrent:
                runs = await asyncio.gather(
                    *[sessions[p](track, d) for p in protocols for d in delays]
                )
                for i, p in enumerate(protocols):
                    chunk = runs[i * clients : (i + 1) * clients]
                    figures[p] = [figures_of[p](run, track) for run in chunk]
            else:  # one protocol at a time, the order rotating each round
                shift = round_index % len(protocols)
                for p in protocols[shift:] + protocols[:shift]:
                    runs = await asyncio.gather(*[sessions[p](track, d) for d in delays])
                    figures[p] = [figures_of[p](run, track) for run in runs]
                    await asyncio.sleep(0.5)
            for p, per_client in figures.items():
                for one in per_client:
                    for key, values in one.items():
                        bucket = results.setdefault(f"{scenario}/{p}", {}).setdefault(key, [])
                        bucket.extend(v for v in values if v is not None)
            for pair_scenario, p, key, v1_key in PAIRS:
                if pair_scenario != scenario:
                    continue
                bucket = paired.setdefault(f"{scenario}: {p} {key} - v1 {v1_key}", {})
                diffs = bucket.setdefault("diff", [])
                for mine, base in zip(figures[p], figures["v1"], strict=True):
                    for a, b in zip(mine[key], base[v1_key], strict=False):
                        if a is not None and b is not None:
                            diffs.append(a - b)
            logger.info("%d clients, round %d: %s done", clients, round_index + 1, scenario)
            await asyncio.sleep(0.5)
    return results, paired


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def report(all_results: dict[int, tuple[Results, Results]]) -> str:
    lines = [
        "| clients | scenario / protocol | figure | n | p50 ms | p95 ms |",
        "|---|---|---|---|---|---|",
    ]
    for clients, (results, _) in all_results.items():
        for name, figures in results.items():
            for key, values in figures.items():
                lines.append(
                    f"| {clients} | {name} | {key} | {len(values)} | "
                    f"{percentile(values, 50) * 1000:.1f} | {percentile(values, 95) * 1000:.1f} |"
                )
    lines += [
        "",
        "| clients | paired difference (same client slot and utterance) | n | p50 ms | p95 ms |",
        "|---|---|---|---|---|",
    ]
    for clients, (_, paired) in all_results.items():
        for name, bucket in paired.items():
            diffs = bucket["diff"]
            lines.append(
                f"| {clients} | {name} | {len(diffs)} | {percentile(diffs, 50) * 1000:+.1f} | "
                f"{percentile(diffs, 95) * 1000:+.1f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:tagged")
    parser.add_argument("--clients", default="1,8", help="comma-separated concurrency levels")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scenarios", default="captions,command", help="which to run")
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="run the protocols' sessions at the same time (they then queue for the one "
        "model worker together) instead of one protocol after the other",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="the server's torch threads (1: no oversubscription)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    parser.add_argument("--cost-only", action="store_true", help="only the in-process table")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(os.environ.get("STREAMER_CACHE_DIR", REPO / ".cache")),
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    tracks = make_tracks(args.cache_dir / "speech")
    ports = {"funasr": free_port(), "wyoming": free_port()}
    options = ServerOptions(
        model=args.model,
        extra_args=(
            "--funasr-port",
            str(ports["funasr"]),
            "--wyoming-port",
            str(ports["wyoming"]),
            "--cache-dir",
            str(args.cache_dir),
            "--threads",
            str(args.threads),
        ),
    )
    cost = adapter_cost()
    cost_table = "\n".join(
        [
            "| adapter | frames out per session | drain() per session p50 us | p95 us "
            "| input + drain() per session p50 us |",
            "|---|---|---|---|---|",
        ]
        + [
            f"| {k} | {v['frames_per_session']:.0f} | {v['drain_p50_us']:.0f} | "
            f"{v['drain_p95_us']:.0f} | {v['in_out_p50_us']:.0f} |"
            for k, v in cost.items()
        ]
    )
    if args.cost_only:
        print(cost_table)
        return 0
    all_results: dict[int, tuple[Results, Results]] = {}
    with ManagedServer(options, REPO / "bench/out/compat-ports-server.log") as server:
        for clients in (int(c) for c in args.clients.split(",")):
            all_results[clients] = asyncio.run(
                measure(
                    server,
                    ports,
                    tracks,
                    clients,
                    args.rounds,
                    args.seed,
                    args.concurrent,
                    tuple(args.scenarios.split(",")),
                )
            )
    table = report(all_results) + "\n\n" + cost_table
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"model": args.model, "results": all_results, "adapter_cost": cost, "table": table},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
