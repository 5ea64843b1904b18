"""Dynamic int8 quantization of a graph's MatMul weights, one weight in memory at a time.

onnxruntime's ``quantize_dynamic`` holds three copies of every weight at once (the
graph it loaded, a deep copy, the copy it reloads after shape inference: a 2.8 GiB peak
for SenseVoiceSmall's 936 MB, bench/RESULTS.md). :func:`quantize_matmuls` writes the
graph ``quantize_dynamic(op_types_to_quantize=["MatMul"], per_channel=False)`` writes,
node for node and name for name, with the weights' numbers computed by onnxruntime's
own ``quantize_data``, while holding only the graph's structure, the int8 weights made
so far and one float weight (read from the graph's external data file): for each
``MatMul`` whose second input is a float initializer,

    DynamicQuantizeLinear(A) -> A_quantized, A_scale, A_zero_point   (once per A)
    MatMulInteger(A_quantized, W_quantized, A_zero_point, W_zero_point) -> int32
    Cast(float) * (A_scale * W_scale) -> the MatMul's output

QInt8 weights are symmetric, QUInt8 asymmetric, as onnxruntime's defaults;
``reduce_range`` is onnxruntime's. tests/test_onnx_backend.py holds it to
``quantize_dynamic``'s output. onnx and onnxruntime are imported inside functions only.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PRODUCER = "onnx.quantize"  # what onnxruntime's quantizer writes as producer_name


def quantize_matmuls(
    source: Path, target: Path, weight_type: str, *, reduce_range: bool = False
) -> None:
    """Write ``target``: graph ``source`` with its MatMul weights quantized to
    ``weight_type`` ("QInt8" or "QUInt8"); activations are quantized at run time."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.quant_utils import quantize_data

    qtype = getattr(QuantType, weight_type).tensor_type
    symmetric = qtype == TensorProto.INT8
    model = onnx.load(str(source), load_external_data=False)
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    weights: dict[str, tuple[str, str, str]] = {}  # float weight -> _quantized_names
    activations: dict[str, tuple[str, str, str]] = {}  # activation -> _quantized_names
    new_initializers: list[Any] = []
    nodes: list[Any] = []
    scale_muls: set[str] = set()
    for node in graph.node:
        weight = initializers.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight is None or weight.data_type != TensorProto.FLOAT:
            nodes.append(node)
            continue
        activation = node.input[0]
        if activation not in activations:
            names = (f"{activation}_quantized", f"{activation}_scale", f"{activation}_zero_point")
            nodes.append(
                helper.make_node(
                    "DynamicQuantizeLinear",
                    [activation],
                    list(names),
                    f"{activation}_QuantizeLinear",
                )
            )
            activations[activation] = names
        if weight.name not in weights:
            data = _read_array(weight, source.parent)
            zero_point, scale, quantized = quantize_data(
                data.reshape(-1), qtype, symmetric, reduce_range=reduce_range
            )
            names = (
                f"{weight.name}_quantized",
                f"{weight.name}_scale",
                f"{weight.name}_zero_point",
            )
            new_initializers += [
                helper.make_tensor(names[1], weight.data_type, [], scale.reshape(-1).tolist()),
                helper.make_tensor(names[2], qtype, [], zero_point.reshape(-1).tolist()),
                numpy_helper.from_array(
                    quantized.astype(helper.tensor_dtype_to_np_dtype(qtype)).reshape(data.shape),
                    names[0],
                ),
            ]
            weights[weight.name] = names
            del data, quantized
        a_q, a_scale, a_zero = activations[activation]
        w_q, w_scale, w_zero = weights[weight.name]
        integer_name = f"{node.name}_quant" if node.name else ""
        integer_out = f"{node.output[0]}_output_quantized"
        nodes.append(
            helper.make_node(
                "MatMulInteger", [a_q, w_q, a_zero, w_zero], [integer_out], integer_name
            )
        )
        cast_out = f"{integer_out}_cast_output"
        nodes.append(
            helper.make_node(
                "Cast", [integer_out], [cast_out], f"{integer_out}_cast", to=TensorProto.FLOAT
            )
        )
        scales_mul = f"{integer_name}_scales_mul" if integer_name else f"{a_scale}_{w_scale}_mul"
        if scales_mul not in scale_muls:
            nodes.append(
                helper.make_node("Mul", [a_scale, w_scale], [f"{scales_mul}:0"], scales_mul)
            )
            scale_muls.add(scales_mul)
        nodes.append(
            helper.make_node(
                "Mul",
                [cast_out, f"{scales_mul}:0"],
                [node.output[0]],
                f"{integer_name}_output_scale_mul" if integer_name else "",
            )
        )
    used = {name for node in nodes for name in node.input}
    kept = []
    for initializer in graph.initializer:
        if initializer.name in used:  # the float weights of quantized MatMuls go
            if initializer.data_location == TensorProto.EXTERNAL:
                array = _read_array(initializer, source.parent)
                initializer = numpy_helper.from_array(array, initializer.name)
            kept.append(initializer)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + new_initializers)
    model.producer_name = PRODUCER
    onnx.save(model, str(target))
    logger.debug("quantized %d MatMul weights to %s", len(weights), weight_type)


def _quantized_names(name: str) -> tuple[str, str, str]:
    """onnxruntime's names for the quantized tensor, its scale and its zero point."""
    return f"{name}_quantized", f"{name}_scale", f"{name}_zero_point"


def _read_array(tensor: Any, directory: Path) -> Any:
    """The values of initializer ``tensor``: inline, or read from its external data file
    (only its own bytes, not loaded into the graph)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    if tensor.data_location != TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    info = {entry.key: entry.value for entry in tensor.external_data}
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    count = int(np.prod(tensor.dims, dtype=np.int64))
    location = directory / info["location"]
    if location.resolve().parent != directory.resolve():
        raise ValueError(f"{tensor.name}: external data outside {directory}")
    array = np.fromfile(location, dtype=dtype, count=count, offset=int(info.get("offset", 0)))
    if array.size != count:
        raise ValueError(f"{tensor.name}: {location} is shorter than the tensor")
    return array.reshape(tuple(tensor.dims))
