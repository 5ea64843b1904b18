"""Latency through each wire protocol, side by side in one run: v1, Deepgram, OpenAI Realtime.

What the adapters cost: N real-time clients per protocol stream the same speech (100 ms
chunks, staggered starts) over raw WebSockets, each in its own protocol's messages, and
the bench maps each utterance's server-reported start and end onto the client's send log
(as ``bench.latency`` does for v1):

- **ttft**: the first text of an utterance (v1 ``partial``/``final``, Deepgram ``Results``,
  OpenAI ``delta``/``completed``) minus the send time of the utterance's first sample;
- **final**: the utterance's final (v1 ``final``, Deepgram ``Results`` with ``is_final``,
  OpenAI ``completed``) minus the send time of its last sample.

The protocols ask for the same thing: 16 kHz PCM (OpenAI's ``audio/pcm`` at 16000, so no
protocol resamples), server VAD with a 500 ms endpoint, partials on, language detection.
A step of N clients runs N clients *of each protocol at once* (3N sessions, starts
staggered, protocols assigned round-robin and rotated every round so each protocol gets
each track), so all three see the same machine: on a shared machine, steps run one after
the other would differ by more than the adapters do. OpenAI's ttft is later by design:
its deltas are append-only, so the first one waits for two partial decodes to agree.

    python -m bench.compat_latency --model random:small --quantize int8 --clients 1,8 \
        --duration-s 20 --rounds 2 --out bench/out/compat
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from bench import common
from bench.latency.audio import SAMPLE_RATE, load_bench_audio
from bench.latency.load import ClientPlan, StepOptions, plan_clients
from bench.latency.metrics import SendLog, percentiles

logger = logging.getLogger("bench.compat_latency")

PROTOCOLS = ("v1", "deepgram", "openai")
CHUNK_MS = 100
ENDPOINT_MS = 500
DRAIN_TIMEOUT_S = 30.0


@dataclass
class Utterance:
    """What one client saw of one utterance (times are time.monotonic())."""

    start_ms: float
    end_ms: float | None = None
    first_text_t: float | None = None
    final_t: float | None = None


@dataclass
class ClientRun:
    protocol: str
    sends: list[tuple[int, float]] = field(default_factory=list)  # (samples sent, time)
    utterances: dict[Any, Utterance] = field(default_factory=dict)
    error: str | None = None

    def latencies(self) -> tuple[list[float], list[float]]:
        log = SendLog.from_pairs(self.sends, SAMPLE_RATE)
        ttft, final = [], []
        for u in self.utterances.values():
            sent_start = log.time_of_start_ms(u.start_ms)
            if u.first_text_t is not None and sent_start is not None:
                ttft.append(u.first_text_t - sent_start)
            if u.final_t is not None and u.end_ms is not None:
                sent_end = log.time_of_end_ms(u.end_ms)
                if sent_end is not None:
                    final.append(u.final_t - sent_end)
        return ttft, final


class Protocol:
    """How one protocol's client opens, sends audio, ends, and reads utterance times."""

    path = ""

    def __init__(self, run: ClientRun, utterances: int) -> None:
        self.run = run
        self.expected = utterances  # speech clips in the track
        self.done = asyncio.Event()  # the session is over (closed, or every final in)

    async def open(self, ws: ClientConnection) -> None:
        pass

    def audio(self, chunk: bytes) -> str | bytes:
        return chunk

    async def end(self, ws: ClientConnection) -> None:
        pass

    def on_message(self, message: dict[str, Any], t: float) -> None:
        raise NotImplementedError

    def utterance(self, key: Any, start_ms: float) -> Utterance:
        if key not in self.run.utterances:
            self.run.utterances[key] = Utterance(start_ms=start_ms)
        return self.run.utterances[key]


class V1(Protocol):
    path = f"/v1/asr?endpoint_ms={ENDPOINT_MS}"

    async def end(self, ws: ClientConnection) -> None:
        await ws.send('{"type": "stop"}')

    def on_message(self, m: dict[str, Any], t: float) -> None:
        kind = m.get("type")
        if kind == "speech_start":
            self.utterance(m["segment_id"], m["start_ms"])
        elif kind in ("partial", "final"):
            u = self.utterance(m["segment_id"], m["start_ms"])
            if m["text"] and u.first_text_t is None:
                u.first_text_t = t
            if kind == "final":
                u.end_ms, u.final_t = m["end_ms"], t
        elif kind == "end":
            self.done.set()


class Deepgram(Protocol):
    path = (
        f"/v1/listen?encoding=linear16&sample_rate={SAMPLE_RATE}&channels=1"
        f"&interim_results=true&endpointing={ENDPOINT_MS}&model=nova-3"
    )

    async def end(self, ws: ClientConnection) -> None:
        await ws.send('{"type": "CloseStream"}')

    def on_message(self, m: dict[str, Any], t: float) -> None:
        if m.get("type") == "Results":
            start_ms = round(m["start"] * 1000, 1)
            u = self.utterance(start_ms, start_ms)  # interims and final share their start
            if m["channel"]["alternatives"][0]["transcript"] and u.first_text_t is None:
                u.first_text_t = t
            if m["is_final"]:
                u.end_ms, u.final_t = round((m["start"] + m["duration"]) * 1000, 1), t
        elif m.get("type") == "Metadata":
            self.done.set()


class OpenAI(Protocol):
    path = "/v1/realtime?intent=transcription"

    def __init__(self, run: ClientRun, utterances: int) -> None:
        super().__init__(run, utterances)
        self.ended = False
        self.open_items: set[str] = set()
        self.completed = 0

    async def open(self, ws: ClientConnection) -> None:
        update = {
            "type": "session.update",
            "session": {
                "type": "transcription",
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcm", "rate": SAMPLE_RATE},
                        "turn_detection": {
                            "type": "server_vad",
                            "silence_duration_ms": ENDPOINT_MS,
                        },
                    }
                },
            },
        }
        await ws.send(json.dumps(update))

    def audio(self, chunk: bytes) -> str:
        return orjson.dumps(
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}
        ).decode()

    async def end(self, ws: ClientConnection) -> None:
        # The protocol has no end of stream: the last item is over once the VAD has closed
        # it (every track ends in silence) and at least one item per clip has completed.
        self.ended = True
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.ended and not self.open_items and self.completed >= self.expected:
            self.done.set()

    def on_message(self, m: dict[str, Any], t: float) -> None:
        kind = m.get("type", "")
        if kind == "input_audio_buffer.speech_started":
            self.open_items.add(m["item_id"])
            self.utterance(m["item_id"], m["audio_start_ms"])
        elif kind == "conversation.item.input_audio_transcription.delta":
            u = self.run.utterances.get(m["item_id"])
            if u is not None and m["delta"] and u.first_text_t is None:
                u.first_text_t = t
        elif kind == "input_audio_buffer.speech_stopped":
            u = self.run.utterances.get(m["item_id"])
            if u is not None:
                u.end_ms = m["audio_end_ms"]
        elif kind == "conversation.item.input_audio_transcription.completed":
            u = self.run.utterances.get(m["item_id"])
            if u is not None:
                if m["transcript"] and u.first_text_t is None:
                    u.first_text_t = t
                u.final_t = t
            self.open_items.discard(m["item_id"])
            self.completed += 1
            self._maybe_done()
        elif kind == "error":
            self.run.error = m["error"]["message"]


CLIENTS: dict[str, Callable[[ClientRun, int], Protocol]] = {
    "v1": V1,
    "deepgram": Deepgram,
    "openai": OpenAI,
}


async def run_client(port: int, protocol: str, plan: ClientPlan) -> ClientRun:
    await asyncio.sleep(plan.delay_s)
    track = plan.track
    run = ClientRun(protocol)
    client = CLIENTS[protocol](run, len(plan.speech_spans))
    chunk = SAMPLE_RATE * CHUNK_MS // 1000
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
            await client.open(ws)
            loop = asyncio.get_running_loop()
            started = loop.time()
            for k, i in enumerate(range(0, track.size, chunk)):
                await asyncio.sleep(max(0.0, started + k * CHUNK_MS / 1000 - loop.time()))
                piece = track[i : i + chunk]
                await ws.send(client.audio(piece.tobytes()))
                run.sends.append((i + piece.size, time.monotonic()))
            await client.end(ws)
            await asyncio.wait_for(client.done.wait(), DRAIN_TIMEOUT_S)
            reader.cancel()
    except (OSError, TimeoutError, ConnectionClosed) as error:
        run.error = f"{type(error).__name__}: {error}"
    return run


async def run_step(port: int, protocols: list[str], plans: list[ClientPlan]) -> list[ClientRun]:
    """Client ``j`` streams ``plans[j]`` in ``protocols[j]``, all at once."""
    return await asyncio.gather(
        *(run_client(port, p, plan) for p, plan in zip(protocols, plans, strict=True))
    )


def summarize(runs: list[ClientRun]) -> dict[str, Any]:
    ttft: list[float] = []
    final: list[float] = []
    for run in runs:
        t, f = run.latencies()
        ttft += t
        final += f
    ms = lambda values: {k: (v * 1000 if v is not None else None)  # noqa: E731
                         for k, v in percentiles(values).items()}  # fmt: skip
    return {
        "utterances": len(final),
        "ttft_ms": ms(ttft),
        "final_ms": ms(final),
        "errors": [r.error for r in runs if r.error],
    }


def table(results: dict[str, Any]) -> str:
    lines = [
        "| clients | protocol | utterances | ttft p50 / p95 | final p50 / p95 | final p50 vs v1 |",
        "|---|---|---|---|---|---|",
    ]
    for clients, by_protocol in results["steps"].items():
        base = by_protocol["v1"]["final_ms"]["p50"]
        for protocol in PROTOCOLS:
            s = by_protocol[protocol]
            t, f = s["ttft_ms"], s["final_ms"]
            fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
            diff = "" if protocol == "v1" or base is None or f["p50"] is None else (
                f"{f['p50'] - base:+.0f} ms")  # fmt: skip
            lines.append(
                f"| {clients} | {protocol} | {s['utterances']} | {fmt(t['p50'])} / "
                f"{fmt(t['p95'])} | {fmt(f['p50'])} / {fmt(f['p95'])} | {diff} |"
            )
    return "\n".join(lines)


def add_side_by_side_args(
    parser: argparse.ArgumentParser, *, clients: list[int], rounds: int, out: str
) -> None:
    """The arguments of a bench that runs N clients of each kind at once, in rounds."""
    common.add_server_args(parser)
    common.add_output_args(parser, out=out)
    parser.add_argument("--clients", type=common.int_list, default=clients,
                        help="clients of each kind per step, e.g. 1,4")  # fmt: skip
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--stagger-s", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--audio", default="auto", help="auto, synth, recorded or mixed")


def warmup_plans(audio: list[Any]) -> list[ClientPlan]:
    """Three short clients at once: the first decodes are slower."""
    return plan_clients(StepOptions(url="", clients=3, duration_s=4, stagger_s=0), audio)


def step_plans(
    args: argparse.Namespace, audio: list[Any], clients: int, kinds: int, chunk_ms: int
) -> list[ClientPlan]:
    """``clients`` of each of ``kinds`` kinds, starts staggered over ``--stagger-s``."""
    step = StepOptions(
        url="", clients=kinds * clients, duration_s=args.duration_s,
        stagger_s=args.stagger_s, endpoint_ms=ENDPOINT_MS, chunk_ms=chunk_ms,
    )  # fmt: skip
    return plan_clients(step, audio)


def rotation(kinds: tuple[str, ...], count: int, round_index: int) -> list[str]:
    """Client ``j``'s kind in a round: round-robin, shifted every round, so that each kind
    gets each track."""
    return [kinds[(j + round_index) % len(kinds)] for j in range(count)]


def report(args: argparse.Namespace, results: dict[str, Any], text: str) -> None:
    """Write results.json (with the command and the machine) and print the table and errors."""
    path = common.write_results(args.out, results, args)
    print(text)
    for clients, by_kind in results["steps"].items():
        for kind, s in by_kind.items():
            if s["errors"]:
                print(f"{clients} clients, {kind}: {len(s['errors'])} errors: {s['errors'][:3]}")
    print(f"results: {path}")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    audio = load_bench_audio(args.audio, args.cache_dir / "speech")
    results: dict[str, Any] = {"steps": {}}
    with common.started_server(args, args.out / "server.log", endpoint_ms=ENDPOINT_MS) as server:
        await run_step(server.port, list(PROTOCOLS), warmup_plans(audio))
        for clients in args.clients:
            plans = step_plans(args, audio, clients, len(PROTOCOLS), CHUNK_MS)
            runs: dict[str, list[ClientRun]] = {p: [] for p in PROTOCOLS}
            for r in range(args.rounds):
                logger.info("%d clients of each protocol, round %d", clients, r + 1)
                for run in await run_step(server.port, rotation(PROTOCOLS, len(plans), r), plans):
                    runs[run.protocol].append(run)
            results["steps"][clients] = {p: summarize(runs[p]) for p in PROTOCOLS}
    return results


def main() -> int:
    parser = common.parser(__doc__)
    add_side_by_side_args(parser, clients=[1, 8], rounds=3, out="bench/out/compat")
    args = parser.parse_args()
    common.setup_logging()
    results = asyncio.run(main_async(args))
    report(args, results, table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
