"""Reduced-precision ONNX variants for the ``onnxruntime`` engine: fused FP32 → per-channel INT8.

``build_int8(engines_dir)`` (``healthbot build-engine --engine onnxruntime
--precision int8``) turns the prepared ``engines/model.onnx`` into
``engines/model.int8.onnx`` in two steps, then runs the accuracy check
(:mod:`inference.model.accuracy`) and records the result in a sidecar
``engines/model.int8.onnx.json``:

1. **BERT fusion** with ONNX Runtime's transformer optimizer
   (``onnxruntime.transformers.optimizer.optimize_model``, ``model_type="bert"``,
   12 heads, hidden 384): the embedding sum + LayerNorm becomes one
   ``EmbedLayerNormalization``, each self-attention one ``Attention`` node, the
   residual adds + LayerNorms ``SkipLayerNormalization`` and the FFN's bias +
   GELU ``BiasGelu`` (measured on the prepared model: 1, 12, 24 and 12 nodes).
   It needs the export with eager attention (inference/model/prepare.py does that).
2. **Dynamic INT8 quantization** (``onnxruntime.quantization.quantize_dynamic``)
   with ``per_channel=True``, ``reduce_range=True`` (7-bit weights: ONNX Runtime's
   advice for CPUs without VNNI, whose u8s8 kernels can saturate; on an AVX2-only
   machine, 2026-12-01, without it min cosine 0.9960 and dev topic accuracy −1.1
   points, so the check failed; with it 0.9984 and equal) and signed INT8 weights: MatMul weights become
   ``MatMulInteger``, attention ``QAttention`` and the embedding tables
   ``QEmbedLayerNormalization`` (the file shrinks from 449 to ~130 MiB);
   activations are quantized per batch at run time. The FFN output projections
   stay FP32 (:func:`quantize_int8` says why). Per-tensor weights drift with the
   batch contents (ARCHITECTURE.md, "Facts measured"): not offered.

Measured on this project's 2-core development machine (2026-11-29, noisy shared
cores; docs/benchmarks.md): cosine to the FP32 model on the parity windows min
0.9984, mean 0.9992; ``healthbot eval`` equal to FP32; a [16, 16] batch
~1.4-1.6x faster than FP32 and a single query ~2x.

Whether the engine may use the file: :func:`inference.onnx_variants.int8_status`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from inference.onnx_variants import (FP32_FILE, INT8_FILE, VARIANT_FORMAT, read_sidecar, sidecar_path, source_sha,
                                     variant_path)

NUM_HEADS = 12
HIDDEN_SIZE = 384
"""multilingual-e5-small's attention heads and hidden size (manifest ``heads``/``dim``);
the fusion needs them given (it cannot always infer them from reshapes)."""


class VariantError(RuntimeError):
    """A variant could not be built; the message says what to do."""


def fuse_bert(src: Path, dst: Path, num_heads: int = NUM_HEADS, hidden_size: int = HIDDEN_SIZE) -> dict[str, int]:
    """ONNX Runtime's BERT fusion of ``src`` written to ``dst`` (FP32).

    Returns:
        the fused operator counts (``{"Attention": 12, ...}``, zeros dropped).

    Raises:
        VariantError: the fusion found no ``Attention`` (an export with SDPA
            attention, or not a BERT).
    """
    from onnxruntime.transformers.optimizer import optimize_model

    model = optimize_model(str(src), model_type="bert", num_heads=num_heads, hidden_size=hidden_size,
                           opt_level=1, use_gpu=False)
    stats = {k: int(v) for k, v in model.get_fused_operator_statistics().items() if v}
    if not stats.get("Attention"):
        raise VariantError(f"ONNX Runtime's BERT fusion found no attention in {src.name} ({stats}): "
                           "re-run 'healthbot prepare-model --force' (the export must use eager attention)")
    model.save_model_to_file(str(dst))
    return stats


def ffn_output_matmuls(model: Any) -> list[str]:
    """Names of the FFN output projections (intermediate 1536 → hidden 384) of a fused
    BERT: the MatMul nodes that read a ``BiasGelu`` / ``Gelu`` / ``FastGelu`` output."""
    gelu_out = {o for n in model.graph.node if n.op_type in ("BiasGelu", "Gelu", "FastGelu") for o in n.output}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input and n.input[0] in gelu_out]


def quantize_int8(src: Path, dst: Path) -> dict[str, Any]:
    """Per-channel dynamic INT8 quantization of the fused ``src`` into ``dst``.

    Every MatMul, attention and the embeddings are INT8 except the 12 FFN output
    projections, which stay FP32: their input (after GELU) has outliers that a
    per-tensor activation scale quantizes coarsely. Measured on the parity set and
    ``healthbot eval`` (2026-11-29): with them INT8, min cosine 0.9953 but topic
    accuracy −2.2 points (2 of 93 answers); kept FP32, min cosine 0.9984, eval
    equal to FP32, at ~20 % more time per batch than all-INT8.

    Returns:
        the settings used (recorded in the sidecar).
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fused = onnx.load(str(src), load_external_data=False)
    keep_fp32 = ffn_output_matmuls(fused)
    del fused
    settings: dict[str, Any] = {"method": "quantize_dynamic", "per_channel": True, "weight_type": "QInt8",
                                "reduce_range": True, "fp32_nodes": len(keep_fp32), "fp32_kept": "FFN output projections"}
    quantize_dynamic(str(src), str(dst), per_channel=True, reduce_range=True, weight_type=QuantType.QInt8,
                     nodes_to_exclude=keep_fp32,
                     # The fused contrib ops have no ONNX shape inference: tell the quantizer
                     # that unknown tensors are float.
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    m = onnx.load(str(dst), load_external_data=False)
    counts: dict[str, int] = {}
    for n in m.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    settings["ops"] = {k: counts[k] for k in ("MatMulInteger", "QAttention", "QEmbedLayerNormalization",
                                              "MatMul", "DynamicQuantizeLinear") if k in counts}
    return settings


def build_int8(engines_dir: Path | str, *, force: bool = False, check: bool = True, eval_file: Path | None = None,
               log: Callable[..., None] | None = None) -> dict[str, Any]:
    """Build ``engines/model.int8.onnx`` (fusion + per-channel INT8) and check its accuracy.

    Blocking (tens of seconds on 2 cores, plus two ``healthbot eval`` runs of
    about a minute each when ``eval_file`` is given).

    Args:
        engines_dir: the prepared model folder (``model.onnx``, ``manifest.json``).
        force: rebuild even when a current file exists (the check still re-runs
            when it was not recorded).
        check: run the accuracy check (:func:`inference.model.accuracy.check_accuracy`)
            and record it; without it the variant is never picked by ``auto``.
        eval_file: labelled JSONL for the eval half of the check (default:
            :data:`inference.model.accuracy.DEFAULT_EVAL_FILE` when it exists; None
            when absent: the variant then does not count as passed).
        log: ``log(event, **fields)`` for progress.

    Returns:
        the sidecar dict (``accuracy.passed`` says whether ``auto`` will use it).

    Raises:
        VariantError: ``model.onnx`` missing, or the fusion failed.
    """
    from inference.model.accuracy import DEFAULT_EVAL_FILE, check_accuracy

    engines_dir = Path(engines_dir)
    emit = log or (lambda event, **kw: None)
    src = engines_dir / FP32_FILE
    if not src.is_file():
        raise VariantError(f"{src} missing: run 'healthbot prepare-model' first")
    dst = engines_dir / INT8_FILE
    sha = source_sha(engines_dir)
    meta = read_sidecar(dst)
    fresh = (not force and dst.is_file() and meta and meta.get("format") == VARIANT_FORMAT
             and meta.get("source_sha256") == sha and meta.get("bytes") == dst.stat().st_size)
    if not fresh:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="int8-", dir=engines_dir) as tmp:
            fused = Path(tmp) / "model.fused.onnx"
            emit("onnx_fusion_started", source=src.name)
            fused_ops = fuse_bert(src, fused)
            emit("onnx_quantization_started", fused_ops=fused_ops)
            out = Path(tmp) / INT8_FILE
            quant = quantize_int8(fused, out)
            os.replace(out, dst)
        meta = {"format": VARIANT_FORMAT, "precision": "int8", "source": FP32_FILE, "source_sha256": sha,
                "bytes": dst.stat().st_size, "fused_ops": fused_ops, "quantization": quant,
                "built": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "build_seconds": round(time.perf_counter() - t0, 1), "accuracy": None}
        _write_sidecar(dst, meta)
        emit("onnx_int8_built", file=dst.name, mib=round(meta["bytes"] / 2**20, 1), seconds=meta["build_seconds"])
    if check and (not fresh or not (meta.get("accuracy") or {}).get("passed")):
        if eval_file is None and DEFAULT_EVAL_FILE.is_file():
            eval_file = DEFAULT_EVAL_FILE
        report = check_accuracy(engines_dir, engine="onnxruntime", precision="int8", eval_file=eval_file, log=emit)
        meta["accuracy"] = report
        _write_sidecar(dst, meta)
    return meta


def _write_sidecar(model: Path, meta: dict[str, Any]) -> None:
    sc = sidecar_path(model)
    tmp = sc.with_name(sc.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(meta, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, sc)


def remove_variant(engines_dir: Path | str, precision: str) -> None:
    """Delete a variant and its sidecar (``fp32`` is never removed)."""
    if precision == "fp32":
        raise ValueError("the FP32 model is the reference: remove it with 'healthbot prepare-model --force'")
    path = variant_path(engines_dir, precision)
    for p in (path, sidecar_path(path)):
        if p.exists():
            p.unlink()
