"""Start, wait for and stop a ``streamer serve`` process for a self-contained bench run."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

READY_POLL_S = 0.5  # between /readyz probes while the model loads
STOP_GRACE_S = 30.0  # SIGINT lets the server finish its sessions; then SIGKILL


@dataclass(frozen=True)
class ServerOptions:
    """How the bench starts ``streamer serve``."""

    model: str = "random:small"  # --model
    device: str = "cpu"  # --device
    quantize: str | None = None  # --quantize (e.g. "int8"); None for full precision
    dtype: str | None = None  # --dtype (fp16, bf16 on CUDA); None: the server's fp32
    partial_interval_ms: int | None = None  # --partial-interval-ms; None: server default
    endpoint_ms: int | None = None  # --endpoint-ms; None: server default
    max_sessions: int = 1000  # --max-sessions, above any sweep step
    log_level: str = "warning"  # --log-level
    extra_args: tuple[str, ...] = ()  # passed through verbatim
    # the server's streamer package from another checkout (PYTHONPATH), e.g. an older
    # commit exported with ``git archive``, to measure old and new code in one run
    code_dir: Path | None = None
    ready_timeout_s: float = 900.0  # building a real-size random model takes a while

    def command(self, port: int) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "streamer",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            self.model,
            "--device",
            self.device,
            "--max-sessions",
            str(self.max_sessions),
            "--log-level",
            self.log_level,
        ]
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ManagedServer:
    """A ``streamer serve`` child process; use as a context manager.

    ``__enter__`` returns once ``/readyz`` answers 200 and raises RuntimeError (with the
    log's tail) if the process exits or the timeout passes first.
    """

    def __init__(self, options: ServerOptions, log_path: Path) -> None:
        self.options = options
        self.log_path = log_path
        self.port = free_port()
        self.url = f"ws://127.0.0.1:{self.port}/v1/asr"
        self.process: subprocess.Popen[bytes] | None = None
        self.load_s: float | None = None  # start to ready

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def __enter__(self) -> ManagedServer:
        command = self.options.command(self.port)
        logger.info("starting %s", " ".join(command))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        started = time.monotonic()
        env, cwd = None, None
        if self.options.code_dir is not None:  # python -m looks in the current folder first
            env = {**os.environ, "PYTHONPATH": str(self.options.code_dir)}
            cwd = self.options.code_dir
        self.process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd
        )
        log.close()  # the child holds its own descriptor
        ready = f"{http_base(self.url)}/readyz"
        deadline = started + self.options.ready_timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"streamer serve exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            if http_get(ready, timeout_s=2.0)[0] == 200:
                break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not ready after {self.options.ready_timeout_s} s")
            time.sleep(READY_POLL_S)
        self.load_s = time.monotonic() - started
        logger.info("server ready on port %d after %.1f s", self.port, self.load_s)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            logger.warning("server did not stop within %.0f s; killing it", STOP_GRACE_S)
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
