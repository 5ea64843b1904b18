"""What every bench shares: the server it starts, probes, the CPU's name, arguments, results.

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
                ...  # server.url, server.port; memory.peak_mb afterwards
        common.write_results(args.out, results, args)

Run benches from the repository root as ``python -m bench.NAME`` (or ``python -m bench NAME``);
``python -m bench`` lists them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("STREAMER_CACHE_DIR", REPO / ".cache"))
AUDIO_CACHE = REPO / "bench" / "out" / "audio-cache"  # the latency benches' generated speech
logger = logging.getLogger(__name__)
_FLAGS = ("avx512_vnni", "avx512f", "avx2")  # what decides the int8 and fp32 kernels


def _cpuinfo() -> tuple[str, set[str]]:
    """The first CPU's model name and flags, from /proc/cpuinfo."""
    name, flags = "", set[str]()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return name, flags


def cpu_name() -> str:
    """The CPU's model name and its widest vector flags, e.g. ``AMD EPYC 7B13 (avx2)``.

    The same as ``lscpu | grep -E 'Model name|Flags'`` names it in bench/RESULTS.md.
    """
    name, flags = _cpuinfo()
    name = name or "unknown CPU"
    present = [flag for flag in _FLAGS if flag in flags]
    return f"{name} ({', '.join(present)})" if present else name


def machine_info() -> dict[str, Any]:
    """What the plots and the JSON say about where the bench ran."""
    import psutil

    info: dict[str, Any] = {
        "host": platform.node(),
        "cpu": _cpuinfo()[0] or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "gpu": None,
    }
    for package in ("torch", "funasr", "websockets"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = None
    info["gpu"] = "; ".join(", ".join(row) for row in nvidia_smi("name,memory.total")) or None
    return info


def nvidia_smi(fields: str, units: bool = True) -> list[list[str]]:
    """``nvidia-smi --query-gpu=FIELDS``: one row of cells per GPU; none without one."""
    if shutil.which("nvidia-smi") is None:
        return []
    form = "csv,noheader" if units else "csv,noheader,nounits"
    query = ["nvidia-smi", f"--query-gpu={fields}", f"--format={form}"]
    try:
        out = subprocess.run(query, check=True, capture_output=True, text=True, timeout=5).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [[cell.strip() for cell in line.split(",")] for line in out.strip().splitlines()]


PERCENTILES = (50.0, 95.0, 99.0)


def percentiles(
    values: Iterable[float | None],
    qs: Sequence[float] = PERCENTILES,
    missing: float | None = None,
) -> dict[str, float | None]:
    """``{"p50": ..., "p95": ..., "p99": ...}`` (linear interpolation); ``missing`` (None,
    or NaN to fail every bound it is compared with) when there are no values.

    ``None`` and NaN values are dropped first. The one percentile function of the benches.
    """
    data = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    return {f"p{q:g}": float(np.percentile(data, q)) if data.size else missing for q in qs}


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table of ``head`` and one line per row (each cell as ``str`` gives it)."""
    lines = [head, ["---"] * len(head), *rows]
    return "\n".join("| " + " | ".join(map(str, line)) + " |" for line in lines)


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
    parser.add_argument("--quantize", default=quantize or "none", help="int8 or none [%(default)s]")
    parser.add_argument("--device", default=device, help="cpu, cuda, cuda:N")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="for streamer serve (repeat): --server-arg=--threads")  # fmt: skip


def add_output_args(
    parser: argparse.ArgumentParser, *, out: str | None, cache_dir: Path = CACHE_DIR
) -> None:
    """``--out`` (a folder for results.json and the server's log; none when ``out`` is None)
    and ``--cache-dir`` (the models, and the generated speech in its ``speech/`` folder;
    STREAMER_CACHE_DIR or ``.cache``)."""
    if out is not None:
        parser.add_argument("--out", type=Path, default=Path(out), help="default %(default)s")
    parser.add_argument("--cache-dir", type=Path, default=cache_dir, help="default %(default)s")


# -- the server ------------------------------------------------------------------------------

READY_POLL_S = 0.5  # between /readyz probes while the model loads
STOP_GRACE_S = 30.0  # SIGINT lets the server finish its sessions; then SIGKILL
PORT_POLL_S = 0.1  # between looks at the listening sockets until the server has bound


@dataclass(frozen=True)
class ServerOptions:
    """How a bench starts ``streamer serve`` (a subclass overriding :meth:`command` starts
    another server, e.g. io_load's test double)."""

    model: str = "random:small"  # --model
    device: str = "cpu"  # --device
    quantize: str | None = None  # --quantize (e.g. "int8"); None for full precision
    dtype: str | None = None  # --dtype (fp16, bf16 on CUDA); None: the server's fp32
    partial_interval_ms: int | None = None  # --partial-interval-ms; None: server default
    endpoint_ms: int | None = None  # --endpoint-ms; None: server default
    max_sessions: int = 1000  # --max-sessions, above any sweep step
    log_level: str = "warning"  # --log-level
    extra_args: tuple[str, ...] = ()  # passed through verbatim
    # the server's streamer package from another checkout (PYTHONPATH, and the working
    # folder, which ``python -m`` searches first), e.g. an older commit exported with
    # ``git archive``, to measure old and new code in one run
    code_dir: Path | None = None
    python: str = sys.executable  # the server's interpreter (a plain install's venv, say)
    env: tuple[tuple[str, str], ...] = ()  # set in the server's environment
    ready_timeout_s: float = 900.0  # building a real-size random model takes a while
    ready_poll_s: float = READY_POLL_S  # between /readyz probes (a start-up bench: less)

    def command(self, port: int) -> list[str]:
        cmd = [self.python, "-m", "streamer", "serve", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--model", self.model, "--device", self.device]
        cmd += ["--max-sessions", str(self.max_sessions), "--log-level", self.log_level]
        if self.quantize:
            cmd += ["--quantize", self.quantize]
        if self.dtype:
            cmd += ["--dtype", self.dtype]
        if self.partial_interval_ms is not None:
            cmd += ["--partial-interval-ms", str(self.partial_interval_ms)]
        if self.endpoint_ms is not None:
            cmd += ["--endpoint-ms", str(self.endpoint_ms)]
        return cmd + list(self.extra_args)


def http_base(ws_url: str) -> str:
    """``ws://h:p/v1/asr`` -> ``http://h:p`` (``wss`` -> ``https``)."""
    parts = urlsplit(ws_url)
    scheme = "https" if parts.scheme == "wss" else "http"
    return f"{scheme}://{parts.netloc}"


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """Status and body of a GET; status 0 when the server cannot be reached."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError):
        return 0, ""


class LoopbackUrls:
    """``url`` (protocol v1's WebSocket) and ``http_url`` of a server listening on
    127.0.0.1:``port``: a bench's :class:`ManagedServer`, the tests' server thread."""

    port: int | None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/asr"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class ManagedServer(LoopbackUrls):
    """A server child process on port 0, its port read back from its listening socket.

    ``with ManagedServer(options, log) as server`` returns once ``/readyz`` answers 200;
    a bench that watches the start itself calls :meth:`start`, then :meth:`find_port`
    (None until the server listens) or :meth:`wait_ready`. Either raises RuntimeError
    (with the log's tail) if the process exits or the timeout passes first; :meth:`stop`
    (also on exit) sends SIGINT, then SIGKILL after ``STOP_GRACE_S``.
    """

    def __init__(self, options: ServerOptions, log_path: Path) -> None:
        self.options = options
        self.log_path = log_path
        self.command = options.command(0)
        self.process: subprocess.Popen[bytes] | None = None
        self.port: int | None = None  # read back once the server listens
        self.started_at: float | None = None  # time.monotonic() at the spawn
        self.load_s: float | None = None  # start to ready

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self) -> ManagedServer:
        logger.info("starting %s", shlex.join(self.command))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env, cwd = {**os.environ, **dict(self.options.env)}, None
        if self.options.code_dir is not None:
            env["PYTHONPATH"] = str(self.options.code_dir)
            cwd = self.options.code_dir
        with self.log_path.open("wb") as log:  # the child holds its own descriptor
            self.started_at = time.monotonic()
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd
            )
        return self

    def find_port(self) -> int | None:
        """The port the server listens on (the first 127.0.0.1 listener that no option
        named), or None while it has not bound one yet."""
        if self.port is None and self.process is not None:
            import psutil

            after = zip(self.command, self.command[1:], strict=False)
            named = {int(value) for flag, value in after if flag.endswith("-port")}
            with contextlib.suppress(psutil.Error):
                for conn in psutil.Process(self.process.pid).net_connections("tcp4"):
                    if conn.status == psutil.CONN_LISTEN and conn.laddr.port not in named:
                        self.port = int(conn.laddr.port)
                        break
        return self.port

    def check_running(self) -> None:
        """RuntimeError with the log's tail when the server has exited."""
        if self.process is None or self.process.poll() is not None:
            code = None if self.process is None else self.process.returncode
            raise RuntimeError(f"the server exited with {code}:\n{self.log_tail()}")

    def wait_ready(self) -> ManagedServer:
        assert self.started_at is not None, "start() first"
        deadline = self.started_at + self.options.ready_timeout_s
        while True:
            self.check_running()
            port = self.find_port()
            if port is not None and http_get(f"{self.http_url}/readyz", 2.0)[0] == 200:
                break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not ready after {self.options.ready_timeout_s} s")
            time.sleep(self.options.ready_poll_s if port is not None else PORT_POLL_S)
        self.load_s = time.monotonic() - self.started_at
        logger.info("server ready on port %d after %.1f s", self.port, self.load_s)
        return self

    def __enter__(self) -> ManagedServer:
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = STOP_GRACE_S) -> float | None:
        """Send ``sig``, SIGKILL after ``timeout_s``: seconds until the server exited (0 when
        it was not running), or None when it had to be killed."""
        if self.process is None or self.process.poll() is not None:
            return 0.0
        started = time.monotonic()
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout=timeout_s)
            return time.monotonic() - started
        except subprocess.TimeoutExpired:
            logger.warning("server did not stop within %.0f s; killing it", timeout_s)
            self.process.kill()
            self.process.wait()
            return None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


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
    """A ``streamer serve`` on a 127.0.0.1 port of its own; enter it to start it and wait
    for ``/readyz`` (``random:NAME`` models are built on first use, into the cache)."""
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
    if "machine" not in record:  # a run saved step by step has it already
        record["machine"] = {**machine_info(), "cpu_flags": cpu_name()}
    if args is not None:
        record.setdefault(
            "args", {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        )
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    text = json.dumps(
        record, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o)
    )
    path.write_text(text + "\n", encoding="utf-8")
    return path


# -- polling -------------------------------------------------------------------------------


def proc_status(pid: int, field: str) -> int:
    """A number of ``/proc/PID/status`` (``VmRSS``, ``VmHWM`` in KiB, ``Threads``); 0 once
    the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_s(pid: int, thread: int | None = None) -> tuple[float, float]:
    """User and system CPU seconds of a process (its threads included), or of one of its
    threads, so far (``/proc``)."""
    path = f"/proc/{pid}/task/{thread}/stat" if thread else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def rss_mb(pid: int) -> float:
    """A process's resident memory (VmRSS) in MiB; 0 once it is gone."""
    return proc_status(pid, "VmRSS") / 1024


def tree_rss_mb(pid: int) -> float | None:
    """Resident MiB of a process and all its descendants (a model process, an export
    child); None once it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        total = 0
        for process in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += process.memory_info().rss
    except psutil.NoSuchProcess:
        return None
    return total / 2**20


class Poller:
    """Calls :meth:`poll` every ``interval_s`` in a daemon thread, from ``with`` entry to
    exit (the first call one interval in). Subclasses keep what they see as attributes."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def poll(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()


class PeakRss(Poller):
    """A process's resident memory (with ``tree``, its descendants' too) sampled in a
    thread while the ``with`` block runs: ``start_mb`` on entry, ``peak_mb`` the highest."""

    def __init__(self, pid: int, interval_s: float = 0.2, *, tree: bool = False) -> None:
        super().__init__(interval_s)
        self.pid, self.tree = pid, tree
        self.start_mb = self.peak_mb = self.now_mb()

    def now_mb(self) -> float:
        return (tree_rss_mb(self.pid) or 0.0) if self.tree else rss_mb(self.pid)

    def poll(self) -> None:
        self.peak_mb = max(self.peak_mb, self.now_mb())


class HealthProbes(Poller):
    """``/healthz`` and ``/readyz`` in turn every interval, each on a new connection (as a
    balancer's or a kubelet's probe comes): how long each took to answer, seconds."""

    def __init__(self, port: int, interval_s: float = 0.1) -> None:
        super().__init__(interval_s)
        self.port = port
        self.took_s: dict[str, list[float]] = {"/healthz": [], "/readyz": []}
        self._turn = 0

    def poll(self) -> None:
        path = ("/healthz", "/readyz")[self._turn % 2]
        self._turn += 1
        started = time.perf_counter()
        status, _ = http_get(f"http://127.0.0.1:{self.port}{path}", 10.0)
        self.took_s[path].append(time.perf_counter() - started if status else 99.0)  # 99: none

    def summary_ms(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for path, took in self.took_s.items():
            values, name = [1000 * s for s in took] or [0.0], path.strip("/")
            out |= {f"{name}_{q}_ms": v for q, v in percentiles(values, (50, 95)).items()}
            out |= {f"{name}_max_ms": max(values), f"{name}_probes": len(took)}
        return out
