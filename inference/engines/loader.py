"""Engine choice at start-up: the loader of each engine name, and :func:`load_engine_factory`,
which tries the engines of ``inference.engine_order`` in turn (module doc of
:mod:`inference.manager`). Tools and tests put their own loader in with :func:`register_loader`."""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import structlog

from inference import metrics
from inference.config import InferenceConfig
from inference.devices import GPU_ENGINES, NO_GPU, Device, gpu_visible
from inference.engines.base import Engine, EngineError

log = structlog.get_logger("healthbot.inference.manager")

#: Engine names ``inference.engine_order`` may hold (ARCHITECTURE.md).
KNOWN_ENGINES = ("tensorrt", "torch_cuda", "onnxruntime")

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


def _load_remote(cfg: InferenceConfig, name: str) -> Engine:
    """``name`` served by this GPU's engine server (a worker process with ``inference.engine_socket``)."""
    from inference.engines.remote import RemoteEngine

    return RemoteEngine(cfg.engine_socket, expect=name, timeout_s=cfg.deadline_ms / 1000.0 + 1.0)


def _load_tensorrt(cfg: InferenceConfig, engines_dir: Path, device: Device = None) -> Engine:
    if not gpu_visible():
        raise EngineError(NO_GPU)
    if cfg.engine_socket:
        return _load_remote(cfg, "tensorrt")
    from inference.engines.tensorrt.engine import TensorRTEngine

    # build_missing=False: a missing engine falls back at once; build it with
    # `healthbot build-engine` (an init container) rather than during start-up.
    return TensorRTEngine(engines_dir, onnx_file=ONNX_FILE, build_missing=False, device=device or 0)


def _load_torch_cuda(cfg: InferenceConfig, engines_dir: Path, device: Device = None) -> Engine:
    if not gpu_visible():
        raise EngineError(NO_GPU)
    if cfg.engine_socket:
        return _load_remote(cfg, "torch_cuda")
    from inference.engines.torch_cuda.engine import TorchCudaEngine

    return TorchCudaEngine.from_engines_dir(engines_dir, device=device or 0)


#: name -> loader(cfg, engines_dir, device) -> Engine; a loader raises EngineError when it cannot load.
LOADERS: dict[str, Callable[[InferenceConfig, Path, Device], Engine]] = {
    "tensorrt": _load_tensorrt,
    "torch_cuda": _load_torch_cuda,
    "onnxruntime": _load_onnxruntime,
}


def register_loader(name: str, loader: Callable[..., Engine], *, gpu: bool) -> None:
    """Load engine ``name`` with ``loader(cfg, engines_dir, device)`` from now on (tools and
    tests: an engine built from other weights, a double); ``gpu``: whether it is placed on GPUs."""
    LOADERS[name] = loader
    if gpu:
        GPU_ENGINES.add(name)
    else:
        GPU_ENGINES.discard(name)


def call_loader(loader: Callable[..., Engine], cfg: InferenceConfig, engines_dir: Path, device: Device) -> Engine:
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
    unknown = [n for n in cfg.engine_order if n not in LOADERS]
    if unknown:
        raise EngineError(f"unknown engine(s) {unknown} in inference.engine_order: "
                          f"choose from {list(KNOWN_ENGINES)}")
    if not cfg.engine_order:
        raise EngineError(f"inference.engine_order is empty: list engines from {list(KNOWN_ENGINES)}")
    engines_dir = Path(engines_dir)
    skipped: dict[str, str] = {}
    for name in cfg.engine_order:
        loader = LOADERS[name]
        device = _first_device(cfg) if name in GPU_ENGINES else None
        try:
            probe = call_loader(loader, cfg, engines_dir, device)
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
        return EngineFactory(name, lambda d, loader=loader: call_loader(loader, cfg, engines_dir, d), probe, skipped,
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
    if name not in LOADERS or name in GPU_ENGINES:
        raise EngineError(f"inference.fallback_engine {name!r}: use a CPU engine (onnxruntime) or \"\" for none")
    loader = LOADERS[name]
    probe = call_loader(loader, cfg, engines_dir, None)
    return EngineFactory(name, lambda d, loader=loader: call_loader(loader, cfg, engines_dir, None), probe)


