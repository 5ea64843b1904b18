"""Capacity and admission: per client count, what real-time clients feel with admission
off, how many the default admits and what those feel, quiet and beside a CPU hog, with
speaker labels asked or not.

    python -m bench.capacity --clients 1,4,8 --hog-clients 3 \\
        --duration-s 40 --out bench/out/capacity-31

Each server configuration (``off``: ``--no-capacity-admission``; ``default``: every
default; ``--old-code DIR`` runs each again on another checkout, e.g. ``git archive``
of main, as ``off@old``, ``default@old``) is started once, warmed up, and runs every
client count quiet, then each of ``--hog-clients`` beside the hog (a busy loop on one
core, or busy ``--hog-share`` of each 20 ms: 0.3 is 15 % of 2 cores). A name ending in
``+diarize`` (``off+diarize``) asks its clients for speaker labels (the stream option
``diarize``): give every server the speaker models with
``--server-arg=--diarize-model=DIR``, so that the two differ in the option only.
Clients start ``--start-every-s`` apart (2 s: "8 clients started 2 s apart") and stream
at real time; a client the server refuses (503) is not retried, and counts as refused
with the refusal's text. Latencies are the admitted clients', as
:mod:`bench.latency.metrics` measures them on the client.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import ManagedServer, ServerOptions, cpu_s, proc_status
from bench.latency.audio import AUDIO_CHOICES, BenchAudio, load_bench_audio
from bench.latency.client_processes import run_step_in_processes
from bench.latency.load import StepOptions, plan_clients, run_step, warm_up
from bench.latency.report import ms as _ms
from bench.latency.sweep import _drained, step_result

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
# one core's worth of other work, or its share of one core: busy, then asleep, per 20 ms
HOG = "import time\nwhile True:\n t = time.perf_counter() + 0.02 * {share}\n while time.perf_counter() < t: pass\n time.sleep(0.02 * (1 - {share}))"  # noqa: E501
DRAIN_S = 60.0


@dataclasses.dataclass(frozen=True)
class Config:
    """One server configuration of the comparison."""

    name: str
    extra_args: tuple[str, ...]
    code_dir: Path | None = None
    diarize: bool = False  # the clients ask for speaker labels


def config_args(name: str) -> tuple[str, ...]:
    """``off`` or ``default``, optionally ``-wN`` (``--workers N``) and ``+diarize`` (the
    clients', not the server's): its server flags."""
    admission, _, workers = name.removesuffix("+diarize").partition("-w")
    if admission not in ("off", "default") or (workers and not workers.isdigit()):
        raise SystemExit(f"configuration {name!r}: off or default, optionally -wN")
    flags = ("--no-capacity-admission",) if admission == "off" else ()
    return flags + (("--workers", workers) if workers else ())


def summary_row(step: dict[str, Any], clients: int) -> dict[str, Any]:
    """The figures one table row shows: admitted, refused, the admitted's latencies."""
    refused = [e for e in step["errors"] if "HTTP 503" in e]
    s = step["summary"]
    return {
        "clients": clients,
        "admitted": clients - len(refused),
        "refused": refused,
        "other_errors": [e for e in step["errors"] if "HTTP 503" not in e],
        "ttft_p50_s": s["first_token_s"]["p50"],
        "ttft_p95_s": s["first_token_s"]["p95"],
        "final_p50_s": s["final_s"]["p50"],
        "final_p95_s": s["final_s"]["p95"],
        "segments": s["segments"],
    }


async def run_config(
    config: Config, args: argparse.Namespace, audio: BenchAudio, out: Path
) -> list[dict[str, Any]]:
    options = ServerOptions(
        model=args.model,
        quantize="int8",
        extra_args=(*config.extra_args, *args.server_arg),
        code_dir=config.code_dir,
    )
    rows: list[dict[str, Any]] = []
    with ManagedServer(options, out / f"server-{config.name}.log") as server:
        await warm_up(server.url, audio)
        for hog in (False, True) if args.hog_clients else (False,):
            # beside the server, not pinned: the scheduler shares the 2 cores
            hog_process = subprocess.Popen(_hog(args.hog_share)) if hog else None
            try:
                for clients in args.hog_clients if hog else args.clients:
                    await _drained(server.url, DRAIN_S)
                    step = StepOptions(
                        url=server.url,
                        clients=clients,
                        duration_s=args.duration_s,
                        stagger_s=args.start_every_s * clients,
                        diarize=config.diarize,
                    )
                    load_before = os.getloadavg()[0]
                    cpu_before = _cpu_s(server.pid)
                    if args.client_processes:  # each client a process of its own
                        records = await asyncio.to_thread(
                            run_step_in_processes,
                            step,
                            args.audio,
                            out / f"clients-{config.name}-{clients}{'-hog' if hog else ''}",
                        )
                    else:
                        records = await run_step(step, plan_clients(step, audio))
                    result = step_result(records, clients, {})
                    row = {
                        "config": config.name,
                        "hog": hog,
                        "hog_share": args.hog_share if hog else 0.0,
                        **summary_row(result, clients),
                        "loadavg": [load_before, os.getloadavg()[0]],
                        # the server's CPU time in the step (user + system), s: the work
                        # the clients cost it, whatever else the machine ran
                        "server_cpu_s": _cpu_s(server.pid) - cpu_before,
                        # the server's peak resident memory so far (VmHWM), MiB
                        "peak_rss_mb": proc_status(server.pid, "VmHWM") / 1024
                        if server.pid
                        else None,
                    }
                    rows.append(row)
                    logger.info("%s", _line(row))
                    await asyncio.sleep(args.pause_s)
            finally:
                if hog_process is not None:
                    hog_process.terminate()
                    hog_process.wait(timeout=10)
    return rows


def _hog(share: float) -> list[str]:
    """The hog's command: busy ``share`` of each 20 ms (1: all of it)."""
    return [sys.executable, "-c", HOG.format(share=min(share, 1.0))]


def _cpu_s(pid: int | None) -> float:
    """A process's CPU time so far (user + system, its threads included), s."""
    return sum(cpu_s(pid)) if pid else 0.0


def _beside(row: dict[str, Any]) -> str:
    share = row.get("hog_share", 1.0)  # rows written before --hog-share have none
    return "quiet" if not row["hog"] else "hog" if share >= 1 else f"hog {share:g} core"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _line(row: dict[str, Any]) -> str:
    return (
        f"| {row['config']} | {_beside(row)} | {row['clients']} | "
        f"{row['admitted']} | {_ms(row['ttft_p50_s'])} / {_ms(row['ttft_p95_s'])} | "
        f"{_ms(row['final_p50_s'])} / {_ms(row['final_p95_s'])} | "
        f"{row['loadavg'][0]:.1f}-{row['loadavg'][1]:.1f} | {_mib(row.get('peak_rss_mb'))} | "
        f"{row.get('server_cpu_s', 0):.0f} |"
    )


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| server | beside | clients | admitted | TTFT p50 / p95 (ms) | final p50 / p95 (ms) "
        "| load avg | server peak RSS (MiB) | server CPU s |\n" + "|---" * 9 + "|\n"
    )
    return head + "\n".join(_line(r) for r in rows) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__)
    p.add_argument("--model", default="random:small")
    p.add_argument("--clients", default="1,4,8", help="comma list of client counts")
    p.add_argument("--duration-s", type=float, default=40.0, help="audio per client")
    p.add_argument("--start-every-s", type=float, default=2.0, help="between client starts")
    p.add_argument(
        "--hog-clients", default="", help="client counts also run beside a busy loop (e.g. 3)"
    )
    p.add_argument("--hog-share", type=float, default=1.0, help="of one core the hog busies")
    p.add_argument(
        "--configs",
        default="off,default",
        help="comma list of off, default, each optionally -wN (--workers N) and +diarize, "
        "e.g. off-w2, off+diarize",
    )
    p.add_argument("--old-code", type=Path, help="a checkout each configuration also runs on")
    p.add_argument("--server-arg", action="append", default=[], help="for every server")
    p.add_argument("--pause-s", type=float, default=3.0)
    p.add_argument("--audio", choices=AUDIO_CHOICES, default="synth")
    p.add_argument(
        "--client-processes",
        action="store_true",
        help="each client a process of its own (bench/latency/client_processes.py)",
    )
    p.add_argument("--out", type=Path)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.clients = [int(n) for n in args.clients.split(",")]
    args.hog_clients = [int(n) for n in args.hog_clients.split(",") if n.strip()]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out: Path = args.out or REPO / "bench" / "out" / f"capacity-{dt.datetime.now():%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    audio = load_bench_audio(args.audio, REPO / "bench" / "out" / "audio-cache")
    configs = [
        Config(name, config_args(name), diarize=name.endswith("+diarize"))
        for name in args.configs.split(",")
    ]
    if args.old_code is not None:  # each configuration again on the older checkout
        old = args.old_code.resolve()
        configs += [
            dataclasses.replace(c, name=f"{c.name}@old", code_dir=old) for c in list(configs)
        ]
    rows: list[dict[str, Any]] = []
    for config in configs:
        rows += asyncio.run(run_config(config, args, audio, out))
        (out / "results.json").write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))
    text = table(rows)
    (out / "table.md").write_text(text)
    print(text)  # noqa: T201  (a bench script's answer)
    for row in rows:
        for refusal in row["refused"][:1]:
            print(f"{row['config']} x{row['clients']}: {refusal}")  # noqa: T201
    os.sync()


if __name__ == "__main__":
    main()
