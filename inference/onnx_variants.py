"""Reduced-precision ONNX variants for the ``onnxruntime`` engine: fused FP32 → per-channel INT8.

``build_int8(engines_dir)`` (``healthbot build-engine --engine onnxruntime
--precision int8``) turns the prepared ``engines/model.onnx`` into
``engines/model.int8.onnx`` in two steps, then runs the accuracy check
(:mod:`inference.accuracy`) and records the result in a sidecar
``engines/model.int8.onnx.json``:

1. **BERT fusion** with ONNX Runtime's transformer optimizer
   (``onnxruntime.transformers.optimizer.optimize_model``, ``model_type="bert"``,
   12 heads, hidden 384): the embedding sum + LayerNorm becomes one
   ``EmbedLayerNormalization``, each self-attention one ``Attention`` node, the
   residual adds + LayerNorms ``SkipLayerNormalization`` and the FFN's bias +
   GELU ``BiasGelu`` (measured on the prepared model: 1, 12, 24 and 12 nodes).
   It needs the export with eager attention (inference/prepare.py does that).
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

The ``onnxruntime`` engine uses the INT8 file only when asked
(``inference.onnx_precision = "int8"``) or, with ``"auto"`` (the default), when
the sidecar says it is current (built from this ``model.onnx``) and passed the
accuracy check (:func:`int8_status`).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

VARIANT_FORMAT = 1
"""Version of the sidecar; bump it to make every built variant stale."""

FP32_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"

NUM_HEADS = 12
HIDDEN_SIZE = 384
"""multilingual-e5-small's attention heads and hidden size (manifest ``heads``/``dim``);
the fusion needs them given (it cannot always infer them from reshapes)."""


class VariantError(RuntimeError):
    """A variant could not be built; the message says what to do."""


def variant_path(engines_dir: Path | str, precision: str) -> Path:
    """The ONNX file of ``precision`` (``"fp32"`` or ``"int8"``) in ``engines_dir``.

    Raises:
        ValueError: an unknown precision.
    """
    files = {"fp32": FP32_FILE, "int8": INT8_FILE}
    if precision not in files:
        raise ValueError(f"ONNX precision {precision!r}: use one of {sorted(files)}")
    return Path(engines_dir) / files[precision]


def sidecar_path(model: Path) -> Path:
    """``<model>.json``: what the variant was built from and its accuracy check."""
    return model.with_name(model.name + ".json")


def _source_sha(engines_dir: Path) -> str:
    from inference.build_engine import onnx_sha256_of

    return onnx_sha256_of(engines_dir / FP32_FILE)


def read_sidecar(model: Path) -> dict[str, Any] | None:
    """The parsed sidecar of ``model``, or None when absent or unreadable."""
    try:
        return json.loads(sidecar_path(model).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@dataclass(frozen=True)
class VariantStatus:
    """Whether a built variant may be used by ``onnx_precision = "auto"``.

    Attributes:
        path: the variant's file.
        exists: the file is there.
        current: built from the present ``model.onnx`` with this format.
        passed: its recorded accuracy check passed (parity and eval).
        reason: why it is not usable (``""`` when usable).
    """

    path: Path
    exists: bool
    current: bool
    passed: bool
    reason: str

    @property
    def usable(self) -> bool:
        return self.exists and self.current and self.passed


def int8_status(engines_dir: Path | str) -> VariantStatus:
    """State of ``engines/model.int8.onnx`` (cheap: reads the sidecar and manifest only)."""
    engines_dir = Path(engines_dir)
    path = engines_dir / INT8_FILE
    hint = "build it with 'healthbot build-engine --engine onnxruntime --precision int8'"
    if not path.is_file():
        return VariantStatus(path, False, False, False, f"{path.name} missing: {hint}")
    meta = read_sidecar(path)
    if not meta:
        return VariantStatus(path, True, False, False, f"{sidecar_path(path).name} missing: {hint}")
    try:
        sha = _source_sha(engines_dir)
    except FileNotFoundError:
        return VariantStatus(path, True, False, False, f"{FP32_FILE} missing: run 'healthbot prepare-model'")
    current = (meta.get("format") == VARIANT_FORMAT and meta.get("source_sha256") == sha
               and meta.get("bytes") == path.stat().st_size)
    if not current:
        return VariantStatus(path, True, False, False, f"{path.name} was built from another model.onnx: rebuild it ({hint})")
    acc = meta.get("accuracy") or {}
    passed = bool(acc.get("passed"))
    if not passed:
        why = acc.get("reason") or "no accuracy check recorded"
        return VariantStatus(path, True, True, False, f"{path.name} did not pass the accuracy check ({why})")
    return VariantStatus(path, True, True, True, "")


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
        check: run the accuracy check (:func:`inference.accuracy.check_accuracy`)
            and record it; without it the variant is never picked by ``auto``.
        eval_file: labelled JSONL for the eval half of the check (default:
            :data:`inference.accuracy.DEFAULT_EVAL_FILE` when it exists; None
            when absent: the variant then does not count as passed).
        log: ``log(event, **fields)`` for progress.

    Returns:
        the sidecar dict (``accuracy.passed`` says whether ``auto`` will use it).

    Raises:
        VariantError: ``model.onnx`` missing, or the fusion failed.
    """
    from inference.accuracy import DEFAULT_EVAL_FILE, check_accuracy

    engines_dir = Path(engines_dir)
    emit = log or (lambda event, **kw: None)
    src = engines_dir / FP32_FILE
    if not src.is_file():
        raise VariantError(f"{src} missing: run 'healthbot prepare-model' first")
    dst = engines_dir / INT8_FILE
    sha = _source_sha(engines_dir)
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


__all__ = ["VariantError", "VariantStatus", "variant_path", "sidecar_path", "read_sidecar", "int8_status",
           "fuse_bert", "quantize_int8", "build_int8", "remove_variant", "FP32_FILE", "INT8_FILE"]
