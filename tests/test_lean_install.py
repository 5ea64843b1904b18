"""The plain install, as a CPU user gets it: no torch, no funasr, and it serves.

A virtual environment of its own (``.cache/lean-venv``, made again when pyproject.toml or
constraints.txt changes; pip's download cache makes that about a minute) gets
``pip install -e .`` with no extra. Its ``streamer serve`` runs a sherpa-onnx-layout
export (what the CPU default fetches from Hugging Face, here made from the tagged test
model) and its ``streamer client`` streams speech to it and prints the transcript.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from streamer.model.artifacts.onnx_export import cached_export
from streamer.testkit.onnx_layouts import sherpa_layout
from streamer.testkit.speech import join_with_silence, speak
from tests.support import free_port
from tests.timing import timeout_s as scaled

REPO_ROOT = Path(__file__).resolve().parent.parent
LEAN_VENV = REPO_ROOT / ".cache" / "lean-venv"
MAX_VENV_BYTES = 600 * 10**6  # the bound for the plain install (README states it)
INSTALL_TIMEOUT_S = 900
ABSENT = ("torch", "funasr", "onnx", "psutil", "silero_vad", "matplotlib")


def _stamp() -> str:
    digest = hashlib.sha256()
    # a venv is not relocatable (its scripts name their interpreter by path, the editable
    # install its checkout): one built from another checkout or folder is built again
    digest.update(str(LEAN_VENV).encode() + b"\0" + str(REPO_ROOT).encode() + b"\0")
    for name in ("pyproject.toml", "constraints.txt"):
        digest.update((REPO_ROOT / name).read_bytes())
    return digest.hexdigest()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PYTHONNOUSERSITE": "1"}


@pytest.fixture(scope="module")
def lean_python() -> Path:
    python = LEAN_VENV / "bin" / "python"
    stamp = LEAN_VENV / "installed-from"
    if python.exists() and stamp.is_file() and stamp.read_text() == _stamp():
        return python
    shutil.rmtree(LEAN_VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(LEAN_VENV)], check=True, env=_env())
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-c", "constraints.txt", "-e", "."],
        cwd=REPO_ROOT,
        check=True,
        env=_env(),
        timeout=scaled(INSTALL_TIMEOUT_S),
    )
    stamp.write_text(_stamp())
    return python


def test_the_plain_install_has_neither_torch_nor_funasr(lean_python: Path) -> None:
    code = (
        "import importlib.util as u, sys\n"
        f"print(' '.join(m for m in {ABSENT!r} if u.find_spec(m) is not None))\n"
    )
    found = subprocess.run(
        [str(lean_python), "-c", code], capture_output=True, text=True, check=True, env=_env()
    )
    assert found.stdout.strip() == ""
    size = sum(p.lstat().st_size for p in LEAN_VENV.rglob("*") if p.is_file())
    assert size <= MAX_VENV_BYTES, f"the plain install takes {size / 1e6:.0f} MB"


def test_a_missing_extra_is_one_line_naming_it(lean_python: Path, tmp_path: Path) -> None:
    streamer = str(lean_python.parent / "streamer")
    for args in (
        ["serve", "--backend", "torch", "--port", "0"],
        ["build-model", "tiny"],
    ):
        result = subprocess.run(
            [streamer, *args, "--cache-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=scaled(60),
        )
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "-e '.[torch]'" in lines[0], args  # from the checkout


def _wait_ready(port: int, server: subprocess.Popen[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        assert server.poll() is None, "the server exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=scaled(2)) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server was not ready in time")


def test_the_plain_install_serves_a_published_layout_export(
    lean_python: Path,
    tagged_model_dir: Path,
    cache_dir: Path,
    speech_cache: Path,
    tmp_path: Path,
) -> None:
    import soundfile

    model = sherpa_layout(cached_export(tagged_model_dir, cache_dir), tmp_path / "sherpa")
    pcm = speak("hello there", "en", cache_dir=speech_cache)
    signal, _ = join_with_silence([("en", "hello there", pcm)], 800)
    audio = tmp_path / "hello.wav"
    soundfile.write(audio, np.asarray(signal), 16000, subtype="PCM_16")
    bin_dir = lean_python.parent
    port = free_port()
    command = [str(bin_dir / "streamer"), "serve", "--model", str(model), "--device", "cpu"]
    command += ["--port", str(port), "--cache-dir", str(tmp_path / "cache")]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        _wait_ready(port, server)
        client = subprocess.run(
            [
                str(bin_dir / "streamer"),
                "client",
                str(audio),
                "--url",
                f"ws://127.0.0.1:{port}/v1/asr",
            ],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=scaled(120),
        )
        assert client.returncode == 0, client.stderr
        assert "hello there" in client.stdout
    finally:
        server.terminate()
        _, log = server.communicate(timeout=scaled(30))
    assert "with ONNX Runtime" in log and "(sherpa-onnx, cpu" in log
