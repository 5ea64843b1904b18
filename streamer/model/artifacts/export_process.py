"""The one-time ONNX export in a child process of its own.

A server that has to export a torch model (the first start with a torch model on the
CPU) runs ``streamer export-onnx MODEL --out DIR`` as a child instead of exporting in
its model thread: torch, funasr and the weights live and die in the child, so the
server never holds them (it goes on to load the int8 graph with ONNX Runtime alone),
and tracing, which holds the GIL for tens of seconds, runs under the child's GIL, not
the one the event loop needs to answer ``/healthz`` (bench/RESULTS.md has both sides).

The child logs JSON lines on its stderr; each is logged again here under its own
logger name and level, so the export's progress shows in the server's log as if it had
run inside. The kernel kills the child if the thread that started it goes away
(``--die-with-parent``: ``PR_SET_PDEATHSIG``), and a child that runs past
:data:`EXPORT_TIMEOUT_S` is killed.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import IO

from streamer.errors import ModelError

logger = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 1800.0  # the real size takes 1-3 minutes on 2 cores
_TAIL_LINES = 20  # of the child's other output, quoted when it fails


def export_in_child(
    model_dir: Path, out_dir: Path, *, int8_weight_type: str, name: str | None, digest: str
) -> None:
    """:func:`~streamer.model.artifacts.onnx_export.export_onnx` of ``model_dir`` into the empty
    directory ``out_dir``, in a child process; ModelError when it fails."""
    level = logging.getLevelName(logging.getLogger("streamer").getEffectiveLevel()).lower()
    command = [
        sys.executable,
        "-m",
        "streamer",
        "export-onnx",
        str(model_dir),
        "--out",
        str(out_dir),
        "--int8-weight-type",
        int8_weight_type,
        "--source-name",
        name or str(model_dir),
        "--source-sha256",
        digest,
        "--die-with-parent",
        "--log-format",
        "json",
        "--log-level",
        level if level in ("debug", "info", "warning", "error") else "info",
    ]
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        errors="replace",
    )
    logger.info("export: running in child process %d", process.pid)
    errors: list[str] = []
    tail: deque[str] = deque(maxlen=_TAIL_LINES)
    assert process.stderr is not None
    relay = threading.Thread(
        target=_relay, args=(process.stderr, errors, tail), name="export-log", daemon=True
    )
    relay.start()
    try:
        status = process.wait(timeout=EXPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
        raise ModelError(
            f"the ONNX export of {name or model_dir} took over {EXPORT_TIMEOUT_S:.0f} s "
            "and was stopped"
        ) from None
    finally:
        relay.join(timeout=10)
    if status != 0:
        said = "; ".join(errors) or " / ".join(tail) or "no message"
        raise ModelError(f"the ONNX export of {name or model_dir} failed (status {status}): {said}")


def _relay(stream: IO[str], errors: list[str], tail: deque[str]) -> None:
    """Log the child's JSON lines again here; keep its errors (the ModelError raised
    here says them) and its other lines."""
    for line in stream:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            level = logging.getLevelName(entry["level"])
            message = str(entry["message"])
            name = str(entry["logger"])
        except (ValueError, KeyError, TypeError):
            tail.append(line)
            logger.debug("export child: %s", line)
            continue
        if not isinstance(level, int):
            level = logging.INFO
        if level >= logging.ERROR:
            errors.append(message)
        else:
            logging.getLogger(name).log(level, "%s", message)
