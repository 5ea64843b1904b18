"""What every bench shares: the server it starts, free ports, the CPU's name, arguments, results.

A bench that serves a model starts ``streamer serve`` (127.0.0.1 only) with
:func:`started_server`; its command line takes the common server arguments from
:func:`add_server_args`, and its results go through :func:`write_results`, which adds the
command and the machine (:func:`machine_info`, :func:`cpu_name`) so every figure says where
and how it was measured::

    from bench import common

    def main() -> int:
        parser = common.parser(__doc__)
        common.add_server_args(parser)
        common.add_output_args(parser, out="bench/out/files")
        args = parser.parse_args()
        common.setup_logging()
        with common.started_server(args, args.out / "server.log") as server:
            with common.PeakRss(server.pid) as memory:
                ...  # server.url, server.port; memory.growth_mb afterwards
        common.write_results(args.out, results, args)

Run benches from the repository root as ``python -m bench.NAME`` (or ``python -m bench NAME``);
``python -m bench`` lists them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.latency.monitor import machine_info
from bench.latency.poller import Poller
from bench.latency.serverproc import ManagedServer, ServerOptions, free_port, http_base, http_get

__all__ = [
    "REPO",
    "ManagedServer",
    "PeakRss",
    "Poller",
    "ServerOptions",
    "add_output_args",
    "add_server_args",
    "command_line",
    "cpu_name",
    "free_port",
    "http_base",
    "http_get",
    "int_list",
    "machine_info",
    "parser",
    "rss_mb",
    "server_options",
    "setup_logging",
    "started_server",
    "wait_until",
    "write_results",
]

REPO = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("STREAMER_CACHE_DIR", REPO / ".cache"))
_FLAGS = ("avx512_vnni", "avx512f", "avx2")  # what decides the int8 and fp32 kernels


def cpu_name() -> str:
    """The CPU's model name and its widest vector flags, e.g. ``AMD EPYC 7B13 (avx2)``.

    The same as ``lscpu | grep -E 'Model name|Flags'`` names it in bench/RESULTS.md.
    """
    name, flags = "unknown CPU", set[str]()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return name
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == "unknown CPU":
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    present = [flag for flag in _FLAGS if flag in flags]
    return f"{name} ({', '.join(present)})" if present else name


def parser(doc: str | None, prog: str | None = None) -> argparse.ArgumentParser:
    """An argument parser described by the first paragraph of a bench's docstring."""
    first = (doc or "").split("\n\n")[0]
    return argparse.ArgumentParser(
        prog=prog or f"python -m {_main_module()}", description=" ".join(first.split())
    )


def int_list(text: str) -> list[int]:
    """``"1,4,8"`` -> ``[1, 4, 8]`` (an argparse ``type``)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        message = f"expected integers separated by commas: {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def add_server_args(
    parser: argparse.ArgumentParser,
    *,
    model: str = "random:small",
    quantize: str | None = "int8",
    device: str = "cpu",
) -> None:
    """``--model``, ``--quantize`` (``none`` for full precision), ``--device`` and the
    repeatable ``--server-arg ARG`` (passed to ``streamer serve`` verbatim)."""
    parser.add_argument("--model", default=model, help=f"default {model}")
    parser.add_argument(
        "--quantize", default=quantize or "none", help="int8 or none (default %(default)s)"
    )
    parser.add_argument("--device", default=device, help="cpu, cuda, cuda:N")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed to streamer serve (repeatable), e.g. --server-arg=--threads --server-arg=2",
    )


def add_output_args(
    parser: argparse.ArgumentParser, *, out: str | None, cache_dir: Path = CACHE_DIR
) -> None:
    """``--out`` (a folder for results.json and the server's log; none when ``out`` is None)
    and ``--cache-dir`` (the models, and the generated speech in its ``speech/`` folder;
    STREAMER_CACHE_DIR or ``.cache``)."""
    if out is not None:
        parser.add_argument("--out", type=Path, default=Path(out), help="default %(default)s")
    parser.add_argument("--cache-dir", type=Path, default=cache_dir, help="default %(default)s")


def server_options(args: argparse.Namespace, **fields: Any) -> ServerOptions:
    """ServerOptions from the arguments of :func:`add_server_args`; ``fields`` override."""
    quantize = None if args.quantize in (None, "none") else args.quantize
    extra = tuple(getattr(args, "server_arg", ()) or ()) + tuple(fields.pop("extra_args", ()))
    values: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "quantize": quantize,
        "extra_args": extra,
    }
    values.update(fields)
    return ServerOptions(**values)


def started_server(args: argparse.Namespace, log_path: Path, **fields: Any) -> ManagedServer:
    """A ``streamer serve`` on a free 127.0.0.1 port; enter it to start it and wait for
    ``/readyz`` (``random:NAME`` models are built on first use, into the cache)."""
    return ManagedServer(server_options(args, **fields), log_path)


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command that ran this bench, to record beside its figures."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def _main_module() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else Path(sys.argv[0]).stem


def write_results(
    out: Path, results: dict[str, Any], args: argparse.Namespace | None = None
) -> Path:
    """Write ``out/results.json``: ``results`` plus the command, the machine and the CPU's
    name (kept when ``results`` already has them); returns the path."""
    record = dict(results)
    record.setdefault("command", command_line(_main_module()))
    record.setdefault("machine", {**machine_info(), "cpu_flags": cpu_name()})
    if args is not None:
        record.setdefault(
            "args", {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        )
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")
    return path


# -- polling -------------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    """A process's resident memory (VmRSS) in MiB; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class PeakRss(Poller):
    """A process's resident memory sampled in a thread while the ``with`` block runs:
    ``start_mb`` on entry, ``peak_mb`` the highest seen."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        super().__init__(interval_s)
        self.pid = pid
        self.start_mb = self.peak_mb = rss_mb(pid)

    def poll(self) -> None:
        self.peak_mb = max(self.peak_mb, rss_mb(self.pid))

    @property
    def growth_mb(self) -> float:
        return self.peak_mb - self.start_mb


def wait_until(
    predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.1, what: str = ""
) -> None:
    """Poll ``predicate`` until it holds; TimeoutError (naming ``what``) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what or 'the condition'} did not hold within {timeout_s:g} s")
        time.sleep(interval_s)
