"""Model directories: where a model's files are, whether they fit together, the hub.

Finding the files funasr will read, checking that the tokenizer and the CTC head agree
(funasr silently decodes garbage when they do not), and finding a hub id in the local
cache, or failing fast when the hub cannot be reached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from streamer.errors import ConfigError, ModelError

logger = logging.getLogger(__name__)

HUB_PROBE_TIMEOUT_S = 2.5  # how long an unreachable hub may delay start-up
RANDOM_PREFIX = "random:"  # test models: built by a RandomModels, never by this package
MARKER_FILE = "random_model.json"  # written into every random model directory built

_CTC_HEAD_KEY = "ctc.ctc_lo.weight"
_HF_ALIASES = {"iic/SenseVoiceSmall": "FunAudioLLM/SenseVoiceSmall"}


class RandomModels(Protocol):
    """What builds the test models ``random:NAME`` names, passed in by the caller.

    ``streamer.testkit.models.RANDOM_MODELS`` is the one there is; the CLI, the test
    fixtures and the benches pass it, so that nothing here imports the test kit. It must
    pickle (a spawned model process receives it with the options).
    """

    @property
    def names(self) -> tuple[str, ...]: ...

    def is_built(self, name: str, cache_dir: Path) -> bool:
        """Whether ``name`` is built under ``cache_dir`` already (nothing slow)."""
        ...

    def ensure(self, name: str, cache_dir: Path) -> Path:
        """The directory of ``name``, built (once) under ``cache_dir`` if needed."""
        ...


def default_cache_dir() -> Path:
    """``$STREAMER_CACHE_DIR``, else ``~/.cache/sensevoice-streamer``."""
    env = os.environ.get("STREAMER_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sensevoice-streamer"


@dataclass(frozen=True)
class ModelFiles:
    """The files of one model directory, as funasr's loader will pick them."""

    directory: Path
    config: Path  # config.yaml
    checkpoint: Path  # model.pt
    tokenizer: Path | None  # sentencepiece model; None when the config names another kind
    cmvn: Path  # am.mvn


def random_model(model: str, random_models: RandomModels | None) -> tuple[str, RandomModels]:
    """The name in ``random:NAME`` and what builds it; ConfigError for an unknown name or
    when no builder was passed."""
    name = model[len(RANDOM_PREFIX) :]
    if random_models is None:
        raise ConfigError(
            f"model {model!r} is a random-weight test model, built by streamer.testkit: pass "
            "random_models=streamer.testkit.models.RANDOM_MODELS with it (the CLI does)"
        )
    if name not in random_models.names:
        raise ConfigError(
            f"unknown random model {model!r}; choose random:"
            + ", random:".join(random_models.names)
        )
    return name, random_models


def has_random_weights(directory: Path) -> bool:
    """Whether ``directory`` was built with random weights (it holds :data:`MARKER_FILE`)."""
    try:
        return isinstance(json.loads((directory / MARKER_FILE).read_text()), dict)
    except (OSError, ValueError):
        return False


def locate_model(
    model: str, hub: str, cache_dir: Path, random_models: RandomModels | None = None
) -> Path | str:
    """A checked local model directory, or the hub id funasr should download.

    ``random:NAME`` is built (once) under ``cache_dir`` by ``random_models``; a
    directory is checked for missing files and a tokenizer that does not fit the weights;
    a hub id is looked up in the local hub cache, and when it is not there the hub must
    answer within :data:`HUB_PROBE_TIMEOUT_S`. Raises ModelError otherwise.
    """
    source = model_source(model, hub, cache_dir, random_models)
    if isinstance(source, str):
        return source
    directory = source
    check_vocabulary(model_files(directory))
    if not model.startswith(RANDOM_PREFIX) and has_random_weights(directory):
        logger.warning(
            "model directory %s was built with random weights: its transcripts are meaningless",
            directory,
        )
    return directory


def model_source(
    model: str, hub: str, cache_dir: Path, random_models: RandomModels | None = None
) -> Path | str:
    """Where ``model`` lives, before any check of its files: the directory of
    ``random:NAME`` (built once under ``cache_dir`` by ``random_models``), of a path, or of
    a hub id already in the local hub cache; else the hub id itself, once the hub has
    answered (ModelError when it does not within :data:`HUB_PROBE_TIMEOUT_S`)."""
    if model.startswith(RANDOM_PREFIX):
        name, builder = random_model(model, random_models)
        directory = builder.ensure(name, cache_dir)
        if name == "tagged":  # trained, on two clips: not meaningless, but not a real model
            logger.warning(
                "model %s is a 1 M-parameter test model trained on two clips: it "
                "transcribes those and little else. Use it for tests only.",
                model,
            )
        else:
            logger.warning(
                "MODEL %s HAS RANDOM WEIGHTS: every transcript it produces is meaningless. "
                "Use it for tests and timing only.",
                model,
            )
        return directory
    path = Path(model).expanduser()
    if path.exists() or looks_like_path(model):
        return path
    cached = hub_cache_dir(model, hub)
    if cached is None:
        require_hub(model, hub)
        return model
    return cached


def looks_like_path(model: str) -> bool:
    """Hub ids are ``owner/name``; anything else that does not exist is a missing path."""
    if model.startswith(("/", "./", "../", "~")) or Path(model).is_absolute():
        return True
    return model.count("/") != 1


def missing_directory(directory: Path) -> ModelError:
    """The error for a ``--model`` directory that does not exist: every layout it may be."""
    return ModelError(
        f"Model directory {directory} does not exist. --model takes a directory in one of "
        "these layouts: torch/funasr's (config.yaml, model.pt, its sentencepiece tokenizer "
        "and am.mvn, as ModelScope's iic/SenseVoiceSmall), FunASR's ONNX export (model.onnx "
        "or model_quant.onnx, am.mvn, tokens.json or a *.bpe.model), or sherpa-onnx's "
        "(model.int8.onnx or model.onnx and tokens.txt); or a hub id (iic/SenseVoiceSmall, "
        "csukuangfj/sherpa-onnx-sense-voice-zh-en-ja-ko-yue-2024-07-17), or random:tiny / "
        "random:small for a test model."
    )


def model_files(directory: Path) -> ModelFiles:
    """The files funasr will read from ``directory``; ModelError naming any missing one."""
    if not directory.is_dir():
        raise missing_directory(directory)
    metas: dict[str, Any] = {}
    meta_file = directory / "configuration.json"
    if meta_file.exists():
        try:
            metas = json.loads(meta_file.read_text(encoding="utf-8")).get("file_path_metas", {})
        except (OSError, ValueError) as error:
            raise ModelError(
                f"{meta_file} is not valid JSON ({error}); restore it from the original "
                "download or delete it to use config.yaml, model.pt, bpe.model and am.mvn."
            ) from error
    tokenizer_name = (metas.get("tokenizer_conf") or {}).get("bpemodel") or "bpe.model"
    expected = {
        "config": metas.get("config") or "config.yaml",
        "checkpoint": metas.get("init_param") or "model.pt",
        "tokenizer": tokenizer_name,
        "cmvn": (metas.get("frontend_conf") or {}).get("cmvn_file") or "am.mvn",
    }
    if not metas and not (directory / "bpe.model").exists():
        del expected["tokenizer"]  # layout B without bpe.model: config.yaml names it
    missing = [name for name in expected.values() if not (directory / name).is_file()]
    if missing:
        raise ModelError(
            f"Model directory {directory} is missing {', '.join(missing)}. A SenseVoiceSmall "
            "directory holds config.yaml, model.pt, its sentencepiece tokenizer and am.mvn; "
            "download it again (or rebuild it with streamer build-model) and retry."
        )
    tokenizer = expected.get("tokenizer")
    return ModelFiles(
        directory=directory,
        config=directory / expected["config"],
        checkpoint=directory / expected["checkpoint"],
        tokenizer=directory / tokenizer if tokenizer else None,
        cmvn=directory / expected["cmvn"],
    )


def check_vocabulary(files: ModelFiles) -> None:
    """ModelError when the tokenizer and the checkpoint's CTC head disagree in size.

    funasr would skip loading the mismatched head and decode garbage without a warning.
    """
    if files.tokenizer is None:
        return
    import sentencepiece as spm
    import torch

    try:
        pieces = spm.SentencePieceProcessor(model_file=str(files.tokenizer)).get_piece_size()
    except (OSError, RuntimeError) as error:
        raise ModelError(
            f"Tokenizer {files.tokenizer} cannot be read ({error}); download the model again."
        ) from error
    try:
        state = torch.load(files.checkpoint, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:
        try:  # files saved in the legacy (non-zip) format cannot be memory-mapped
            state = torch.load(files.checkpoint, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ModelError(
                f"{files.checkpoint} cannot be read ({error}); it is damaged or not a torch "
                "checkpoint. Download the model again."
            ) from error
    head = _find_tensor(state, _CTC_HEAD_KEY)
    if head is None:
        logger.debug("no %s in %s; vocabulary not checked", _CTC_HEAD_KEY, files.checkpoint)
        return
    outputs = int(head.shape[0])
    if outputs != pieces:
        raise ModelError(
            f"Model {files.directory} is inconsistent: its tokenizer {files.tokenizer.name} has "
            f"{pieces} pieces but {files.checkpoint.name}'s CTC head has {outputs} outputs. "
            "funasr would silently skip loading that head and decode garbage. Use the "
            "tokenizer that was shipped with these weights."
        )


def _find_tensor(state: Any, key: str) -> Any:
    for wrapper in ("state_dict", "model_state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict):
        return None
    return state.get(key, state.get("module." + key))


def hub_cache_dir(model: str, hub: str) -> Path | None:
    """The locally cached snapshot of hub id ``model``, found without network access."""
    try:
        if hub == "ms":
            from modelscope.hub.snapshot_download import snapshot_download

            path = snapshot_download(model, local_files_only=True)
        else:
            from huggingface_hub import snapshot_download as hf_snapshot_download

            path = hf_snapshot_download(_HF_ALIASES.get(model, model), local_files_only=True)
    except Exception as error:  # each hub library has its own "not cached" errors
        logger.debug("%s is not in the %s cache: %s", model, hub, error)
        return None
    return Path(path) if path and Path(path).is_dir() else None


def _hub_host(hub: str) -> str:
    if hub == "ms":
        domain = os.environ.get("MODELSCOPE_DOMAIN", "www.modelscope.cn")
        return urlparse(domain if "//" in domain else f"//{domain}").hostname or domain
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    return urlparse(endpoint).hostname or "huggingface.co"


def require_hub(model: str, hub: str) -> None:
    """ModelError within a few seconds when the hub cannot be reached."""
    host = _hub_host(hub)
    problem = _probe(host, 443, HUB_PROBE_TIMEOUT_S)
    if problem is None:
        return
    hub_name = "ModelScope" if hub == "ms" else "Hugging Face"
    other = "--hub hf" if hub == "ms" else "--hub ms"
    raise ModelError(
        f"Cannot load model {model!r}: it is not in the local {hub_name} cache and {host} "
        f"cannot be reached ({problem}). Run once with network access so it is downloaded "
        "and cached, or download the model directory elsewhere, copy it here and pass its "
        f"path as the model; {other} tries the other hub, and random:tiny needs no download."
    )


def _probe(host: str, port: int, timeout_s: float) -> str | None:
    """None if a TCP connection to host:port opens within ``timeout_s``, else why not."""
    outcome: list[str | None] = []

    def connect() -> None:
        try:  # name resolution has no timeout of its own, hence the thread
            with socket.create_connection((host, port), timeout=timeout_s):
                outcome.append(None)
        except OSError as error:
            outcome.append(f"{type(error).__name__}: {error}")

    thread = threading.Thread(target=connect, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s + 0.5)
    if not outcome:
        return f"no answer within {timeout_s:.1f} s"
    return outcome[0]


HASH_CHUNK_BYTES = 1 << 20  # read this much at a time when hashing a model file


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file's bytes."""
    return file_digest(hashlib.sha256(), path)


def file_digest(digest: hashlib._Hash, path: Path) -> str:
    """``digest`` (fed whatever goes before) updated with a file's bytes, read in
    :data:`HASH_CHUNK_BYTES` pieces, as hex."""
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def build_directory(
    target: Path, marker: str, build: Callable[[Path], object], *, prefix: str = ".building-"
) -> Path:
    """``target``, made by ``build(directory)`` in a temporary sibling and then renamed
    into place at once, so that no reader (another process, a build interrupted) sees it
    half written. Where another process finished the same directory first (its file
    ``marker`` is there), theirs is kept."""
    target.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        build(building)
        building.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            building.rename(target)
        except OSError:
            if not (target / marker).is_file():
                raise
            # another process finished the same directory first; keep theirs
    finally:
        if building.exists():
            shutil.rmtree(building, ignore_errors=True)
    return target
