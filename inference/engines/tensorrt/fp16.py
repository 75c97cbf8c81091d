"""The strongly typed FP16 ONNX TensorRT 11.x builds from (module doc of
:mod:`inference.engines.tensorrt.build`): FP16 weights and matmuls, normalization, softmax
and reductions in FP32, FP32 inputs and outputs; and the INT8 (Q/DQ) check."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from inference.engines.tensorrt.spec import ENGINE_FORMAT, BuildError

FP32_OPS = frozenset({"LayerNormalization", "Softmax", "ReduceSum", "ReduceMean", "ReduceL2",
                      "Pow", "Sqrt", "ReduceSumSquare"})
"""ONNX ops kept in FP32 in the FP16 model: normalization, softmax and reductions,
whose FP16 sums overflow or lose precision (TensorRT developer guide, "Strongly
Typed Networks"; ModelOpt AutoCast keeps the same ops in high precision)."""

_FOLLOW_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Clip", "Max", "Min", "Where", "Reshape",
                         "Transpose", "Unsqueeze", "Squeeze", "Expand", "Concat", "Slice",
                         "Identity", "Flatten", "Neg", "Abs"})
"""Cheap elementwise and layout ops: they stay in FP32 when every non-constant float
input is already FP32 (e.g. the pooling tail after the last LayerNorm)."""

_TYPE_AGNOSTIC = frozenset({"Shape", "Size"})
"""Ops whose float inputs are never cast (they read only the shape)."""

_FP16_MAX = 65504.0
"""Largest finite float16 (IEEE 754 binary16)."""


def to_strongly_typed_fp16(model: Any, fp32_ops: frozenset[str] = FP32_OPS) -> Any:
    """A strongly typed mixed-precision copy of an FP32 ONNX model.

    Rules (what ModelOpt AutoCast does for TensorRT 11, written out for this
    model family so no extra package is needed):

    - every node runs in FP16, except ops in ``fp32_ops`` (LayerNormalization,
      Softmax, reductions) and cheap elementwise/layout ops whose non-constant
      float inputs are all FP32 already (the mean-pooling tail);
    - "constant-like" float tensors (initializers, ``Constant`` /
      ``ConstantOfShape`` outputs, int->float ``Cast`` outputs such as the
      attention mask, and elementwise ops over only those) stay FP32 and are
      converted where an FP16 node reads them;
    - FP32 -> FP16 conversions saturate: ``Clip(-65504, 65504)`` then ``Cast``,
      so the additive mask's ``finfo(float32).min`` becomes -65504, not -inf;
      FP16 initializers are clipped the same way;
    - graph inputs and outputs keep their types (``pooled`` stays float32).

    Args:
        model: ``onnx.ModelProto`` in FP32 (opset >= 13), no control-flow subgraphs.
        fp32_ops: ONNX op types kept in FP32.

    Returns:
        A new ``onnx.ModelProto`` that passes ``onnx.checker.check_model(full_check=True)``.

    Raises:
        BuildError: the graph has subgraphs (If/Loop/Scan).
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16
    model = onnx.shape_inference.infer_shapes(model)
    g = model.graph
    types: dict[str, int] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    inits = {t.name: t for t in g.initializer}
    for t in g.initializer:
        types[t.name] = t.data_type
    for node in g.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise BuildError(f"node {node.name or node.op_type} has a subgraph; FP16 conversion supports flat graphs only")
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    types[node.output[0]] = a.t.data_type

    prec: dict[str, str] = {}  # float tensor -> "fp32" | "fp16" | "const" (fp32, convertible)
    for vi in g.input:
        prec[vi.name] = "fp32"
    for name in inits:
        prec[name] = "const"

    def is_float(name: str) -> bool:
        return bool(name) and types.get(name) == FLOAT

    new_nodes: list[Any] = []
    new_inits: list[Any] = []
    cast_cache: dict[tuple[str, str], str] = {}
    clip_lo = "__fp16_clip_lo"
    clip_hi = "__fp16_clip_hi"
    new_inits += [numpy_helper.from_array(np.array(-_FP16_MAX, dtype=np.float32), clip_lo),
                  numpy_helper.from_array(np.array(_FP16_MAX, dtype=np.float32), clip_hi)]

    def as_fp16(name: str) -> str:
        key = (name, "fp16")
        if key in cast_cache:
            return cast_cache[key]
        if name in inits:
            arr = numpy_helper.to_array(inits[name]).astype(np.float32)
            out = name + "__fp16"
            new_inits.append(numpy_helper.from_array(np.clip(arr, -_FP16_MAX, _FP16_MAX).astype(np.float16), out))
        else:
            clipped, out = name + "__sat", name + "__fp16"
            new_nodes.append(helper.make_node("Clip", [name, clip_lo, clip_hi], [clipped], name=clipped))
            new_nodes.append(helper.make_node("Cast", [clipped], [out], to=HALF, name=out))
        cast_cache[key] = out
        return out

    def as_fp32(name: str) -> str:
        key = (name, "fp32")
        if key not in cast_cache:
            out = name + "__fp32"
            new_nodes.append(helper.make_node("Cast", [name], [out], to=FLOAT, name=out))
            cast_cache[key] = out
        return cast_cache[key]

    for node in g.node:
        op = node.op_type
        float_in = [n for n in node.input if is_float(n)]
        float_out = [n for n in node.output if is_float(n)]
        if op in ("Constant", "ConstantOfShape") or (op == "Cast" and not float_in):
            for o in float_out:
                prec[o] = "const"
            new_nodes.append(node)
            continue
        live = [prec.get(n, "fp32") for n in float_in if prec.get(n) != "const"]
        if op in fp32_ops:
            p = "fp32"
        elif op in _FOLLOW_OPS and not live and float_in:
            p = "const"  # e.g. (1 - mask) * min: stays FP32, converted at use
        elif op in _FOLLOW_OPS and live and all(x == "fp32" for x in live):
            p = "fp32"
        else:
            p = "fp16"
        node_copy = onnx.NodeProto()
        node_copy.CopyFrom(node)
        if op not in _TYPE_AGNOSTIC:
            for i, name in enumerate(node_copy.input):
                if not is_float(name):
                    continue
                src = prec.get(name, "fp32")
                if p == "fp16" and src != "fp16":
                    node_copy.input[i] = as_fp16(name)
                elif p in ("fp32", "const") and src == "fp16":
                    node_copy.input[i] = as_fp32(name)
        if op == "Cast" and p == "fp16":
            for a in node_copy.attribute:
                if a.name == "to" and a.i == FLOAT:
                    a.i = HALF
        for o in float_out:
            prec[o] = p
        new_nodes.append(node_copy)

    # Graph outputs keep FP32: re-route an FP16 producer through a Cast.
    for out in g.output:
        if prec.get(out.name) != "fp16":
            continue
        inner = out.name + "__fp16out"
        for n in new_nodes:
            for i, name in enumerate(n.output):
                if name == out.name:
                    n.output[i] = inner
            for i, name in enumerate(n.input):
                if name == out.name:
                    n.input[i] = inner
        new_nodes.append(helper.make_node("Cast", [inner], [out.name], to=FLOAT, name=out.name + "__cast"))

    # Drop FP32 initializers nobody reads any more.
    used = {n for node in new_nodes for n in node.input}
    kept = [t for t in g.initializer if t.name in used]
    extra = [t for t in new_inits if t.name in used]

    graph = helper.make_graph(new_nodes, g.name, list(g.input), list(g.output), kept + extra)
    out_model = helper.make_model(graph, opset_imports=list(model.opset_import),
                                  producer_name="healthbot.build_engine", producer_version=str(ENGINE_FORMAT))
    out_model.ir_version = model.ir_version
    out_model = onnx.shape_inference.infer_shapes(out_model)
    return out_model


def fp16_onnx_for(onnx_path: Path, onnx_sha256: str) -> Path:
    """Write (once) and return the strongly typed FP16 ONNX next to ``onnx_path``.

    Named ``<stem>.fp16-st.onnx``; a ``.sha256`` file records the source sha so a
    re-prepared model is converted again. Checked with ``onnx.checker`` (full).
    """
    import onnx

    out = onnx_path.with_name(onnx_path.stem + ".fp16-st.onnx")
    stamp = out.with_name(out.name + ".sha256")
    if out.is_file() and stamp.is_file() and stamp.read_text().strip() == onnx_sha256:
        return out
    converted = to_strongly_typed_fp16(onnx.load(str(onnx_path)))
    onnx.checker.check_model(converted, full_check=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    onnx.save(converted, str(tmp))
    os.replace(tmp, out)
    stamp.write_text(onnx_sha256 + "\n")
    return out


def has_explicit_quantization(onnx_path: Path) -> bool:
    """True when the ONNX holds QuantizeLinear/DequantizeLinear nodes (explicit INT8)."""
    import onnx

    m = onnx.load(str(onnx_path), load_external_data=False)
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in m.graph.node)
