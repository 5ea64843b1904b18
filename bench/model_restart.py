"""What a model process that dies mid-stream costs the sessions (``serve --model-process``).

Starts ``streamer serve --model-process``, streams the same speech from ``--clients``
real-time clients twice on it: once undisturbed, once with the model process killed
(``--fault kill``: SIGKILL) or frozen (``--fault stop``: SIGSTOP, a stall the watchdog
must see after ``--decode-timeout-s``) ``--kill-after-s`` into the stream. Reports how
long the server was unready (``/readyz`` polled every 50 ms), whether every client's
finals are the undisturbed run's (none lost, none changed, no session closed), and the
finals' latency in both runs.

    python -m bench.model_restart --model random:small --quantize int8 --clients 4
    python -m bench.model_restart --fault stop --decode-timeout-s 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench import common
from bench.latency.audio import synth_clips
from bench.latency.poller import Poller
from bench.latency.serverproc import http_base, http_get
from streamer.client.connection import ClientOptions
from streamer.client.streaming import transcribe
from streamer.client.timeline import SessionResult
from streamer.core.audio import SAMPLE_RATE
from streamer.testkit.speech import join_with_silence

logger = logging.getLogger("bench.model_restart")

POLL_S = 0.05


def speech(cache_dir: Path, clips: int) -> np.ndarray:
    """The first ``clips`` bench sentences, 1 s of silence after each."""
    chosen = synth_clips(cache_dir)[:clips]
    items = [(c.source.partition(":")[2], c.text, c.pcm) for c in chosen]
    return join_with_silence(items, 1000)[0]


def model_process(server_pid: int) -> psutil.Process:
    children = psutil.Process(server_pid).children()
    children = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
    if len(children) != 1:
        raise RuntimeError(f"expected one model process under {server_pid}, found {children}")
    return children[0]


class ReadinessWatch(Poller):
    """Polls ``/readyz`` in a thread: when it first answered non-200, and 200 again."""

    def __init__(self, base: str) -> None:
        super().__init__(POLL_S)
        self.base = base
        self.unready_at: float | None = None
        self.ready_again_at: float | None = None
        self.states: list[str] = []

    def poll(self) -> None:
        status, body = http_get(f"{self.base}/readyz", timeout_s=2.0)
        now = time.monotonic()
        if status != 200 and self.unready_at is None:
            self.unready_at = now
            self.states.append(json.loads(body).get("status", "?") if body else "?")
        elif status == 200 and self.unready_at is not None and self.ready_again_at is None:
            self.ready_again_at = now


async def stream_all(url: str, pcm: np.ndarray, clients: int) -> list[SessionResult]:
    options = ClientOptions(url=url)
    return list(
        await asyncio.gather(
            *(transcribe(options, pcm, SAMPLE_RATE, speed=1.0) for _ in range(clients))
        )
    )


def finals_of(result: SessionResult) -> list[tuple[float, float, str]]:
    return [(f.start_ms, f.end_ms, f.text) for f in result.finals]


def latencies_ms(results: list[SessionResult]) -> dict[str, float]:
    values = sorted(1000 * s for r in results for s in r.final_latencies_s())
    return {
        "finals": len(values),
        "p50": round(statistics.median(values), 1),
        "max": round(values[-1], 1),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    pcm = speech(args.cache_dir / "speech", args.clips)
    extra = ("--model-process", "--decode-timeout-s", str(args.decode_timeout_s))
    server = common.started_server(
        args, args.out / "server.log", log_level="info", extra_args=extra
    )
    with server:
        assert server.pid is not None
        calm = await stream_all(server.url, pcm, args.clients)
        victim = model_process(server.pid)
        with ReadinessWatch(http_base(server.url)) as watch:

            async def kill_later() -> float:
                await asyncio.sleep(args.kill_after_s)
                os.kill(victim.pid, signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
                return time.monotonic()

            killer = asyncio.create_task(kill_later())
            disturbed = await stream_all(server.url, pcm, args.clients)
            killed_at = await killer
            deadline = time.monotonic() + 120
            while watch.ready_again_at is None and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
        replacement = model_process(server.pid)
    same = [finals_of(a) == finals_of(b) for a, b in zip(calm, disturbed, strict=True)]
    return {
        "model": args.model,
        "quantize": args.quantize,
        "clients": args.clients,
        "stream_s": round(pcm.size / SAMPLE_RATE, 1),
        "fault": args.fault,
        "decode_timeout_s": args.decode_timeout_s,
        "fault_after_s": args.kill_after_s,
        "new_model_process": replacement.pid != victim.pid,
        "unready_after_fault_s": None
        if watch.unready_at is None
        else round(watch.unready_at - killed_at, 2),
        "unready_s": None
        if watch.ready_again_at is None or watch.unready_at is None
        else round(watch.ready_again_at - watch.unready_at, 2),
        "readyz_status_seen": watch.states,
        "clients_with_identical_finals": sum(same),
        "sessions_ended_normally": sum(r.end is not None for r in disturbed),
        "final_latency_ms_undisturbed": latencies_ms(calm),
        "final_latency_ms_with_kill": latencies_ms(disturbed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    common.add_server_args(parser)
    common.add_output_args(parser, out="bench/out/model-restart")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--clips", type=int, default=6, help="bench sentences per stream")
    parser.add_argument("--fault", choices=("kill", "stop"), default="kill")
    parser.add_argument("--kill-after-s", type=float, default=6.0, help="when the fault comes")
    parser.add_argument("--decode-timeout-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    common.setup_logging()
    results = asyncio.run(run(args))
    common.write_results(args.out, results, args)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
