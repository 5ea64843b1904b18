"""Reliability stress suite: attacks a ``streamer serve`` process it starts (issue 9).

    python -m bench.stress                          # scaled run, into bench/RESULTS.md
    python -m bench.stress --clients 8 --minutes 15 --model random:small --quantize int8
    python -m bench.stress soak --minutes 20        # the mixed soak (bench/stress_soak.py)

Every attack talks to 127.0.0.1 only, and every loop is bounded in count and time. Each
row of the table says what was expected, what was observed, the verdict, how many finals
were lost (of how many expected) and the server's peak RSS during the attack.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from bench import common
from bench.common import ManagedServer, PeakRss, ServerOptions, http_get, percentiles
from bench.latency import prom
from bench.latency.monitor import scrape
from streamer.client.connection import ClientOptions, Received, StreamingClient
from streamer.client.streaming import stream_file
from streamer.core.protocol import Error, Final, StreamOptions
from streamer.errors import ConnectionRefusedByServer
from streamer.testkit import speech as synth

logger = logging.getLogger("bench.stress")

READY_TIMEOUT_S = 900.0  # building random:small the first time takes minutes
ATTACK_TIMEOUT_S = 1800.0  # no attack runs longer than this
ATTACKS = (
    "unpaced",
    "finalize",
    "http",
    "flood",
    "tiny",
    "blocked",
    "sigterm",
    "hung",
    "restart",
    "admission",
    "floods",
)
HANG_ENV = "STRESS_HANG_AFTER_DECODES"  # the injected recognizer hangs after N decodes


# -- the server process --------------------------------------------------------


@dataclass(frozen=True)
class StressServerOptions(ServerOptions):
    """``streamer serve`` with exactly ``args`` (the server's defaults for the rest), or,
    with ``hang_after_decodes``, the injected recognizer that hangs (``serve-injected``)."""

    args: tuple[str, ...] = ()
    hang_after_decodes: int | None = None
    ready_timeout_s: float = READY_TIMEOUT_S
    ready_poll_s: float = 0.25

    def command(self, port: int) -> list[str]:
        injected = self.hang_after_decodes is not None
        command = [self.python, "-m", *(("bench.stress", "serve-injected") if injected else
                                       ("streamer", "serve"))]  # fmt: skip
        return command + ["--host", "127.0.0.1", "--port", str(port), *self.args]


def stress_server(
    args: list[str], log: Path, *, port: int = 0, hang_after_decodes: int | None = None
) -> ManagedServer:
    """A stress server, not started yet (``with`` starts it and waits for /readyz); its
    output is appended to ``log``, which every server of a run shares."""
    env = [("PYTHONUNBUFFERED", "1")]
    if hang_after_decodes is not None:
        env.append((HANG_ENV, str(hang_after_decodes)))
    options = StressServerOptions(
        args=tuple(args), hang_after_decodes=hang_after_decodes, env=tuple(env)
    )
    return ManagedServer(options, log, port=port, append_log=True)


# -- results -------------------------------------------------------------------


@dataclass
class Row:
    attack: str
    expected: str
    observed: str
    ok: bool
    finals_lost: tuple[int, int] | None = None  # (lost, expected)
    peak_rss_mb: float = 0.0

    def cells(self) -> list[str]:
        lost = (
            "-" if self.finals_lost is None else f"{self.finals_lost[0]} of {self.finals_lost[1]}"
        )
        verdict = "PASS" if self.ok else "FAIL"
        return [
            self.attack,
            self.expected,
            self.observed,
            verdict,
            lost,
            f"{self.peak_rss_mb:.0f} MB",
        ]


def table(rows: list[Row]) -> str:
    header = ["attack", "expected", "observed", "verdict", "finals lost", "peak RSS"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


# -- audio -----------------------------------------------------------------------


def long_speech(cache_dir: Path, minutes: float) -> np.ndarray:
    """espeak sentences with pauses, repeated to ``minutes`` of 16 kHz audio."""
    clips = [synth.speak(text, "en", cache_dir=cache_dir) for text in synth.SENTENCES["en"][:3]]
    pause = np.zeros(16000 * 12 // 10, dtype=np.int16)
    one = np.concatenate([x for clip in clips for x in (clip, pause)])
    reps = max(1, int(np.ceil(minutes * 60 * 16000 / one.size)))
    return np.tile(one, reps)[: int(minutes * 60 * 16000)]


async def finals_of(
    url: str,
    pcm: np.ndarray,
    *,
    ping: bool,
    speed: float | None = None,
    finalize_every_ms: int | None = None,
) -> tuple[list[Final], bool, list[str]]:
    """One session: (finals, end received, error codes)."""
    options = ClientOptions(
        url=url, stream=StreamOptions(partials=False), ping_interval_s=20.0 if ping else None
    )
    client = await StreamingClient.connect(options)
    finals: list[Final] = []
    errors: list[str] = []

    async def read() -> None:
        async for message in client.messages():
            if isinstance(message, Final):
                finals.append(message)
            elif isinstance(message, Error):
                errors.append(message.code)

    reader = asyncio.create_task(read())
    step = 16 * (finalize_every_ms or 100)
    try:
        for i in range(0, pcm.size, step):
            await client.send_audio(pcm[i : i + step])
            if finalize_every_ms is not None:
                await client.finalize()
            if speed is not None:
                await asyncio.sleep(step / 16000 / speed)
        await client.stop()
        await reader
    except Exception as exc:  # the row records it
        errors.append(f"{type(exc).__name__}: {exc}"[:80])
        reader.cancel()
    finally:
        await client.close()
    return finals, client.end is not None, errors


# -- attacks -----------------------------------------------------------------------


async def attack_unpaced(
    server: ManagedServer, args: argparse.Namespace, reference: int, pcm: np.ndarray
) -> Row:
    with PeakRss(server.pid or 0) as rss:
        results = await asyncio.gather(
            *[finals_of(server.url, pcm, ping=i % 2 == 0) for i in range(args.clients)]
        )
    lost = sum(max(0, reference - len(f)) for f, _, _ in results)
    ends = sum(end for _, end, _ in results)
    errors = sorted({e for _, _, errs in results for e in errs})
    bound = args.clients * args.session_bound_mb + rss.start_mb
    ok = lost == 0 and ends == args.clients and rss.peak_mb < bound
    return Row(
        f"{args.clients} unpaced clients x {args.minutes:g} min (pings on for half)",
        f"every final and end; RSS < {bound:.0f} MB (per-session bound x sessions + idle server)",
        f"{ends}/{args.clients} end; errors {errors or 'none'}",
        ok,
        (lost, reference * args.clients),
        rss.peak_mb,
    )


async def never_reading(server: ManagedServer, **options: Any) -> ClientConnection:
    """A client that never reads, its receive buffer 4 KiB, so the server's sends block."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.setblocking(False)
    return await connect(server.url, sock=sock, ping_interval=None, max_queue=1, **options)


async def attack_flood(server: ManagedServer, args: argparse.Namespace) -> Row:
    """A never-reading client sending junk text frames as fast as it can."""
    ws = await never_reading(server, max_size=None)
    junk = "x" * 60000
    sent = 0
    started = time.monotonic()
    closed_after = None
    with PeakRss(server.pid or 0) as rss:
        try:
            while sent < args.flood_mb * 1e6 and time.monotonic() - started < 120:
                await ws.send(junk)
                sent += len(junk)
        except Exception:
            closed_after = time.monotonic() - started
        for _ in range(200):  # wait for the slot to be freed, 20 s at most
            if open_sessions(server) == 0:
                break
            await asyncio.sleep(0.1)
        freed_after = time.monotonic() - started
    ws.transport.abort()
    growth = rss.peak_mb - rss.start_mb
    limit = args.idle_timeout_s + 5.0
    ok = growth < 50 and open_sessions(server) == 0 and freed_after < limit + 5
    return Row(
        f"never-reading client flooding {args.flood_mb} MB of junk text",
        f"one error, closed by the idle timeout ({args.idle_timeout_s:g} s; junk is not input), "
        "slot freed, RSS growth < 50 MB",
        f"{sent / 1e6:.0f} MB sent; send failed after "
        f"{'-' if closed_after is None else f'{closed_after:.1f} s'}; slot freed after "
        f"{freed_after:.1f} s; RSS +{growth:.0f} MB",
        ok,
        None,
        rss.peak_mb,
    )


def tiny_frames_client(url: str, seconds: float, frame_bytes: int = 1) -> int:
    """``python -m bench.stress tiny-frames URL SECONDS [BYTES]``: BYTES-byte (1) binary
    frames as fast as one process can send them (in its own process, so that it does not
    slow the canary)."""

    # Remote attackers have CPUs of their own; on loopback they share the server's, and
    # 8 of them spinning would measure the machine, not the server: they run niced.
    os.nice(19)

    async def flood() -> int:
        sent = 0
        frame = b"\x00" * frame_bytes
        ws = await connect(url, ping_interval=None, max_queue=None)
        with contextlib.suppress(TimeoutError, ConnectionClosed):  # closed: by a limit
            async with asyncio.timeout(seconds):  # sends block once TCP pushes back
                while True:
                    await ws.send(frame)
                    sent += 1
                    if sent % 1000 == 0:  # a send that does not block never yields:
                        await asyncio.sleep(0)  # let the timeout fire
        ws.transport.abort()
        return sent

    sys.stdout.write(f"{asyncio.run(flood())}\n")
    return 0


async def attack_tiny_frames(server: ManagedServer, pcm: np.ndarray, reference: list[str]) -> Row:
    """A client sending 1-byte frames as fast as it can, beside a real-time client."""
    seconds = pcm.size / 16000
    flooder = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.stress", "tiny-frames", server.url, str(seconds),
        stdout=subprocess.PIPE,
    )  # fmt: skip
    probes: list[float] = []

    async def probe() -> None:
        while flooder.returncode is None:
            started = time.monotonic()
            status, _ = await asyncio.to_thread(http_get, f"{server.http_url}/readyz", 10.0)
            probes.append(time.monotonic() - started if status == 200 else 99.0)
            await asyncio.sleep(0.5)

    prober = asyncio.create_task(probe())
    with PeakRss(server.pid or 0) as rss:
        finals, end, errors = await finals_of(server.url, pcm, ping=True, speed=1.0)
        out, _ = await asyncio.wait_for(flooder.communicate(), seconds + 60)
    await prober
    texts = [f.text for f in finals if f.text]
    paced = metric_value(server, "streamer_input_paced_seconds_total")
    readyz_max = max(probes, default=99.0)
    ok = texts == reference and end and not errors and readyz_max < 1.0 and paced > 0
    return Row(
        f"a client sending 1-byte frames as fast as it can for {seconds:.0f} s, beside a "
        "real-time client",
        "the real-time client gets every final and its end; /readyz answers within 1 s; the "
        "flooder is paced (--max-input-messages-per-s)",
        f"{int(out or 0)} frames sent; finals {len(texts)}/{len(reference)}, end {end}, errors "
        f"{errors or 'none'}; /readyz max {readyz_max * 1000:.0f} ms over {len(probes)} probes; "
        f"paced {paced:.1f} s",
        ok,
        (max(0, len(reference) - len(texts)), len(reference)),
        rss.peak_mb,
    )


async def realtime_client(url: str, pcm: np.ndarray, started: asyncio.Event | None = None) -> dict:
    """One real-time session (partials on, as a caption client): each final's latency
    (received minus when its last sample was sent), or the code it was refused with."""
    try:
        client = await StreamingClient.connect(ClientOptions(url=url, ping_interval_s=20.0))
    except ConnectionRefusedByServer as refused:
        if started is not None:
            started.set()
        return {"refused": refused.reason or str(refused.status), "latencies": []}
    latencies: list[float] = []
    t0 = time.monotonic()

    async def read() -> None:
        async for message in client.messages():
            if isinstance(message, Final) and message.text:
                latencies.append(time.monotonic() - (t0 + message.end_ms / 1000))

    reader = asyncio.create_task(read())
    if started is not None:
        started.set()
    step = 1600  # 100 ms frames, sent on the real-time clock
    try:
        for i in range(0, pcm.size, step):
            await client.send_audio(pcm[i : i + step])
            await asyncio.sleep(max(0.0, t0 + (i + step) / 16000 - time.monotonic()))
        await client.stop()
        await asyncio.wait_for(reader, 120)
    finally:
        await client.close()
    return {"refused": None, "latencies": latencies}


async def attack_admission(server: ManagedServer, pcm: np.ndarray, joiners: int = 10) -> Row:
    """A real-time client alone, then again while ``joiners`` real-time clients join:
    those the server cannot serve are refused, /readyz says so, the first keeps its
    latency."""
    await asyncio.sleep(20.0)  # the reference runs' load leaves the capacity window
    alone = await realtime_client(server.url, pcm)
    probes: list[tuple[int, str]] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            try:
                status, body = await asyncio.to_thread(http_get, f"{server.http_url}/readyz", 5.0)
                probes.append((status, orjson.loads(body).get("status", "?")))
            except Exception:  # a probe that failed to answer is recorded as such
                probes.append((0, "no answer"))
            await asyncio.sleep(0.5)

    prober = asyncio.create_task(probe())
    first_started = asyncio.Event()
    first = asyncio.create_task(realtime_client(server.url, pcm, first_started))
    await first_started.wait()
    await asyncio.sleep(5.0)  # the server is busy with the first client

    async def join(i: int) -> dict:
        await asyncio.sleep(i * 1.0)  # one a second
        return await realtime_client(server.url, pcm[: pcm.size * 2 // 3])

    interrupted = metric_value(server, "streamer_partials_interrupted_total")
    others = await asyncio.gather(*[join(i) for i in range(joiners)])
    loaded = await first
    interrupted = metric_value(server, "streamer_partials_interrupted_total") - interrupted
    done.set()
    await prober
    admitted = [o for o in others if o["refused"] is None]
    refused = sorted({o["refused"] for o in others if o["refused"] is not None})
    first_alone = percentiles(alone["latencies"], missing=math.nan)
    first_loaded = percentiles(loaded["latencies"], missing=math.nan)
    theirs = percentiles([x for o in admitted for x in o["latencies"]], missing=math.nan)
    ratio = first_loaded["p95"] / first_alone["p95"]
    saturated = sum(1 for _, status in probes if status == "saturated")
    ok = ratio <= 1.3 and saturated > 0 and len(admitted) < joiners
    return Row(
        f"a real-time client alone, then with {joiners} real-time clients joining one a second",
        "those it cannot serve refused (503 saturated); /readyz says saturated; the first "
        "client's final p95 within 1.3x of alone",
        f"first client final p95 {first_alone['p95']:.2f} s alone, "
        f"{first_loaded['p95']:.2f} s with the others ({ratio:.2f}x; p50 "
        f"{first_alone['p50']:.2f} / {first_loaded['p50']:.2f} s, "
        f"{len(alone['latencies'])} / {len(loaded['latencies'])} finals); admitted "
        f"{len(admitted)}/{joiners} (their p95 "
        f"{theirs['p95']:.2f} s), refused {refused}; "
        f"/readyz saturated in {saturated}/{len(probes)} probes; "
        f"{interrupted:.0f} partial decodes stopped for a final",
        ok,
    )


async def attack_floods(server: ManagedServer, pcm: np.ndarray, flooders: int = 8) -> Row:
    """``flooders`` clients sending 2-byte frames as fast as they can (each within its own
    --max-input-messages-per-s), beside a real-time client: the total input budget keeps
    the loop for the real-time client and the probes."""
    seconds = pcm.size / 16000
    alone = await realtime_client(server.url, pcm)
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.stress",
            "tiny-frames",
            server.url,
            str(seconds + 10),
            "2",
            stdout=subprocess.PIPE,
        )  # fmt: skip
        for _ in range(flooders)
    ]
    probes: dict[str, list[float]] = {"/readyz": [], "/healthz": []}
    done = asyncio.Event()

    async def probe(path: str) -> None:
        while not done.is_set():
            started = time.monotonic()
            try:
                status, _ = await asyncio.to_thread(http_get, f"{server.http_url}{path}", 10.0)
            except Exception:  # no answer within 10 s
                status = 0
            probes[path].append(time.monotonic() - started if status in (200, 503) else 99.0)
            await asyncio.sleep(0.5)

    probers = [asyncio.create_task(probe(path)) for path in probes]
    deadline = time.monotonic() + 60  # the flooders' processes start (imports take seconds)
    while open_sessions(server) < flooders and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    await asyncio.sleep(2.0)  # the floods are under way
    with PeakRss(server.pid or 0) as rss:
        flooded = await realtime_client(server.url, pcm)
    done.set()
    await asyncio.gather(*probers)
    sent = 0
    for process in processes:
        out, _ = await asyncio.wait_for(process.communicate(), seconds + 60)
        sent += int(out or 0)
    paced = metric_value(server, "streamer_input_budget_paced_seconds_total")
    readyz_max = max(probes["/readyz"], default=99.0)
    healthz_max = max(probes["/healthz"], default=99.0)
    p95_alone = percentiles(alone["latencies"], missing=math.nan)["p95"]
    p95_flooded = percentiles(flooded["latencies"], missing=math.nan)["p95"]
    ok = p95_flooded <= 1.5 and readyz_max < 1.0 and flooded["refused"] is None
    return Row(
        f"{flooders} clients sending 2-byte frames as fast as they can, beside a real-time client",
        "the real-time client's final p95 <= 1.5 s; /readyz answers within 1 s throughout",
        f"{sent} frames sent; real-time client final p95 {p95_alone:.2f} s alone, "
        f"{p95_flooded:.2f} s flooded ({len(flooded['latencies'])} finals); /readyz max "
        f"{readyz_max * 1000:.0f} ms, /healthz max {healthz_max * 1000:.0f} ms over "
        f"{len(probes['/readyz'])} probes each; budget paced {paced:.1f} s",
        ok,
        None,
        rss.peak_mb,
    )


def metric_value(server: ManagedServer, name: str) -> float:
    """A metric of the server's /metrics, its labelled series summed (0.0 when absent)."""
    return prom.value(scrape(server.http_url), name) or 0.0


async def attack_blocked_writer_then_sigterm(
    server: ManagedServer, args: argparse.Namespace
) -> Row:
    """A client that never reads while making the server write, then SIGTERM."""
    ws = await never_reading(server)
    started = time.monotonic()
    closed = False
    with PeakRss(server.pid or 0) as rss:
        try:
            for _ in range(400000):  # each pair makes the server send one small error
                await ws.send(b"\x00")
                await ws.send("junk")
                if time.monotonic() - started > args.write_timeout_s + 30:
                    break
        except Exception:
            closed = True
        closed_after = time.monotonic() - started
    ws.transport.abort()
    row = Row(
        "never-reading client making the server write (1-byte audio + junk pairs)",
        f"closed 1008 within the write timeout ({args.write_timeout_s:g} s) once sends block",
        f"{'closed' if closed else 'still open'} after {closed_after:.1f} s",
        closed,
        None,
        rss.peak_mb,
    )
    return row


async def attack_sigterm_with_blocked_client(
    server: ManagedServer, args: argparse.Namespace
) -> Row:
    ws = await never_reading(server)
    with PeakRss(server.pid or 0) as rss:
        for _ in range(3000):
            await ws.send(b"\x00")
            await ws.send("junk")
        took = await asyncio.to_thread(server.stop, signal.SIGTERM, 60.0)
    ws.transport.abort()
    limit = args.drain_s + args.grace_s + 2  # the session is served while draining
    return Row(
        "SIGTERM with a never-reading client attached",
        f"exit within drain + grace + 2 s ({limit:g} s)",
        "had to be killed"
        if took is None
        else f"exited in {took:.1f} s (rc {server.process.returncode})",
        took is not None and took <= limit,
        None,
        rss.peak_mb,
    )


async def attack_hung_decode(args: argparse.Namespace, log: Path, pcm: np.ndarray) -> Row:
    flags = [*args.model_args, "--decode-timeout-s", str(args.decode_timeout_s), "--no-warmup"]
    with stress_server(flags, log, hang_after_decodes=2) as server:
        return await _hung_decode(server, args, pcm)


async def _hung_decode(server: ManagedServer, args: argparse.Namespace, pcm: np.ndarray) -> Row:
    assert server.process is not None
    with PeakRss(server.pid or 0) as rss:
        sessions = [
            asyncio.create_task(finals_of(server.url, pcm, ping=True, speed=4.0)) for _ in range(3)
        ]
        hang_seen = time.monotonic()
        readyz = None
        for _ in range(int((args.decode_timeout_s + 30) * 10)):
            status, body = await asyncio.to_thread(http_get, f"{server.http_url}/readyz", 1.0)
            if status == 503 and readyz is None:
                readyz = orjson.loads(body).get("reason")
                logger.info("readyz 503: %s", body[:200])
            if server.process.poll() is not None:
                break
            await asyncio.sleep(0.1)
        exited_after = time.monotonic() - hang_seen
        results = await asyncio.gather(*sessions)
    rc = server.process.poll()
    if rc is None:
        server.stop(signal.SIGKILL)
    told = sum("model_stalled" in errs for _, _, errs in results)
    limit = args.decode_timeout_s + 5
    ok = rc not in (None, 0) and readyz is not None and told == len(results)
    ok = ok and exited_after <= limit + 2  # the hang starts about 2 decodes in
    return Row(
        "hung decode (injected recognizer hangs after 2 decodes)",
        f"/readyz 503 with reason, every session told model_stalled, exit non-zero "
        f"within --decode-timeout-s + 5 s ({limit:g} s)",
        f"readyz reason {readyz!r}; {told}/{len(results)} told; rc {rc}; "
        f"exited {exited_after:.1f} s after the first session began",
        ok,
        None,
        rss.peak_mb,
    )


def tagged_clips(cache_dir: Path) -> np.ndarray:
    """The two clips random:tagged decodes exactly, twice, with pauses."""
    fox = synth.speak("the quick brown fox jumps over the lazy dog", "en", cache_dir=cache_dir)
    hello = synth.speak("hello there", "en", cache_dir=cache_dir)
    clips = [("en", "a", fox), ("en", "b", hello), ("en", "c", fox), ("en", "d", hello)]
    return synth.join_with_silence(clips, 1500)[0]


async def attack_kill_restart(args: argparse.Namespace, log: Path, pcm: np.ndarray) -> Row:
    model = ["--model", "random:tagged", "--device", "cpu", "--threads", str(args.threads)]
    with stress_server(model, log) as server:
        return await _kill_restart(server, model, log, pcm)


async def _kill_restart(server: ManagedServer, model: list[str], log: Path, pcm: np.ndarray) -> Row:
    reference = [f.text for f in (await finals_of(server.url, pcm, ping=False))[0] if f.text]
    first_final = asyncio.Event()

    def on_message(item: Received) -> None:
        if isinstance(item.message, Final):
            first_final.set()

    options = ClientOptions(
        url=server.url, stream=StreamOptions(partials=False), reconnect_timeout_s=READY_TIMEOUT_S
    )
    client = asyncio.create_task(
        stream_file(options, pcm, sample_rate=16000, speed=2.0, on_message=on_message)
    )
    with PeakRss(server.pid or 0) as rss:
        await asyncio.wait_for(first_final.wait(), 300)
        server.stop(signal.SIGKILL)
        # not waited for: the client reconnects on its own while the model loads
        restarted = stress_server(model, log, port=server.port or 0).start()
        started = time.monotonic()
        try:
            result = await asyncio.wait_for(client, ATTACK_TIMEOUT_S)
        finally:
            restarted.stop(signal.SIGTERM)
        down_s = time.monotonic() - started
    texts = [f.text for f in result.finals if f.text]
    lost = sum(1 for a, b in zip(reference, texts, strict=False) if a != b) + abs(
        len(reference) - len(texts)
    )
    return Row(
        "kill -9 mid-file (random:tagged, paced x2), restart on the same port",
        "transcript equals an uninterrupted run's",
        f"{result.reconnects} reconnect(s); {'equal' if texts == reference else 'DIFFERENT'}; "
        f"finished {down_s:.0f} s after the kill",
        texts == reference,
        (lost, len(reference)),
        rss.peak_mb,
    )


async def attack_finalize_spam(server: ManagedServer, pcm: np.ndarray, reference: list[str]) -> Row:
    rows = []
    with PeakRss(server.pid or 0) as rss:
        for every_ms in (20, 40, 100, 320):
            finals, end, _ = await finals_of(server.url, pcm, ping=True, finalize_every_ms=every_ms)
            rows.append(([f.text for f in finals if f.text] == reference and end, every_ms))
    bad = [ms for ok, ms in rows if not ok]
    return Row(
        "finalize after every chunk (20, 40, 100, 320 ms)",
        "the same final texts as without finalize",
        "all equal" if not bad else f"different at {bad} ms",
        not bad,
        None,
        rss.peak_mb,
    )


def raw_http(port: int, request: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]) if data else 0


async def attack_http(server: ManagedServer) -> Row:
    def req(line: str, *headers: str) -> bytes:
        return "\r\n".join([line, "Host: x", *headers, "", ""]).encode("latin-1")

    cases = [
        (
            "duplicate Authorization",
            req("GET /v1/asr HTTP/1.1", "Authorization: a", "Authorization: b"),
            400,
        ),
        ("path part > 255 bytes", req("GET /" + "a" * 300 + " HTTP/1.1"), 400),
        ("NUL in path", req("GET /a\x00b HTTP/1.1"), 400),
        ("POST", req("POST /healthz HTTP/1.1"), 405),
        ("HEAD", req("HEAD /healthz HTTP/1.1"), 200),
        ("unknown path", req("GET /nope HTTP/1.1"), 404),
    ]
    observed = []
    ok = True
    with PeakRss(server.pid or 0) as rss:
        for name, request, expected in cases:
            status = await asyncio.to_thread(raw_http, server.port, request)
            observed.append(f"{name} {status}")
            ok = ok and status == expected
        status, _ = await asyncio.to_thread(http_get, f"{server.http_url}/readyz")
    return Row(
        "malformed and non-GET HTTP requests",
        "400 / 405 / HEAD without body / 404, never 500",
        "; ".join(observed),
        ok,
        None,
        rss.peak_mb,
    )


def open_sessions(server: ManagedServer) -> int:
    """Sessions open, of every protocol."""
    return int(metric_value(server, "streamer_sessions_active"))


# -- main ---------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> list[Row]:
    cache = Path(os.environ.get("STREAMER_CACHE_DIR", "~/.cache/sensevoice-streamer")).expanduser()
    speech_cache = cache / "speech"
    log = Path(args.log)
    log.unlink(missing_ok=True)
    long_pcm = long_speech(speech_cache, args.minutes)
    short_pcm = long_speech(speech_cache, 0.5)
    admission_pcm = long_speech(speech_cache, args.admission_minutes)
    flags = [
        *args.model_args,
        "--idle-timeout-s",
        str(args.idle_timeout_s),
        "--write-timeout-s",
        str(args.write_timeout_s),
        "--shutdown-grace-s",
        str(args.grace_s),
        "--drain-s",
        str(args.drain_s),
    ]
    rows: list[Row] = []

    async def step(name: str, make: Callable[[], Awaitable[Row]]) -> None:
        if args.attacks and name not in args.attacks:
            return
        logger.info("attack: %s", name)
        try:
            row = await asyncio.wait_for(make(), ATTACK_TIMEOUT_S)
        except Exception as exc:
            row = Row(name, "-", f"the attack failed: {type(exc).__name__}: {exc}"[:160], False)
        logger.info("%s: %s (%s)", "PASS" if row.ok else "FAIL", row.observed, name)
        rows.append(row)

    with stress_server(flags, log) as server:
        # the reference: one client alone, the whole file
        reference_finals, _, _ = await finals_of(server.url, long_pcm, ping=False)
        short_reference = [
            f.text for f in (await finals_of(server.url, short_pcm, ping=False))[0] if f.text
        ]
        await step("unpaced", lambda: attack_unpaced(server, args, len(reference_finals), long_pcm))
        await step("finalize", lambda: attack_finalize_spam(server, short_pcm, short_reference))
        await step("http", lambda: attack_http(server))
        await step("flood", lambda: attack_flood(server, args))
        await step("tiny", lambda: attack_tiny_frames(server, short_pcm, short_reference))
        await step("admission", lambda: attack_admission(server, admission_pcm))
        await step("floods", lambda: attack_floods(server, long_speech(speech_cache, 0.5)))
        await step("blocked", lambda: attack_blocked_writer_then_sigterm(server, args))
        await step("sigterm", lambda: attack_sigterm_with_blocked_client(server, args))
        server.stop(signal.SIGTERM)  # the sigterm attack may have stopped it
    await step("hung", lambda: attack_hung_decode(args, log, short_pcm))
    clips = tagged_clips(speech_cache)
    await step("restart", lambda: attack_kill_restart(args, log, clips))
    return rows


BEGIN, END = "<!-- stress:begin -->", "<!-- stress:end -->"


def write_section(path: Path, text: str) -> None:
    """Replace the text between the stress markers of ``path`` (append them if absent)."""
    old = path.read_text() if path.exists() else ""
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + block + rest.split(END, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(new)


def serve_injected() -> int:
    """``streamer serve`` whose recognizer hangs after $STRESS_HANG_AFTER_DECODES decode
    calls: every backend decodes through ``CtcRecognizer.decode_jobs`` (the torch
    backend and ONNX Runtime alike; patching one backend's class missed the other)."""
    from streamer import cli
    from streamer.model.decode.decoding import CtcRecognizer

    hang_after = int(os.environ[HANG_ENV])
    real = CtcRecognizer.decode_jobs
    calls = 0

    def hanging(self, jobs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls > hang_after:
            threading.Event().wait()  # a stuck native call, as far as Python can tell
        return real(self, jobs)

    CtcRecognizer.decode_jobs = hanging  # type: ignore[method-assign]
    return cli.main(["serve", *sys.argv[2:]])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-injected"]:
        return serve_injected()
    if argv[:1] == ["tiny-frames"]:
        return tiny_frames_client(argv[1], float(argv[2]), *map(int, argv[3:4]))
    if argv[:1] == ["soak"]:  # the mixed soak (issue 32): bench/stress_soak.py
        from bench.stress_soak import main as soak

        return soak(argv[1:])
    p = argparse.ArgumentParser(
        prog="python -m bench.stress",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_server_args(p, model="random:tiny", quantize=None)  # and --server-arg
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--minutes", type=float, default=2.0, help="length of each unpaced file")
    p.add_argument("--flood-mb", type=int, default=300)
    for timeout in ("idle-timeout-s", "write-timeout-s", "decode-timeout-s", "grace-s", "drain-s"):
        p.add_argument(f"--{timeout}", type=float, default=5.0,
                       help="for streamer serve (--grace-s: its --shutdown-grace-s)")  # fmt: skip
    p.add_argument("--session-bound-mb", type=float, default=6.0,
                   help="documented per-session memory bound (docs/protocol.md)")  # fmt: skip
    p.add_argument(
        "--attacks", nargs="*", default=[], choices=ATTACKS, help="run only these (default: all)"
    )
    p.add_argument("--admission-minutes", type=float, default=2.0,
                   help="the admission attack's first client speaks this long (the joiners "
                   "2/3 of it): more finals make its p95 steadier")  # fmt: skip
    p.add_argument("--log", default="/tmp/stress-server.log")
    p.add_argument(
        "--results",
        default=str(Path(__file__).parent / "RESULTS.md"),
        help="the table replaces the stress section of this file (or is appended)",
    )
    args = p.parse_args(argv)
    args.model_args = ["--model", args.model, "--quantize", args.quantize, "--threads",
                       str(args.threads), "--device", args.device, "--log-level", "info",
                       *args.server_arg]  # fmt: skip
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    started = time.monotonic()
    rows = asyncio.run(run(args))
    command = "python -m bench.stress " + " ".join(argv)
    text = "\n".join(
        [
            f"Command: `{command.strip()}` ({time.monotonic() - started:.0f} s, "
            f"{os.cpu_count()} CPUs, model {args.model} quantize {args.quantize})",
            "",
            table(rows),
            "",
        ]
    )
    sys.stdout.write(text)
    write_section(Path(args.results), text)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
