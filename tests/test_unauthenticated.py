"""An empty STREAMER_TOKEN never serves unauthenticated; a server without a token says so."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from tests.fakes import FakeRecognizer
from tests.timing import timeout_s


def test_an_empty_streamer_token_refuses_to_start(cache_dir: Path) -> None:
    env = {**os.environ, "STREAMER_CACHE_DIR": str(cache_dir), "STREAMER_TOKEN": ""}
    done = subprocess.run(
        [sys.executable, "-m", "streamer", "serve", "--model", "random:tiny", "--port", "0"],
        capture_output=True, text=True, timeout=timeout_s(120), env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "STREAMER_TOKEN is set but empty" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_server_without_a_token_warns_once_and_one_with_a_token_does_not(
    make_server, caplog
) -> None:
    with caplog.at_level(logging.WARNING, logger="streamer.server.server"):
        make_server(FakeRecognizer)
        make_server(FakeRecognizer, token="s3cret")
    warnings = [r for r in caplog.records if "without authentication" in r.getMessage()]
    assert len(warnings) == 1
