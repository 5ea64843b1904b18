"""The static checks run in the suite: mypy (configured in pyproject.toml) and ruff; the
dependency floors pyproject.toml declares are the ones scripts/test_floor.sh tests."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
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


def test_the_declared_floors_are_the_tested_ones() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {
        match["name"]: match["floor"]
        for spec in project["dependencies"]
        if (match := re.fullmatch(r"(?P<name>[\w-]+)>=(?P<floor>[\d.]+)", spec))
    }
    pins = re.findall(r"^([\w-]+)==([\d.]+)$", (REPO / "constraints-floor.txt").read_text(), re.M)
    assert pins, "constraints-floor.txt pins nothing"
    for name, version in pins:
        assert declared.get(name) == version, f"pyproject.toml's floor of {name} is not {version}"
    script = (REPO / "scripts" / "test_floor.sh").read_text()
    assert "constraints-floor.txt" in script
    # the README's test command, which CI runs, runs it
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()
    assert "bash scripts/test_floor.sh" in (REPO / "scripts" / "test.sh").read_text()
