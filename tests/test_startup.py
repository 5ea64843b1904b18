"""``streamer serve`` start-up as a user meets it: clear one-line failures, honest stages.

Each failure must be one line on stderr (no traceback) with a non-zero exit, found
before anything slow happens; the timeouts below only keep a hung process from hanging
the suite.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest

from tests.support import free_port
from tests.timing import timeout_s

HANG_GUARD_S = 60


def _serve(*args: str, cache_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STREAMER_CACHE_DIR": str(cache_dir)}
    return subprocess.run(
        [sys.executable, "-m", "streamer", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s(HANG_GUARD_S),
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    errors = [line for line in lines if " ERROR " in line]
    assert len(errors) == 1, stderr
    assert not any("listening on" in line for line in lines), stderr
    return errors[0]


def test_port_in_use_is_one_clear_line(cache_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _serve("--model", "random:tiny", "--port", str(port), cache_dir=cache_dir)
    assert result.returncode != 0
    assert "already in use" in _one_error_line(result.stderr)


def test_missing_model_directory_is_one_clear_line(cache_dir: Path, tmp_path: Path) -> None:
    result = _serve("--model", str(tmp_path / "no-such-model"), cache_dir=cache_dir)
    assert result.returncode != 0
    line = _one_error_line(result.stderr)
    assert "does not exist" in line
    for layout in ("config.yaml, model.pt", "model_quant.onnx", "tokens.txt", "random:small"):
        assert layout in line  # every layout --model may be, torch's and ONNX's


def test_incomplete_model_directory_names_the_missing_files(
    cache_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "config.yaml").write_text("model: SenseVoiceSmall\n")
    result = _serve("--model", str(tmp_path), cache_dir=cache_dir)
    assert result.returncode != 0
    line = _one_error_line(result.stderr)
    assert "model.pt" in line and "am.mvn" in line


def test_cuda_without_cuda_is_refused_before_loading(cache_dir: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = _serve("--model", "random:tiny", "--device", "cuda", cache_dir=cache_dir)
    assert result.returncode == 2
    line = _one_error_line(result.stderr)
    assert "CUDA" in line and "--device cpu" in line
    assert "loading model" not in result.stderr  # refused before any loading stage


def test_bad_certificate_path_is_one_clear_line(cache_dir: Path, tmp_path: Path) -> None:
    result = _serve(
        "--model",
        "random:tiny",
        "--port",
        str(free_port()),
        "--certfile",
        str(tmp_path / "missing.pem"),
        "--keyfile",
        str(tmp_path / "missing.key"),
        cache_dir=cache_dir,
    )
    assert result.returncode == 2
    assert "TLS certificate" in _one_error_line(result.stderr)


@pytest.mark.parametrize(
    ("backend", "imported"),
    [("torch", "importing torch and funasr"), ("onnx", "importing onnxruntime")],
)
def test_readyz_reports_the_loading_stage_then_ready_and_sigint_exits(
    cache_dir: Path, backend: str, imported: str
) -> None:
    """Bound first, /readyz says which stage is loading, every stage is logged with its
    duration, and SIGINT with no session open ends the process at once."""
    port = free_port()
    env = {**os.environ, "STREAMER_CACHE_DIR": str(cache_dir)}
    command = [sys.executable, "-m", "streamer", "serve", "--model", "random:tiny"]
    process = subprocess.Popen(
        [*command, "--backend", backend, "--port", str(port)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    seen_loading: list[dict[str, object]] = []
    try:
        deadline = time.monotonic() + timeout_s(HANG_GUARD_S)
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/readyz", timeout=timeout_s(2)
                ) as r:
                    body = orjson.loads(r.read())
                    assert body["status"] == "ready"
                    break
            except urllib.error.HTTPError as error:
                assert error.code == 503
                body = orjson.loads(error.read())
                assert body["status"] == "loading"
                seen_loading.append(body)
            except (urllib.error.URLError, ConnectionError):
                pass  # not bound yet
            time.sleep(0.05)
        else:
            pytest.fail("the server never became ready")
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=timeout_s(HANG_GUARD_S))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert seen_loading, "never saw /readyz 503 while loading"
    assert {body["stage"] for body in seen_loading} <= {
        "starting",
        "import",
        "build",
        "load",
        "warmup",
        # the model has loaded and the loop has not yet seen the worker turn ready: a
        # probe in that instant still gets 503
        "ready",
    }
    for stage in (
        f"{imported}: done in",
        "loading model random:tiny",
        "warming up (decoding 1, 3 and 7 s): done in",
        "model ready after",
    ):
        assert stage in stderr, stderr
    assert "Traceback" not in stderr
