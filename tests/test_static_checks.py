"""The static checks run in the suite: mypy (configured in pyproject.toml) and ruff."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.timing import timeout_s

REPO = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s(600),
    )


def test_mypy_finds_no_error() -> None:
    result = _run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_lint_and_format_are_clean() -> None:
    lint = _run("ruff", "check", ".")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = _run("ruff", "format", "--check", "streamer", "tests", "bench", "client_examples")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
