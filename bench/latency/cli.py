"""``python -m bench.latency``: time to first token and final latency under N real-time
clients, against a running server (``--url``) or one it starts itself.

Writes ``results.json`` (every measurement), ``table.txt`` and ``summary.md`` into
``--out`` and prints the table; ``--merge`` writes them for earlier runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import shlex
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench import common
from bench.common import ServerOptions
from bench.latency import continuous, protocols, report
from bench.latency.audio import AUDIO_CHOICES, load_bench_audio
from bench.latency.load import StepOptions
from bench.latency.monitor import find_listening_pid, machine_info
from bench.latency.sweep import Sweep, SweepOptions, parse_clients, parse_variant

logger = logging.getLogger("bench.latency")


def free_port() -> int:
    """A free 127.0.0.1 port, for the extra listeners (``--funasr-port``, ``--wyoming-port``)
    whose port cannot be told apart from the main one when read back."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.latency", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    add = p.add_argument
    add("--url", help="ws://HOST:PORT/v1/asr of a running server; without it the bench starts"
        " `streamer serve` itself (one per quantization)")  # fmt: skip
    add("--model", default="random:small", help="--model of the started server")
    add("--device", default="cpu", help="--device of the started server")
    add("--partial-interval-ms", type=int, help="of the started server (default: its own)")
    add("--server-arg", action="append", default=[], help="for `streamer serve` (repeat)")
    add("--variants", default="int8,int8:nopartials,fp32",
        help="comma list of int8 | fp32 | fp16 | bf16 | server (with --url), each optionally"
        " :nopartials; the first swept over --clients, others at --compare-clients")  # fmt: skip
    add("--clients", default="auto", help="client counts of the main sweep, e.g. 1,2,4,8; "
        "'auto' doubles until final p95 passes the limit, then bisects")  # fmt: skip
    add("--max-clients", type=int, default=64, help="ceiling of 'auto'")
    add("--compare-clients", default="1,4", help="for the other variants; 'same' = main's")
    add("--duration-s", type=float, default=30.0, help="audio per client per step")
    add("--stagger-s", type=float, default=4.0, help="client starts spread over this long")
    add("--chunk-ms", type=int, default=100, help="audio per WebSocket frame")
    add("--endpoint-ms", type=int, default=500, help="stream option endpoint_ms")
    add("--drain-timeout-s", type=float, default=60.0, help="a client's wait for `end`")
    add("--pause-s", type=float, default=2.0, help="idle time between steps")
    add("--quiet-cpu-pct", type=float, help="on a shared machine: before each step wait until"
        " other processes use less CPU than this (100 = a core), redo a step over it")  # fmt: skip
    add("--step-retries", type=int, default=2, help="redos per step (--quiet-cpu-pct)")
    add("--saturation-final-p95-s", type=float, default=2.0, help="a saturated step's p95")
    add("--no-stop-when-saturated", action="store_true", help="run every --clients count")
    add("--protocol", help=f"side by side: comma list of {','.join(protocols.PROTOCOLS)}")
    add("--encoding", help="side by side: pcm,webm (WebM/Opus in 250 ms MediaRecorder slices)")
    add("--rounds", type=int, default=2, help="side by side: rounds per step, kinds rotated")
    add("--audio", choices=AUDIO_CHOICES + continuous.TRACKS, default="auto",
        help="generated, recorded speech or both (auto); continuous*: no pauses")  # fmt: skip
    add("--out", type=Path, help="output folder (default bench/out/latency-TIME)")
    add("--code-dir", type=Path, help="serve another checkout's code (an old commit's)")
    add("--merge", type=Path, nargs="+", metavar="RUN_DIR", help="do not run: one table and "
        "summary of earlier runs (several: each variant named after its RUN_DIR)")  # fmt: skip
    add("--log-level", default="info")
    return p


def server_options(args: argparse.Namespace, *extra: str) -> ServerOptions:
    """The started server's options (a variant sets its precision)."""
    return ServerOptions(
        model=args.model, device=args.device, code_dir=args.code_dir,
        partial_interval_ms=args.partial_interval_ms, endpoint_ms=args.endpoint_ms,
        extra_args=(*args.server_arg, *extra),
    )  # fmt: skip


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Run the sweep described by ``args``; returns the results (also written to disk)."""
    variants = tuple(parse_variant(v) for v in args.variants.split(",") if v.strip())
    if args.url and any(v.precision for v in variants):
        raise SystemExit("with --url the server is given: use --variants server,server:nopartials")
    if not args.url and any(v.name.startswith("server") for v in variants):
        raise SystemExit("variant 'server' needs --url")
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir: Path = args.out or common.REPO / "bench" / "out" / f"latency-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    audio = load_bench_audio(args.audio, common.AUDIO_CACHE)
    server = server_options(args)
    compare = None if args.compare_clients == "same" else parse_clients(args.compare_clients)
    port = urlsplit(args.url).port if args.url else None
    server_pid = find_listening_pid(port) if port else None  # a given server's, for its CPU
    step = StepOptions(
        url="", clients=0, duration_s=args.duration_s, stagger_s=args.stagger_s,
        endpoint_ms=args.endpoint_ms, chunk_ms=args.chunk_ms, drain_timeout_s=args.drain_timeout_s,
    )  # fmt: skip
    options = SweepOptions(
        url=args.url, server_pid=server_pid, server=server, variants=variants,
        clients=parse_clients(args.clients), compare_clients=compare,
        max_clients=args.max_clients, step=step,
        saturation_final_p95_s=args.saturation_final_p95_s,
        stop_when_saturated=not args.no_stop_when_saturated, out_dir=out_dir,
        pause_s=args.pause_s, quiet_cpu_pct=args.quiet_cpu_pct, step_retries=args.step_retries,
    )  # fmt: skip
    given = {"model": "(given server)", "device": "(given server)"} if args.url else {}
    results: dict[str, Any] = {
        "bench": "latency",
        "format": 1,
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench.latency", *argv]),
        "machine": machine_info(),
        "audio": audio.describe(),
        "options": {**vars(args), "out": str(out_dir), **given},
        "variants": [],
    }
    sweep = Sweep(options, audio, results, on_update=lambda r: common.write_results(out_dir, r))
    try:
        asyncio.run(sweep.run())
    finally:
        results["finished"] = dt.datetime.now().isoformat(timespec="seconds")
        write_outputs(results, out_dir)
    return results


def write_outputs(results: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    common.write_results(out_dir, results)
    (out_dir / "table.txt").write_text(report.table(results) + "\n")
    (out_dir / "summary.md").write_text(report.summary_markdown(results))


def merged(run_dirs: list[Path]) -> dict[str, Any]:
    """Earlier runs' results as one (the first run's options; several runs' variants are
    named ``RUN_DIR-NAME VARIANT``), e.g. run_on_gpu.sh's runs into its ``sweep.md``."""
    found = [d for d in run_dirs if (d / "results.json").exists()]  # a phase that timed out
    if not found:
        raise SystemExit(f"no results.json in {', '.join(map(str, run_dirs))}")
    runs = [(d, json.loads((d / "results.json").read_text())) for d in found]
    results = runs[0][1]
    if len(runs) > 1:
        results["variants"] = [
            {**variant, "name": f"{d.name} {variant['name']}"}
            for d, run in runs
            for variant in run["variants"]
        ]  # fmt: skip
    return results


def run_side_by_side(args: argparse.Namespace, argv: list[str]) -> int:
    """``--protocol``/``--encoding`` (:mod:`bench.latency.protocols`) or continuous speech
    (:mod:`bench.latency.continuous`) on one started server (the first variant's precision)."""
    clients = tuple(parse_clients(args.clients) or [1, 4])
    options = protocols.RunOptions(
        protocols=tuple((args.protocol or "v1").split(",")),
        encodings=tuple((args.encoding or "pcm").split(",")),
        clients=clients, rounds=args.rounds, duration_s=args.duration_s,
        stagger_s=args.stagger_s, chunk_ms=args.chunk_ms, endpoint_ms=args.endpoint_ms,
    )  # fmt: skip
    try:
        protocols.validate(options)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    out_dir: Path = args.out or common.REPO / "bench" / "out" / "latency-side-by-side"
    ports: dict[str, int] = {
        p: free_port() for p in ("funasr", "wyoming") if p in options.protocols
    }
    if args.url and ports:
        raise SystemExit("funasr and wyoming need the server the bench starts (no --url)")
    extra = [a for p, port in ports.items() for a in (f"--{p}-port", str(port))]
    base = server_options(args, *extra)
    server = parse_variant(args.variants.split(",")[0]).server_options(base)
    command = shlex.join(["python", "-m", "bench.latency", *argv])
    results: dict[str, Any] = {"command": command, "audio": args.audio, "steps": {}}
    with contextlib.ExitStack() as stack:
        url = (
            args.url
            or stack.enter_context(common.ManagedServer(server, out_dir / "server.log")).url
        )
        if args.audio in continuous.TRACKS:
            track = continuous.build(args.audio, common.CACHE_DIR / "speech", args.duration_s)
            for n in clients:
                results["steps"][n] = continuous.run(url, track, n, args.rounds, args.endpoint_ms)
            text = continuous.table(results)
        else:
            audio = load_bench_audio(args.audio, common.AUDIO_CACHE)
            ports["v1"] = urlsplit(url).port or 80
            results.update(asyncio.run(protocols.run_side_by_side(ports, audio, options)))
            text = protocols.table(results)
    common.write_results(out_dir, results, args)
    print(text)
    for clients_n, by_kind in results["steps"].items():
        for kind, s in by_kind.items() if "kinds" in results else ():
            if s["errors"]:
                print(f"{clients_n} clients, {kind}: {len(s['errors'])} errors: {s['errors'][:3]}")
    if "decode_cost" in results:
        print("decode cost per WebM/Opus stream:", results["decode_cost"])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.protocol or args.encoding or args.audio in continuous.TRACKS:
        return run_side_by_side(args, argv)
    if args.merge:
        results = merged(args.merge)
        write_outputs(results, args.out or args.merge[0])
    else:
        results = run(args, argv)
    print(report.table(results))  # the bench's product: the table on stdout
    for line in report.carried_lines(results):
        print(line)
    return 0
