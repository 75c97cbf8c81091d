"""The TensorRT API double and the cuda-python runtime double of tests/test_tensorrt.py (whose
module doc says what they mirror), and a tiny BERT-shaped ONNX to build from. ``tools/gpu_bench.py``
imports them too (``tests.trt_doubles``), to exercise the real cuda-python path on a GPU."""

from __future__ import annotations

import ctypes
import enum
import json
import sys
import threading
import types
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


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

FAKE_ENGINE_MAGIC = b"FAKETRT1"


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
            from inference.engines.cuda import import_cudart, query_device

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
            return FAKE_ENGINE_MAGIC + json.dumps(payload).encode()

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
            from inference.engines.cuda import cuda_check, import_cudart

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
            from inference.engines.cuda import import_cudart, query_device

            data = bytes(data)
            if not data.startswith(FAKE_ENGINE_MAGIC):
                trt.log.append("IRuntime::deserializeCudaEngine: Error Code 1: Serialization (magic tag mismatch)")
                return None
            meta = json.loads(data[len(FAKE_ENGINE_MAGIC):])
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
