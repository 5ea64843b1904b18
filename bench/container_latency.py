"""Latency of compressed audio against PCM, side by side in one run: WebM/Opus in 250 ms
slices (as a browser's MediaRecorder sends them) against PCM in 40 ms chunks.

N real-time clients of each kind stream the same tracks at once (kinds rotated over the
tracks every round), so all see the same machine:

- ``pcm-40ms``: protocol v1, s16le PCM in 40 ms chunks (the reference);
- ``webm-250ms``: protocol v1 with ``encoding=auto``, the track encoded by ffmpeg as
  WebM/Opus 32 kb/s and sent as MediaRecorder does: every 250 ms, the bytes of the
  Opus packets recorded in those 250 ms (cut at packet boundaries found with PyAV);
- ``deepgram-webm-250ms``: the same bytes to Deepgram's ``/v1/listen`` without
  ``encoding``.

Times are counted from when the audio was *spoken* (the stream's start plus the sample's
position), so the time a sample waits for its slice to be sent (up to 40 ms for PCM, up
to 250 ms in a recorder's slice) is in the figures: **ttft**: the utterance's first text
minus the time its first sample was spoken; **final**: its final minus the time its
last sample was spoken.

Decode cost: the same WebM slices pushed through one :class:`ContainerDecoder` unpaced,
process CPU time per second of audio (% of one core per real-time stream).

    python -m bench.container_latency --model random:small --quantize int8 --clients 1,4 \
        --duration-s 20 --rounds 2 --out bench/out/container
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from bench import common
from bench.compat_latency import (
    V1,
    ClientRun,
    Deepgram,
    Protocol,
    add_side_by_side_args,
    report,
    rotation,
    step_plans,
    summarize,
    warmup_plans,
)
from bench.latency.audio import SAMPLE_RATE, load_bench_audio
from bench.latency.load import ClientPlan
from streamer.media import ContainerDecoder

logger = logging.getLogger("bench.container_latency")

KINDS = ("pcm-40ms", "webm-250ms", "deepgram-webm-250ms")
PCM_CHUNK_MS = 40
SLICE_MS = 250
ENDPOINT_MS = 500
DRAIN_TIMEOUT_S = 30.0


class V1Auto(V1):
    path = f"/v1/asr?endpoint_ms={ENDPOINT_MS}&encoding=auto"


class DeepgramAuto(Deepgram):
    path = f"/v1/listen?interim_results=true&endpointing={ENDPOINT_MS}&model=nova-3"


CLIENTS: dict[str, type[Protocol]] = {
    "pcm-40ms": V1,
    "webm-250ms": V1Auto,
    "deepgram-webm-250ms": DeepgramAuto,
}


@dataclass(frozen=True)
class Piece:
    data: bytes
    at_s: float  # when it is sent, after the stream's start


def webm_bytes(track: np.ndarray, folder: Path) -> bytes:
    raw, out = folder / "track.s16", folder / "track.webm"
    raw.write_bytes(track.astype("<i2").tobytes())
    subprocess.run(
        ["ffmpeg", "-loglevel", "error", "-y", "-f", "s16le", "-ar", str(SAMPLE_RATE)]
        + ["-ac", "1", "-i", str(raw), "-c:a", "libopus", "-b:a", "32k", str(out)],
        check=True,
        timeout=120,
    )
    return out.read_bytes()


def recorder_slices(data: bytes, folder: Path) -> list[Piece]:
    """``data`` cut where MediaRecorder would cut it: after the packets of each 250 ms."""
    path = folder / "slices.webm"
    path.write_bytes(data)
    cuts: list[tuple[int, float]] = []  # (byte offset where a packet starts, its pts in s)
    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        for packet in container.demux(stream):
            if packet.pos is not None and packet.pts is not None and packet.time_base:
                cuts.append((packet.pos, float(packet.pts * packet.time_base)))
    pieces, offset, boundary = [], 0, SLICE_MS / 1000
    for pos, pts in cuts:
        if pts >= boundary:
            pieces.append(Piece(data[offset:pos], boundary))
            offset, boundary = pos, boundary + SLICE_MS / 1000
    pieces.append(Piece(data[offset:], boundary))
    return pieces


def pcm_pieces(track: np.ndarray) -> list[Piece]:
    chunk = SAMPLE_RATE * PCM_CHUNK_MS // 1000
    return [
        Piece(track[i : i + chunk].tobytes(), (i + chunk) / SAMPLE_RATE)
        for i in range(0, track.size, chunk)
    ]


async def run_client(port: int, kind: str, plan: ClientPlan, pieces: list[Piece]) -> ClientRun:
    await asyncio.sleep(plan.delay_s)
    run = ClientRun(kind)
    client = CLIENTS[kind](run, len(plan.speech_spans))
    try:
        async with connect(f"ws://127.0.0.1:{port}{client.path}", max_size=None) as ws:

            async def read() -> None:
                try:
                    async for data in ws:
                        client.on_message(orjson.loads(data), time.monotonic())
                except ConnectionClosed:
                    pass
                client.done.set()

            reader = asyncio.create_task(read())
            loop = asyncio.get_running_loop()
            started, spoken_from = loop.time(), time.monotonic()
            # the time each 10 ms of the track was spoken (see the module doc)
            run.sends = [
                (i, spoken_from + i / SAMPLE_RATE) for i in range(160, plan.track.size + 160, 160)
            ]
            for piece in pieces:
                await asyncio.sleep(max(0.0, started + piece.at_s - loop.time()))
                await ws.send(piece.data)
            await client.end(ws)
            await asyncio.wait_for(client.done.wait(), DRAIN_TIMEOUT_S)
            reader.cancel()
    except (OSError, TimeoutError, ConnectionClosed) as error:
        run.error = f"{type(error).__name__}: {error}"
    return run


def decode_cost(pieces: list[Piece], duration_s: float) -> dict[str, float]:
    """CPU time of decoding one stream's slices, per second of audio, and per slice."""
    decoder = ContainerDecoder("webm", SAMPLE_RATE)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    per_push: list[float] = []
    for piece in pieces:
        t0 = time.perf_counter()
        decoder.push(piece.data)
        per_push.append(time.perf_counter() - t0)
    decoder.flush()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    decoder.close()
    return {
        "core_percent": round(100 * cpu / duration_s, 3),
        "wall_ms_per_audio_s": round(1000 * wall / duration_s, 3),
        "push_ms_p50": round(1000 * float(np.median(per_push)), 3),
        "push_ms_max": round(1000 * max(per_push), 3),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    audio = load_bench_audio(args.audio, args.cache_dir / "speech")
    results: dict[str, Any] = {"steps": {}}
    server = common.started_server(args, args.out / "server.log", endpoint_ms=ENDPOINT_MS)
    with tempfile.TemporaryDirectory() as tmp, server:
        folder = Path(tmp)

        def pieces_for(plans: list[ClientPlan]) -> dict[tuple[int, str], list[Piece]]:
            table: dict[tuple[int, str], list[Piece]] = {}
            for plan in plans:
                webm = recorder_slices(webm_bytes(plan.track, folder), folder)
                table[(plan.index, "pcm-40ms")] = pcm_pieces(plan.track)
                table[(plan.index, "webm-250ms")] = webm
                table[(plan.index, "deepgram-webm-250ms")] = webm
            return table

        async def step(plans: list[ClientPlan], kinds: list[str], table) -> list[ClientRun]:
            return await asyncio.gather(
                *(
                    run_client(server.port, kind, plan, table[(plan.index, kind)])
                    for kind, plan in zip(kinds, plans, strict=True)
                )
            )

        warm = warmup_plans(audio)
        await step(warm, list(KINDS), pieces_for(warm))
        for clients in args.clients:
            plans = step_plans(args, audio, clients, len(KINDS), PCM_CHUNK_MS)
            table = pieces_for(plans)
            runs: dict[str, list[ClientRun]] = {k: [] for k in KINDS}
            for r in range(args.rounds):
                logger.info("%d clients of each kind, round %d", clients, r + 1)
                for run in await step(plans, rotation(KINDS, len(plans), r), table):
                    runs[run.protocol].append(run)
            results["steps"][clients] = {k: summarize(runs[k]) for k in KINDS}
        track = plans[0].track
        results["decode_cost"] = decode_cost(
            table[(plans[0].index, "webm-250ms")], track.size / SAMPLE_RATE
        )
    return results


def table(results: dict[str, Any]) -> str:
    lines = [
        "| clients | kind | utterances | ttft p50 / p95 | final p50 / p95 | ttft p50 vs pcm |",
        "|---|---|---|---|---|---|",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    for clients, by_kind in results["steps"].items():
        base = by_kind["pcm-40ms"]["ttft_ms"]["p50"]
        for kind in KINDS:
            s = by_kind[kind]
            t, f = s["ttft_ms"], s["final_ms"]
            diff = "" if kind == "pcm-40ms" or base is None or t["p50"] is None else (
                f"{t['p50'] - base:+.0f} ms")  # fmt: skip
            lines.append(
                f"| {clients} | {kind} | {s['utterances']} | {fmt(t['p50'])} / "
                f"{fmt(t['p95'])} | {fmt(f['p50'])} / {fmt(f['p95'])} | {diff} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = common.parser(__doc__)
    add_side_by_side_args(parser, clients=[1, 4], rounds=2, out="bench/out/container")
    args = parser.parse_args()
    common.setup_logging()
    results = asyncio.run(main_async(args))
    report(args, results, table(results))
    print("decode cost per WebM/Opus stream:", results["decode_cost"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
