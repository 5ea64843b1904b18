"""The CPU default: sherpa-onnx's published export fetched from a hub and checked.

The hub cannot be reached where the suite runs, so a stand-in of its file API on loopback
(tests/hub_standin.py) serves a sherpa-onnx-layout export of the tagged test model under
the published model's id, and huggingface_hub's own client fetches it from there
(HF_ENDPOINT): a transfer dropped halfway is resumed, the cache serves later starts also
offline, and a 404, an unreachable hub or a corrupt file are clear errors.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from streamer.errors import ModelError
from streamer.model.artifacts.onnx_export import cached_export
from streamer.model.artifacts.published import (
    PUBLISHED_FILES,
    PUBLISHED_ONNX_MODEL,
    fetch_published,
)
from streamer.model.backends.loading import load_recognizer, resolve_backend, resolve_model
from streamer.model.options import RecognizerOptions
from streamer.testkit.speech import speak
from tests.hub_standin import Hub, running
from tests.timing import timeout_s

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.fixture(scope="module")
def published_files(tagged_model_dir: Path, cache_dir: Path) -> dict[str, bytes]:
    """The tagged model's export as sherpa-onnx publishes SenseVoice: the int8 graph
    (metadata kept) and tokens.txt."""
    export = cached_export(tagged_model_dir, cache_dir)
    return {name: (export / name).read_bytes() for name in PUBLISHED_FILES}


@pytest.fixture
def hub_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HOME", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _options(cache: Path, **options: object) -> RecognizerOptions:
    defaults: dict[str, object] = {"device": "cpu", "threads": 1, "cache_dir": cache}
    return RecognizerOptions(**{**defaults, **options})  # type: ignore[arg-type]


def test_the_cpu_default_is_the_published_int8_export() -> None:
    options = resolve_model(RecognizerOptions(device="cpu"))
    assert (options.model, options.quantize) == (PUBLISHED_ONNX_MODEL, "int8")
    assert resolve_backend(options) == "onnx"
    torch = resolve_model(RecognizerOptions(device="cpu", backend="torch"))
    assert torch.model == "iic/SenseVoiceSmall"


def test_fetch_resumes_a_dropped_transfer_then_serves_from_the_cache_offline(
    hub_env, tmp_path: Path, published_files, speech_cache: Path
) -> None:
    from huggingface_hub import constants

    # huggingface_hub resumes from the last whole chunk it wrote (10 MB): smaller chunks
    # let a 1 MB test graph break off after some of them, as the real 239 MB one would
    hub_env.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    hub = Hub({PUBLISHED_ONNX_MODEL: published_files}, drop_first_get={"model.int8.onnx"})
    with running(hub):
        hub_env.setenv("HF_ENDPOINT", hub.url)
        recognizer = load_recognizer(_options(tmp_path, warmup=False))
    gets = [(path, ranged) for method, path, ranged in hub.requests if method == "GET"]
    graph_gets = [ranged for path, ranged in gets if path.endswith("/model.int8.onnx")]
    assert graph_gets[0] is None and graph_gets[1] is not None  # resumed with a Range
    assert int(graph_gets[1].split("=")[1].rstrip("-")) > 0
    assert recognizer.backend == "onnx" and recognizer.model_dir.kind == "sherpa-onnx"
    assert recognizer.model_dir.graph.read_bytes() == published_files["model.int8.onnx"]
    pcm = speak("hello there", "en", cache_dir=speech_cache)
    assert recognizer.decode(pcm, language="auto", use_itn=False).text == "hello there"

    # later starts: the cache, without the hub (gone) when HF_HUB_OFFLINE is set
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    directory = fetch_published(PUBLISHED_ONNX_MODEL, tmp_path)
    assert directory == recognizer.model_dir.directory


def test_a_corrupt_download_is_refused_and_deleted_then_fetched_again(
    hub_env, tmp_path: Path, published_files
) -> None:
    hub = Hub({PUBLISHED_ONNX_MODEL: published_files}, corrupt={"model.int8.onnx"})
    with running(hub):
        hub_env.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(ModelError, match="model.int8.onnx downloaded from the hub is corrupt"):
            fetch_published(PUBLISHED_ONNX_MODEL, tmp_path)
        hub.corrupt.clear()
        directory = fetch_published(PUBLISHED_ONNX_MODEL, tmp_path)
    assert (directory / "model.int8.onnx").read_bytes() == published_files["model.int8.onnx"]


def test_a_missing_repository_or_file_is_a_clear_404(
    hub_env, tmp_path: Path, published_files
) -> None:
    partial = {"tokens.txt": published_files["tokens.txt"]}
    hub = Hub({"someone/sherpa-onnx-sense-voice-elsewhere": partial})
    with running(hub):
        hub_env.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(ModelError, match=r"has no model .*2024-07-17 \(404\); check the id"):
            fetch_published(PUBLISHED_ONNX_MODEL, tmp_path)
        with pytest.raises(ModelError, match=r"has no file model.int8.onnx \(404\)"):
            fetch_published("someone/sherpa-onnx-sense-voice-elsewhere", tmp_path)


def test_offline_without_a_cache_and_an_unreachable_hub_say_what_to_do(
    hub_env, tmp_path: Path
) -> None:
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set") as offline:
        fetch_published(PUBLISHED_ONNX_MODEL, tmp_path)
    hub_env.delenv("HF_HUB_OFFLINE")
    with running(Hub({})) as hub:
        url = hub.url  # the port is closed once the block ends
    hub_env.setenv("HF_ENDPOINT", url)
    started = time.monotonic()
    with pytest.raises(ModelError, match=f"{url} cannot be reached") as unreachable:
        fetch_published(PUBLISHED_ONNX_MODEL, tmp_path)
    assert time.monotonic() - started < timeout_s(10)  # asked once, not retried for 25 s
    for message in (str(offline.value), str(unreachable.value)):
        # the next steps that work without the hub, by today's names
        assert f"hf download {PUBLISHED_ONNX_MODEL} model.int8.onnx tokens.txt" in message
        assert "huggingface-cli" not in message
        assert "--model /path/to/dir" in message and "HF_ENDPOINT" in message
        assert "--model random:small" in message
    # random:small needs torch: where it is missing, the command for this install
    from streamer.extras import TORCH, install_hint
    from streamer.model.artifacts import published

    hub_env.setattr(published, "missing", lambda *modules: list(modules))
    message = published._offline_message(PUBLISHED_ONNX_MODEL, "tokens.txt", "offline")
    assert f"needs torch: {install_hint(TORCH)})" in message


def test_an_unreachable_hub_serves_what_is_cached(
    hub_env, tmp_path: Path, published_files: dict[str, bytes]
) -> None:
    with running(Hub({PUBLISHED_ONNX_MODEL: published_files})) as hub:
        hub_env.setenv("HF_ENDPOINT", hub.url)
        first = fetch_published(PUBLISHED_ONNX_MODEL, tmp_path)
    started = time.monotonic()  # the hub is gone now, HF_HUB_OFFLINE is not set
    assert fetch_published(PUBLISHED_ONNX_MODEL, tmp_path) == first
    assert time.monotonic() - started < timeout_s(10)
