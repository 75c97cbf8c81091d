"""TensorRT engine and engine build, run against an API double (TensorRT cannot be installed here).

The double mirrors the TensorRT 10 / 11 Python API subset the project uses
(Builder, INetworkDefinition, OnnxParser, IBuilderConfig, optimization
profiles, timing cache, Runtime.deserialize_cuda_engine, ICudaEngine,
IExecutionContext.set_optimization_profile_async / set_input_shape /
set_tensor_address / execute_async_v3) and the cuda-python runtime calls
(``cuda.bindings.runtime``). Both are injected through ``sys.modules`` so the
engine's own logic runs unchanged: profile selection, shape checks, buffer
allocation per bucket, engine naming and rebuild on mismatch, the 10 vs 11
precision branches, per-thread device handling. The double's execution
context reads its inputs through the CUDA runtime it finds (the fake one here,
the real one on a GPU: ``tools/gpu_bench.py`` reuses this double to exercise the
real cuda-python path) and computes with ONNX Runtime on the ONNX file the
parser was given, so numerics are real, including the strongly typed FP16 ONNX
of the 11.x branch. What real TensorRT does differently (kernel choice, FP16
arithmetic of the 10.x weak-typing branch) is NOT tested here.

Behaviour of the double taken from the TensorRT 10.x Python API reference and
the 10.x -> 11.x migration guide: removed 11.x APIs (``BuilderFlag.FP16``,
``OBEY_PRECISION_CONSTRAINTS``) raise AttributeError; ``set_input_shape``
returns False and logs outside the active profile; ``deserialize_cuda_engine``
returns None for an engine of another TensorRT version or GPU.
"""

from __future__ import annotations

import asyncio
import ctypes
import enum
import json
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from inference import build_engine as be  # noqa: E402
from inference.engines.base import Engine, EngineError  # noqa: E402

# =========================================================================== CUDA runtime double


class cudaError_t(enum.IntEnum):  # noqa: N801 - cuda-python's names
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidDevice = 101
    cudaErrorDeviceUninitialized = 201  # "invalid device context"
    cudaErrorInvalidResourceHandle = 400


class cudaMemcpyKind(enum.IntEnum):  # noqa: N801
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


class _Stream:
    """cuda-python's ``cudaStream_t``: converts to the int handle TensorRT takes."""

    def __init__(self, handle: int):
        self.handle = handle

    def __int__(self) -> int:
        return self.handle


class _Props:
    def __init__(self, name: str, major: int, minor: int):
        self.name = name.encode() + b"\0" * (256 - len(name))
        self.major, self.minor = major, minor
        self.totalGlobalMem = 141 << 30


class FakeCudaRuntime(types.ModuleType):
    """``cuda.bindings.runtime`` double. Device memory is host memory (so copies
    are real ``memmove``s), every copy is bounds-checked against its allocation,
    and every call from a thread that has not called ``cudaSetDevice`` fails with
    ``cudaErrorDeviceUninitialized`` (strict: the real runtime would silently
    use device 0; this catches a worker thread that forgot to make its device
    current)."""

    cudaError_t = cudaError_t
    cudaMemcpyKind = cudaMemcpyKind
    cudaStreamNonBlocking = 1

    def __init__(self, device_name: str = "NVIDIA H200", cc: tuple[int, int] = (9, 0)):
        super().__init__("cuda.bindings.runtime")
        self.device_name, self.cc = device_name, cc
        self._tls = threading.local()
        self.set_device_threads: set[int] = set()
        self.device_allocs: dict[int, np.ndarray] = {}
        self.host_allocs: dict[int, np.ndarray] = {}
        self.malloc_sizes: list[int] = []
        self.streams: set[int] = set()
        self.copies = 0
        self._next_stream = 0x1000

    # -- helpers
    def _ready(self) -> bool:
        return getattr(self._tls, "device", None) is not None

    @staticmethod
    def _inside(allocs: dict[int, np.ndarray], ptr: int, n: int) -> bool:
        return any(base <= ptr and ptr + n <= base + a.nbytes for base, a in allocs.items())

    # -- API
    def cudaGetErrorName(self, err):
        return (cudaError_t.cudaSuccess, cudaError_t(int(err)).name.encode())

    def cudaGetErrorString(self, err):
        return (cudaError_t.cudaSuccess, f"fake CUDA error {int(err)}".encode())

    def cudaSetDevice(self, device):
        if device != 0:
            return (cudaError_t.cudaErrorInvalidDevice,)
        self._tls.device = device
        self.set_device_threads.add(threading.get_ident())
        return (cudaError_t.cudaSuccess,)

    def cudaGetDeviceProperties(self, device):
        if device != 0:
            return (cudaError_t.cudaErrorInvalidDevice, None)
        return (cudaError_t.cudaSuccess, _Props(self.device_name, *self.cc))

    def cudaStreamCreateWithFlags(self, flags):
        if not self._ready():
            return (cudaError_t.cudaErrorDeviceUninitialized, None)
        self._next_stream += 1
        self.streams.add(self._next_stream)
        return (cudaError_t.cudaSuccess, _Stream(self._next_stream))

    def cudaStreamDestroy(self, stream):
        self.streams.discard(int(stream))
        return (cudaError_t.cudaSuccess,)

    def cudaStreamSynchronize(self, stream):
        if not self._ready():
            return (cudaError_t.cudaErrorDeviceUninitialized,)
        if int(stream) not in self.streams:
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        return (cudaError_t.cudaSuccess,)

    def _alloc(self, table, nbytes):
        if not self._ready():
            return (cudaError_t.cudaErrorDeviceUninitialized, 0)
        a = np.zeros(max(1, nbytes), dtype=np.uint8)
        table[a.ctypes.data] = a
        self.malloc_sizes.append(nbytes)
        return (cudaError_t.cudaSuccess, a.ctypes.data)

    def cudaMalloc(self, nbytes):
        return self._alloc(self.device_allocs, nbytes)

    def cudaMallocHost(self, nbytes):
        return self._alloc(self.host_allocs, nbytes)

    def cudaFree(self, ptr):
        return (cudaError_t.cudaSuccess,) if self.device_allocs.pop(int(ptr), None) is not None \
            else (cudaError_t.cudaErrorInvalidValue,)

    def cudaFreeHost(self, ptr):
        return (cudaError_t.cudaSuccess,) if self.host_allocs.pop(int(ptr), None) is not None \
            else (cudaError_t.cudaErrorInvalidValue,)

    def cudaMemcpy(self, dst, src, count, kind):
        if not self._ready():
            return (cudaError_t.cudaErrorDeviceUninitialized,)
        dst, src = int(dst), int(src)
        if kind in (cudaMemcpyKind.cudaMemcpyHostToDevice, cudaMemcpyKind.cudaMemcpyDeviceToDevice) \
                and not self._inside(self.device_allocs, dst, count):
            return (cudaError_t.cudaErrorInvalidValue,)
        if kind in (cudaMemcpyKind.cudaMemcpyDeviceToHost, cudaMemcpyKind.cudaMemcpyDeviceToDevice) \
                and not self._inside(self.device_allocs, src, count):
            return (cudaError_t.cudaErrorInvalidValue,)
        ctypes.memmove(dst, src, count)
        self.copies += 1
        return (cudaError_t.cudaSuccess,)

    def cudaMemcpyAsync(self, dst, src, count, kind, stream):
        if int(stream) not in self.streams:
            return (cudaError_t.cudaErrorInvalidResourceHandle,)
        return self.cudaMemcpy(dst, src, count, kind)


# =========================================================================== TensorRT double

_MAGIC = b"FAKETRT1"


class _Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


def make_fake_tensorrt(version: str = "10.13.3.9") -> types.ModuleType:
    """A ``tensorrt`` module double for TensorRT ``version`` (10.x or 11.x API surface)."""
    major = int(version.split(".")[0])
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.log: list[str] = []  # errors the double "logged", like TensorRT's logger would
    trt.stats = {"builds": 0, "deserialized": [], "executions": 0, "profile_switches": 0,
                 "timing_cache_in": [], "parsed": []}

    class DataType(enum.IntEnum):
        FLOAT = 0
        HALF = 1
        INT8 = 2
        INT32 = 3
        BOOL = 4
        INT64 = 9

    trt.DataType = DataType
    trt.float32, trt.float16, trt.int32, trt.int64 = DataType.FLOAT, DataType.HALF, DataType.INT32, DataType.INT64
    _np = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT32: np.int32,
           DataType.INT64: np.int64, DataType.BOOL: np.bool_, DataType.INT8: np.int8}
    trt.nptype = lambda dt: _np[DataType(dt)]
    _from_onnx = {TensorProto.FLOAT: DataType.FLOAT, TensorProto.FLOAT16: DataType.HALF,
                  TensorProto.INT64: DataType.INT64, TensorProto.INT32: DataType.INT32}

    flag_names = ["TF32", "REFIT", "SPARSE_WEIGHTS", "VERSION_COMPATIBLE"]
    if major < 11:  # removed in 11.x (migration guide, "Removed Python APIs")
        flag_names = ["FP16", "INT8", "BF16", "FP8", "OBEY_PRECISION_CONSTRAINTS",
                      "PREFER_PRECISION_CONSTRAINTS", "DIRECT_IO"] + flag_names
    trt.BuilderFlag = enum.IntEnum("BuilderFlag", flag_names)
    trt.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag",
                                                     {"EXPLICIT_BATCH": 0, "STRONGLY_TYPED": 1})
    trt.MemoryPoolType = enum.IntEnum("MemoryPoolType", {"WORKSPACE": 0})
    trt.LayerType = enum.IntEnum("LayerType", ["CONVOLUTION", "MATRIX_MULTIPLY", "ELEMENTWISE", "SOFTMAX",
                                               "REDUCE", "NORMALIZATION", "UNARY", "SHUFFLE", "GATHER",
                                               "CAST", "CONSTANT", "OTHER"])
    trt.TensorIOMode = enum.IntEnum("TensorIOMode", {"NONE": 0, "INPUT": 1, "OUTPUT": 2})

    class Logger:
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = (_Severity.INTERNAL_ERROR, _Severity.ERROR,
                                                         _Severity.WARNING, _Severity.INFO, _Severity.VERBOSE)
        Severity = _Severity

        def __init__(self, min_severity=_Severity.WARNING):
            self.min_severity = min_severity

    trt.Logger = Logger

    class ITensor:
        def __init__(self, name, dtype, shape):
            self.name, self.dtype, self.shape = name, dtype, tuple(shape)

    _layer_of = {"LayerNormalization": "NORMALIZATION", "Softmax": "SOFTMAX", "ReduceSum": "REDUCE",
                 "ReduceMean": "REDUCE", "MatMul": "MATRIX_MULTIPLY", "Gather": "GATHER", "Cast": "CAST",
                 "Add": "ELEMENTWISE", "Mul": "ELEMENTWISE", "Div": "ELEMENTWISE", "Sub": "ELEMENTWISE",
                 "Erf": "UNARY", "Transpose": "SHUFFLE", "Reshape": "SHUFFLE", "Unsqueeze": "SHUFFLE",
                 "Constant": "CONSTANT"}

    class ILayer:
        def __init__(self, name, op):
            self.name = name
            self.type = trt.LayerType[_layer_of.get(op, "OTHER")]
            self.num_outputs = 1
            self.precision = DataType.FLOAT
            self.precision_is_set = False
            self.output_types: dict[int, DataType] = {}

        def __setattr__(self, key, value):
            if key == "precision" and hasattr(self, "precision_is_set"):
                object.__setattr__(self, "precision_is_set", True)
            object.__setattr__(self, key, value)

        def set_output_type(self, index, dtype):
            self.output_types[index] = dtype

    class INormalizationLayer(ILayer):
        def __init__(self, name, op):
            super().__init__(name, op)
            self.compute_precision = DataType.FLOAT

    class INetworkDefinition:
        def __init__(self, flags):
            self.flags = flags
            self.strongly_typed = bool(flags & (1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)))
            self._inputs, self._outputs, self._layers = [], [], []
            self.onnx_path = None

        num_inputs = property(lambda self: len(self._inputs))
        num_outputs = property(lambda self: len(self._outputs))
        num_layers = property(lambda self: len(self._layers))

        def get_input(self, i):
            return self._inputs[i]

        def get_output(self, i):
            return self._outputs[i]

        def get_layer(self, i):
            return self._layers[i]

    class OnnxParser:
        def __init__(self, network, logger):
            self.network, self._errors = network, []

        num_errors = property(lambda self: len(self._errors))

        def get_error(self, i):
            return self._errors[i]

        def parse_from_file(self, path):
            try:
                model = onnx.load(str(path), load_external_data=False)
            except Exception as exc:  # noqa: BLE001
                self._errors.append(f"ModelImporter: failed to load {path}: {exc}")
                return False
            net = self.network
            net.onnx_path = str(path)
            trt.stats["parsed"].append(Path(path).name)
            dims = lambda vi: [d.dim_value if d.HasField("dim_value") else -1 for d in vi.type.tensor_type.shape.dim]  # noqa: E731
            for vi in model.graph.input:
                net._inputs.append(ITensor(vi.name, _from_onnx[vi.type.tensor_type.elem_type], dims(vi)))
            for vi in model.graph.output:
                net._outputs.append(ITensor(vi.name, _from_onnx[vi.type.tensor_type.elem_type], dims(vi)))
            for n in model.graph.node:
                cls = INormalizationLayer if n.op_type == "LayerNormalization" else ILayer
                net._layers.append(cls(n.name or n.op_type, n.op_type))
            return True

    class IOptimizationProfile:
        def __init__(self):
            self.shapes: dict[str, tuple] = {}

        def set_shape(self, name, min, opt, max):  # noqa: A002 - TensorRT's keyword names
            lo, op, hi = tuple(min), tuple(opt), tuple(max)
            if not (len(lo) == len(op) == len(hi) and all(a <= b <= c for a, b, c in zip(lo, op, hi))):
                raise ValueError(f"IOptimizationProfile::setDimensions: min <= opt <= max violated for {name}")
            self.shapes[name] = (lo, op, hi)

        def get_shape(self, name):
            return list(self.shapes[name])

    class ITimingCache:
        def __init__(self, data: bytes):
            self.entries = json.loads(data) if data else {"builds": 0}

        def serialize(self):
            return json.dumps(self.entries).encode()

    class IBuilderConfig:
        def __init__(self):
            self.flags, self.profiles, self.pool_limits = set(), [], {}
            self.timing_cache = None

        def set_flag(self, flag):
            self.flags.add(flag)

        def get_flag(self, flag):
            return flag in self.flags

        def set_memory_pool_limit(self, pool, size):
            self.pool_limits[pool] = size

        def add_optimization_profile(self, profile):
            self.profiles.append(profile)
            return len(self.profiles) - 1

        def create_timing_cache(self, data):
            trt.stats["timing_cache_in"].append(bytes(data))
            return ITimingCache(bytes(data))

        def set_timing_cache(self, cache, ignore_mismatch):
            self.timing_cache = cache
            return True

        def get_timing_cache(self):
            return self.timing_cache

    class Builder:
        def __init__(self, logger):
            self.logger = logger

        def create_network(self, flags=0):
            return INetworkDefinition(flags)

        def create_builder_config(self):
            return IBuilderConfig()

        def create_optimization_profile(self):
            return IOptimizationProfile()

        def build_serialized_network(self, network, config):
            if network.strongly_typed and major < 11 and any(
                    config.get_flag(getattr(trt.BuilderFlag, f)) for f in ("FP16", "INT8", "BF16")):
                trt.log.append("Error Code 2: precision flags are not allowed on a strongly typed network")
                return None
            dynamic = [t for t in network._inputs if -1 in t.shape]
            if dynamic and not config.profiles:
                trt.log.append("Error Code 4: Network has dynamic or shape inputs, but no optimization profile")
                return None
            for p in config.profiles:
                missing = [t.name for t in dynamic if t.name not in p.shapes]
                if missing:
                    trt.log.append(f"Error Code 4: optimization profile is missing values for {missing}")
                    return None
            from inference.build_engine import import_cudart, query_device

            dev = query_device(import_cudart(), 0)  # the GPU it is built on (the current device)
            trt.stats["builds"] += 1
            if config.timing_cache is not None:
                config.timing_cache.entries["builds"] += 1
            out = network._outputs[0]
            payload = {
                "version": version, "gpu": dev.name, "cc": [dev.major, dev.minor],
                "onnx": network.onnx_path, "strongly_typed": network.strongly_typed,
                "flags": sorted(f.name for f in config.flags),
                "fp32_layers": [ly.name for ly in network._layers
                                if ly.precision_is_set and ly.precision == DataType.FLOAT
                                and ly.output_types.get(0) == DataType.FLOAT],
                "inputs": [[t.name, int(t.dtype)] for t in network._inputs],
                "output": [out.name, int(out.dtype), list(out.shape)],
                "profiles": [{k: [list(s) for s in v] for k, v in p.shapes.items()} for p in config.profiles],
            }
            return _MAGIC + json.dumps(payload).encode()

    class ICudaEngine:
        def __init__(self, meta):
            self.meta = meta
            self._io = [(n, DataType(d), trt.TensorIOMode.INPUT) for n, d in meta["inputs"]]
            self._io.append((meta["output"][0], DataType(meta["output"][1]), trt.TensorIOMode.OUTPUT))

        num_io_tensors = property(lambda self: len(self._io))
        num_optimization_profiles = property(lambda self: len(self.meta["profiles"]))

        def get_tensor_name(self, i):
            return self._io[i][0]

        def get_tensor_mode(self, name):
            return next((m for n, _, m in self._io if n == name), trt.TensorIOMode.NONE)

        def get_tensor_dtype(self, name):
            return next(d for n, d, _ in self._io if n == name)

        def get_tensor_shape(self, name):
            if name == self.meta["output"][0]:
                return tuple(self.meta["output"][2])
            return (-1, -1)

        def get_tensor_profile_shape(self, name, profile_index):
            return [tuple(s) for s in self.meta["profiles"][profile_index][name]]

        def create_execution_context(self):
            return IExecutionContext(self)

    _sessions: dict[str, object] = {}

    class IExecutionContext:
        def __init__(self, engine):
            self.engine = engine
            self.active_optimization_profile = 0
            self.shapes: dict[str, tuple] = {}
            self.addresses: dict[str, int] = {}

        def set_optimization_profile_async(self, profile_index, stream_handle):
            if not 0 <= profile_index < self.engine.num_optimization_profiles:
                return False
            assert isinstance(stream_handle, int)
            self.active_optimization_profile = profile_index
            self.shapes.clear()
            trt.stats["profile_switches"] += 1
            return True

        def set_input_shape(self, name, shape):
            lo, _, hi = self.engine.get_tensor_profile_shape(name, self.active_optimization_profile)
            shape = tuple(shape)
            for i, (a, s, b) in enumerate(zip(lo, shape, hi)):
                if not a <= s <= b:
                    trt.log.append(
                        f"IExecutionContext::setInputShape: Error Code 3: API Usage Error (Parameter check "
                        f"failed, condition: engineDims.d[i] == dims.d[i]. Supplied binding dimension "
                        f"[{','.join(map(str, shape))}] for bindings[{name}] exceed min ~ max range at index "
                        f"{i}, maximum dimension in profile is {b}, minimum dimension in profile is {a}, but "
                        f"supplied dimension is {s}.)")
                    return False
            self.shapes[name] = shape
            return True

        def set_tensor_address(self, name, ptr):
            self.addresses[name] = int(ptr)
            return True

        def infer_shapes(self):
            return [n for n, _, m in self.engine._io if m == trt.TensorIOMode.INPUT and n not in self.shapes]

        def execute_async_v3(self, stream_handle):
            from inference.build_engine import cuda_check, import_cudart

            cudart = import_cudart()  # the fake here; the real cuda-python on a GPU
            assert isinstance(stream_handle, int)
            if self.infer_shapes() or any(n not in self.addresses for n, _, _ in self.engine._io):
                trt.log.append("IExecutionContext::enqueueV3: Error Code 3: not all shapes/addresses set")
                return False
            path = self.engine.meta["onnx"]
            sess = _sessions.get(path)
            if sess is None:
                so = ort.SessionOptions()
                so.intra_op_num_threads = 1
                sess = _sessions[path] = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
            cuda_check(cudart, cudart.cudaStreamSynchronize(stream_handle), "sync")
            feeds = {}
            for n, dt, m in self.engine._io:
                if m != trt.TensorIOMode.INPUT:
                    continue
                host = np.empty(self.shapes[n], dtype=trt.nptype(dt))
                cuda_check(cudart, cudart.cudaMemcpy(host.ctypes.data, self.addresses[n], host.nbytes,
                                                     cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost), "d2h")
                feeds[n] = host.astype(np.int64)
            name = self.engine.meta["output"][0]
            out = np.ascontiguousarray(sess.run([name], feeds)[0], dtype=trt.nptype(self.engine.get_tensor_dtype(name)))
            cuda_check(cudart, cudart.cudaMemcpy(self.addresses[name], out.ctypes.data, out.nbytes,
                                                 cudart.cudaMemcpyKind.cudaMemcpyHostToDevice), "h2d")
            trt.stats["executions"] += 1
            return True

    class Runtime:
        def __init__(self, logger):
            self.logger = logger

        def deserialize_cuda_engine(self, data):
            from inference.build_engine import import_cudart, query_device

            data = bytes(data)
            if not data.startswith(_MAGIC):
                trt.log.append("IRuntime::deserializeCudaEngine: Error Code 1: Serialization (magic tag mismatch)")
                return None
            meta = json.loads(data[len(_MAGIC):])
            trt.stats["deserialized"].append((meta["version"], meta["gpu"]))
            dev = query_device(import_cudart(), 0)
            if meta["version"] != version or meta["gpu"] != dev.name or meta["cc"] != [dev.major, dev.minor]:
                trt.log.append("IRuntime::deserializeCudaEngine: Error Code 1: Serialization (Version tag "
                               "does not match / engine plan built for another device)")
                return None
            return ICudaEngine(meta)

    trt.Builder, trt.OnnxParser, trt.Runtime = Builder, OnnxParser, Runtime
    trt.IBuilderConfig, trt.INetworkDefinition, trt.ICudaEngine = IBuilderConfig, INetworkDefinition, ICudaEngine
    trt.IExecutionContext, trt.IOptimizationProfile = IExecutionContext, IOptimizationProfile
    return trt


def install_fakes(monkeypatch, *, trt_version: str = "10.13.3.9", cudart: FakeCudaRuntime | None = None):
    """Put the doubles into ``sys.modules`` as ``tensorrt`` and ``cuda.bindings.runtime``."""
    trt = make_fake_tensorrt(trt_version)
    cudart = cudart or FakeCudaRuntime()
    cuda_pkg, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    cuda_pkg.bindings, bindings.runtime = bindings, cudart
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "cuda", cuda_pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", cudart)
    return trt, cudart


# =========================================================================== a tiny BERT-shaped ONNX

VOCAB, DIM = 64, 16


def write_tiny_bert_onnx(path: Path, seed: int = 0) -> Path:
    """A one-layer BERT-shaped model with the real I/O contract: Gather embedding,
    LayerNormalization, attention with the additive ``finfo(float32).min`` mask and
    Softmax, erf FFN, residual LayerNorms, masked mean pooling.
    Inputs ``input_ids``/``attention_mask`` int64[B, T]; output ``pooled`` float32[B, 16]."""
    rng = np.random.default_rng(seed)
    w = lambda *s: numpy_helper.from_array((rng.standard_normal(s) * 0.5).astype(np.float32))  # noqa: E731
    inits = []
    for name, shape in (("emb", (VOCAB, DIM)), ("wq", (DIM, DIM)), ("w1", (DIM, 4 * DIM)), ("w2", (4 * DIM, DIM))):
        t = w(*shape)
        t.name = name
        inits.append(t)
    for i in range(3):
        inits += [numpy_helper.from_array(np.ones(DIM, np.float32) + 0.1 * i, f"g{i}"),
                  numpy_helper.from_array(np.full(DIM, 0.05 * i, np.float32), f"b{i}")]
    consts = {"one": 1.0, "neg": float(np.finfo(np.float32).min), "scale": DIM ** -0.5, "lo": 1.0}
    inits += [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in consts.items()]
    inits += [numpy_helper.from_array(np.array([1], np.int64), "ax1"),
              numpy_helper.from_array(np.array([2], np.int64), "ax2"),
              numpy_helper.from_array(np.array([0, 2, 1], np.int64), "perm")]
    N = helper.make_node
    nodes = [
        N("Gather", ["emb", "input_ids"], ["e"]),
        N("LayerNormalization", ["e", "g0", "b0"], ["x"], axis=-1, epsilon=1e-12),
        N("MatMul", ["x", "wq"], ["q"]),
        N("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        N("MatMul", ["q", "xt"], ["s0"]),
        N("Mul", ["s0", "scale"], ["s1"]),
        N("Unsqueeze", ["attention_mask", "ax1"], ["m1"]),
        N("Cast", ["m1"], ["mf1"], to=TensorProto.FLOAT),
        N("Sub", ["one", "mf1"], ["inv"]),
        N("Mul", ["inv", "neg"], ["bias"]),
        N("Add", ["s1", "bias"], ["s2"]),
        N("Softmax", ["s2"], ["p"], axis=-1),
        N("MatMul", ["p", "x"], ["c"]),
        N("Add", ["c", "x"], ["r1"]),
        N("LayerNormalization", ["r1", "g1", "b1"], ["h"], axis=-1, epsilon=1e-12),
        N("MatMul", ["h", "w1"], ["f1"]),
        N("Erf", ["f1"], ["f2"]),
        N("MatMul", ["f2", "w2"], ["f3"]),
        N("Add", ["f3", "h"], ["r2"]),
        N("LayerNormalization", ["r2", "g2", "b2"], ["y"], axis=-1, epsilon=1e-12),
        N("Unsqueeze", ["attention_mask", "ax2"], ["m2"]),
        N("Cast", ["m2"], ["mf2"], to=TensorProto.FLOAT),
        N("Mul", ["y", "mf2"], ["ym"]),
        N("ReduceSum", ["ym", "ax1"], ["num"], keepdims=0),
        N("ReduceSum", ["mf2", "ax1"], ["cnt0"], keepdims=0),
        N("Clip", ["cnt0", "lo"], ["cnt"]),
        N("Div", ["num", "cnt"], ["pooled"]),
    ]
    ins = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"]) for n in ("input_ids", "attention_mask")]
    out = [helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", DIM])]
    model = helper.make_model(helper.make_graph(nodes, "tiny_bert", ins, out, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def random_batch(rng, batch: int, seq: int, pad_id: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int64[B, T] ids/mask; the first row is full length, others random."""
    lens = [seq] + list(rng.integers(1, seq + 1, batch - 1))
    ids = np.full((batch, seq), pad_id, np.int64)
    mask = np.zeros((batch, seq), np.int64)
    for r, n in enumerate(lens):
        ids[r, :n] = rng.integers(2, VOCAB, n)
        mask[r, :n] = 1
    return ids, mask


def ort_reference(onnx_path: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    return sess.run(["pooled"], {"input_ids": ids, "attention_mask": mask})[0]


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


SMALL = be.BuildSpec(max_batch_size=64, seq_buckets=(16, 32, 64, 128, 256, 512), max_tokens=1024, opt_tokens=256)
"""Profiles with small token caps so batch splitting is exercised on small inputs."""


@pytest.fixture()
def model_dir(tmp_path) -> Path:
    write_tiny_bert_onnx(tmp_path / "model.onnx")
    return tmp_path


@pytest.fixture(params=["10.13.3.9", "11.4.1.2"], ids=["trt10", "trt11"])
def fakes(request, monkeypatch):
    return install_fakes(monkeypatch, trt_version=request.param)


def _engine(model_dir, spec=SMALL, **kw):
    from inference.engines.tensorrt import TensorRTEngine

    return TensorRTEngine(model_dir, spec=spec, **kw)


# =========================================================================== profiles and naming


def test_buckets_match_the_batchers_so_each_batch_falls_in_one_profile():
    from inference.batcher import DEFAULT_BUCKETS

    assert be.DEFAULT_SEQ_BUCKETS == tuple(DEFAULT_BUCKETS)


@pytest.mark.parametrize("per_bucket", [True, False])
def test_profiles_cover_every_sequence_length_from_1_to_512_exactly_once(per_bucket):
    profiles = be.BuildSpec(per_bucket=per_bucket).profiles()
    for t in range(1, 513):
        assert sum(p.seq_min <= t <= p.seq_max for p in profiles) == 1, t
    assert profiles[0].seq_min == 1  # a 7-token query never meets a 128..128 profile


def test_profile_batches_are_capped_by_the_token_budget_and_tuned_for_the_batcher():
    profiles = {p.seq_max: p for p in be.BuildSpec().profiles()}
    assert profiles[16].batch_max == 256 and profiles[16].batch_opt == 256
    assert profiles[128].batch_max == 128 and profiles[128].batch_opt == 64
    assert profiles[512].batch_max == 32 and profiles[512].batch_opt == 16
    assert all(p.batch_min == 1 and p.batch_max * p.seq_max <= be.DEFAULT_MAX_TOKENS for p in profiles.values())


def test_engine_name_says_model_precision_gpu_compute_capability_and_tensorrt_version(tmp_path):
    dev = be.DeviceInfo("NVIDIA H200", 9, 0)
    path = be.engine_path(tmp_path, "model", be.BuildSpec(), dev, "10.13.3.9")
    assert path.name == "model.fp16.nvidia-h200.sm90.trt10.13.3.engine"
    other = be.engine_path(tmp_path, "model", be.BuildSpec(), be.DeviceInfo("NVIDIA A10", 8, 6), "10.13.3.9")
    assert other != path and "nvidia-a10.sm86" in other.name


def test_bad_spec_is_rejected_with_a_reason():
    with pytest.raises(be.BuildError, match="precision"):
        be.BuildSpec(precision="int4")
    with pytest.raises(be.BuildError, match="ascending"):
        be.BuildSpec(seq_buckets=(64, 16))


# =========================================================================== build branches 10 vs 11


def test_trt10_builds_fp16_with_normalization_softmax_and_reductions_pinned_to_fp32(model_dir, monkeypatch):
    trt, _ = install_fakes(monkeypatch, trt_version="10.13.3.9")
    res = be.build_engine(model_dir / "model.onnx", spec=SMALL)
    meta = json.loads(res.engine.read_bytes()[len(_MAGIC):])
    assert {"FP16", "OBEY_PRECISION_CONSTRAINTS"} <= set(meta["flags"])
    assert not meta["strongly_typed"] and trt.stats["parsed"] == ["model.onnx"]
    pinned = meta["fp32_layers"]
    assert len(pinned) == 3 + 1 + 2  # 3 LayerNorms, 1 Softmax, 2 ReduceSums
    assert len(meta["profiles"]) == len(SMALL.seq_buckets)
    side = json.loads(be.sidecar_path(res.engine).read_text())
    assert side["fp32_layers_pinned"] == 6 and side["tensorrt"] == "10.13.3.9"


def test_trt11_builds_a_strongly_typed_fp16_onnx_without_the_removed_precision_flags(model_dir, monkeypatch):
    trt, _ = install_fakes(monkeypatch, trt_version="11.4.1.2")
    assert not hasattr(trt.BuilderFlag, "FP16")  # using it would raise AttributeError, as on real 11.x
    res = be.build_engine(model_dir / "model.onnx", spec=SMALL)
    meta = json.loads(res.engine.read_bytes()[len(_MAGIC):])
    assert meta["strongly_typed"] and meta["flags"] == []
    assert trt.stats["parsed"] == ["model.fp16-st.onnx"] and res.strongly_typed
    fp16 = onnx.load(str(model_dir / "model.fp16-st.onnx"))
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(fp16.graph.value_info) + list(fp16.graph.output)}
    for node in fp16.graph.node:
        if node.op_type in ("LayerNormalization", "Softmax", "ReduceSum"):
            assert types[node.output[0]] == TensorProto.FLOAT, node.op_type
        if node.op_type == "MatMul":
            assert types[node.output[0]] == TensorProto.FLOAT16
    assert types["pooled"] == TensorProto.FLOAT


def test_fp16_onnx_saturates_the_additive_mask_and_stays_within_cosine_0_999(model_dir):
    src = onnx.load(str(model_dir / "model.onnx"))
    fp16 = be.to_strongly_typed_fp16(src)
    onnx.checker.check_model(fp16, full_check=True)
    rng = np.random.default_rng(3)
    ids, mask = random_batch(rng, 6, 24)
    want = ort_reference(model_dir / "model.onnx", ids, mask)
    got = ort.InferenceSession(fp16.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["pooled"], {"input_ids": ids, "attention_mask": mask})[0]
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert cosine_rows(got, want).min() >= 0.999


def test_int8_needs_an_explicitly_quantized_onnx(model_dir, monkeypatch):
    install_fakes(monkeypatch)
    with pytest.raises(be.BuildError, match="explicitly quantized"):
        be.build_engine(model_dir / "model.onnx", spec=be.BuildSpec(precision="int8"))


def test_timing_cache_is_saved_and_fed_to_the_next_build(model_dir, monkeypatch):
    trt, _ = install_fakes(monkeypatch)
    first = be.build_engine(model_dir / "model.onnx", spec=SMALL)
    cache = be.timing_cache_path(model_dir, be.DeviceInfo("NVIDIA H200", 9, 0), "10.13.3.9")
    assert cache.is_file() and trt.stats["timing_cache_in"] == [b""]
    saved = cache.read_bytes()
    be.build_engine(model_dir / "model.onnx", spec=SMALL, force=True)
    assert trt.stats["timing_cache_in"][1] == saved and json.loads(saved)["builds"] == 1
    assert first.built and trt.stats["builds"] == 2


def test_a_current_engine_is_not_built_again(model_dir, monkeypatch):
    trt, _ = install_fakes(monkeypatch)
    assert be.build_engine(model_dir / "model.onnx", spec=SMALL).built
    assert not be.build_engine(model_dir / "model.onnx", spec=SMALL).built
    assert trt.stats["builds"] == 1


# =========================================================================== runtime


def test_engine_satisfies_the_protocol_and_matches_onnx_runtime(model_dir, fakes):
    eng = _engine(model_dir)
    try:
        assert isinstance(eng, Engine) and eng.name == "tensorrt" and eng.dim == DIM and eng.max_seq_len == 512
        rng = np.random.default_rng(0)
        for batch, seq in ((1, 1), (1, 7), (3, 16), (5, 17), (8, 100), (2, 512)):
            ids, mask = random_batch(rng, batch, seq)
            got = eng.infer(ids, mask)
            want = ort_reference(model_dir / "model.onnx", ids, mask)
            assert got.shape == (batch, DIM) and got.dtype == np.float32
            if fakes[0].__version__.startswith("10"):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            else:  # 11.x runs the strongly typed FP16 ONNX
                assert cosine_rows(got, want).min() >= 0.999
    finally:
        eng.close()


def test_a_7_token_query_runs_in_the_first_bucket_instead_of_being_rejected(model_dir, fakes):
    trt, _ = fakes
    eng = _engine(model_dir)
    ids, mask = random_batch(np.random.default_rng(1), 1, 7)
    eng.infer(ids, mask)
    assert eng.bucket_for(1, 7).profile.seq_min == 1 and eng.bucket_for(1, 7).profile.seq_max == 16
    assert not any("setInputShape" in line for line in trt.log)
    eng.close()


def test_profile_is_the_smallest_bucket_holding_t_and_switches_only_when_it_changes(model_dir, fakes):
    trt, _ = fakes
    eng = _engine(model_dir)
    rng = np.random.default_rng(2)
    assert eng.bucket_for(4, 16).profile.seq_max == 16
    assert eng.bucket_for(4, 17).profile.seq_max == 32
    assert eng.bucket_for(1, 512).profile.seq_max == 512
    for seq in (10, 12, 16):  # same bucket: one switch (from the initial -1)
        eng.infer(*random_batch(rng, 2, seq))
    assert trt.stats["profile_switches"] == 1
    eng.infer(*random_batch(rng, 2, 40))
    eng.infer(*random_batch(rng, 2, 40))
    assert trt.stats["profile_switches"] == 2
    eng.close()


def test_batch_beyond_a_profiles_largest_batch_is_split_and_rows_stay_in_order(model_dir, fakes):
    trt, _ = fakes
    eng = _engine(model_dir)
    bucket = eng.bucket_for(64, 100)
    assert bucket.profile.batch_max == 1024 // 128  # SMALL caps B x T at 1024
    ids, mask = random_batch(np.random.default_rng(4), 64, 100)
    before = trt.stats["executions"]
    got = eng.infer(ids, mask)
    assert trt.stats["executions"] - before == 8
    want = ort_reference(model_dir / "model.onnx", ids, mask)
    assert cosine_rows(got, want).min() >= 0.999
    eng.close()


def test_out_of_range_inputs_raise_engine_error_naming_the_limits(model_dir, fakes):
    eng = _engine(model_dir)
    with pytest.raises(EngineError, match=r"outside \[1..64, 1..512\]"):
        eng.infer(np.ones((1, 513), np.int64), np.ones((1, 513), np.int64))
    with pytest.raises(EngineError, match="must both be"):
        eng.infer(np.ones((2, 5), np.int64), np.ones((2, 6), np.int64))
    eng.close()


def test_context_shape_check_failure_becomes_an_engine_error_with_the_profile(model_dir, fakes):
    eng = _engine(model_dir)
    b = eng.bucket_for(1, 16)
    object.__setattr__(b, "profile", be.Profile(1, 1, 64, 1, 16, 64))  # lie: pretend the bucket reaches 64
    with pytest.raises(EngineError, match=r"rejected input shape \[1, 40\].*T 1..64"):
        eng._run(b, np.ones((1, 40), np.int64), np.ones((1, 40), np.int64))
    eng.close()


def test_buffers_are_allocated_once_per_bucket_at_load_and_freed_at_close(model_dir, fakes):
    _, cudart = fakes
    eng = _engine(model_dir)
    n_profiles = len(SMALL.seq_buckets)
    assert len(cudart.device_allocs) == len(cudart.host_allocs) == 3 * n_profiles  # ids, mask, pooled
    expected = set()
    for p in SMALL.profiles():
        expected |= {p.batch_max * p.seq_max * 8, p.batch_max * DIM * 4}
    assert set(cudart.malloc_sizes) == expected
    rng = np.random.default_rng(5)
    for _ in range(20):
        eng.infer(*random_batch(rng, int(rng.integers(1, 64)), int(rng.integers(1, 300))))
    assert len(cudart.malloc_sizes) == 2 * 3 * n_profiles  # nothing allocated per call
    eng.close()
    eng.close()  # idempotent
    assert not cudart.device_allocs and not cudart.host_allocs and not cudart.streams
    with pytest.raises(EngineError, match="closed"):
        eng.infer(np.ones((1, 3), np.int64), np.ones((1, 3), np.int64))


def test_other_threads_make_the_device_current_before_first_use(model_dir, fakes):
    _, cudart = fakes
    eng = _engine(model_dir)  # made on this thread, like the manager's probe
    ids, mask = random_batch(np.random.default_rng(6), 2, 9)
    out: dict[str, object] = {}

    def worker():
        try:
            out["y"] = eng.infer(ids, mask)
        except Exception as exc:  # noqa: BLE001
            out["err"] = exc

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert "err" not in out, out.get("err")
    assert len(cudart.set_device_threads) == 2
    eng.close()


def test_the_fake_runtime_really_rejects_a_thread_without_a_current_device(fakes):
    _, cudart = fakes
    res: list = []
    t = threading.Thread(target=lambda: res.append(cudart.cudaMalloc(16)[0]))
    t.start()
    t.join()
    assert res == [cudaError_t.cudaErrorDeviceUninitialized]


async def test_pool_workers_each_own_an_engine_and_results_match(model_dir, fakes):
    from inference.engines.tensorrt import TensorRTEngine
    from inference.pool import InferencePool

    _, cudart = fakes
    pool = await InferencePool.start(lambda: TensorRTEngine(model_dir, spec=SMALL), workers=2, pad_id=1)
    try:
        rng = np.random.default_rng(7)
        windows = [[0] + list(rng.integers(3, VOCAB, int(n))) + [2] for n in rng.integers(1, 60, 40)]
        outs = await asyncio.gather(*(pool.run_batch(windows[i:i + 5]) for i in range(0, 40, 5)))
        got = np.concatenate(outs)
        from inference.pool import pad_batch

        want = np.concatenate([ort_reference(model_dir / "model.onnx", *pad_batch(windows[i:i + 5], 1))
                               for i in range(0, 40, 5)])
        assert cosine_rows(got, want).min() >= 0.999
        assert len(cudart.set_device_threads) >= 2 and len(cudart.streams) == 2
    finally:
        await pool.close()
    assert not cudart.streams


# =========================================================================== engine identity, rebuild


def test_engine_from_another_gpu_is_rebuilt_never_loaded(model_dir, monkeypatch):
    a10 = FakeCudaRuntime("NVIDIA A10", (8, 6))
    trt, _ = install_fakes(monkeypatch, cudart=a10)
    built_on_a10 = be.build_engine(model_dir / "model.onnx", spec=SMALL).engine
    trt2, h200 = install_fakes(monkeypatch)  # same files, now on an H200
    eng = _engine(model_dir)
    assert eng.engine_file != built_on_a10 and "nvidia-h200.sm90" in eng.engine_file.name
    assert trt2.stats["deserialized"] == [("10.13.3.9", "NVIDIA H200")]  # the A10 plan was never read
    assert built_on_a10.is_file()
    eng.close()


def test_engine_from_another_tensorrt_version_is_rebuilt_never_loaded(model_dir, monkeypatch):
    install_fakes(monkeypatch, trt_version="10.13.3.9")
    old = be.build_engine(model_dir / "model.onnx", spec=SMALL).engine
    trt11, _ = install_fakes(monkeypatch, trt_version="11.4.1.2")
    eng = _engine(model_dir)
    assert eng.engine_file != old and ".trt11.4.1." in eng.engine_file.name
    assert all(v == "11.4.1.2" for v, _ in trt11.stats["deserialized"])
    eng.close()


def test_unreadable_engine_under_the_right_name_is_rebuilt_once(model_dir, fakes):
    trt, _ = fakes
    path = _engine(model_dir).engine_file
    path.write_bytes(b"truncated copy")
    eng = _engine(model_dir)
    assert trt.stats["builds"] == 2 and any("magic tag" in line for line in trt.log)
    eng.infer(*random_batch(np.random.default_rng(8), 2, 5))
    eng.close()


def test_a_re_prepared_onnx_makes_the_engine_stale(model_dir, fakes):
    trt, _ = fakes
    _engine(model_dir).close()
    write_tiny_bert_onnx(model_dir / "model.onnx", seed=1)
    _engine(model_dir).close()
    assert trt.stats["builds"] == 2


def test_missing_engine_without_build_permission_says_what_to_run(model_dir, fakes):
    with pytest.raises(EngineError, match="run 'healthbot build-engine'"):
        _engine(model_dir, build_missing=False)


def test_missing_tensorrt_is_an_engine_error_with_the_install_hint(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(EngineError, match="pip install tensorrt"):
        _engine(model_dir)


def test_missing_onnx_is_an_engine_error_pointing_at_prepare_model(tmp_path, fakes):
    with pytest.raises(EngineError, match="prepare-model"):
        _engine(tmp_path)


def test_build_engine_cli_prints_the_engine_path(model_dir, fakes, capsys):
    assert be.main(["--engines-dir", str(model_dir), "--max-batch", "32"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.endswith(".engine") and Path(printed).is_file()


def test_unexpected_errors_while_loading_become_engine_errors_so_the_manager_falls_back(model_dir, fakes, monkeypatch):
    trt, _ = fakes

    def broken(self, logger):
        raise TypeError("pybind11 signature mismatch")

    monkeypatch.setattr(trt.Runtime, "__init__", broken)
    with pytest.raises(EngineError, match="TypeError: pybind11 signature mismatch"):
        _engine(model_dir)
