"""The torch side of the ONNX export, holding the weights once.

SenseVoiceSmall's weights are 936 MB at the real size. Loading them through funasr's
``AutoModel`` holds three copies at once (the randomly initialised model, the loaded
checkpoint and funasr's deep copy of it: a 3.2 GiB peak), and ``torch.onnx.export``
with the weights inside the graph holds two or three more (the constant-folded
transposes, the protobuf, its serialised bytes: 4.3 GiB, bench/RESULTS.md). Here:

- :func:`read_torch_model` builds funasr's model class on the ``meta`` device (no memory)
  and takes the checkpoint's tensors as its parameters (``torch.load(mmap=True)``,
  ``load_state_dict(assign=True)``): one copy, mapped from the file;
- :func:`trace_to_onnx` traces the graph without its weights (``export_params=False``:
  every weight is a graph input), then writes each weight once into ``model.onnx.data``
  (ONNX external data, which ONNX Runtime reads next to the graph) and makes it an
  initializer. A weight the graph only transposes (a ``Linear``'s, for ``MatMul``) is
  written transposed in place of the ``Transpose`` node, which is what constant folding
  did; the other constant subgraphs are left to ONNX Runtime, which folds them when it
  loads the graph (``ORT_ENABLE_ALL``).

torch, funasr and onnx are imported inside functions only.
"""

from __future__ import annotations

import io
import logging
import warnings
from pathlib import Path
from typing import Any

from streamer.errors import ModelError
from streamer.model.artifacts.files import ModelFiles
from streamer.model.sensevoice import (
    EVENT_EMO_ROWS,
    FEATURE_DIM,
    LID_ROWS,
    QUERY_FRAMES,
    TEXTNORM_ROWS,
)

logger = logging.getLogger(__name__)

ONNX_OPSET = 13
INPUT_NAMES = ("x", "x_length", "language", "text_norm")
OUTPUT_NAME = "logits"
DATA_SUFFIX = ".data"  # model.onnx -> model.onnx.data
_ALIGN_BYTES = 4096  # each weight starts on a page, so ONNX Runtime can map it


def read_torch_model(files: ModelFiles, vocab_size: int) -> Any:
    """funasr's SenseVoiceSmall from ``files`` on the CPU, its weights mapped from the
    checkpoint (see the module doc). ModelError when the checkpoint does not fit."""
    import torch
    import yaml

    from streamer.model.backends.funasr_quiet import import_funasr, quiet_funasr

    import_funasr()
    from funasr.register import tables

    try:
        conf = yaml.safe_load(files.config.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ModelError(f"{files.config} cannot be read as YAML ({error})") from error
    model_class = tables.model_classes.get(conf.get("model"))
    if model_class is None:
        raise ModelError(f"{files.config} names model {conf.get('model')!r}, which funasr lacks")
    # as funasr's AutoModel.build_model: model_conf, then every top-level key over it
    kwargs = {**(conf.get("model_conf") or {}), **conf}
    kwargs.update(vocab_size=vocab_size, input_size=FEATURE_DIM)
    with quiet_funasr(), torch.device("meta"):
        model = model_class(**kwargs)
    try:
        state = torch.load(files.checkpoint, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:  # a checkpoint in torch's legacy format cannot be mapped
        state = torch.load(files.checkpoint, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model_state_dict", "model"):  # funasr's wrappers
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    state = {name.removeprefix("module."): tensor for name, tensor in state.items()}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as error:
        raise ModelError(
            f"{files.checkpoint} does not fit {files.config} with a {vocab_size}-piece "
            f"tokenizer: {error}"
        ) from error
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ModelError(f"{files.checkpoint} has no values for {', '.join(left[:5])}")
    return model.eval()


def trace_to_onnx(model: Any, path: Path) -> tuple[Any, int]:
    """Trace embedding + encoder + CTC head; returns the ONNX ModelProto (its weights
    already written to ``path`` + ``.data``; the caller adds metadata and saves it to
    ``path``) and the vocabulary size."""
    import onnx
    import torch

    graph = _graph_module(model)
    frames = 20
    example = (
        torch.zeros(2, frames, FEATURE_DIM),
        torch.tensor([frames - 5, frames], dtype=torch.int32),
        torch.tensor([LID_ROWS["auto"], LID_ROWS["en"]], dtype=torch.int32),
        torch.tensor([TEXTNORM_ROWS["withitn"], TEXTNORM_ROWS["woitn"]], dtype=torch.int32),
    )
    with torch.inference_mode():
        vocab_size = int(graph(*[t.clone() for t in example]).shape[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about Python control flow
        torch.onnx.export(
            graph,
            example,
            str(path),  # the structure alone, read back below
            opset_version=ONNX_OPSET,
            dynamo=False,
            export_params=False,  # weights become inputs: see _attach_weights
            do_constant_folding=False,  # it needs the weights inside the graph
            input_names=list(INPUT_NAMES),
            output_names=[OUTPUT_NAME],
            dynamic_axes={
                "x": {0: "N", 1: "T"},
                "x_length": {0: "N"},
                "language": {0: "N"},
                "text_norm": {0: "N"},
                OUTPUT_NAME: {0: "N", 1: "frames"},
            },
        )
    proto = onnx.load(str(path))
    weights = {**dict(graph.named_parameters()), **dict(graph.named_buffers())}
    _attach_weights(proto, weights, path)
    return proto, vocab_size


def _graph_module(model: Any) -> Any:
    import torch

    class _Graph(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(
            self,
            x: torch.Tensor,
            x_length: torch.Tensor,
            language: torch.Tensor,
            text_norm: torch.Tensor,
        ) -> torch.Tensor:
            # As SenseVoiceSmall.inference(): [language, event/emotion rows, textnorm] + x
            language_query = self.model.embed(language).unsqueeze(1)
            textnorm_query = self.model.embed(text_norm).unsqueeze(1)
            rows = torch.tensor([list(EVENT_EMO_ROWS)], dtype=torch.int64)
            event_emo_query = self.model.embed(rows).repeat(x.size(0), 1, 1)
            speech = torch.cat((language_query, event_emo_query, textnorm_query, x), dim=1)
            encoded, _ = self.model.encoder(speech, x_length + QUERY_FRAMES)
            if isinstance(encoded, tuple):
                encoded = encoded[0]
            return self.model.ctc.ctc_lo(encoded)

    return _Graph().eval()


def _attach_weights(proto: Any, weights: dict[str, Any], path: Path) -> None:
    """Turn the weight inputs of ``proto`` into initializers stored in ``path.data``."""
    import onnx

    graph = proto.graph
    names = [i.name for i in graph.input if i.name not in INPUT_NAMES]
    unknown = [name for name in names if name not in weights]
    if unknown:
        raise ModelError(f"the traced graph has inputs that are no weight: {unknown[:5]}")
    consumers: dict[str, list[Any]] = {name: [] for name in names}
    for node in graph.node:
        for name in node.input:
            if name in consumers:
                consumers[name].append(node)
    folded: set[int] = set()
    data_file = path.name + DATA_SUFFIX
    initializers = []
    with (path.parent / data_file).open("wb") as stream:

        def write(name: str, tensor: Any) -> None:
            array = tensor.detach().contiguous().numpy()
            stream.seek(-stream.tell() % _ALIGN_BYTES, io.SEEK_CUR)
            offset = stream.tell()
            stream.write(memoryview(array.reshape(-1)))
            initializer = onnx.TensorProto(
                name=name,
                dims=list(array.shape),
                data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype),
                data_location=onnx.TensorProto.EXTERNAL,
            )
            for key, value in (("location", data_file), ("offset", offset)):
                entry = initializer.external_data.add()
                entry.key, entry.value = key, str(value)
            entry = initializer.external_data.add()
            entry.key, entry.value = "length", str(array.nbytes)
            initializers.append(initializer)

        for name in names:
            tensor = weights[name]
            kept = False
            for node in consumers[name]:
                if _plain_transpose(node, tensor):
                    write(node.output[0], tensor.t())
                    folded.add(id(node))
                else:
                    kept = True
            if kept:
                write(name, tensor)
    nodes = [node for node in graph.node if id(node) not in folded]
    del graph.node[:]
    graph.node.extend(nodes)
    inputs = [i for i in graph.input if i.name in INPUT_NAMES]
    del graph.input[:]
    graph.input.extend(inputs)
    graph.initializer.extend(initializers)
    logger.debug(
        "wrote %d weights (%d transposed) to %s", len(initializers), len(folded), data_file
    )


def _plain_transpose(node: Any, tensor: Any) -> bool:
    """A Transpose that swaps the two axes of a 2-D weight (a Linear's, before MatMul)."""
    if node.op_type != "Transpose" or tensor.dim() != 2:
        return False
    perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
    return not perm or perm[0] == [1, 0]
