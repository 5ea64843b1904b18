"""A first start that exports: peak memory of the process tree, time to ready, /healthz meanwhile.

Starts ``streamer serve --model MODEL`` (and each ``--server-arg``) with an empty ONNX
cache (a fresh cache directory whose ``models/`` is a link to the given cache's, so the
torch model is there and its ONNX export is not), once per ``--code`` checkout
(``PYTHONPATH`` set to it, so two versions of the code are measured side by side in one
run). While it loads it samples, every ``--sample-s``:

- the resident memory of the server and of every process below it (``/proc``), summed:
  the tree's peak is what a container's memory limit must hold;
- ``GET /healthz`` and ``GET /readyz`` in turn (latency), until ``/readyz`` answers 200.

``--starts 2`` starts each checkout twice on the same cache: the second is a later start
(the export and any download already cached); ``--server-arg=--backend=torch`` measures
the torch backend's start. A directory as
``--model`` (a sherpa-onnx layout, say) measures a start with nothing to export.
``--python`` runs the server with another interpreter (the plain install's venv: the
bench itself needs the dev install's psutil). ``--clients N --audio FILE`` then streams
FILE from N ``streamer client`` processes at once, in real time, still sampling: the
peak over start, warm-up and clients is what the issue-23 bound is about, and the mean
decode of each kind (``/metrics``) shows whether a change slowed decoding.

    python -m bench.first_start --code /work/main --code . --model random:small
    python -m bench.first_start --code OLD --code . --model DIR --starts 2
    python -m bench.first_start --code OLD --code NEW --model DIR \
        --python .cache/lean-venv/bin/python --clients 4 --audio speech.wav
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.latency import prom
from bench.latency.monitor import scrape


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--code", action="append", type=Path, required=True)
    parser.add_argument("--model", default="random:small")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--server-arg", action="append", default=[], help="for the server")
    parser.add_argument("--sample-s", type=float, default=0.25)
    parser.add_argument("--python", type=Path, default=Path(sys.executable),
                        help="the server's interpreter")  # fmt: skip
    parser.add_argument("--clients", type=int, default=0, help="clients streaming once ready")
    parser.add_argument("--audio", type=Path, help="what the clients stream (WAV)")
    parser.add_argument("--starts", type=int, default=1,
                        help="starts per checkout, one cache (2: a later start)")  # fmt: skip
    common.add_output_args(parser, out="bench/out/first_start")
    args = parser.parse_args(argv)
    if args.clients and args.audio is None:
        parser.error("--clients needs --audio")
    common.setup_logging()
    results = [result for code in args.code for result in _starts(code.resolve(), args)]
    common.write_results(args.out, {"starts": results}, args)
    for result in results:
        print(json.dumps(result))
    return 0


def _starts(code: Path, args: Any) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="first-start-") as scratch:
        cache = Path(scratch) / "cache"
        cache.mkdir()
        (cache / "models").symlink_to(Path(args.cache_dir).resolve() / "models")
        return [_one_start(code, cache, number, args) for number in range(1, args.starts + 1)]


def _one_start(code: Path, cache: Path, number: int, args: Any) -> dict[str, Any]:
    options = common.ServerOptions(
        model=args.model,
        log_level="info",  # the load's and warm-up's times, in the log kept in --out
        extra_args=("--threads", str(args.threads), *args.server_arg),
        code_dir=code,
        python=str(args.python),
        env=(("STREAMER_CACHE_DIR", str(cache)),),
        ready_poll_s=args.sample_s,
    )
    log_path = args.out / f"server-{code.name or 'root'}-{number}.log"
    server = common.ManagedServer(options, log_path).start()
    try:
        result = _watch(server, args.sample_s)
        if args.clients:
            result.update(_clients(server, args))
    finally:
        server.stop()
    command = shlex.join(server.command)
    result.update(code=str(code), start=number, commit=_commit(code), command=command)
    return result


def _clients(server: common.ManagedServer, args: Any) -> dict:
    """Stream ``args.audio`` from ``args.clients`` clients at once; the server's peak
    resident memory meanwhile, its mean decode time of each kind, the finals received."""
    command = [str(args.python), "-m", "streamer", "client", str(args.audio.resolve())]
    command += ["--url", server.url, "--quiet", "--json"]
    env = {**os.environ, "PYTHONPATH": str(server.options.code_dir)}
    assert server.pid is not None
    clients = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        for _ in range(args.clients)
    ]
    with common.PeakRss(server.pid, args.sample_s) as peak:
        while any(client.poll() is None for client in clients):
            server.check_running()
            time.sleep(args.sample_s)
    finals = [client.communicate()[0].decode().count("\n") for client in clients]
    failed = [client.returncode for client in clients if client.returncode != 0]
    if failed:
        raise RuntimeError(f"clients failed with status {failed}")
    metrics = scrape(server.http_url)
    decode_s = {kind: prom.histogram_delta({}, metrics, "streamer_decode_seconds", {"kind": kind})
                for kind in ("partial", "final", "background")}  # fmt: skip
    return {
        "clients": args.clients,
        "clients_peak_mib": round(peak.peak_mb),
        "finals_per_client": finals,
        "decode_mean_ms": {
            kind: round(h.mean * 1000, 1)
            for kind, h in decode_s.items()
            if h is not None and h.mean is not None
        },  # fmt: skip
        "server_hwm_mib": common.proc_status(server.pid, "VmHWM") // 1024,
    }


def _watch(server: common.ManagedServer, every_s: float) -> dict:
    """Sample the tree's memory from the spawn, and ``/healthz`` and ``/readyz`` in turn
    once the server listens (the first at once), until ready."""
    assert server.pid is not None
    pid = server.pid
    with common.PeakRss(pid, every_s) as own, common.PeakRss(pid, every_s, tree=True) as tree:
        while server.find_port() is None:
            server.check_running()
            time.sleep(common.PORT_POLL_S)
        with common.HealthProbes(server.find_port() or 0, every_s / 2) as probes:
            probes.poll()  # at once: a small model can be ready within one interval
            server.wait_ready()
    assert server.load_s is not None
    return {
        "ready_s": round(server.load_s, 1),
        "tree_peak_mib": round(max(tree.peak_mb, own.peak_mb)),  # sampled apart; the tree holds it
        "server_peak_mib": round(own.peak_mb),
        **probes.summary_ms(),  # a probe not answered counts 99 s
        "ready_hwm_mib": common.proc_status(pid, "VmHWM") // 1024,
    }


def _commit(code: Path) -> str:
    command = ["git", "-C", str(code), "rev-parse", "--short", "HEAD"]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
