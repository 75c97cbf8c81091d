"""Model manager: engine choice, placement on GPUs, runtime fallback (circuit breaker) and hot swap.

ARCHITECTURE.md, "The inference pool".

**Choice at start-up** (:func:`~inference.engines.loader.load_engine_factory`): engines are tried in the
configured order (production default tensorrt, torch_cuda, onnxruntime); the
first that loads is used and the log says which one and why the others were
skipped (GPU engines are skipped at once without a GPU).

**Placement** (:func:`~inference.devices.resolve_devices`, issue 9): a GPU engine gets
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

Metrics (inference/metrics.py): ``healthbot_engine_fallbacks_total{from_engine,
to_engine}`` counts each engine passed over at start-up and each time a circuit
opens at run time; ``healthbot_engine_circuit_state{engine}`` is 0 closed, 1
open, 2 half-open (a skipped engine stays open until a restart);
``healthbot_inference_workers{engine}`` counts the workers of the engine that
is serving (the stand-by CPU pool counts only while the circuit is open).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import structlog

from inference import metrics
from inference.config import InferenceConfig
from inference.devices import Device, resolve_devices
from inference.engines.base import Engine, EngineError
from inference.engines.loader import EngineFactory, load_engine_factory, load_fallback_factory
from inference.pool import InferencePool

log = structlog.get_logger("healthbot.inference.manager")

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
        """Hot-swap to whatever :func:`~inference.engines.loader.load_engine_factory` chooses now (e.g. after
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
