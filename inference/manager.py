"""Model manager: pick the first engine in ``inference.engine_order`` that loads.

ARCHITECTURE.md, "The inference pool": engines are tried in the configured order
(production default tensorrt, torch_cuda, onnxruntime); the first that loads is
used and the log says which one and why the others were skipped. Runtime
fallback and hot swap come later, behind the same factory.

Metrics (bot/metrics.py): each engine passed over counts one
``healthbot_engine_fallbacks_total{from_engine, to_engine}``; the chosen engine's
``healthbot_engine_circuit_state`` is closed (0), each skipped one's open (1: it
gets no traffic until a restart; a runtime fallback records through the same
helpers, :func:`bot.metrics.record_fallback` and :func:`bot.metrics.set_circuit_state`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
import os
from pathlib import Path
from typing import Callable

import structlog

from bot import metrics
from bot.config import InferenceConfig
from inference.engines.base import Engine, EngineError

log = structlog.get_logger("healthbot.inference.manager")

#: Engine names ``inference.engine_order`` may hold (ARCHITECTURE.md).
KNOWN_ENGINES = ("tensorrt", "torch_cuda", "onnxruntime")

#: The ONNX file ``healthbot prepare-model`` writes into the engines folder.
ONNX_FILE = "model.onnx"


def _load_onnxruntime(cfg: InferenceConfig, engines_dir: Path) -> Engine:
    from inference.engines.onnxruntime import OnnxRuntimeEngine

    return OnnxRuntimeEngine(engines_dir / ONNX_FILE, intra_op_threads=cfg.intra_op_threads)


def _gpu_visible() -> bool:
    """True when an NVIDIA device node exists (checked before importing a CUDA stack)."""
    return any(Path("/dev").glob("nvidia[0-9]*")) or bool(os.environ.get("HEALTHBOT_ASSUME_GPU"))


def _load_tensorrt(cfg: InferenceConfig, engines_dir: Path) -> Engine:
    if not _gpu_visible():
        raise EngineError("no NVIDIA GPU visible")
    from inference.engines.tensorrt import TensorRTEngine

    # build_missing=False: a missing engine falls back at once; build it with
    # `healthbot build-engine` (an init container) rather than during start-up.
    return TensorRTEngine(engines_dir, onnx_file=ONNX_FILE, build_missing=False)


def _load_torch_cuda(cfg: InferenceConfig, engines_dir: Path) -> Engine:
    if not _gpu_visible():
        raise EngineError("no NVIDIA GPU visible")
    from inference.engines.torch_cuda import TorchCudaEngine

    return TorchCudaEngine.from_engines_dir(engines_dir)


#: name -> loader(cfg, engines_dir) -> Engine; a loader raises EngineError when it cannot load.
_LOADERS: dict[str, Callable[[InferenceConfig, Path], Engine]] = {
    "tensorrt": _load_tensorrt,
    "torch_cuda": _load_torch_cuda,
    "onnxruntime": _load_onnxruntime,
}


@dataclass
class EngineFactory:
    """Creates engines of the chosen kind; call it once per pool worker.

    The first call hands out the instance loaded while choosing (so the model is
    not loaded twice); later calls load new instances. Engines whose context is
    tied to a thread (CUDA) must make it current in :meth:`Engine.infer`'s thread.

    Attributes:
        name: the chosen engine (``"onnxruntime"``, ...).
        skipped: ``{name: reason}`` for engines earlier in the order that did not load.
    """

    name: str
    _load: Callable[[], Engine]
    _probe: Engine | None
    skipped: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self) -> Engine:
        with self._lock:
            probe, self._probe = self._probe, None
        return probe if probe is not None else self._load()


def load_engine_factory(cfg: InferenceConfig, engines_dir: Path) -> EngineFactory:
    """Load the first engine of ``cfg.engine_order`` that works; return its factory.

    Blocking (loads a model): call it off the event loop (``asyncio.to_thread``).

    Args:
        cfg: ``engine_order`` and engine knobs (``intra_op_threads``).
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
        try:
            probe = loader(cfg, engines_dir)
        except EngineError as exc:
            skipped[name] = str(exc)
            log.warning("engine_skipped", engine=name, reason=str(exc))
            metrics.set_circuit_state(name, metrics.CircuitState.OPEN)
            continue
        if skipped:
            log.warning("engine_selected", engine=name, skipped=skipped)
        else:
            log.info("engine_selected", engine=name, reason="first in inference.engine_order")
        for passed_over in skipped:
            metrics.record_fallback(passed_over, name)
        metrics.set_circuit_state(name, metrics.CircuitState.CLOSED)
        return EngineFactory(name, lambda loader=loader: loader(cfg, engines_dir), probe, skipped)
    for passed_over in skipped:
        metrics.record_fallback(passed_over, None)
    raise EngineError("no inference engine could be loaded: "
                      + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
