"""Model manager: engine choice, placement on GPUs, runtime fallback (circuit breaker) and hot swap.

ARCHITECTURE.md, "The inference pool".

**Choice at start-up** (:func:`load_engine_factory`): engines are tried in the
configured order (production default tensorrt, torch_cuda, onnxruntime); the
first that loads is used and the log says which one and why the others were
skipped (GPU engines are skipped at once without a GPU).

**Placement** (:func:`resolve_devices`, issue 9): a GPU engine gets
``inference.workers`` engines on every GPU of ``inference.devices`` (``"all"``:
every visible one); the :class:`~inference.pool.InferencePool` routes each batch
to the least-loaded GPU and takes a failing GPU out of rotation while the
others keep serving.

**Runtime fallback** (:class:`ModelManager`): next to a GPU pool the manager
keeps a stand-by pool of ``inference.fallback_engine`` (ONNX Runtime on the CPU,
loaded at start so a fallback never waits for a load). A batch the GPU pool
fails is served again on the CPU pool at once, so no request is lost;
``inference.circuit_failures`` consecutive failures open the circuit: every
batch goes to the CPU until, ``inference.circuit_reset_s`` later, one batch
probes the GPU again (half-open): success closes the circuit, failure re-opens
it for twice as long (up to ``inference.circuit_max_reset_s``).

**Hot swap** (:meth:`ModelManager.swap`): a new engine version is loaded into a
new pool while the old one serves; then new batches go to the new pool and the
old one is closed once the batches it admitted are done. No request fails.

Metrics (bot/metrics.py): ``healthbot_engine_fallbacks_total{from_engine,
to_engine}`` counts each engine passed over at start-up and each time a circuit
opens at run time; ``healthbot_engine_circuit_state{engine}`` is 0 closed, 1
open, 2 half-open (a skipped engine stays open until a restart);
``healthbot_inference_workers{engine}`` counts the workers of the engine that
is serving (the stand-by CPU pool counts only while the circuit is open).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import structlog

from bot import metrics
from inference.config import InferenceConfig
from inference.engines.base import Engine, EngineError
from inference.pool import Device, InferencePool

log = structlog.get_logger("healthbot.inference.manager")

#: Engine names ``inference.engine_order`` may hold (ARCHITECTURE.md).
KNOWN_ENGINES = ("tensorrt", "torch_cuda", "onnxruntime")

#: Engines that run on a GPU (placed per device); the others run on the CPU.
GPU_ENGINES = frozenset({"tensorrt", "torch_cuda"})

#: The ONNX file ``healthbot prepare-model`` writes into the engines folder.
ONNX_FILE = "model.onnx"


def onnx_model_for(cfg: InferenceConfig, engines_dir: Path) -> tuple[Path, str]:
    """The ONNX file the ``onnxruntime`` engine loads, and its precision.

    ``inference.onnx_precision``: ``fp32`` → ``model.onnx``; ``int8`` →
    ``model.int8.onnx`` (must exist); ``auto`` → the INT8 file when it is current
    and passed the accuracy check (:func:`inference.onnx_variants.int8_status`),
    else ``model.onnx``.

    Raises:
        EngineError: ``int8`` asked for but not built (the message has the command).
    """
    from inference.onnx_variants import int8_status, variant_path

    engines_dir = Path(engines_dir)
    if cfg.onnx_precision == "int8":
        path = variant_path(engines_dir, "int8")
        if not path.is_file():
            raise EngineError(f"{path} missing: run 'healthbot build-engine --engine onnxruntime --precision int8' "
                              "(or set inference.onnx_precision = \"fp32\")")
        return path, "int8"
    if cfg.onnx_precision == "auto":
        status = int8_status(engines_dir)
        if status.usable:
            return status.path, "int8"
        if status.exists:
            log.warning("onnx_int8_not_used", reason=status.reason)
    return variant_path(engines_dir, "fp32"), "fp32"


def _load_onnxruntime(cfg: InferenceConfig, engines_dir: Path, device: Device = None) -> Engine:
    from inference.engines.onnxruntime import OnnxRuntimeEngine

    path, precision = onnx_model_for(cfg, engines_dir)
    # The CPU engine takes CPU-sized batches: a GPU batch of 256 handed to it while
    # the circuit is open is split by the pool instead of one very long call.
    return OnnxRuntimeEngine(path, intra_op_threads=cfg.intra_op_threads, precision=precision,
                             max_batch_size=cfg.max_batch_size)


#: Why a GPU engine is skipped on a machine without one (logged at info, not counted as a fallback).
NO_GPU = "no NVIDIA GPU visible"


def _gpu_visible() -> bool:
    """True when an NVIDIA device node exists (checked before importing a CUDA stack)."""
    return any(Path("/dev").glob("nvidia[0-9]*")) or bool(os.environ.get("HEALTHBOT_ASSUME_GPU"))


def _load_remote(cfg: InferenceConfig, name: str) -> Engine:
    """``name`` served by this GPU's engine server (a worker process with ``inference.engine_socket``)."""
    from inference.engines.remote import RemoteEngine

    return RemoteEngine(cfg.engine_socket, expect=name, timeout_s=cfg.deadline_ms / 1000.0 + 1.0)


def _load_tensorrt(cfg: InferenceConfig, engines_dir: Path, device: Device = None) -> Engine:
    if not _gpu_visible():
        raise EngineError(NO_GPU)
    if cfg.engine_socket:
        return _load_remote(cfg, "tensorrt")
    from inference.engines.tensorrt import TensorRTEngine

    # build_missing=False: a missing engine falls back at once; build it with
    # `healthbot build-engine` (an init container) rather than during start-up.
    return TensorRTEngine(engines_dir, onnx_file=ONNX_FILE, build_missing=False, device=device or 0)


def _load_torch_cuda(cfg: InferenceConfig, engines_dir: Path, device: Device = None) -> Engine:
    if not _gpu_visible():
        raise EngineError(NO_GPU)
    if cfg.engine_socket:
        return _load_remote(cfg, "torch_cuda")
    from inference.engines.torch_cuda import TorchCudaEngine

    return TorchCudaEngine.from_engines_dir(engines_dir, device=device or 0)


#: name -> loader(cfg, engines_dir, device) -> Engine; a loader raises EngineError when it cannot load.
_LOADERS: dict[str, Callable[[InferenceConfig, Path, Device], Engine]] = {
    "tensorrt": _load_tensorrt,
    "torch_cuda": _load_torch_cuda,
    "onnxruntime": _load_onnxruntime,
}


# --------------------------------------------------------------------------- devices
def visible_gpu_count() -> int:
    """GPUs this process can use: PyTorch's count when torch has CUDA, else cuda-python's
    ``cudaGetDeviceCount``, else the ``/dev/nvidia<N>`` nodes (limited by
    ``CUDA_VISIBLE_DEVICES``); 0 without any. ``HEALTHBOT_ASSUME_GPU=N`` (tests, whose
    GPU engines are doubles) makes it N."""
    if not _gpu_visible():
        return 0
    if os.environ.get("HEALTHBOT_ASSUME_GPU", "").isdigit():
        return int(os.environ["HEALTHBOT_ASSUME_GPU"])
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.device_count())
    except ImportError:
        pass
    try:
        from inference.build_engine import cuda_check, import_cudart

        cudart = import_cudart()
        return int(cuda_check(cudart, cudart.cudaGetDeviceCount(), "cudaGetDeviceCount"))
    except (ImportError, RuntimeError):
        pass
    nodes = len(list(Path("/dev").glob("nvidia[0-9]*")))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        nodes = min(nodes, len([v for v in visible.split(",") if v.strip()]))
    return nodes


def resolve_devices(devices: Sequence[str | int], engine: str,
                    count: Callable[[], int] = visible_gpu_count) -> list[Device]:
    """The devices an engine's workers are placed on.

    Args:
        devices: ``inference.devices``: ``["all"]`` or GPU indices (``["0", "1"]``).
        engine: the engine's name; CPU engines always get ``[None]``.
        count: visible GPU count (tests pass a fake).

    Returns:
        ``[None]`` for a CPU engine, else the GPU indices in order, without duplicates.

    Raises:
        EngineError: no GPU visible, or an index beyond the visible GPUs.
    """
    if engine not in GPU_ENGINES:
        return [None]
    spec = [str(d).strip() for d in devices] or ["all"]
    n = count()
    if n < 1:
        raise EngineError(f"{engine}: no GPU visible (inference.devices = {spec})")
    if spec == ["all"]:
        return list(range(n))
    try:
        ids = list(dict.fromkeys(int(d) for d in spec))
    except ValueError:
        raise EngineError(f"inference.devices {spec}: use \"all\" or GPU indices") from None
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise EngineError(f"inference.devices {spec}: GPU(s) {bad} not visible ({n} visible: 0..{n - 1})")
    return ids


def _call_loader(loader: Callable[..., Engine], cfg: InferenceConfig, engines_dir: Path, device: Device) -> Engine:
    """``loader(cfg, engines_dir, device)``; loaders written before placement (two
    arguments, e.g. test doubles) are called without the device."""
    try:
        params = inspect.signature(loader).parameters.values()
        takes_device = len(params) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)
    except (TypeError, ValueError):
        takes_device = True
    return loader(cfg, engines_dir, device) if takes_device else loader(cfg, engines_dir)


def _first_device(cfg: InferenceConfig) -> int:
    spec = [str(d).strip() for d in cfg.devices]
    return 0 if not spec or spec == ["all"] else int(spec[0])


# --------------------------------------------------------------------------- factory
@dataclass
class EngineFactory:
    """Creates engines of the chosen kind; call it once per pool worker, on that worker's thread.

    ``factory()`` for CPU engines, ``factory(device)`` for GPU index ``device``.
    The first call for the device the choice was made on hands out the instance
    loaded while choosing (so the model is not loaded twice); later calls load new
    instances. Engines whose context is tied to a thread (CUDA) make it current
    in :meth:`Engine.infer`'s thread.

    Attributes:
        name: the chosen engine (``"onnxruntime"``, ...).
        skipped: ``{name: reason}`` for engines earlier in the order that did not load.
        probe_device: the device the probe engine was loaded on (None: CPU).
    """

    name: str
    _load: Callable[[Device], Engine]
    _probe: Engine | None
    skipped: dict[str, str] = field(default_factory=dict)
    probe_device: Device = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, device: Device = None) -> Engine:
        with self._lock:
            probe = None
            if self._probe is not None and (device is None or device == self.probe_device):
                probe, self._probe = self._probe, None
        return probe if probe is not None else self._load(device)

    def discard_probe(self) -> None:
        """Close the probe engine if no worker took it."""
        with self._lock:
            probe, self._probe = self._probe, None
        if probe is not None:
            probe.close()


def load_engine_factory(cfg: InferenceConfig, engines_dir: Path) -> EngineFactory:
    """Load the first engine of ``cfg.engine_order`` that works; return its factory.

    Blocking (loads a model): call it off the event loop (``asyncio.to_thread``).

    Args:
        cfg: ``engine_order`` and engine knobs (``intra_op_threads``, ``onnx_precision``, ``devices``).
        engines_dir: folder with ``model.onnx`` / ``.engine`` files and ``manifest.json``.

    Raises:
        EngineError: an unknown engine name (before anything is loaded), or no
            engine in the order loaded (the message lists each one's reason).
    """
    unknown = [n for n in cfg.engine_order if n not in _LOADERS]
    if unknown:
        raise EngineError(f"unknown engine(s) {unknown} in inference.engine_order: "
                          f"choose from {list(KNOWN_ENGINES)}")
    if not cfg.engine_order:
        raise EngineError(f"inference.engine_order is empty: list engines from {list(KNOWN_ENGINES)}")
    engines_dir = Path(engines_dir)
    skipped: dict[str, str] = {}
    for name in cfg.engine_order:
        loader = _LOADERS[name]
        device = _first_device(cfg) if name in GPU_ENGINES else None
        try:
            probe = _call_loader(loader, cfg, engines_dir, device)
        except EngineError as exc:
            skipped[name] = str(exc)
            if NO_GPU in str(exc):  # a GPU engine on a machine without a GPU: expected, not a failure
                log.info("engine_skipped", engine=name, reason=str(exc))
                continue
            log.warning("engine_skipped", engine=name, reason=str(exc))
            metrics.set_circuit_state(name, metrics.CircuitState.OPEN)
            continue
        failed = {k: why for k, why in skipped.items() if NO_GPU not in why}
        if failed:
            log.warning("engine_selected", engine=name, skipped=skipped)
        elif skipped:
            log.info("engine_selected", engine=name, skipped=skipped)
        else:
            log.info("engine_selected", engine=name, reason="first in inference.engine_order")
        for passed_over in failed:
            metrics.record_fallback(passed_over, name)
        metrics.set_circuit_state(name, metrics.CircuitState.CLOSED)
        return EngineFactory(name, lambda d, loader=loader: _call_loader(loader, cfg, engines_dir, d), probe, skipped,
                             device)
    for passed_over in skipped:
        metrics.record_fallback(passed_over, None)
    raise EngineError("no inference engine could be loaded: "
                      + "; ".join(f"{k}: {v}" for k, v in skipped.items()))


def load_fallback_factory(cfg: InferenceConfig, engines_dir: Path) -> EngineFactory:
    """Factory of ``cfg.fallback_engine`` (a CPU engine), its first instance loaded.

    Raises:
        EngineError: unknown or GPU fallback engine, or it does not load.
    """
    name = cfg.fallback_engine
    if name not in _LOADERS or name in GPU_ENGINES:
        raise EngineError(f"inference.fallback_engine {name!r}: use a CPU engine (onnxruntime) or \"\" for none")
    loader = _LOADERS[name]
    probe = _call_loader(loader, cfg, engines_dir, None)
    return EngineFactory(name, lambda d, loader=loader: _call_loader(loader, cfg, engines_dir, None), probe)


# --------------------------------------------------------------------------- manager
CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
_STATE_VALUE = {CLOSED: metrics.CircuitState.CLOSED, OPEN: metrics.CircuitState.OPEN,
                HALF_OPEN: metrics.CircuitState.HALF_OPEN}


class ModelManager:
    """What the batcher runs batches on: the primary pool, a stand-by CPU pool and the
    circuit breaker between them, with hot swap of the primary (module doc).

    Pool-like: ``run_batch``, ``engine_name`` (the engine serving now), ``dim``,
    ``max_batch_size``, ``max_seq_len``, ``workers``, ``pad_id``, ``on_gpu``, ``close``.

    Args:
        primary: the pool of the chosen engine.
        fallback: the stand-by CPU pool, or None (then failures reach the callers).
        circuit_failures: consecutive failed batches that open the circuit.
        reset_s / max_reset_s: wait before the first half-open probe, and its cap
            (doubled per failed probe), seconds.
        pool_options: what :meth:`swap` starts the new pool with (workers, devices, ...).

    Attributes:
        state: ``"closed"``, ``"open"`` or ``"half_open"``.
        fallback_batches: batches served by the fallback pool.
        swaps: hot swaps done.
    """

    def __init__(self, primary: InferencePool, fallback: InferencePool | None = None, *, circuit_failures: int = 3,
                 reset_s: float = 5.0, max_reset_s: float = 60.0,
                 pool_options: dict[str, Any] | None = None) -> None:
        self._primary = primary
        self._fallback = fallback
        self.circuit_failures = circuit_failures
        self.reset_s = reset_s
        self.max_reset_s = max_reset_s
        self._pool_options = pool_options or {}
        self.state = CLOSED
        self._failures = 0
        self._retry_at = 0.0
        self._backoff = reset_s
        self._probing = False
        self.fallback_batches = 0
        self.swaps = 0
        self._closed = False
        self.pad_id = primary.pad_id
        self.dim = primary.dim
        metrics.set_circuit_state(primary.engine_name, metrics.CircuitState.CLOSED)

    @classmethod
    async def start(cls, cfg: InferenceConfig, engines_dir: Path, pad_id: int,
                    factory: EngineFactory | None = None) -> ModelManager:
        """Choose the engine, start its pool on its devices and the stand-by CPU pool.

        Model loading runs off the event loop.

        Raises:
            EngineError: no engine could be loaded, or the devices are invalid.
        """
        cfg.validate()
        if factory is None:
            factory = await asyncio.to_thread(load_engine_factory, cfg, engines_dir)
        try:
            devices = resolve_devices(cfg.devices, factory.name)
        except EngineError:
            factory.discard_probe()
            raise
        options = dict(workers=cfg.workers, pad_id=pad_id, devices=devices, circuit_failures=cfg.circuit_failures,
                       reset_s=cfg.circuit_reset_s, max_reset_s=cfg.circuit_max_reset_s)
        primary = await _start_pool(factory, options)
        fallback = None
        if cfg.fallback_engine and cfg.fallback_engine != factory.name:
            try:
                fb_factory = await asyncio.to_thread(load_fallback_factory, cfg, engines_dir)
                fallback = await InferencePool.start(fb_factory, 1, pad_id, record_workers=False)
                metrics.set_circuit_state(fallback.engine_name, metrics.CircuitState.CLOSED)
                log.info("fallback_engine_ready", engine=fallback.engine_name, primary=factory.name)
            except EngineError as exc:
                log.warning("fallback_engine_unavailable", engine=cfg.fallback_engine, error=str(exc),
                            effect="GPU failures reach the callers")
        return cls(primary, fallback, circuit_failures=cfg.circuit_failures, reset_s=cfg.circuit_reset_s,
                   max_reset_s=cfg.circuit_max_reset_s, pool_options=options)

    # ------------------------------------------------------------------ pool-like
    @property
    def primary(self) -> InferencePool:
        return self._primary

    @property
    def fallback(self) -> InferencePool | None:
        return self._fallback

    @property
    def engine_name(self) -> str:
        """The engine serving new batches now (the fallback's while the circuit is open)."""
        if self.state == OPEN and self._fallback is not None:
            return self._fallback.engine_name
        return self._primary.engine_name

    @property
    def variant(self) -> str:
        """``"<engine>/<precision>"`` of the engine serving now, e.g. ``"onnxruntime/int8"``
        (what a cache of vectors must be keyed by, besides the model file)."""
        pool = self._fallback if self.state == OPEN and self._fallback is not None else self._primary
        return f"{pool.engine_name}/{pool.precision}"

    @property
    def max_batch_size(self) -> int:
        return self._primary.max_batch_size

    @property
    def max_seq_len(self) -> int:
        return min(p.max_seq_len for p in (self._primary, self._fallback) if p is not None)

    @property
    def workers(self) -> int:
        return self._primary.workers

    @property
    def on_gpu(self) -> bool:
        return self._primary.on_gpu

    @property
    def batches_run(self) -> int:
        return self._primary.batches_run + (self._fallback.batches_run if self._fallback else 0)

    async def call_on_worker(self, fn: Callable[[Engine], Any], device: Device | str = "first") -> Any:
        """``fn(engine)`` on a worker of the primary pool (the bench's engine-only run)."""
        return await self._primary.call_on_worker(fn, device)

    # ------------------------------------------------------------------ circuit
    def _set_state(self, state: str) -> None:
        if state == self.state:
            return
        was_open = self.state != CLOSED
        self.state = state
        metrics.set_circuit_state(self._primary.engine_name, _STATE_VALUE[state])
        if self._fallback is not None and was_open != (state != CLOSED):
            # Workers gauge: the engine serving is the one with workers counted.
            self._primary.set_record_workers(state == CLOSED)
            self._fallback.set_record_workers(state != CLOSED)

    def _on_failure(self, exc: Exception, probe: bool) -> None:
        self._failures += 1
        if probe:
            self._backoff = min(self._backoff * 2, self.max_reset_s)
            self._retry_at = time.monotonic() + self._backoff
            self._set_state(OPEN)
            log.warning("engine_circuit_probe_failed", engine=self._primary.engine_name, retry_in_s=self._backoff,
                        error=str(exc))
        elif self.state == CLOSED and self._failures >= self.circuit_failures:
            self._backoff = self.reset_s
            self._retry_at = time.monotonic() + self._backoff
            self._set_state(OPEN)
            metrics.record_fallback(self._primary.engine_name, self._fallback.engine_name)
            log.error("engine_circuit_opened", engine=self._primary.engine_name, to_engine=self._fallback.engine_name,
                      failures=self._failures, retry_in_s=self._backoff, error=str(exc))

    def _on_success(self, probe: bool) -> None:
        self._failures = 0
        if probe or self.state != CLOSED:
            self._backoff = self.reset_s
            self._set_state(CLOSED)
            log.warning("engine_circuit_closed", engine=self._primary.engine_name,
                        reason="probe batch succeeded: the engine recovered")

    async def _run_fallback(self, windows: list[list[int]]) -> np.ndarray:
        self.fallback_batches += 1
        return await self._fallback.run_batch(windows)

    async def run_batch(self, windows: list[list[int]]) -> np.ndarray:
        """Run one batch on the primary engine, or on the CPU engine when the circuit is
        open or the primary failed this batch (module doc).

        Returns:
            float32[N, D] mean-pooled, not normalized.

        Raises:
            EngineError: no fallback and the primary failed, or both failed.
        """
        if self._closed:
            raise EngineError("inference engines are closed")
        fallback = self._fallback
        probe = False
        if fallback is not None and self.state != CLOSED:
            if self._probing or time.monotonic() < self._retry_at:
                return await self._run_fallback(windows)
            probe = True
            self._probing = True
            self._set_state(HALF_OPEN)
        primary = self._primary
        try:
            out = await primary.run_batch(windows, probe=probe)
        except EngineError as exc:
            if primary is not self._primary:  # swapped while it ran: the new engine takes it
                return await self._primary.run_batch(windows)
            if fallback is None:
                raise
            self._on_failure(exc, probe)
            return await self._run_fallback(windows)
        finally:
            if probe:
                self._probing = False
        if primary is self._primary:
            self._on_success(probe)
        return out

    # ------------------------------------------------------------------ hot swap
    async def swap(self, factory: EngineFactory | Callable[..., Engine]) -> InferencePool:
        """Load a new engine version and switch to it without failing any request.

        The new pool starts (same workers and devices) while the old one serves;
        then new batches go to the new pool, the old one finishes the batches it
        admitted and is closed. The circuit starts closed for the new engine.

        Args:
            factory: engine factory of the new version (``load_engine_factory(...)``
                or any ``factory()`` / ``factory(device)``).

        Returns:
            the new primary pool.

        Raises:
            EngineError: the new version did not load, or its embedding dimension
                differs (the old one keeps serving in both cases).
        """
        new = await _start_pool(factory, self._pool_options)
        if new.dim != self.dim:
            await new.close()
            raise EngineError(f"new engine gives {new.dim}-dim vectors, the serving one {self.dim}: "
                              "not swapped (re-embed the knowledge base with a restart instead)")
        old = self._primary
        if self.state != CLOSED:
            self._set_state(CLOSED)
        self._primary = new
        self._failures = 0
        self._backoff = self.reset_s
        self.swaps += 1
        metrics.set_circuit_state(new.engine_name, metrics.CircuitState.CLOSED)
        log.info("engine_swapped", engine=new.engine_name, old_engine=old.engine_name, workers=new.workers)
        await old.close()
        return new

    async def reload(self, cfg: InferenceConfig, engines_dir: Path) -> InferencePool:
        """Hot-swap to whatever :func:`load_engine_factory` chooses now (e.g. after
        ``healthbot build-engine`` wrote a new engine)."""
        factory = await asyncio.to_thread(load_engine_factory, cfg, engines_dir)
        return await self.swap(factory)

    async def close(self) -> None:
        """Close both pools (each waits for the batches it admitted). Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._primary.close()
        if self._fallback is not None:
            await self._fallback.close()


async def _start_pool(factory: Callable[..., Engine], options: dict[str, Any]) -> InferencePool:
    opts = dict(options)
    workers = opts.pop("workers", 1)
    pad_id = opts.pop("pad_id", 1)
    try:
        return await InferencePool.start(factory, workers, pad_id, **opts)
    finally:
        if isinstance(factory, EngineFactory):
            factory.discard_probe()
