"""TensorRT engine build: ``engines/model.onnx`` -> ``engines/<name>.engine`` (``healthbot build-engine``).

What is built and why (TensorRT developer guide, sections "Working with Dynamic
Shapes / Optimization Profiles", "Timing Cache", "Strongly Typed Networks",
"Reduced Precision"; TensorRT 10.x -> 11.x migration guide):

- **Optimization profiles per sequence bucket.** One profile per bucket of
  :data:`inference.batcher.DEFAULT_BUCKETS` (16, 32, ... 512 tokens): profile k
  covers sequence lengths ``prev_bucket + 1 .. bucket`` (the first starts at 1)
  and batch ``1 .. max``. Together they cover every T in 1..512 with no gap, so
  the known failure of a profile built for one length ("between 128 and 128 but
  received 7") cannot happen, and each profile's kernels are tuned for its own
  ``opt`` shape. ``per_bucket=False`` builds one profile over 1..512 instead.
  A profile's largest batch is capped by a token budget (``max_tokens``, B x T)
  so the activation memory TensorRT reserves for the largest shape stays small;
  the runtime splits larger batches (:mod:`inference.engines.tensorrt`).
- **FP16, with LayerNorm, Softmax and the pooling reductions kept in FP32**
  (BERT's LayerNorm variance overflows FP16; TensorRT warns "Running layernorm
  after self-attention in FP16 may cause overflow"):
  * TensorRT 10.x: ``BuilderFlag.FP16`` plus ``OBEY_PRECISION_CONSTRAINTS`` and
    FP32 precision/output types on every normalization, softmax and reduce layer
    (and ``INormalizationLayer.compute_precision = float32``);
  * TensorRT 11.x, where the precision flags are gone and every network is
    strongly typed: a strongly typed FP16 ONNX written by
    :func:`to_strongly_typed_fp16` (FP16 weights and matmuls; LayerNormalization,
    Softmax and ReduceSum/Mean in FP32; FP32 inputs/outputs), parsed with
    ``NetworkDefinitionCreationFlag.STRONGLY_TYPED``.
- **INT8 only through explicit quantization** (an ONNX with QuantizeLinear /
  DequantizeLinear nodes), off by default; never calibration.
- **Timing cache** per GPU and TensorRT version (``engines/timing.<tag>.cache``),
  loaded before and saved after each build: rebuilds take seconds, not minutes.
- **Engine file named by what it is only valid for**: model stem, precision,
  GPU name, compute capability and TensorRT version, e.g.
  ``model.fp16.nvidia-h200.sm90.trt10.13.3.engine``. A serialized engine only
  deserializes on the same GPU model and TensorRT version (developer guide,
  "Serialized engines are not portable across platforms or TensorRT versions"),
  so an engine from another GPU or version is simply not found under this name
  and is rebuilt, never loaded. A JSON sidecar (``<engine>.json``) records the
  ONNX sha256 and the build settings; a different ONNX or different settings
  also trigger a rebuild.

TensorRT and cuda-python are imported lazily (``pip install tensorrt
cuda-python`` on a machine with an NVIDIA GPU). The FP16 ONNX conversion needs
only ``onnx`` and runs anywhere.

Run: ``healthbot build-engine`` or ``python -m inference.build_engine [--force]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import fcntl
import importlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ENGINE_FORMAT = 1
"""Version of the sidecar JSON and naming scheme; bump it to invalidate engines."""

DEFAULT_SEQ_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
"""Sequence buckets in tokens; the same as :data:`inference.batcher.DEFAULT_BUCKETS`
(a test pins them equal), so each batch the batcher forms falls in one profile."""

DEFAULT_MAX_BATCH = 256
"""Largest batch the engine accepts (the pool splits larger ones)."""

DEFAULT_OPT_TOKENS = 8192
"""B x T the profiles are tuned for: the batcher's default ``max_batch_tokens``
(text-embeddings-inference's padded budget), so ``opt`` batch = 8192 // bucket."""

DEFAULT_MAX_TOKENS = 16384
"""Cap on B x T of a profile's largest shape; bounds the activation memory
TensorRT reserves. Larger batches are split by the runtime."""

DEFAULT_WORKSPACE_BYTES = 1 << 30
"""Builder workspace (``MemoryPoolType.WORKSPACE``) limit: 1 GiB."""

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


class BuildError(RuntimeError):
    """The engine could not be built; the message says what to do."""


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Profile:
    """One optimization profile: inclusive ranges over batch B and sequence T.

    ``opt`` is the shape TensorRT tunes kernels for.
    """

    batch_min: int
    batch_opt: int
    batch_max: int
    seq_min: int
    seq_opt: int
    seq_max: int

    def contains(self, batch: int, seq: int) -> bool:
        """True when a [batch, seq] input is inside this profile."""
        return self.batch_min <= batch <= self.batch_max and self.seq_min <= seq <= self.seq_max

    def shapes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """``(min, opt, max)`` [B, T] shapes as ``IOptimizationProfile.set_shape`` takes them."""
        return ((self.batch_min, self.seq_min), (self.batch_opt, self.seq_opt), (self.batch_max, self.seq_max))

    def describe(self) -> str:
        """``"B 1..256 x T 1..16"``."""
        return f"B {self.batch_min}..{self.batch_max} x T {self.seq_min}..{self.seq_max}"


@dataclass(frozen=True)
class BuildSpec:
    """Build settings; part of the sidecar, so changing one triggers a rebuild.

    Attributes:
        max_batch_size: largest B (default 256).
        seq_buckets: ascending sequence buckets in tokens, the last one the
            model's max length (512).
        per_bucket: one profile per bucket (default) or one profile over 1..512.
        precision: ``"fp16"`` (default), ``"fp32"``, or ``"int8"`` (needs an
            explicitly quantized ONNX with Q/DQ nodes).
        opt_tokens: B x T each profile is tuned for (default 8192).
        max_tokens: cap on B x T of each profile's largest shape (default 16384).
        workspace_bytes: builder workspace limit in bytes (default 1 GiB).
    """

    max_batch_size: int = DEFAULT_MAX_BATCH
    seq_buckets: tuple[int, ...] = DEFAULT_SEQ_BUCKETS
    per_bucket: bool = True
    precision: str = "fp16"
    opt_tokens: int = DEFAULT_OPT_TOKENS
    max_tokens: int = DEFAULT_MAX_TOKENS
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES

    def __post_init__(self) -> None:
        if self.precision not in ("fp16", "fp32", "int8"):
            raise BuildError(f"precision {self.precision!r}: use 'fp16', 'fp32' or 'int8'")
        buckets = tuple(self.seq_buckets)
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise BuildError(f"seq_buckets {buckets} must be ascending, distinct and >= 1")
        if self.max_batch_size < 1 or self.opt_tokens < 1 or self.max_tokens < buckets[-1]:
            raise BuildError("max_batch_size and opt_tokens must be >= 1 and max_tokens >= the largest bucket")
        object.__setattr__(self, "seq_buckets", buckets)

    def profiles(self) -> list[Profile]:
        """The optimization profiles, in index order.

        Per bucket b (previous bucket p, 0 for the first): T in ``p+1 .. b``,
        ``opt`` T = b; B in ``1 .. min(max_batch, max_tokens // b)`` with
        ``opt`` B = ``min(that max, max(1, opt_tokens // b))``. Every T in
        1..max bucket lies in exactly one profile.
        """
        edges = list(self.seq_buckets) if self.per_bucket else [self.seq_buckets[-1]]
        out, lo = [], 1
        for hi in edges:
            bmax = max(1, min(self.max_batch_size, self.max_tokens // hi))
            bopt = min(bmax, max(1, self.opt_tokens // hi))
            out.append(Profile(1, bopt, bmax, lo, hi, hi))
            lo = hi + 1
        return out

    def as_json(self) -> dict[str, Any]:
        """The settings as JSON-ready values (for the sidecar)."""
        d = dataclasses.asdict(self)
        d["seq_buckets"] = list(self.seq_buckets)
        return d


@dataclass(frozen=True)
class DeviceInfo:
    """The GPU an engine is built for (``cudaGetDeviceProperties``)."""

    name: str
    major: int
    minor: int

    @property
    def slug(self) -> str:
        """File-name-safe GPU name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-") or "gpu"

    @property
    def sm(self) -> str:
        """Compute capability as ``"sm90"``."""
        return f"sm{self.major}{self.minor}"


def trt_major(trt: Any) -> int:
    """TensorRT major version from ``trt.__version__`` (``"10.13.3.9"`` -> 10)."""
    try:
        return int(str(trt.__version__).split(".")[0])
    except (AttributeError, ValueError) as exc:
        raise BuildError(f"cannot read the TensorRT version ({exc})") from None


def trt_tag(trt: Any) -> str:
    """``"trt10.13.3"``: the first three parts of ``trt.__version__``."""
    return "trt" + ".".join(str(trt.__version__).split(".")[:3])


def engine_path(engines_dir: Path, onnx_stem: str, spec: BuildSpec, device: DeviceInfo, trt_version: str) -> Path:
    """Where the engine for this model, precision, GPU and TensorRT version lives.

    Example: ``engines/model.fp16.nvidia-h200.sm90.trt10.13.3.engine``. The
    name is the compatibility key: an engine made elsewhere never matches it.
    """
    tag = "trt" + ".".join(str(trt_version).split(".")[:3])
    return Path(engines_dir) / f"{onnx_stem}.{spec.precision}.{device.slug}.{device.sm}.{tag}.engine"


def timing_cache_path(engines_dir: Path, device: DeviceInfo, trt_version: str) -> Path:
    """Timing cache for one GPU model and TensorRT version (caches are not portable either)."""
    tag = "trt" + ".".join(str(trt_version).split(".")[:3])
    return Path(engines_dir) / f"timing.{device.slug}.{device.sm}.{tag}.cache"


def sidecar_path(engine: Path) -> Path:
    """``<engine>.json``: what the engine was built from and with."""
    return engine.with_name(engine.name + ".json")


def engine_is_current(engine: Path, onnx_sha256: str, spec: BuildSpec) -> bool:
    """True when ``engine`` exists and its sidecar names the same ONNX, settings and format."""
    try:
        meta = json.loads(sidecar_path(engine).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return (engine.is_file() and meta.get("format") == ENGINE_FORMAT
            and meta.get("onnx_sha256") == onnx_sha256 and meta.get("spec") == spec.as_json())


# --------------------------------------------------------------------------- imports
def import_tensorrt() -> Any:
    """The ``tensorrt`` module (whatever ``sys.modules`` holds: tests inject a double).

    Raises:
        ImportError: with the install hint.
    """
    try:
        return importlib.import_module("tensorrt")
    except ImportError as exc:
        raise ImportError(f"TensorRT is not installed ({exc}): pip install tensorrt "
                          "(needs an NVIDIA GPU and driver); otherwise use the torch_cuda or onnxruntime engine") from None


def import_cudart() -> Any:
    """cuda-python's runtime bindings: ``cuda.bindings.runtime`` (cuda-python >= 12.6),
    else the older ``cuda.cudart``.

    Raises:
        ImportError: with the install hint.
    """
    try:
        return importlib.import_module("cuda.bindings.runtime")
    except ImportError:
        try:
            return importlib.import_module("cuda.cudart")
        except ImportError as exc:
            raise ImportError(f"cuda-python is not installed ({exc}): pip install 'healthbot[gpu]'") from None


def cuda_check(cudart: Any, result: Any, what: str) -> Any:
    """Unwrap a cuda-python call's ``(err, *values)`` tuple.

    Returns:
        None, the single value, or a tuple of values.

    Raises:
        RuntimeError: ``err`` is not ``cudaSuccess`` (message: call, error name, description).
    """
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if int(err) != 0:
        try:
            name = cudart.cudaGetErrorName(err)[1]
            desc = cudart.cudaGetErrorString(err)[1]
            name = name.decode() if isinstance(name, bytes) else str(name)
            desc = desc.decode() if isinstance(desc, bytes) else str(desc)
        except Exception:  # noqa: BLE001 - best effort description
            name, desc = str(err), ""
        raise RuntimeError(f"CUDA {what} failed: {name} ({int(err)}): {desc}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def query_device(cudart: Any, device: int = 0) -> DeviceInfo:
    """Name and compute capability of CUDA device ``device`` (``cudaGetDeviceProperties``).

    Raises:
        RuntimeError: no such device or no driver.
    """
    prop = cuda_check(cudart, cudart.cudaGetDeviceProperties(device), f"cudaGetDeviceProperties({device})")
    name = prop.name
    if isinstance(name, (bytes, bytearray)):
        name = bytes(name).split(b"\0", 1)[0].decode("utf-8", "replace")
    return DeviceInfo(str(name).strip(), int(prop.major), int(prop.minor))


# --------------------------------------------------------------------------- FP16 ONNX
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


# --------------------------------------------------------------------------- build
def onnx_sha256_of(onnx_path: Path) -> str:
    """sha256 of the ONNX: from ``manifest.json`` beside it when it describes this
    file (same name and byte size), else hashed."""
    onnx_path = Path(onnx_path)
    try:
        m = json.loads((onnx_path.parent / "manifest.json").read_text(encoding="utf-8"))
        if m.get("onnx") == onnx_path.name and m.get("onnx_bytes") == onnx_path.stat().st_size and m.get("onnx_sha256"):
            return str(m["onnx_sha256"])
    except (FileNotFoundError, json.JSONDecodeError):
        pass
    from inference.prepare import sha256_file

    return sha256_file(onnx_path)


@contextlib.contextmanager
def _exclusive(engines_dir: Path) -> Iterator[None]:
    """flock ``engines/.build-engine.lock``: workers loading at once build one engine, once."""
    with open(Path(engines_dir) / ".build-engine.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass
class BuildResult:
    """What :func:`build_engine` did.

    Attributes:
        engine: the ``.engine`` path.
        built: False when a current engine was already there.
        seconds: build time (0 when not built).
        strongly_typed: built from the strongly typed FP16 ONNX.
        profiles: the optimization profiles, in index order.
    """

    engine: Path
    built: bool
    seconds: float = 0.0
    strongly_typed: bool = False
    profiles: list[Profile] = field(default_factory=list)


def _trt_logger(trt: Any) -> Any:
    return trt.Logger(trt.Logger.WARNING)


def _keep_fp32_layers(trt: Any, network: Any) -> int:
    """TensorRT 10.x weak typing: pin normalization, softmax and reduce layers to FP32.

    Returns:
        how many layers were pinned.
    """
    pinned_types = {getattr(trt.LayerType, n) for n in ("NORMALIZATION", "SOFTMAX", "REDUCE")
                    if hasattr(trt.LayerType, n)}
    n = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type not in pinned_types:
            continue
        layer.precision = trt.float32
        for j in range(layer.num_outputs):
            layer.set_output_type(j, trt.float32)
        if hasattr(layer, "compute_precision"):  # INormalizationLayer (TensorRT >= 8.6)
            layer.compute_precision = trt.float32
        n += 1
    return n


def build_engine(onnx_path: Path, engines_dir: Path | None = None, spec: BuildSpec = BuildSpec(), *,
                 device: int = 0, force: bool = False, trt: Any = None, cudart: Any = None,
                 log: Any = None) -> BuildResult:
    """Build (or find) the TensorRT engine for ``onnx_path`` on this GPU and TensorRT.

    Args:
        onnx_path: the FP32 model (``engines/model.onnx``; inputs ``input_ids``,
            ``attention_mask`` int64[B, T]; output ``pooled`` float32[B, 384]).
        engines_dir: where engines, sidecars and timing caches go (default: the
            ONNX's folder).
        spec: profiles and precision (:class:`BuildSpec`).
        device: CUDA device index to build on (engines are tuned for it).
        force: rebuild even when a current engine exists.
        trt, cudart: modules to use instead of importing ``tensorrt`` and
            ``cuda.bindings.runtime`` (tests pass doubles).
        log: optional callable ``log(event: str, **fields)`` for progress.

    Returns:
        :class:`BuildResult`.

    Raises:
        BuildError: ONNX missing or unparsable, INT8 without Q/DQ nodes, a
            profile rejected, or the builder returned no engine.
        ImportError: TensorRT or cuda-python missing (message has the pip command).
        RuntimeError: a CUDA call failed (no GPU, no driver).
    """
    onnx_path = Path(onnx_path)
    engines_dir = Path(engines_dir) if engines_dir is not None else onnx_path.parent
    if not onnx_path.is_file():
        raise BuildError(f"{onnx_path} missing: run 'healthbot prepare-model' first")
    trt = trt if trt is not None else import_tensorrt()
    cudart = cudart if cudart is not None else import_cudart()
    emit = log or (lambda event, **kw: None)
    major = trt_major(trt)
    if major < 10:
        raise BuildError(f"TensorRT {trt.__version__} is too old: this project uses the TensorRT >= 10 API "
                         "(set_input_shape, set_tensor_address, execute_async_v3); pip install -U tensorrt")
    cuda_check(cudart, cudart.cudaSetDevice(device), f"cudaSetDevice({device})")
    dev = query_device(cudart, device)
    sha = onnx_sha256_of(onnx_path)
    target = engine_path(engines_dir, onnx_path.stem, spec, dev, trt.__version__)
    profiles = spec.profiles()
    if not force and engine_is_current(target, sha, spec):
        return BuildResult(target, built=False, profiles=profiles)

    with _exclusive(engines_dir):
        if not force and engine_is_current(target, sha, spec):
            return BuildResult(target, built=False, profiles=profiles)  # another worker built it
        t0 = time.perf_counter()
        if spec.precision == "int8" and not has_explicit_quantization(onnx_path):
            raise BuildError("INT8 needs an explicitly quantized ONNX (QuantizeLinear/DequantizeLinear nodes, "
                             "e.g. from NVIDIA ModelOpt) that passes the accuracy check; implicit INT8 "
                             "calibration is not supported (and is removed in TensorRT 11)")
        # TensorRT 11 builds every network strongly typed: FP16 must be in the ONNX itself.
        strongly_typed = major >= 11
        parse_path = fp16_onnx_for(onnx_path, sha) if strongly_typed and spec.precision == "fp16" else onnx_path

        logger = _trt_logger(trt)
        builder = trt.Builder(logger)
        flags = 0
        st_flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
        if strongly_typed and st_flag is not None:
            flags |= 1 << int(st_flag)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(parse_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise BuildError(f"TensorRT could not parse {parse_path.name}: {errors or 'no detail'} "
                             "(re-run 'healthbot prepare-model --force')")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, spec.workspace_bytes)
        pinned = 0
        if major == 10 and spec.precision in ("fp16", "int8"):
            config.set_flag(trt.BuilderFlag.FP16)
            if spec.precision == "int8":
                config.set_flag(trt.BuilderFlag.INT8)  # Q/DQ nodes decide what is INT8
            config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
            pinned = _keep_fp32_layers(trt, network)

        inputs = [network.get_input(i) for i in range(network.num_inputs)]
        for p in profiles:
            prof = builder.create_optimization_profile()
            lo, opt, hi = p.shapes()
            for tensor in inputs:
                prof.set_shape(tensor.name, lo, opt, hi)
            if config.add_optimization_profile(prof) < 0:
                raise BuildError(f"TensorRT rejected optimization profile {p.describe()}")

        cache_file = timing_cache_path(engines_dir, dev, trt.__version__)
        cache = config.create_timing_cache(cache_file.read_bytes() if cache_file.is_file() else b"")
        config.set_timing_cache(cache, False)

        emit("tensorrt_build_started", engine=target.name, profiles=[p.describe() for p in profiles],
             strongly_typed=strongly_typed, fp32_layers=pinned)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise BuildError(f"TensorRT could not build {target.name} (see the TensorRT log above); "
                             "try a smaller max_batch_size or max_tokens")
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(memoryview(serialized))
        os.replace(tmp, target)
        new_cache = config.get_timing_cache()
        if new_cache is not None:
            tmp_cache = cache_file.with_name(cache_file.name + f".tmp{os.getpid()}")
            with open(tmp_cache, "wb") as f:
                f.write(memoryview(new_cache.serialize()))
            os.replace(tmp_cache, cache_file)
        seconds = round(time.perf_counter() - t0, 1)
        meta = {
            "format": ENGINE_FORMAT,
            "onnx": onnx_path.name,
            "onnx_sha256": sha,
            "parsed": parse_path.name,
            "strongly_typed": strongly_typed,
            "fp32_layers_pinned": pinned,
            "spec": spec.as_json(),
            "profiles": [dataclasses.asdict(p) for p in profiles],
            "gpu": dev.name,
            "compute_capability": f"{dev.major}.{dev.minor}",
            "tensorrt": str(trt.__version__),
            "built": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "build_seconds": seconds,
        }
        sc = sidecar_path(target)
        tmp_sc = sc.with_name(sc.name + f".tmp{os.getpid()}")
        tmp_sc.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp_sc, sc)
        emit("tensorrt_build_done", engine=target.name, seconds=seconds)
        return BuildResult(target, built=True, seconds=seconds, strongly_typed=strongly_typed, profiles=profiles)


# --------------------------------------------------------------------------- CLI
def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``build-engine`` options (shared by ``healthbot build-engine`` and ``-m``)."""
    ap.add_argument("--engine", choices=("tensorrt", "onnxruntime"), default="tensorrt",
                    help="tensorrt: a .engine for this GPU (default); onnxruntime: the INT8 ONNX variant "
                         "(engines/model.int8.onnx, with --precision int8), checked for accuracy")
    ap.add_argument("--engines-dir", type=Path, default=None,
                    help="folder with model.onnx (default: the config's engines_dir, else engines/)")
    ap.add_argument("--onnx", default="model.onnx", help="ONNX file name inside --engines-dir")
    ap.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH)
    ap.add_argument("--precision", choices=("fp16", "fp32", "int8"), default=None,
                    help="tensorrt: fp16 (default), fp32, or int8 (needs an explicitly quantized Q/DQ ONNX); "
                         "onnxruntime: int8 (the default there)")
    ap.add_argument("--single-profile", action="store_true",
                    help="one profile over T 1..512 instead of one per sequence bucket")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if a current engine exists")
    ap.add_argument("--eval", dest="eval_file", type=Path, default=None,
                    help="onnxruntime: labelled JSONL for the eval half of the accuracy check "
                         "(default ../shared/eval/dev.jsonl when present)")
    ap.add_argument("--no-check", action="store_true",
                    help="onnxruntime: skip the accuracy check (the variant is then never used by 'auto')")


def _run_onnxruntime_cli(args: argparse.Namespace, engines_dir: Path) -> int:
    from inference.accuracy import format_report
    from inference.onnx_variants import VariantError, build_int8

    precision = args.precision or "int8"
    if precision != "int8":
        print(f"error: --engine onnxruntime builds the int8 variant only (fp32 is engines/model.onnx from "
              f"'healthbot prepare-model'), not {precision}", file=sys.stderr)
        return 2
    try:
        meta = build_int8(engines_dir, force=args.force, check=not args.no_check, eval_file=args.eval_file,
                          log=lambda event, **kw: print(event, json.dumps(kw, default=str), file=sys.stderr))
    except (VariantError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    acc = meta.get("accuracy")
    if acc:
        print(format_report(acc), file=sys.stderr)
    print(engines_dir / "model.int8.onnx")
    if acc and not acc["passed"]:
        print("the INT8 variant did not pass the accuracy check: inference.onnx_precision=auto keeps FP32",
              file=sys.stderr)
        return 1
    return 0


def run_cli(args: argparse.Namespace) -> int:
    """Build from parsed ``build-engine`` arguments; print the engine path. Exit code 0/1
    (2 for a bad combination of options)."""
    engines_dir = Path(args.engines_dir) if args.engines_dir else Path("engines")
    if getattr(args, "engine", "tensorrt") == "onnxruntime":
        return _run_onnxruntime_cli(args, engines_dir)
    spec = BuildSpec(max_batch_size=args.max_batch, precision=args.precision or "fp16",
                     per_bucket=not args.single_profile)
    try:
        res = build_engine(engines_dir / args.onnx, engines_dir, spec, device=args.device,
                           force=args.force,
                           log=lambda event, **kw: print(event, json.dumps(kw, default=str), file=sys.stderr))
    except (BuildError, ImportError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(res.engine)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m inference.build_engine [--force] ...``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
