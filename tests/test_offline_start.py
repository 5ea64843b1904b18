"""The README's first start without a network (issue 33): ``streamer serve`` with no
cached model and no hub fails fast with one message naming next steps that work, and
the install hints name commands that exist for how the package was installed."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamer import extras
from streamer.model.artifacts import published
from tests.hub_standin import Hub, running
from tests.timing import timeout_s

FIRST_START_BOUND_S = 30  # the bound for the offline failure


def _serve_env(cache: Path, **changes: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HF_") and not k.lower().endswith("_proxy")
    }
    return {**env, "HF_HUB_CACHE": str(cache / "hf"), **changes}


@pytest.mark.parametrize("how", ["unreachable", "no-dns", "HF_HUB_OFFLINE"])
def test_serve_offline_fails_fast_with_one_message(tmp_path: Path, how: str) -> None:
    if how == "unreachable":
        with running(Hub({})) as hub:
            url = hub.url  # its port is closed once the block ends
        env = _serve_env(tmp_path, HF_ENDPOINT=url)
    elif how == "no-dns":
        env = _serve_env(tmp_path, HF_ENDPOINT="https://hub.invalid")  # RFC 2606: never resolves
    else:
        env = _serve_env(tmp_path, HF_HUB_OFFLINE="1")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "streamer", "serve", "--port", "0"]
        + ["--cache-dir", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s(120),
    )
    elapsed_s = time.monotonic() - started
    assert result.returncode != 0
    assert elapsed_s < timeout_s(FIRST_START_BOUND_S), elapsed_s
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if " ERROR " in line]
    assert len(errors) == 1, result.stderr
    (message,) = errors
    assert "hf download " + published.PUBLISHED_ONNX_MODEL in message
    assert "huggingface-cli" not in message
    assert "--model /path/to/dir" in message and "--model random:small" in message
    assert len(lines) == len(set(lines)), "a line printed twice"


def test_hub_warnings_reach_the_log_once(capfd: pytest.CaptureFixture[str]) -> None:
    """huggingface_hub's own stderr handler wrote each retry warning a second time."""
    from huggingface_hub.utils import logging as hub_logging

    hub_logging.get_logger("huggingface_hub.utils._http")  # its handler, as on import
    root = logging.getLogger()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root.addHandler(handler)
    try:
        published._one_handler_per_record()
        logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
    finally:
        root.removeHandler(handler)
    assert stream.getvalue().count("Retrying in 1s") == 1
    assert "Retrying" not in capfd.readouterr().err  # not also through the library's own


def test_install_hints_name_a_command_that_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # from a checkout (README: pip install -e .): the checkout's extra, its constraints
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    (tmp_path / "constraints.txt").write_text("torch==2.13.0\n")
    monkeypatch.setattr(extras, "_checkout", lambda: tmp_path)
    hint = extras.install_hint("torch")
    assert hint.startswith(f"cd {tmp_path} && ")
    assert hint.endswith("-m pip install -c constraints.txt -e '.[torch]'")
    # otherwise the extra's packages by name (the distribution is not on PyPI)
    monkeypatch.setattr(extras, "_checkout", lambda: None)
    hint = extras.install_hint("gpu")  # gpu is [torch] under another name
    assert "sensevoice-streamer[" not in hint
    assert "'torch>=2.1'" in hint and "'funasr>=1.2'" in hint


def test_this_install_is_read_from_its_pep_610_record() -> None:
    import importlib.metadata
    import json

    records = importlib.metadata.distributions(name=extras.DISTRIBUTION)
    record = next((t for d in records if (t := d.read_text("direct_url.json"))), None)
    origin = json.loads(record) if record else {}
    if "dir_info" not in origin:
        pytest.skip("not installed from a directory (scripts/test.sh installs a checkout)")
    checkout = extras._checkout()
    assert checkout is not None and checkout.as_uri() == origin["url"]
