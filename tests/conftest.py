"""Shared pytest fixtures."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Loopback servers (port 0): make_server, server_url, tagged_server_url, http_base_url.
pytest_plugins = ["tests.server_fixtures"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU-only tests skip at collection, before any of their fixtures builds a model."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device (torch {torch.__version__} sees none)")
    for item in gpu_items:
        item.add_marker(skip)


# --- models and speech (recognizer, model builder) -----------------------------------------
# Random-weight models are built once per cache directory (atomically, keyed by the builder
# version) and reused by every later session. Synthesised speech needs espeak-ng and sox,
# which CI installs: tests that need them fail loudly rather than skip.


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """``$STREAMER_CACHE_DIR``, else ``<repo>/.cache`` (git-ignored)."""
    env = os.environ.get("STREAMER_CACHE_DIR")
    path = Path(env).expanduser() if env else REPO_ROOT / ".cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def speech_cache(cache_dir: Path) -> Path:
    """Where :func:`streamer.testkit.speech.speak` caches its clips."""
    return cache_dir / "speech"


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir: Path) -> Path:
    """random:tiny: 0.8 M parameters, meaningless output, loads in well under a second."""
    from streamer.testkit.models import ensure_random_model

    return ensure_random_model("tiny", cache_dir)


@pytest.fixture(scope="session")
def tagged_model_dir(cache_dir: Path) -> Path:
    """random:tagged: tiny, trained once so that its two espeak clips decode to known tags
    (shipped in ``streamer/testkit/tagged_model`` with checksums)."""
    from streamer.testkit.models import ensure_random_model

    return ensure_random_model("tagged", cache_dir)


@pytest.fixture(scope="session")
def small_model_dir(cache_dir: Path) -> Path:
    """random:small: the real SenseVoiceSmall size (about 900 MiB, built once)."""
    from streamer.testkit.models import ensure_random_model

    return ensure_random_model("small", cache_dir)


TAGGED_TEXTS = ["the quick brown fox jumps over the lazy dog", "hello there"]


@pytest.fixture(scope="module")
def speech16(speech_cache: Path):
    """The tagged model's two clips (:data:`TAGGED_TEXTS`), 1.5 s apart, with silence
    after: 16 kHz int16."""
    import numpy as np

    from streamer.testkit import speech as synth

    fox = synth.speak(TAGGED_TEXTS[0], "en", cache_dir=speech_cache)
    hello = synth.speak(TAGGED_TEXTS[1], "en", cache_dir=speech_cache)
    pcm, _ = synth.join_with_silence([("en", "fox", fox), ("en", "hello", hello)], 1500)
    return np.concatenate([pcm, np.zeros(16000, dtype=np.int16)])


@pytest.fixture
def no_tracebacks(caplog):
    """Fails the test when the server logged an error (a traceback) meanwhile."""
    caplog.set_level(logging.INFO)
    yield caplog
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]
