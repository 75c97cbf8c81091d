"""TensorRT engine build: ``engines/model.onnx`` -> ``engines/<name>.engine`` (``healthbot build-engine``).

What is built and why (TensorRT developer guide, sections "Working with Dynamic
Shapes / Optimization Profiles", "Timing Cache", "Strongly Typed Networks",
"Reduced Precision"; TensorRT 10.x -> 11.x migration guide):

- **Optimization profiles per sequence bucket.** One profile per bucket of
  :data:`inference.batching.windows.DEFAULT_BUCKETS` (16, 32, ... 512 tokens): profile k
  covers sequence lengths ``prev_bucket + 1 .. bucket`` (the first starts at 1)
  and batch ``1 .. max``. Together they cover every T in 1..512 with no gap, so
  the known failure of a profile built for one length ("between 128 and 128 but
  received 7") cannot happen, and each profile's kernels are tuned for its own
  ``opt`` shape. ``per_bucket=False`` builds one profile over 1..512 instead.
  A profile's largest batch is capped by a token budget (``max_tokens``, B x T)
  so the activation memory TensorRT reserves for the largest shape stays small;
  the runtime splits larger batches (:mod:`inference.engines.tensorrt.engine`).
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

Run: ``healthbot build-engine`` (:mod:`inference.model.build_cli`); the engine also builds a
missing one when it may (:class:`~inference.engines.tensorrt.engine.TensorRTEngine`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.engines.cuda import cuda_check, import_cudart, query_device
from inference.engines.tensorrt.fp16 import fp16_onnx_for, has_explicit_quantization
from inference.engines.tensorrt.spec import (ENGINE_FORMAT, BuildError, BuildSpec, Profile, engine_is_current,
                                             engine_path, import_tensorrt, sidecar_path, timing_cache_path, trt_major)
from inference.model_files import onnx_sha256_of

# --------------------------------------------------------------------------- build
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
