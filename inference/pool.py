"""Inference pool: engine workers placed on one or several devices, each batch routed
to the least-loaded device.

ARCHITECTURE.md, "The inference pool": engine calls block (ONNX Runtime, CUDA),
so they run off the event loop. Each worker has its own single-thread executor
and creates its engine on that thread, so an engine (a session on CPU; a CUDA
context, stream and buffers on a GPU) is only ever touched from one thread.

Placement and routing (issue 9):

- ``devices``: ``[None]`` for CPU engines (one group of ``workers`` engines), or
  GPU indices ``[0, 1, …]``: ``workers`` engines on EACH device, created by
  ``engine_factory(device)``.
- Each batch goes to the device with the least work in flight (padded tokens of
  its running batches, then batches, then the lowest index) among those in
  rotation that have an idle worker; it waits for a worker only when every
  device in rotation is busy.
- A device whose engine raises :class:`EngineError` on ``circuit_failures``
  consecutive batches is taken out of rotation; the failed batch is retried at
  once on another device in rotation (so no request is lost while one is left).
  After ``reset_s`` the device gets one probe batch (half-open): success puts it
  back, failure doubles its wait (up to ``max_reset_s``). When no device is left
  the batch fails with :class:`EngineError` (the model manager then serves it on
  the CPU engine) — except a ``probe=True`` call, which tries the device that
  has waited longest anyway (the manager's own half-open probe).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import structlog

from inference import metrics
from inference.batching.windows import pad_batch
from inference.devices import Device, device_label
from inference.engines.base import Engine, EngineError, engine_precision

log = structlog.get_logger("healthbot.inference.pool")

#: ``factory()`` for CPU engines, ``factory(device)`` for an engine on GPU ``device``.
EngineFactory = Callable[..., Engine]

@dataclass(eq=False)
class _Worker:
    index: int
    executor: ThreadPoolExecutor
    device: Device = None
    engine: Engine | None = None


@dataclass(eq=False)
class DeviceState:
    """Routing state of one device (a GPU index, or None for the CPU group).

    Attributes:
        device: the GPU index (None: CPU).
        workers: its workers.
        idle: its idle workers.
        in_flight: batches running on it; in_flight_tokens: their padded tokens.
        failures: consecutive failed batches.
        in_rotation: False once taken out (until a probe succeeds).
        retry_at: ``time.monotonic()`` from which a probe batch may go to it.
        probing: a probe batch is running on it.
        reset_s: its current wait before a probe (doubles per failed probe).
        batches / errors: totals.
    """

    device: Device
    workers: list[_Worker] = field(default_factory=list)
    idle: list[_Worker] = field(default_factory=list)
    in_flight: int = 0
    in_flight_tokens: int = 0
    failures: int = 0
    in_rotation: bool = True
    retry_at: float = 0.0
    probing: bool = False
    reset_s: float = 0.0
    batches: int = 0
    errors: int = 0

    @property
    def label(self) -> str:
        return device_label(self.device)


class InferencePool:
    """Runs padded batches on engines placed on one or more devices, one thread per engine.

    Build with :meth:`start` (engines are created on their worker threads).
    Attributes ``engine_name``, ``precision``, ``dim``, ``max_batch_size``,
    ``max_seq_len`` come from the engines; ``workers`` is the number of engines (all devices);
    ``devices`` the device list; ``batches_run`` and ``infer_ms_total`` (ms spent
    inside the worker call) are for the bench. Prometheus (inference/metrics.py):
    ``healthbot_inference_engine_seconds{engine}`` per batch, measured on the
    worker thread, and ``healthbot_inference_workers{engine}`` (unless
    ``record_workers`` is False: the model manager's stand-by CPU pool).

    Args (of the constructor; use :meth:`start`):
        workers: the started workers.
        pad_id: the tokenizer's pad id.
        circuit_failures, reset_s, max_reset_s: device rotation (module doc).
        record_workers: count the workers in ``healthbot_inference_workers``.
    """

    def __init__(self, workers: list[_Worker], pad_id: int, *, circuit_failures: int = 3, reset_s: float = 5.0,
                 max_reset_s: float = 60.0, record_workers: bool = True) -> None:
        self._workers = workers
        self.pad_id = pad_id
        self._states: dict[Device, DeviceState] = {}
        for w in workers:
            st = self._states.setdefault(w.device, DeviceState(w.device, reset_s=reset_s))
            st.workers.append(w)
            st.idle.append(w)
        self.devices: list[Device] = list(self._states)
        first = workers[0].engine
        self.engine_name: str = first.name
        self.precision: str = engine_precision(first)
        self.dim: int = first.dim
        self.max_batch_size: int = min(w.engine.max_batch_size for w in workers)
        self.max_seq_len: int = min(w.engine.max_seq_len for w in workers)
        self.on_gpu: bool = any(d is not None for d in self.devices)
        self.workers = len(workers)
        self.batches_run = 0
        self.infer_ms_total = 0.0
        self.circuit_failures = circuit_failures
        self.reset_s = reset_s
        self.max_reset_s = max_reset_s
        self._waiters: list[asyncio.Future] = []
        self._admitted = 0
        self._closing = False
        self._closed = False
        self._drained: asyncio.Event | None = None
        self._record_workers = record_workers
        if record_workers:
            metrics.INFERENCE_WORKERS.labels(engine=self.engine_name).inc(self.workers)

    @classmethod
    async def start(cls, engine_factory: EngineFactory, workers: int, pad_id: int,
                    devices: Sequence[Device] | None = None, **kwargs: Any) -> InferencePool:
        """Create ``workers`` engines per device, each on its own new thread.

        Args:
            engine_factory: called once per worker, on that worker's thread:
                ``engine_factory()`` when the device is None (CPU),
                ``engine_factory(device)`` for a GPU index.
            workers: engines per device, ≥ 1 (``inference.workers``). On CPU,
                N × intra-op threads should not exceed the cores.
            pad_id: the tokenizer's pad id.
            devices: ``[None]`` (default, CPU) or GPU indices (one group each).
            kwargs: ``circuit_failures``, ``reset_s``, ``max_reset_s``,
                ``record_workers`` (see the class).

        Raises:
            EngineError: an engine could not be created (the others are closed).
        """
        if workers < 1:
            raise ValueError("InferencePool needs at least 1 worker (inference.workers)")
        devices = list(devices) if devices else [None]
        loop = asyncio.get_running_loop()
        made: list[_Worker] = []
        try:
            for device in devices:
                for _ in range(workers):
                    i = len(made)
                    name = f"inference-worker-{i}" if device is None else f"inference-gpu{device}-{i}"
                    w = _Worker(i, ThreadPoolExecutor(max_workers=1, thread_name_prefix=name), device)
                    made.append(w)
                    call = engine_factory if device is None else (lambda d=device: engine_factory(d))
                    w.engine = await loop.run_in_executor(w.executor, call)
        except BaseException as exc:
            await _close_workers(made)
            if isinstance(exc, EngineError):
                raise
            if isinstance(exc, Exception):
                raise EngineError(f"could not create engine for worker {len(made) - 1}: {exc}") from exc
            raise
        log.info("inference_pool_started", workers=len(made), devices=[device_label(d) for d in devices],
                 engine=made[0].engine.name, dim=made[0].engine.dim)
        return cls(made, pad_id, **kwargs)

    # ------------------------------------------------------------------ state
    def device_states(self) -> list[DeviceState]:
        """Routing state per device (for tests, the bench and /readyz)."""
        return list(self._states.values())

    @property
    def devices_in_rotation(self) -> list[Device]:
        return [s.device for s in self._states.values() if s.in_rotation]

    # ------------------------------------------------------------------ routing
    def _pick(self, exclude: set, probe: bool) -> DeviceState | None:
        """The device for the next batch: a device due for its half-open probe first
        (one batch), else the in-rotation device with the least padded tokens in
        flight, then fewest batches, then the lowest index; None when none has an idle worker."""
        now = time.monotonic()
        best, best_key = None, None
        for i, st in enumerate(self._states.values()):
            if st.device in exclude or not st.idle:
                continue
            if st.in_rotation:
                key = (0, -st.in_flight_tokens, -st.in_flight, -i)
            elif not st.probing and now >= st.retry_at:
                key = (1, 0, 0, -i)
            else:
                continue
            if best_key is None or key > best_key:
                best, best_key = st, key
        if best is None and probe:
            # The manager's probe: try the device that was out longest, even before its time.
            out = [st for st in self._states.values()
                   if st.device not in exclude and st.idle and not st.in_rotation and not st.probing]
            if out:
                best = min(out, key=lambda s: s.retry_at)
        return best

    def _any_usable(self, exclude: set, probe: bool) -> bool:
        """True while some device not excluded is in rotation (or may be probed)."""
        now = time.monotonic()
        for st in self._states.values():
            if st.device in exclude:
                continue
            if st.in_rotation or probe or (not st.probing and now >= st.retry_at):
                return True
        return False

    async def _acquire(self, exclude: set, probe: bool) -> tuple[DeviceState, _Worker]:
        loop = asyncio.get_running_loop()
        while True:
            st = self._pick(exclude, probe)
            if st is not None:
                w = st.idle.pop()
                if not st.in_rotation:
                    st.probing = True
                return st, w
            if not self._any_usable(exclude, probe):
                out = ", ".join(f"{s.label} (retry in {max(0.0, s.retry_at - time.monotonic()):.1f} s)"
                                for s in self._states.values() if s.device not in exclude)
                raise EngineError(f"{self.engine_name}: no device left in rotation"
                                  + (f": {out}" if out else "") + " (see the engine errors logged before)")
            fut = loop.create_future()
            self._waiters.append(fut)
            try:
                # Re-check periodically: a device out of rotation becomes probeable by time, not by an event.
                await asyncio.wait_for(asyncio.shield(fut), timeout=max(self.reset_s, 0.05))
            except TimeoutError:
                pass
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)

    def _release(self, st: DeviceState, w: _Worker) -> None:
        st.idle.append(w)
        while self._waiters:
            fut = self._waiters.pop(0)
            if not fut.done():
                fut.set_result(None)
                break

    def _on_success(self, st: DeviceState) -> None:
        st.failures = 0
        if not st.in_rotation:
            st.in_rotation = True
            st.reset_s = self.reset_s
            log.warning("inference_device_back_in_rotation", engine=self.engine_name, device=st.label)

    def _on_failure(self, st: DeviceState, exc: Exception) -> None:
        st.errors += 1
        st.failures += 1
        if st.in_rotation and st.failures >= self.circuit_failures and len(self._states) > 1:
            st.in_rotation = False
            st.retry_at = time.monotonic() + st.reset_s
            log.error("inference_device_out_of_rotation", engine=self.engine_name, device=st.label,
                      failures=st.failures, retry_in_s=st.reset_s, error=str(exc),
                      in_rotation=[s.label for s in self._states.values() if s.in_rotation])
        elif not st.in_rotation:  # a failed probe
            st.reset_s = min(st.reset_s * 2, self.max_reset_s)
            st.retry_at = time.monotonic() + st.reset_s
            log.warning("inference_device_probe_failed", engine=self.engine_name, device=st.label,
                        retry_in_s=st.reset_s, error=str(exc))

    # ------------------------------------------------------------------ run
    async def run_batch(self, windows: list[list[int]], *, probe: bool = False) -> np.ndarray:
        """Pad ``windows`` and run them on the least-loaded device's idle worker.

        Batches larger than the engine's ``max_batch_size`` run in chunks on that
        worker. A batch whose engine fails is retried on another device in
        rotation (each device tried once).

        Args:
            windows: token windows (``[bos] + content + [eos]``).
            probe: the model manager's half-open probe (module doc).

        Returns:
            float32[N, D], row i for ``windows[i]`` (as the engine returns it:
            mean-pooled, not normalized).

        Raises:
            EngineError: every device tried failed, none is in rotation, or the
                pool is closed.
        """
        if self._closing:
            raise EngineError("inference pool is closed")
        self._admitted += 1
        try:
            loop = asyncio.get_running_loop()
            tokens = len(windows) * max(len(w) for w in windows)
            tried: set = set()
            while True:
                st, worker = await self._acquire(tried, probe)
                st.in_flight += 1
                st.in_flight_tokens += tokens
                t0 = time.perf_counter()
                try:
                    if hasattr(worker.engine, "infer_async"):  # the engine server's client: no thread needed
                        out = await self._infer_async(worker.engine, windows)
                    else:
                        out = await loop.run_in_executor(worker.executor, self._infer_on_worker, worker.engine,
                                                         windows)
                except EngineError as exc:
                    self._on_failure(st, exc)
                    tried.add(st.device)
                    retry = self._any_usable(tried, probe)
                    log.warning("inference_engine_failed", engine=self.engine_name, device=st.label, error=str(exc),
                                retry=retry)
                    if not retry:
                        raise
                    continue
                finally:
                    st.in_flight -= 1
                    st.in_flight_tokens -= tokens
                    st.probing = False
                    self._release(st, worker)
                st.batches += 1
                self._on_success(st)
                self.infer_ms_total += (time.perf_counter() - t0) * 1000.0
                self.batches_run += 1
                return out
        finally:
            self._admitted -= 1
            if self._closing and self._admitted == 0 and self._drained is not None:
                self._drained.set()

    def _padded_chunks(self, windows: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """``windows`` padded in chunks of at most ``max_batch_size`` (int64[B, T] ids and mask each)."""
        return [pad_batch(windows[start:start + self.max_batch_size], self.pad_id)
                for start in range(0, len(windows), self.max_batch_size)]

    @staticmethod
    def _joined(engine: Engine, outs: list[np.ndarray], t0: float) -> np.ndarray:
        """The chunks' float32 rows as one array; the engine time since ``t0`` recorded."""
        out = outs[0] if len(outs) == 1 else np.concatenate(outs)
        metrics.INFERENCE_ENGINE_TIME.labels(engine=engine.name).observe(time.perf_counter() - t0)
        return out

    def _infer_on_worker(self, engine: Engine, windows: list[list[int]]) -> np.ndarray:
        t0 = time.perf_counter()
        return self._joined(engine, [engine.infer(ids, mask) for ids, mask in self._padded_chunks(windows)], t0)

    async def _infer_async(self, engine: Any, windows: list[list[int]]) -> np.ndarray:
        t0 = time.perf_counter()
        return self._joined(engine, [await engine.infer_async(ids, mask) for ids, mask in self._padded_chunks(windows)],
                            t0)

    async def call_on_worker(self, fn: Callable[[Engine], Any], device: Device | str = "first") -> Any:
        """Run ``fn(engine)`` on an idle worker's thread (of ``device``; default the
        first device) and return its result: the bench's engine-only measurement.

        Raises:
            EngineError: the pool is closed; whatever ``fn`` raises.
        """
        if self._closing:
            raise EngineError("inference pool is closed")
        dev = self.devices[0] if device == "first" else device
        others = {d for d in self.devices if d != dev}
        st, worker = await self._acquire(others, probe=True)
        try:
            return await asyncio.get_running_loop().run_in_executor(worker.executor, fn, worker.engine)
        finally:
            st.probing = False
            self._release(st, worker)

    async def close(self) -> None:
        """Stop taking batches, wait for those admitted, close every engine on its thread. Idempotent."""
        if self._closing:
            if self._drained is not None and not self._closed:
                await self._drained.wait()
            return
        self._closing = True
        self._drained = asyncio.Event()
        if self._admitted == 0:
            self._drained.set()
        await self._drained.wait()
        await _close_workers(self._workers)
        self._closed = True
        if self._record_workers:
            metrics.INFERENCE_WORKERS.labels(engine=self.engine_name).dec(self.workers)

    def set_record_workers(self, on: bool) -> None:
        """Count (or stop counting) this pool's workers in ``healthbot_inference_workers``
        (the model manager moves the count to the engine that is serving)."""
        if on == self._record_workers or self._closed:
            return
        self._record_workers = on
        metrics.INFERENCE_WORKERS.labels(engine=self.engine_name).inc(self.workers if on else -self.workers)


async def _close_workers(workers: list[_Worker]) -> None:
    loop = asyncio.get_running_loop()
    for w in workers:
        if w.engine is not None:
            try:
                await loop.run_in_executor(w.executor, w.engine.close)
            except Exception as exc:  # noqa: BLE001 - keep closing the others
                log.warning("engine_close_failed", worker=w.index, error=str(exc))
            w.engine = None
        w.executor.shutdown(wait=True)
