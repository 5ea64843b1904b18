"""Latency through each wire protocol and audio encoding, side by side in one run
(``python -m bench.latency --protocol v1,deepgram,openai,funasr,wyoming --encoding pcm,webm``).

N real-time clients *of each kind* stream the same tracks at once (kinds assigned
round-robin and rotated every round, so each kind gets each track and all see the same
machine: on a shared machine, steps run one after the other would differ by more than
the adapters do), each over a raw connection in its own protocol's messages:

- ``v1``, ``deepgram``, ``openai``: ask for the same thing (16 kHz PCM, server VAD with the
  ``--endpoint-ms`` endpoint, partials on); OpenAI's ttft is later by design: its deltas
  are append-only, so the first waits for two partial decodes to agree;
- ``funasr`` (2pass on ``--funasr-port``) and ``wyoming`` (``--wyoming-port``, Home
  Assistant's shape: one transcript at the end of input);
- ``v1-webm``, ``deepgram-webm``: the track encoded by ffmpeg as WebM/Opus 32 kb/s and sent
  as a browser's MediaRecorder does, every 250 ms the packets recorded in those 250 ms
  (v1 ``encoding=auto``, Deepgram without ``encoding``); the decoder's CPU per stream is
  measured apart (``decode_cost``).

Figures per utterance: **ttft**, its first text minus the send time of its first sample
(v1/Deepgram/OpenAI: the server's start; FunASR, Wyoming: the true speech onset, as they
report no times); **final**, its final minus the send time of its last sample; **answer**,
per session, the last answer minus the end of input. With ``webm`` among the encodings,
every kind counts from when a sample was *spoken* (the stream's start plus its position),
so the up to 250 ms a sample waits for its slice is in the figures.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from bench.common import markdown_table, percentiles
from bench.latency.audio import SAMPLE_RATE, BenchAudio
from bench.latency.load import ClientPlan, StepOptions, plan_clients
from bench.latency.metrics import SendLog
from streamer.core.compat.wyoming import EventParser, WyomingEvent, encode_event

logger = logging.getLogger(__name__)

PROTOCOLS = ("v1", "deepgram", "openai", "funasr", "wyoming")
ENCODINGS = ("pcm", "webm")
WEBM_PROTOCOLS = ("v1", "deepgram")  # the protocols that take a container
SLICE_MS = 250  # MediaRecorder's timeslice
WYOMING_FORMAT = {"rate": SAMPLE_RATE, "width": 2, "channels": 1}


@dataclass(frozen=True)
class RunOptions:
    """One side-by-side run: which kinds, how many clients, how they stream."""

    protocols: tuple[str, ...] = ("v1",)
    encodings: tuple[str, ...] = ("pcm",)
    clients: tuple[int, ...] = (1,)  # clients of each kind per step
    rounds: int = 2  # each step repeated, kinds rotated over the tracks
    duration_s: float = 20.0  # audio per client
    stagger_s: float = 4.0  # client starts spread over this many seconds
    chunk_ms: int = 100  # PCM per frame
    endpoint_ms: int = 500  # every protocol asks for this endpoint
    drain_timeout_s: float = 30.0  # after the end of input, wait this long for the answer

    @property
    def kinds(self) -> tuple[str, ...]:
        pcm = self.protocols if "pcm" in self.encodings else ()
        webm = [f"{p}-webm" for p in self.protocols if p in WEBM_PROTOCOLS]
        return (*pcm, *(webm if "webm" in self.encodings else ()))

    @property
    def spoken(self) -> bool:
        """Count from when audio was spoken (with a container's slices), not sent."""
        return "webm" in self.encodings


def validate(options: RunOptions) -> None:
    """ValueError naming what is unknown or empty."""
    unknown = set(options.protocols) - set(PROTOCOLS) | set(options.encodings) - set(ENCODINGS)
    if unknown:
        raise ValueError(f"unknown protocol or encoding: {', '.join(sorted(unknown))}")
    if not options.kinds:
        raise ValueError(f"webm goes through {' and '.join(WEBM_PROTOCOLS)} only")


@dataclass
class Utterance:
    """What one client saw of one utterance (times are time.monotonic())."""

    start_ms: float
    end_ms: float | None = None
    first_text_t: float | None = None
    final_t: float | None = None


@dataclass
class ClientRun:
    kind: str
    sends: list[tuple[int, float]] = field(default_factory=list)  # (samples, time)
    utterances: dict[Any, Utterance] = field(default_factory=dict)
    stop_t: float | None = None  # the end of input left
    answer_t: float | None = None  # the answer to it arrived
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


# -- one client per protocol ----------------------------------------------------------------


class Protocol:
    """How one protocol's client opens, frames audio, ends, and reads utterance times."""

    def __init__(self, run: ClientRun, plan: ClientPlan, options: RunOptions) -> None:
        self.run = run
        self.spans_ms = [
            (1000 * a / SAMPLE_RATE, 1000 * b / SAMPLE_RATE) for a, b in plan.speech_spans
        ]
        self.endpoint_ms = options.endpoint_ms
        self.done = asyncio.Event()  # the answer to the end of input is in

    def path(self, webm: bool) -> str:
        raise NotImplementedError

    def opening(self) -> list[str]:
        return []

    def audio(self, chunk: bytes) -> str | bytes:
        return chunk

    def ending(self) -> list[str]:
        return []

    def on_message(self, m: dict[str, Any], t: float) -> None:
        raise NotImplementedError

    def finish(self, t: float) -> None:
        self.run.answer_t = t
        self.done.set()

    def utterance(self, key: Any, start_ms: float) -> Utterance:
        if key not in self.run.utterances:
            self.run.utterances[key] = Utterance(start_ms=start_ms)
        return self.run.utterances[key]


class V1(Protocol):
    def path(self, webm: bool) -> str:
        return f"/v1/asr?endpoint_ms={self.endpoint_ms}" + ("&encoding=auto" if webm else "")

    def ending(self) -> list[str]:
        return ['{"type": "stop"}']

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
            self.finish(t)


class Deepgram(Protocol):
    def path(self, webm: bool) -> str:
        encoding = "" if webm else f"encoding=linear16&sample_rate={SAMPLE_RATE}&channels=1&"
        options = f"interim_results=true&endpointing={self.endpoint_ms}&model=nova-3"
        return f"/v1/listen?{encoding}{options}"

    def ending(self) -> list[str]:
        return ['{"type": "CloseStream"}']

    def on_message(self, m: dict[str, Any], t: float) -> None:
        if m.get("type") == "Results":
            start_ms = round(m["start"] * 1000, 1)
            u = self.utterance(start_ms, start_ms)  # interims and final share their start
            if m["channel"]["alternatives"][0]["transcript"] and u.first_text_t is None:
                u.first_text_t = t
            if m["is_final"]:
                u.end_ms, u.final_t = round((m["start"] + m["duration"]) * 1000, 1), t
        elif m.get("type") == "Metadata":
            self.finish(t)


class OpenAI(Protocol):
    def __init__(self, run: ClientRun, plan: ClientPlan, options: RunOptions) -> None:
        super().__init__(run, plan, options)
        self.ended = False
        self.open_items: set[str] = set()
        self.completed = 0

    def path(self, webm: bool) -> str:
        return "/v1/realtime?intent=transcription"

    def opening(self) -> list[str]:
        vad = {"type": "server_vad", "silence_duration_ms": self.endpoint_ms}
        audio = {"format": {"type": "audio/pcm", "rate": SAMPLE_RATE}, "turn_detection": vad}
        session = {"type": "transcription", "audio": {"input": audio}}
        return [json.dumps({"type": "session.update", "session": session})]

    def audio(self, chunk: bytes) -> str:
        message = {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}
        return orjson.dumps(message).decode()

    def ending(self) -> list[str]:
        # No end of stream: the last item is over once the VAD has closed it (every track
        # ends in silence) and at least one item per clip has completed.
        self.ended = True
        self._maybe_done(time.monotonic())
        return []

    def _maybe_done(self, t: float) -> None:
        if self.ended and not self.open_items and self.completed >= len(self.spans_ms):
            self.finish(t)

    def on_message(self, m: dict[str, Any], t: float) -> None:
        kind = m.get("type", "")
        u = self.run.utterances.get(m.get("item_id", ""))
        if kind == "input_audio_buffer.speech_started":
            self.open_items.add(m["item_id"])
            self.utterance(m["item_id"], m["audio_start_ms"])
        elif kind == "conversation.item.input_audio_transcription.delta":
            if u is not None and m["delta"] and u.first_text_t is None:
                u.first_text_t = t
        elif kind == "input_audio_buffer.speech_stopped" and u is not None:
            u.end_ms = m["audio_end_ms"]
        elif kind == "conversation.item.input_audio_transcription.completed":
            if u is not None:
                if m["transcript"] and u.first_text_t is None:
                    u.first_text_t = t
                u.final_t = t
            self.open_items.discard(m["item_id"])
            self.completed += 1
            self._maybe_done(t)
        elif kind == "error":
            self.run.error = m["error"]["message"]


class FunAsr(Protocol):
    """2pass mode; its messages carry no times, so utterance k is the track's k-th clip."""

    def path(self, webm: bool) -> str:
        return "/"

    def opening(self) -> list[str]:
        config = {"mode": "2pass", "audio_fs": SAMPLE_RATE, "wav_name": "bench",
                  "chunk_size": [5, 10, 5], "is_speaking": True}  # fmt: skip
        return [json.dumps(config)]

    def ending(self) -> list[str]:
        return ['{"is_speaking": false}']

    def on_message(self, m: dict[str, Any], t: float) -> None:
        k = sum(u.final_t is not None for u in self.run.utterances.values())
        if m.get("text", "").strip() and k < len(self.spans_ms):
            u = self.utterance(k, self.spans_ms[k][0])
            u.first_text_t = u.first_text_t or t
            if m.get("mode") == "2pass-offline":
                u.end_ms, u.final_t = self.spans_ms[k][1], t
        if m.get("is_final"):
            self.finish(t)


class Wyoming(Protocol):
    """One transcript at the end of input; ``transcript-chunk`` events stream text."""

    def path(self, webm: bool) -> str:
        return ""  # TCP: no path

    def ending(self) -> list[str]:
        return [json.dumps(["audio-stop", {}])]

    def on_message(self, m: dict[str, Any], t: float) -> None:
        if m["type"] == "transcript-chunk" and self.spans_ms:
            u = self.utterance(0, self.spans_ms[0][0])
            u.first_text_t = u.first_text_t or t
        elif m["type"] == "transcript":
            self.finish(t)


CLIENTS: dict[str, type[Protocol]] = {
    "v1": V1, "deepgram": Deepgram, "openai": OpenAI, "funasr": FunAsr, "wyoming": Wyoming,
}  # fmt: skip


class WyomingConnection:
    """A Wyoming TCP connection that sends and yields events as the WebSocket ones do."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.parser = reader, writer, EventParser()

    async def send(self, data: str | bytes) -> None:
        if isinstance(data, bytes):
            event = WyomingEvent("audio-chunk", WYOMING_FORMAT, data)
        else:
            kind, fields = json.loads(data)
            event = WyomingEvent(kind, fields)
        self.writer.write(encode_event(event))
        await self.writer.drain()

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        while data := await self.reader.read(65536):
            for event in self.parser.feed(data):
                yield {"type": event.type, **event.data}


# -- one client, one step -------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    data: bytes
    at_s: float  # when it is sent, after the stream's start
    samples: int  # of the track, sent once it is


def pcm_pieces(track: np.ndarray, chunk_ms: int) -> list[Piece]:
    chunk = SAMPLE_RATE * chunk_ms // 1000
    return [
        Piece(track[i : i + chunk].tobytes(), (i + chunk) / SAMPLE_RATE, min(i + chunk, track.size))
        for i in range(0, track.size, chunk)
    ]


def webm_bytes(track: np.ndarray) -> bytes:
    """``track`` (16 kHz) as WebM/Opus at 32 kbit/s, as MediaRecorder sends it (ffmpeg)."""
    with tempfile.TemporaryDirectory() as folder:
        raw, path = Path(folder) / "track.s16", Path(folder) / "track.webm"
        raw.write_bytes(track.astype("<i2").tobytes())
        subprocess.run(
            ["ffmpeg", "-loglevel", "error", "-y", "-f", "s16le", "-ar", str(SAMPLE_RATE)]
            + ["-ac", "1", "-i", str(raw), "-c:a", "libopus", "-b:a", "32k", str(path)],
            check=True,
            timeout=120,
        )
        return path.read_bytes()


def webm_pieces(track: np.ndarray, folder: Path) -> list[Piece]:
    """The track as WebM/Opus, cut where MediaRecorder would cut it: after the packets of
    each 250 ms (packet boundaries found with PyAV)."""
    import av

    data = webm_bytes(track)
    path = folder / "track.webm"
    path.write_bytes(data)
    cuts: list[tuple[int, float]] = []  # (byte offset where a packet starts, its pts in s)
    with av.open(str(path)) as container:
        for packet in container.demux(container.streams.audio[0]):
            if packet.pos is not None and packet.pts is not None and packet.time_base:
                cuts.append((packet.pos, float(packet.pts * packet.time_base)))
    pieces, offset, boundary = [], 0, SLICE_MS / 1000
    for pos, pts in cuts:
        if pts >= boundary:
            samples = min(track.size, int(boundary * SAMPLE_RATE))
            pieces.append(Piece(data[offset:pos], boundary, samples))
            offset, boundary = pos, boundary + SLICE_MS / 1000
    pieces.append(Piece(data[offset:], boundary, track.size))
    return pieces


async def run_client(
    ports: dict[str, int], kind: str, plan: ClientPlan, pieces: list[Piece], options: RunOptions
) -> ClientRun:
    protocol, _, encoding = kind.partition("-")
    await asyncio.sleep(plan.delay_s)
    run = ClientRun(kind)
    client = CLIENTS[protocol](run, plan, options)
    port = ports.get(protocol, ports["v1"])
    try:
        async with contextlib.AsyncExitStack() as stack:
            conn = await _open(stack, protocol, port, client.path(encoding == "webm"))
            await _stream(conn, client, plan, pieces, options)
    except (OSError, TimeoutError, ConnectionClosed) as error:
        run.error = f"{type(error).__name__}: {error}"
    return run


async def _open(stack: contextlib.AsyncExitStack, protocol: str, port: int, path: str) -> Any:
    """A WebSocket connection, or Wyoming's TCP one past its opening events."""
    if protocol != "wyoming":
        subprotocols: Any = ["binary"] if protocol == "funasr" else None
        url = f"ws://127.0.0.1:{port}{path}"
        return await stack.enter_async_context(
            connect(url, max_size=None, subprotocols=subprotocols, compression=None)
        )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    stack.callback(writer.close)
    conn = WyomingConnection(reader, writer)
    await conn.send(json.dumps(["transcribe", {"language": "en"}]))
    await conn.send(json.dumps(["audio-start", WYOMING_FORMAT]))
    return conn


async def _stream(
    conn: Any, client: Protocol, plan: ClientPlan, pieces: list[Piece], options: RunOptions
) -> None:
    run = client.run

    async def read() -> None:
        try:
            async for data in conn:
                message = data if isinstance(data, dict) else orjson.loads(data)
                client.on_message(message, time.monotonic())
        except (ConnectionClosed, OSError):
            pass
        client.done.set()

    reader = asyncio.create_task(read())
    try:
        for message in client.opening():
            await conn.send(message)
        loop = asyncio.get_running_loop()
        started, spoken_from = loop.time(), time.monotonic()
        if options.spoken:  # the time each 10 ms of the track was spoken
            step, size = SAMPLE_RATE // 100, plan.track.size
            run.sends = [(i, spoken_from + i / SAMPLE_RATE) for i in range(step, size + step, step)]
        for piece in pieces:
            await asyncio.sleep(max(0.0, started + piece.at_s - loop.time()))
            await conn.send(client.audio(piece.data))
            if not options.spoken:
                run.sends.append((piece.samples, time.monotonic()))
        run.stop_t = time.monotonic()
        for message in client.ending():
            await conn.send(message)
        await asyncio.wait_for(client.done.wait(), options.drain_timeout_s)
    finally:
        reader.cancel()


def rotation(kinds: tuple[str, ...], count: int, round_index: int) -> list[str]:
    """Client ``j``'s kind in a round: round-robin, shifted every round, so that each kind
    gets each track."""
    return [kinds[(j + round_index) % len(kinds)] for j in range(count)]


def summarize(runs: Iterable[ClientRun]) -> dict[str, Any]:
    ttft: list[float] = []
    final: list[float] = []
    answer: list[float] = []
    errors = []
    for run in runs:
        t, f = run.latencies()
        ttft += t
        final += f
        if run.answer_t is not None and run.stop_t is not None:
            answer.append(run.answer_t - run.stop_t)
        if run.error:
            errors.append(run.error)

    def ms(values: list[float]) -> dict[str, float | None]:
        return {k: None if v is None else v * 1000 for k, v in percentiles(values).items()}

    return {"utterances": len(final), "ttft_ms": ms(ttft), "final_ms": ms(final),
            "answer_ms": ms(answer), "errors": errors}  # fmt: skip


def table(results: dict[str, Any]) -> str:
    """Markdown, a row per step and kind, the first kind the reference."""
    head = "clients|kind|utterances|ttft p50 / p95|final p50 / p95|answer p50|ttft, final p50"
    rows = []

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    def diff(v: float | None, base: float | None) -> str:
        return "-" if v is None or base is None else f"{v - base:+.0f}"

    for clients, by_kind in results["steps"].items():
        first = next(iter(by_kind.values()))
        for kind, s in by_kind.items():
            t, f = s["ttft_ms"], s["final_ms"]
            base_t, base_f = first["ttft_ms"]["p50"], first["final_ms"]["p50"]
            vs = f"{diff(t['p50'], base_t)}, {diff(f['p50'], base_f)}"
            spread = [f"{fmt(x['p50'])} / {fmt(x['p95'])}" for x in (t, f)]
            answer = fmt(s["answer_ms"]["p50"])
            rows.append([clients, kind, s["utterances"], *spread, answer, "" if s is first else vs])
    return markdown_table(f"{head} vs the first".split("|"), rows)


def decode_cost(pieces: list[Piece], duration_s: float) -> dict[str, float]:
    """CPU time of decoding one stream's WebM slices unpaced, per second of audio."""
    from streamer.media import ContainerDecoder

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


async def run_side_by_side(
    ports: dict[str, int], audio: BenchAudio, options: RunOptions
) -> dict[str, Any]:
    """A warm-up (one short client of each kind), then per step ``clients`` of each kind at
    once, ``rounds`` times; returns ``{"steps": {clients: {kind: summary}}}``."""
    kinds = options.kinds
    results: dict[str, Any] = {"kinds": list(kinds), "steps": {}}
    with tempfile.TemporaryDirectory() as tmp:

        def pieces(plans: list[ClientPlan]) -> dict[tuple[int, str], list[Piece]]:
            out = {}
            for plan in plans:
                pcm = pcm_pieces(plan.track, options.chunk_ms)
                webm = webm_pieces(plan.track, Path(tmp)) if options.spoken else []
                for kind in kinds:
                    out[(plan.index, kind)] = webm if kind.endswith("-webm") else pcm
            return out

        async def step(plans: list[ClientPlan], round_index: int) -> list[ClientRun]:
            table = pieces(plans)
            assigned = rotation(kinds, len(plans), round_index)
            return await asyncio.gather(*(
                run_client(ports, kind, plan, table[(plan.index, kind)], options)
                for kind, plan in zip(assigned, plans, strict=True)
            ))  # fmt: skip

        warm = StepOptions(url="", clients=len(kinds), duration_s=4, stagger_s=0)
        await step(plan_clients(warm, audio), 0)
        for clients in options.clients:
            plan = StepOptions(
                url="", clients=len(kinds) * clients, duration_s=options.duration_s,
                stagger_s=options.stagger_s, endpoint_ms=options.endpoint_ms,
                chunk_ms=options.chunk_ms,
            )  # fmt: skip
            plans = plan_clients(plan, audio)
            runs: dict[str, list[ClientRun]] = {k: [] for k in kinds}
            for r in range(options.rounds):
                logger.info("%d clients of each kind, round %d", clients, r + 1)
                for run in await step(plans, r):
                    runs[run.kind].append(run)
            results["steps"][clients] = {k: summarize(runs[k]) for k in kinds}
        if options.spoken:
            track = plans[0].track
            results["decode_cost"] = decode_cost(
                webm_pieces(track, Path(tmp)), track.size / SAMPLE_RATE
            )
    return results
