"""serve raises the open-files limit it starts with, and warns when it cannot hold
--max-sessions sockets (past it new connections are reset, silently under uvloop)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.timing import timeout_s

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import logging, resource
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from streamer.cli.process_limits import raise_open_files_limit
raise_open_files_limit({sessions})
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def run_with_limits(ulimit: str, sessions: int) -> tuple[int, str]:
    script = f"ulimit {ulimit} && exec {sys.executable} -c '{PROBE.format(sessions=sessions)}'"
    done = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout_s(60),
        check=True,
    )
    return int(done.stdout.split()[-1]), done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX rlimits via bash")
def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    hard = int(
        subprocess.run(["bash", "-c", "ulimit -H -n"], capture_output=True, text=True).stdout
    )
    if hard < 2000:
        pytest.skip(f"the hard limit here is {hard}")
    soft, warnings = run_with_limits("-S -n 1000", 64)
    assert soft == hard and "open files" not in warnings


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX rlimits via bash")
def test_a_limit_too_low_for_max_sessions_is_warned_about() -> None:
    soft, warnings = run_with_limits("-n 300", 1000)  # soft and hard
    assert soft == 300
    assert "only 300 open files allowed" in warnings and "--max-sessions 1000" in warnings
