"""TensorRT engine: the production GPU engine behind the :class:`~inference.engines.base.Engine` protocol.

Runtime design (TensorRT developer guide, "Performing Inference" with the
name-based I/O API of TensorRT >= 10, and "Optimization Profiles"; CUDA
Runtime API through NVIDIA's cuda-python, ``cuda.bindings.runtime``, as
TensorRT's own samples do since they left pycuda):

- One instance per pool worker: its own deserialized ``ICudaEngine``, ONE
  ``IExecutionContext`` and ONE non-blocking CUDA stream. Instances never share
  a context, so optimization profiles are never contended between workers.
- The CUDA device is made current in every thread that uses the engine:
  ``cudaSetDevice`` on the creating thread and again the first time
  :meth:`TensorRTEngine.infer` runs on any other thread (the manager builds its
  probe engine on one thread and the pool uses it on a worker thread; the CUDA
  runtime's current device is per host thread — CUDA Runtime API,
  "Device Management").
- Device and pinned (page-locked) host buffers are allocated once per
  optimization profile ("bucket"), at load, sized for that profile's largest
  shape; nothing is allocated per call. Pinned memory makes the
  ``cudaMemcpyAsync`` copies truly asynchronous on the stream.
- Each call picks the profile of the smallest sequence bucket holding T
  (profiles from :mod:`inference.engines.tensorrt.build` cover T = 1..512 with no gap, so
  a 7-token query never meets a 128..128 profile), switches the context to it
  with ``set_optimization_profile_async`` only when it changes, sets the exact
  input shapes with ``set_input_shape`` (no padding to the bucket), binds the
  buffers with ``set_tensor_address``, runs ``execute_async_v3`` and copies the
  pooled rows back. Batches larger than a profile's largest batch are split.
- The engine file is found by GPU name, compute capability and TensorRT version
  (:func:`inference.engines.tensorrt.spec.engine_path`); a missing or stale one is built
  (``build_missing=True``) or reported with the command to run, never loaded
  from another GPU or version.

Output: float32[B, 384] mean-pooled, not normalized (the ONNX's ``pooled``).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from inference.engines.base import EngineError, check_batch
from inference.engines.cuda import cuda_check, import_cudart, query_device
from inference.engines.tensorrt.build import build_engine
from inference.engines.tensorrt.spec import (BuildError, BuildSpec, Profile, engine_is_current, engine_path,
                                             import_tensorrt, trt_major)
from inference.model_files import onnx_sha256_of

log = structlog.get_logger("healthbot.inference.tensorrt")

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
TOKEN_TYPE_IDS = "token_type_ids"
OUTPUT = "pooled"
"""I/O tensor names of ``model.onnx`` (``inference/model/prepare.py``)."""


@dataclass
class _Bucket:
    """Buffers of one optimization profile, allocated once at load.

    Attributes:
        index: profile index in the engine.
        profile: its [B, T] ranges.
        device: tensor name -> device pointer (bytes for ``batch_max x seq_max``
            elements of the tensor's dtype; output: ``batch_max x dim``).
        host: tensor name -> flat numpy view of a pinned host buffer of the same size.
    """

    index: int
    profile: Profile
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, np.ndarray] = field(default_factory=dict)


def _host_view(ptr: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
    """A flat numpy array over ``nbytes`` of host memory at ``ptr`` (no copy)."""
    raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return np.frombuffer(raw, dtype=np.uint8).view(dtype)


class TensorRTEngine:
    """Runs a serialized TensorRT engine of the prepared model on one GPU.

    Args:
        engines_dir: folder with ``model.onnx`` (and its ``manifest.json``);
            engines, sidecars and timing caches are written here.
        onnx_file: ONNX file name in ``engines_dir``.
        spec: build settings (profiles, precision); part of the engine's identity.
        device: CUDA device index.
        build_missing: build the engine when none matches this GPU, TensorRT
            version, ONNX and spec (minutes on first start); False raises instead.
        trt, cudart: modules to use instead of ``tensorrt`` and
            ``cuda.bindings.runtime`` (tests pass doubles).

    Attributes:
        name: ``"tensorrt"``. dim: D (384). max_batch_size: the spec's
        ``max_batch_size`` (split internally per profile). max_seq_len: the
        largest profile T (512). engine_file: the loaded ``.engine`` path.
        profiles: the engine's profiles in index order. gpu: the device's name.

    Raises:
        EngineError: TensorRT / cuda-python missing, no GPU, the engine missing
            and ``build_missing`` False, the build failed, or the engine does not
            have the expected tensors.
    """

    name = "tensorrt"

    def __init__(self, engines_dir: str | Path, *, onnx_file: str = "model.onnx", spec: BuildSpec = BuildSpec(),
                 device: int = 0, build_missing: bool = True, trt: Any = None, cudart: Any = None) -> None:
        self._closed = False
        self._buckets: list[_Bucket] = []
        self._stream: Any = None
        self._context: Any = None
        self._engine: Any = None
        try:
            self._trt = trt if trt is not None else import_tensorrt()
            self._cudart = cudart if cudart is not None else import_cudart()
        except ImportError as exc:
            raise EngineError(str(exc)) from None
        self.device = device
        self._threads_ready: set[int] = set()
        try:
            self._load(Path(engines_dir), onnx_file, spec, build_missing)
        except EngineError:
            self.close()
            raise
        except Exception as exc:  # noqa: BLE001 - TensorRT/onnx raise their own types; the manager falls back on EngineError
            self.close()
            raise EngineError(f"TensorRT engine could not load: {type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------ load
    def _cuda(self, result: Any, what: str) -> Any:
        try:
            return cuda_check(self._cudart, result, what)
        except RuntimeError as exc:
            raise EngineError(f"{exc} (device {self.device})") from None

    def _make_current(self) -> None:
        """``cudaSetDevice`` once per host thread (the runtime's current device is per thread)."""
        tid = threading.get_ident()
        if tid not in self._threads_ready:
            self._cuda(self._cudart.cudaSetDevice(self.device), f"cudaSetDevice({self.device})")
            self._threads_ready.add(tid)

    def _load(self, engines_dir: Path, onnx_file: str, spec: BuildSpec, build_missing: bool) -> None:
        trt = self._trt
        if trt_major(trt) < 10:
            raise EngineError(f"TensorRT {trt.__version__} is older than 10: pip install -U tensorrt")
        self._make_current()
        try:
            gpu = query_device(self._cudart, self.device)
        except RuntimeError as exc:
            raise EngineError(f"no usable CUDA device {self.device}: {exc}") from None
        self.gpu = gpu.name
        onnx_path = engines_dir / onnx_file
        if not onnx_path.is_file():
            raise EngineError(f"{onnx_path} missing: run 'healthbot prepare-model'")
        sha = onnx_sha256_of(onnx_path)
        path = engine_path(engines_dir, onnx_path.stem, spec, gpu, trt.__version__)
        if not engine_is_current(path, sha, spec):
            if not build_missing:
                raise EngineError(f"no TensorRT engine for {gpu.name} ({gpu.sm}) and TensorRT {trt.__version__} "
                                  f"({path.name}): run 'healthbot build-engine'")
            self._build(onnx_path, engines_dir, spec, force=False)
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            # Same name yet unreadable (truncated copy, driver change): rebuild once, never run it.
            if not build_missing:
                raise EngineError(f"{path.name} does not deserialize on this machine: run 'healthbot build-engine --force'")
            log.warning("tensorrt_engine_unreadable_rebuilding", engine=path.name)
            self._build(onnx_path, engines_dir, spec, force=True)
            engine = runtime.deserialize_cuda_engine(path.read_bytes())
            if engine is None:
                raise EngineError(f"{path.name} was rebuilt but still does not deserialize; see the TensorRT log")
        self._runtime = runtime
        self._engine = engine
        self.engine_file = path
        self._setup_io(spec)
        self._context = engine.create_execution_context()
        if self._context is None:
            raise EngineError("TensorRT could not create an execution context (out of GPU memory?)")
        self._stream = self._cuda(self._cudart.cudaStreamCreateWithFlags(
            getattr(self._cudart, "cudaStreamNonBlocking", 1)),
                                  "cudaStreamCreateWithFlags")
        self._active_profile = -1
        for b in self._buckets:
            self._allocate(b)
        log.info("tensorrt_loaded", engine=path.name, gpu=gpu.name, profiles=[b.profile.describe() for b in self._buckets])

    def _build(self, onnx_path: Path, engines_dir: Path, spec: BuildSpec, force: bool) -> None:
        try:
            build_engine(onnx_path, engines_dir, spec, device=self.device, force=force, trt=self._trt,
                         cudart=self._cudart, log=lambda event, **kw: log.info(event, **kw))
        except (BuildError, RuntimeError) as exc:
            raise EngineError(f"TensorRT engine build failed: {exc}") from exc

    def _setup_io(self, spec: BuildSpec) -> None:
        trt, engine = self._trt, self._engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self._inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if not {INPUT_IDS, ATTENTION_MASK} <= set(self._inputs) or OUTPUT not in outputs:
            raise EngineError(f"engine has inputs {self._inputs} and outputs {outputs}; expected "
                              f"{INPUT_IDS}, {ATTENTION_MASK} -> {OUTPUT}: run 'healthbot build-engine --force'")
        unknown = set(self._inputs) - {INPUT_IDS, ATTENTION_MASK, TOKEN_TYPE_IDS}
        if unknown:
            raise EngineError(f"engine has unexpected inputs {sorted(unknown)}")
        self._dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in self._inputs + [OUTPUT]}
        if self._dtypes[OUTPUT] != np.float32:
            raise EngineError(f"engine output {OUTPUT} is {self._dtypes[OUTPUT]}, expected float32")
        dim = int(list(engine.get_tensor_shape(OUTPUT))[-1])
        if dim <= 0:
            raise EngineError(f"engine output {OUTPUT} has no static dimension")
        self.dim = dim
        buckets = []
        for i in range(engine.num_optimization_profiles):
            lo, opt, hi = (tuple(int(x) for x in s) for s in engine.get_tensor_profile_shape(INPUT_IDS, i))
            buckets.append(_Bucket(i, Profile(lo[0], opt[0], hi[0], lo[1], opt[1], hi[1])))
        if not buckets:
            raise EngineError("engine has no optimization profile: run 'healthbot build-engine --force'")
        self._buckets = sorted(buckets, key=lambda b: (b.profile.seq_max, b.profile.seq_min))
        self.profiles = [b.profile for b in sorted(buckets, key=lambda b: b.index)]
        self.max_batch_size = spec.max_batch_size
        self.max_seq_len = max(b.profile.seq_max for b in buckets)
        covered = set()
        for b in buckets:
            covered.update(range(b.profile.seq_min, b.profile.seq_max + 1))
        gaps = sorted(set(range(1, self.max_seq_len + 1)) - covered)
        if gaps:
            raise EngineError(f"engine profiles leave sequence lengths {gaps[:5]}... uncovered: "
                              "run 'healthbot build-engine --force'")

    def _allocate(self, b: _Bucket) -> None:
        p = b.profile
        sizes = {n: p.batch_max * p.seq_max * self._dtypes[n].itemsize for n in self._inputs}
        sizes[OUTPUT] = p.batch_max * self.dim * self._dtypes[OUTPUT].itemsize
        for n, nbytes in sizes.items():
            b.device[n] = int(self._cuda(self._cudart.cudaMalloc(nbytes), f"cudaMalloc({nbytes})"))
            host = int(self._cuda(self._cudart.cudaMallocHost(nbytes), f"cudaMallocHost({nbytes})"))
            b.host[n] = _host_view(host, nbytes, self._dtypes[n])
        if TOKEN_TYPE_IDS in self._inputs:
            b.host[TOKEN_TYPE_IDS][:] = 0

    # ------------------------------------------------------------------ run
    def bucket_for(self, batch: int, seq: int) -> _Bucket:
        """The profile bucket a [batch, seq] input runs in: the smallest sequence
        range holding ``seq`` (batch is split to fit its ``batch_max``).

        Raises:
            EngineError: no profile holds ``seq`` (message lists the ranges).
        """
        for b in self._buckets:
            if b.profile.seq_min <= seq <= b.profile.seq_max and b.profile.batch_min <= min(batch, b.profile.batch_max):
                return b
        ranges = ", ".join(b.profile.describe() for b in self._buckets)
        raise EngineError(f"no optimization profile holds a [{batch}, {seq}] batch (profiles: {ranges}); "
                          "rebuild with 'healthbot build-engine' for longer inputs")

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Run one padded batch (see :meth:`inference.engines.base.Engine.infer`).

        Args:
            input_ids: int64[B, T], 1 <= B <= ``max_batch_size``, 1 <= T <= 512.
            attention_mask: int64[B, T].

        Returns:
            float32[B, D] mean-pooled, not normalized (a new array).

        Raises:
            EngineError: bad shapes, shape outside every profile, or a CUDA /
                TensorRT call failed.
        """
        if self._closed:
            raise EngineError("TensorRT engine is closed")
        batch, seq = check_batch(input_ids, attention_mask, self.max_batch_size, self.max_seq_len)
        self._make_current()
        bucket = self.bucket_for(batch, seq)
        step = bucket.profile.batch_max
        if batch <= step:
            return self._run(bucket, input_ids, attention_mask)
        return np.concatenate([self._run(bucket, input_ids[i:i + step], attention_mask[i:i + step])
                               for i in range(0, batch, step)])

    def _run(self, b: _Bucket, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        cudart, ctx, stream = self._cudart, self._context, self._stream
        batch, seq = ids.shape
        n = batch * seq
        if self._active_profile != b.index:
            if not ctx.set_optimization_profile_async(b.index, int(stream)):
                raise EngineError(f"TensorRT refused optimization profile {b.index} ({b.profile.describe()})")
            self._active_profile = b.index
        h2d, d2h = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        feeds = {INPUT_IDS: ids, ATTENTION_MASK: mask}
        for name in self._inputs:
            host = b.host[name]
            if name in feeds:
                host[:n] = feeds[name].reshape(-1)  # casts to the engine's dtype (int64 or int32)
            self._cuda(cudart.cudaMemcpyAsync(b.device[name], host.ctypes.data, n * host.itemsize, h2d, stream),
                       f"cudaMemcpyAsync({name}, host->device)")
            if not ctx.set_input_shape(name, (batch, seq)):
                raise EngineError(f"TensorRT rejected input shape [{batch}, {seq}] for {name} in profile "
                                  f"{b.index} ({b.profile.describe()})")
            ctx.set_tensor_address(name, b.device[name])
        ctx.set_tensor_address(OUTPUT, b.device[OUTPUT])
        if not ctx.execute_async_v3(int(stream)):
            raise EngineError(f"TensorRT execute_async_v3 failed on a [{batch}, {seq}] batch (see the TensorRT log)")
        out = b.host[OUTPUT]
        nbytes = batch * self.dim * out.itemsize
        self._cuda(cudart.cudaMemcpyAsync(out.ctypes.data, b.device[OUTPUT], nbytes, d2h, stream),
                   f"cudaMemcpyAsync({OUTPUT}, device->host)")
        self._cuda(cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        return out[:batch * self.dim].reshape(batch, self.dim).copy()

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Free buffers, the stream, the context and the engine (idempotent; errors logged, not raised)."""
        if getattr(self, "_closed", True) and not self._buckets and self._stream is None:
            self._closed = True
            return
        self._closed = True
        cudart = self._cudart
        try:
            self._make_current()
            if self._stream is not None:
                cudart.cudaStreamSynchronize(self._stream)
        except Exception as exc:  # noqa: BLE001 - keep releasing
            log.warning("tensorrt_close_sync_failed", error=str(exc))
        for b in self._buckets:
            for ptr in b.device.values():
                cudart.cudaFree(ptr)
            for view in b.host.values():
                cudart.cudaFreeHost(view.ctypes.data)
            b.device.clear()
            b.host.clear()
        self._buckets = []
        if self._stream is not None:
            cudart.cudaStreamDestroy(self._stream)
            self._stream = None
        self._context = None
        self._engine = None
