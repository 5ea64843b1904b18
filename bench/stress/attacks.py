"""Reliability stress suite: attacks a ``streamer serve`` process it starts (issue 9).

    python -m bench.stress                          # scaled run, into bench/RESULTS.md
    python -m bench.stress --clients 8 --minutes 15 --model random:small --quantize int8
    python -m bench.stress soak --minutes 20        # the mixed soak (bench/stress/soak.py)

Two attacks measure what the test suite cannot at real model size: ``unpaced`` (clients
streaming long files unpaced: finals lost, the server's peak RSS against the documented
per-session bound) and ``floods`` (8 processes flooding 2-byte frames beside a real-time
client: its final p95, /readyz and /healthz times). The properties the other attacks of
issue 9 checked (finalize spam, malformed HTTP, never-reading clients, SIGTERM, a hung
decode, kill -9 and restart, admission) are asserted by tests; see bench/RESULTS.md.

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
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from bench import common
from bench.common import HealthProbes, ManagedServer, PeakRss, percentiles
from bench.latency import prom
from bench.latency.audio import looped_speech
from bench.latency.load import ClientPlan, StepOptions, run_client
from bench.latency.metrics import segment_latencies
from bench.latency.monitor import scrape
from streamer.core.protocol import Error, Final
from streamer.testkit import speech as synth

logger = logging.getLogger("bench.stress")

ATTACK_TIMEOUT_S = 1800.0  # no attack runs longer than this
ATTACKS = ("unpaced", "floods")


# -- the server process --------------------------------------------------------


def stress_server(args: argparse.Namespace, log: Path) -> ManagedServer:
    """The server of :func:`common.add_server_args`'s arguments and ``--threads``, logging
    at info, not started yet (``with`` starts it and waits for /readyz)."""
    threads = ("--threads", str(args.threads))
    env = (("PYTHONUNBUFFERED", "1"),)
    return common.started_server(args, log, log_level="info", extra_args=threads, env=env)


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
        lost = "-" if self.finals_lost is None else "{} of {}".format(*self.finals_lost)
        verdict, rss = "PASS" if self.ok else "FAIL", f"{self.peak_rss_mb:.0f} MB"
        return [self.attack, self.expected, self.observed, verdict, lost, rss]


def table(rows: list[Row]) -> str:
    head = "attack|expected|observed|verdict|finals lost|peak RSS".split("|")
    return common.markdown_table(head, (row.cells() for row in rows))


# -- audio -----------------------------------------------------------------------


def long_speech(cache_dir: Path, minutes: float) -> np.ndarray:
    """Three espeak sentences with 1.2 s pauses, repeated to ``minutes`` of 16 kHz audio."""
    sentences = [("en", text) for text in synth.SENTENCES["en"][:3]]
    return looped_speech(sentences, cache_dir, minutes * 60, gap_ms=1200)


@dataclass
class Session:
    """What one client got: its finals, each final's latency (arrival minus when its last
    sample was sent), whether ``end`` came, error codes, a refusal."""

    finals: list[Final] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    ended: bool = False
    errors: list[str] = field(default_factory=list)
    refused: str | None = None

    @property
    def texts(self) -> list[str]:
        return [f.text for f in self.finals if f.text]


async def session(
    url: str,
    pcm: np.ndarray,
    *,
    ping: bool = True,
    speed: float | None = None,
    partials: bool = False,
) -> Session:
    """One session through the load generator's client (100 ms chunks, then ``stop``),
    unpaced or at ``speed`` times real time."""
    options = StepOptions(url, 1, 0.0, 0.0, partials=partials, speed=speed, ping=ping,
                          drain_timeout_s=120.0)  # fmt: skip
    record = await run_client(ClientPlan(0, 0.0, 0, pcm, ()), options)
    messages = [arrival.message for arrival in record.arrivals]
    segments = segment_latencies(record.arrivals, record.send_log())
    codes = [m.code for m in messages if isinstance(m, Error)]
    return Session(
        finals=[m for m in messages if isinstance(m, Final)],
        latencies_s=[s.final_s for s in segments if s.final_s is not None and s.first_token_s],
        ended=record.end is not None,
        errors=codes + ([record.error] if record.error else []),
        refused=record.error if record.connect_s is None else None,
    )


# -- attacks -----------------------------------------------------------------------


async def attack_unpaced(
    server: ManagedServer, args: argparse.Namespace, reference: int, pcm: np.ndarray
) -> Row:
    with PeakRss(server.pid or 0) as rss:
        results = await asyncio.gather(
            *[session(server.url, pcm, ping=i % 2 == 0) for i in range(args.clients)]
        )
    lost = sum(max(0, reference - len(r.finals)) for r in results)
    ends = sum(r.ended for r in results)
    errors = sorted({e for r in results for e in r.errors})
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


async def attack_floods(server: ManagedServer, pcm: np.ndarray, flooders: int = 8) -> Row:
    """``flooders`` clients sending 2-byte frames as fast as they can (each within its own
    --max-input-messages-per-s), beside a real-time client: the total input budget keeps
    the loop for the real-time client and the probes."""
    seconds = pcm.size / 16000
    alone = await session(server.url, pcm, speed=1.0, partials=True)
    flood = [sys.executable, "-m", "bench.stress", "tiny-frames", server.url, str(seconds + 10)]
    spawn = asyncio.create_subprocess_exec
    processes = [await spawn(*flood, "2", stdout=subprocess.PIPE) for _ in range(flooders)]
    with HealthProbes(server.port or 0, interval_s=0.25) as probes:  # each path every 0.5 s
        deadline = time.monotonic() + 60  # the flooders' processes start (imports: seconds)
        while open_sessions(server) < flooders and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await asyncio.sleep(2.0)  # the floods are under way
        with PeakRss(server.pid or 0) as rss:
            flooded = await session(server.url, pcm, speed=1.0, partials=True)
    sent = 0
    for process in processes:
        out, _ = await asyncio.wait_for(process.communicate(), seconds + 60)
        sent += int(out or 0)
    paced = metric_value(server, "streamer_input_budget_paced_seconds_total")
    took = probes.summary_ms()  # a probe not answered counts 99 s
    p95_alone = percentiles(alone.latencies_s, missing=math.nan)["p95"]
    p95_flooded = percentiles(flooded.latencies_s, missing=math.nan)["p95"]
    ok = p95_flooded <= 1.5 and 0 < took["readyz_probes"] and took["readyz_max_ms"] < 1000
    ok = ok and flooded.refused is None
    return Row(
        f"{flooders} clients sending 2-byte frames as fast as they can, beside a real-time client",
        "the real-time client's final p95 <= 1.5 s; /readyz answers within 1 s throughout",
        f"{sent} frames sent; real-time client final p95 {p95_alone:.2f} s alone, "
        f"{p95_flooded:.2f} s flooded ({len(flooded.latencies_s)} finals); /readyz max "
        f"{took['readyz_max_ms']:.0f} ms, /healthz max {took['healthz_max_ms']:.0f} ms over "
        f"{took['readyz_probes']:.0f} probes each; budget paced {paced:.1f} s",
        ok,
        None,
        rss.peak_mb,
    )


def metric_value(server: ManagedServer, name: str) -> float:
    """A metric of the server's /metrics, its labelled series summed (0.0 when absent)."""
    return prom.value(scrape(server.http_url), name) or 0.0


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

    with stress_server(args, log) as server:
        # the reference: one client alone, the whole file
        reference_finals = (await session(server.url, long_pcm, ping=False)).finals
        await step("unpaced", lambda: attack_unpaced(server, args, len(reference_finals), long_pcm))
        await step("floods", lambda: attack_floods(server, long_speech(speech_cache, 0.5)))
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tiny-frames"]:
        return tiny_frames_client(argv[1], float(argv[2]), *map(int, argv[3:4]))
    if argv[:1] == ["soak"]:  # the mixed soak (issue 32)
        from bench.stress.soak import main as soak

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
    p.add_argument("--session-bound-mb", type=float, default=6.0,
                   help="documented per-session memory bound (docs/protocol.md)")  # fmt: skip
    p.add_argument(
        "--attacks", nargs="*", default=[], choices=ATTACKS, help="run only these (default: all)"
    )
    p.add_argument("--log", default="/tmp/stress-server.log")
    p.add_argument(
        "--results",
        default=str(Path(__file__).parents[1] / "RESULTS.md"),
        help="the table replaces the stress section of this file (or is appended)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    started = time.monotonic()
    rows = asyncio.run(run(args))
    took = f"{time.monotonic() - started:.0f} s, {os.cpu_count()} CPUs"
    head = f"Command: `{common.command_line('bench.stress', argv)}` ({took}, model {args.model}"
    text = f"{head} quantize {args.quantize})\n\n{table(rows)}\n"
    sys.stdout.write(text)
    write_section(Path(args.results), text)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
