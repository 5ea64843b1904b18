"""``python -m bench.latency``: time to first token and final latency under N real-time
clients, against a running server (``--url``) or one it starts itself.

Writes ``results.json`` (every measurement), ``table.txt``, ``summary.md``, ``cdf.png``
and ``vs_clients.png`` into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench import common
from bench.common import ServerOptions
from bench.latency import continuous, plots, protocols, report
from bench.latency.audio import AUDIO_CHOICES, load_bench_audio
from bench.latency.load import StepOptions
from bench.latency.monitor import find_listening_pid, machine_info
from bench.latency.sweep import Sweep, SweepOptions, parse_clients, parse_variant

logger = logging.getLogger("bench.latency")

REPO = Path(__file__).resolve().parents[2]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.latency",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    where = p.add_argument_group("server")
    where.add_argument(
        "--url",
        help="ws://HOST:PORT/v1/asr of a running server; without it"
        " the bench starts `streamer serve` itself (one per quantization)",
    )
    where.add_argument("--model", default="random:small", help="--model of the started server")
    where.add_argument("--device", default="cpu", help="--device of the started server")
    where.add_argument(
        "--partial-interval-ms",
        type=int,
        help="--partial-interval-ms of the started server (default: its own)",
    )
    where.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra argument for `streamer serve` (repeat)",
    )
    where.add_argument(
        "--server-pid",
        type=int,
        help="pid of the --url server for CPU/memory (default: found by port)",
    )
    sweep = p.add_argument_group("sweep")
    sweep.add_argument(
        "--variants",
        default="int8,int8:nopartials,fp32",
        help="comma list of int8 | fp32 | fp16 | bf16 | server, each optionally :nopartials;"
        " the first is swept over --clients, the others run at"
        " --compare-clients (with --url use server and server:nopartials)",
    )
    sweep.add_argument(
        "--clients",
        default="auto",
        help="client counts of the main sweep, e.g. 1,2,4,8; 'auto' doubles"
        " until final p95 passes the limit, then bisects",
    )
    sweep.add_argument("--max-clients", type=int, default=64, help="ceiling of 'auto'")
    sweep.add_argument(
        "--also-clients",
        default="",
        help="client counts the main variant also runs after its sweep (e.g. a target: 50)",
    )
    sweep.add_argument(
        "--compare-clients",
        default="1,4",
        help="client counts for the comparison variants; 'same' = main's",
    )
    sweep.add_argument("--duration-s", type=float, default=30.0, help="audio per client per step")
    sweep.add_argument(
        "--stagger-s",
        type=float,
        default=4.0,
        help="client starts are spread over this many seconds",
    )
    sweep.add_argument("--chunk-ms", type=int, default=100, help="audio per WebSocket frame")
    sweep.add_argument("--speed", type=float, default=1.0, help="1.0 = real time")
    sweep.add_argument("--endpoint-ms", type=int, default=500, help="stream option endpoint_ms")
    sweep.add_argument("--language", default="auto", help="stream option language")
    sweep.add_argument(
        "--drain-timeout-s",
        type=float,
        default=60.0,
        help="after its last chunk, a client waits this long for `end`",
    )
    sweep.add_argument("--pause-s", type=float, default=2.0, help="idle time between steps")
    sweep.add_argument(
        "--quiet-cpu-pct",
        type=float,
        help="on a shared machine: before each step wait until other processes use less CPU"
        " than this (100 = one core), and redo a step during which they used more",
    )
    sweep.add_argument(
        "--step-retries", type=int, default=2, help="redos per step (--quiet-cpu-pct)"
    )
    sweep.add_argument(
        "--saturation-final-p95-s",
        type=float,
        default=2.0,
        help="final-latency p95 above which a step counts as saturated",
    )
    sweep.add_argument(
        "--no-stop-when-saturated",
        action="store_true",
        help="with an explicit --clients list, run every count anyway",
    )
    sweep.add_argument(
        "--send-lag-limit-s",
        type=float,
        default=0.1,
        help="flag steps whose load generator sent this late (p95)",
    )
    kinds = p.add_argument_group(
        "side by side (instead of the sweep): N clients of each kind at once, in rounds"
    )
    kinds.add_argument(
        "--protocol",
        help=f"comma list of {','.join(protocols.PROTOCOLS)}: latency through each, side by side",
    )
    kinds.add_argument(
        "--encoding", help="comma list of pcm,webm (WebM/Opus in 250 ms MediaRecorder slices)"
    )
    kinds.add_argument("--rounds", type=int, default=2, help="of each step, kinds rotated")
    out = p.add_argument_group("output")
    out.add_argument(
        "--audio",
        choices=AUDIO_CHOICES + continuous.TRACKS,
        default="auto",
        help="generated speech, recorded speech, or both (auto: what exists); continuous*:"
        " speech without pauses, onset and continuation segments",
    )
    out.add_argument("--out", type=Path, help="output folder (default bench/out/latency-TIME)")
    out.add_argument(
        "--from-json",
        type=Path,
        help="do not run: rewrite the table, summary and plots of an earlier results.json",
    )
    out.add_argument("--log-level", default="info")
    return p


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Run the sweep described by ``args``; returns the results (also written to disk)."""
    variants = tuple(parse_variant(v) for v in args.variants.split(",") if v.strip())
    if args.url and any(v.precision for v in variants):
        raise SystemExit("with --url the server is given: use --variants server,server:nopartials")
    if not args.url and any(v.name.startswith("server") for v in variants):
        raise SystemExit("variant 'server' needs --url")
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir: Path = args.out or REPO / "bench" / "out" / f"latency-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    audio = load_bench_audio(args.audio, REPO / "bench" / "out" / "audio-cache")
    server = ServerOptions(
        model=args.model, device=args.device, partial_interval_ms=args.partial_interval_ms,
        endpoint_ms=args.endpoint_ms, extra_args=tuple(args.server_arg),
    )  # fmt: skip
    compare = None if args.compare_clients == "same" else parse_clients(args.compare_clients)
    server_pid = args.server_pid
    if args.url and server_pid is None:
        port = urlsplit(args.url).port
        server_pid = find_listening_pid(port) if port else None
    options = SweepOptions(
        url=args.url,
        server_pid=server_pid,
        server=server,
        variants=variants,
        clients=parse_clients(args.clients),
        also_clients=parse_clients(args.also_clients) if args.also_clients else [],
        compare_clients=compare,
        max_clients=args.max_clients,
        step=StepOptions(
            url="",
            clients=0,
            duration_s=args.duration_s,
            stagger_s=args.stagger_s,
            endpoint_ms=args.endpoint_ms,
            language=args.language,
            chunk_ms=args.chunk_ms,
            speed=args.speed,
            drain_timeout_s=args.drain_timeout_s,
        ),  # fmt: skip
        saturation_final_p95_s=args.saturation_final_p95_s,
        stop_when_saturated=not args.no_stop_when_saturated,
        send_lag_limit_s=args.send_lag_limit_s,
        out_dir=out_dir,
        pause_s=args.pause_s,
        quiet_cpu_pct=args.quiet_cpu_pct,
        step_retries=args.step_retries,
    )
    results: dict[str, Any] = {
        "bench": "latency",
        "format": 1,
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench.latency", *argv]),
        "machine": machine_info(),
        "audio": audio.describe(),
        "options": {
            "url": args.url,
            "model": args.model if not args.url else "(given server)",
            "device": args.device if not args.url else "(given server)",
            "partial_interval_ms": args.partial_interval_ms,
            "variants": [v.name for v in variants],
            "clients": args.clients,
            "also_clients": args.also_clients,
            "compare_clients": args.compare_clients,
            "duration_s": args.duration_s,
            "stagger_s": args.stagger_s,
            "chunk_ms": args.chunk_ms,
            "speed": args.speed,
            "endpoint_ms": args.endpoint_ms,
            "language": args.language,
            "saturation_final_p95_s": args.saturation_final_p95_s,
            "quiet_cpu_pct": args.quiet_cpu_pct,
        },
        "variants": [],
    }
    json_path = out_dir / "results.json"
    sweep = Sweep(options, audio, results, on_update=lambda r: report.write_json(r, json_path))
    try:
        asyncio.run(sweep.run())
    finally:
        results["finished"] = dt.datetime.now().isoformat(timespec="seconds")
        write_outputs(results, out_dir)
    return results


def write_outputs(results: dict[str, Any], out_dir: Path) -> None:
    report.write_json(results, out_dir / "results.json")
    (out_dir / "table.txt").write_text(report.table(results) + "\n")
    (out_dir / "summary.md").write_text(report.summary_markdown(results))
    if any(v["steps"] for v in results["variants"]):
        plots.plot_cdfs(results, out_dir / "cdf.png")
        plots.plot_vs_clients(results, out_dir / "vs_clients.png")
        plots.plot_comparison(results, out_dir / "compare.png")


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
    out_dir: Path = args.out or REPO / "bench" / "out" / "latency-side-by-side"
    ports: dict[str, int] = {
        p: common.free_port() for p in ("funasr", "wyoming") if p in options.protocols
    }
    if args.url and ports:
        raise SystemExit("funasr and wyoming need the server the bench starts (no --url)")
    extra = [a for p, port in ports.items() for a in (f"--{p}-port", str(port))]
    base = ServerOptions(
        model=args.model, device=args.device, partial_interval_ms=args.partial_interval_ms,
        endpoint_ms=args.endpoint_ms, extra_args=(*args.server_arg, *extra),
    )  # fmt: skip
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
            audio = load_bench_audio(args.audio, REPO / "bench" / "out" / "audio-cache")
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
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        write_outputs(results, args.from_json.parent)
    else:
        results = run(args, argv)
    print(report.table(results))  # the bench's product: the table on stdout
    for line in report.carried_lines(results):
        print(line)
    return 0
