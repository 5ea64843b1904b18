"""Directories in the shapes of published SenseVoiceSmall ONNX exports, made from ours.

The published exports cannot be downloaded where the project is built, so the loader is
tested on directories laid out as they are, built from an export of a random model:

- FunASR (``AutoModel.export(type="onnx")``, funasr's ``export_meta.py``): ``model.onnx``
  and ``model_quant.onnx`` with inputs ``speech``, ``speech_lengths``, ``language``,
  ``textnorm`` and outputs ``ctc_logits``, ``encoder_out_lens``; ``am.mvn``,
  ``config.yaml``, and the sentencepiece model ``chn_jpn_yue_eng_ko_spectok.bpe.model``
  or a ``tokens.json`` list;
- sherpa-onnx (``scripts/sense-voice/export-onnx.py``): ``model.onnx`` /
  ``model.int8.onnx`` with inputs ``x``, ``x_length``, ``language``, ``text_norm``,
  output ``logits``, CMVN and LFR in the metadata, and ``tokens.txt``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FUNASR_TOKENIZER = "chn_jpn_yue_eng_ko_spectok.bpe.model"
FUNASR_NAMES = {
    "x": "speech",
    "x_length": "speech_lengths",
    "text_norm": "textnorm",
    "logits": "ctc_logits",
}


def funasr_layout(export_dir: Path, out_dir: Path, *, tokenizer: str = "bpe") -> Path:
    """A FunASR-shaped directory; ``tokenizer`` is "bpe" (sentencepiece) or "json"."""
    import yaml

    from streamer.model.decode.tokenizer import SentencePieceTokenizer
    from streamer.model.sensevoice import FRONTEND_CONF

    out_dir.mkdir(parents=True, exist_ok=True)
    for source, target in (("model.onnx", "model.onnx"), ("model.int8.onnx", "model_quant.onnx")):
        rewrite_graph(export_dir / source, out_dir / target, FUNASR_NAMES, lengths_output=True)
    shutil.copyfile(export_dir / "am.mvn", out_dir / "am.mvn")
    config: dict[str, Any] = {
        "model": "SenseVoiceSmall",
        "frontend": "WavFrontend",
        "frontend_conf": {**FRONTEND_CONF, "cmvn_file": "am.mvn"},
        "tokenizer": "SentencepiecesTokenizer",
        "tokenizer_conf": {"bpemodel": FUNASR_TOKENIZER, "unk_symbol": "<unk>"},
    }
    if tokenizer == "bpe":
        shutil.copyfile(export_dir / "bpe.model", out_dir / FUNASR_TOKENIZER)
    elif tokenizer == "json":
        del config["tokenizer_conf"]["bpemodel"]
        pieces = SentencePieceTokenizer(export_dir / "bpe.model").pieces()
        (out_dir / "tokens.json").write_text(json.dumps(pieces, ensure_ascii=False))
    else:
        raise ValueError(f"tokenizer must be bpe or json, not {tokenizer!r}")
    (out_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return out_dir


def sherpa_layout(
    export_dir: Path, out_dir: Path, *, graphs: tuple[str, ...] = ("model.onnx", "model.int8.onnx")
) -> Path:
    """A sherpa-onnx-shaped directory: the graphs (metadata kept, and the external
    weights of one that has them) and tokens.txt only."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in graphs:
        shutil.copyfile(export_dir / name, out_dir / name)
        if (export_dir / f"{name}.data").is_file():
            shutil.copyfile(export_dir / f"{name}.data", out_dir / f"{name}.data")
    shutil.copyfile(export_dir / "tokens.txt", out_dir / "tokens.txt")
    return out_dir


def rewrite_graph(
    source: Path,
    target: Path,
    renames: Mapping[str, str],
    *,
    lengths_output: bool = False,
    drop_metadata: bool = True,
) -> None:
    """Copy an ONNX graph renaming its inputs and outputs (``renames``: old -> new).

    ``lengths_output`` adds FunASR's second output, ``encoder_out_lens`` (lengths + 4).
    """
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(source))
    graph = model.graph
    for value in [*graph.input, *graph.output]:
        value.name = renames.get(value.name, value.name)
    for node in graph.node:
        node.input[:] = [renames.get(name, name) for name in node.input]
        node.output[:] = [renames.get(name, name) for name in node.output]
    if lengths_output:
        lengths = renames.get("x_length", "x_length")
        four = helper.make_tensor("query_frames", TensorProto.INT32, [], [4])
        graph.initializer.append(four)
        graph.node.append(helper.make_node("Add", [lengths, "query_frames"], ["encoder_out_lens"]))
        graph.output.append(
            helper.make_tensor_value_info("encoder_out_lens", TensorProto.INT32, ["N"])
        )
    if drop_metadata:
        del model.metadata_props[:]
    onnx.save(model, str(target))
