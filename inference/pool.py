"""Inference pool: N workers, each owning one engine on one dedicated thread.

ARCHITECTURE.md, "The inference pool": engine calls block (ONNX Runtime, CUDA),
so they run off the event loop. Each worker has its own single-thread executor
and creates its engine on that thread, so an engine (a session on CPU; later a
CUDA context, stream and buffers) is only ever touched from one thread.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import structlog

from bot import metrics
from inference.engines.base import Engine, EngineError

log = structlog.get_logger("healthbot.inference.pool")

EngineFactory = Callable[[], Engine]


def pad_batch(windows: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token windows to the longest one.

    Args:
        windows: N windows of token ids (each ``[bos] + content + [eos]``).
        pad_id: the tokenizer's pad id (1 for XLM-R / multilingual-e5).

    Returns:
        ``(input_ids, attention_mask)``, both int64[N, T] with T the longest
        window; the mask is 1 on real tokens, 0 on padding.
    """
    longest = max(len(w) for w in windows)
    ids = np.full((len(windows), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(windows), longest), dtype=np.int64)
    for i, w in enumerate(windows):
        ids[i, : len(w)] = w
        mask[i, : len(w)] = 1
    return ids, mask


@dataclass
class _Worker:
    index: int
    executor: ThreadPoolExecutor
    engine: Engine | None = None


class InferencePool:
    """Runs padded batches on N engines, one dedicated thread each.

    Build with :meth:`start` (engines are created on their worker threads).
    Attributes ``engine_name``, ``dim``, ``max_batch_size``, ``max_seq_len`` come
    from the engines; ``workers`` is N; ``batches_run`` and ``infer_ms_total``
    (ms spent inside ``engine.infer``) are for the bench. Prometheus
    (bot/metrics.py): ``healthbot_inference_engine_seconds{engine}`` per batch,
    measured on the worker thread, and ``healthbot_inference_workers{engine}``.
    """

    def __init__(self, workers: list[_Worker], pad_id: int) -> None:
        self._workers = workers
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        for w in workers:
            self._idle.put_nowait(w)
        self.pad_id = pad_id
        first = workers[0].engine
        self.engine_name: str = first.name
        self.dim: int = first.dim
        self.max_batch_size: int = min(w.engine.max_batch_size for w in workers)
        self.max_seq_len: int = min(w.engine.max_seq_len for w in workers)
        self.workers = len(workers)
        self.batches_run = 0
        self.infer_ms_total = 0.0
        self._closed = False
        metrics.INFERENCE_WORKERS.labels(engine=self.engine_name).inc(self.workers)

    @classmethod
    async def start(cls, engine_factory: EngineFactory, workers: int, pad_id: int) -> InferencePool:
        """Create ``workers`` engines, each on its own new thread.

        Args:
            engine_factory: called once per worker, on that worker's thread.
            workers: N ≥ 1 (``inference.workers``). On CPU, N × intra-op threads
                should not exceed the cores.
            pad_id: the tokenizer's pad id.

        Raises:
            EngineError: an engine could not be created (the others are closed).
        """
        if workers < 1:
            raise ValueError("InferencePool needs at least 1 worker (inference.workers)")
        loop = asyncio.get_running_loop()
        made: list[_Worker] = []
        try:
            for i in range(workers):
                w = _Worker(i, ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"inference-worker-{i}"))
                made.append(w)
                w.engine = await loop.run_in_executor(w.executor, engine_factory)
        except BaseException as exc:
            await _close_workers(made)
            if isinstance(exc, EngineError):
                raise
            if isinstance(exc, Exception):
                raise EngineError(f"could not create engine for worker {len(made) - 1}: {exc}") from exc
            raise
        log.info("inference_pool_started", workers=workers, engine=made[0].engine.name, dim=made[0].engine.dim)
        return cls(made, pad_id)

    async def run_batch(self, windows: list[list[int]]) -> np.ndarray:
        """Pad ``windows`` and run them on the next idle worker's engine.

        Batches larger than the engine's ``max_batch_size`` run in chunks on that
        worker. Waits for an idle worker if all are busy (the batcher normally
        keeps at most ``workers`` batches in flight).

        Returns:
            float32[N, D], row i for ``windows[i]`` (as the engine returns it:
            mean-pooled, not normalized).

        Raises:
            EngineError: the engine failed, or the pool is closed.
        """
        if self._closed:
            raise EngineError("inference pool is closed")
        worker = await self._idle.get()
        try:
            loop = asyncio.get_running_loop()
            t0 = time.perf_counter()
            out = await loop.run_in_executor(worker.executor, self._infer_on_worker, worker.engine, windows)
            self.infer_ms_total += (time.perf_counter() - t0) * 1000.0
            self.batches_run += 1
            return out
        finally:
            self._idle.put_nowait(worker)

    def _infer_on_worker(self, engine: Engine, windows: list[list[int]]) -> np.ndarray:
        t0 = time.perf_counter()
        outs = []
        for start in range(0, len(windows), self.max_batch_size):
            ids, mask = pad_batch(windows[start:start + self.max_batch_size], self.pad_id)
            outs.append(engine.infer(ids, mask))
        out = outs[0] if len(outs) == 1 else np.concatenate(outs)
        metrics.INFERENCE_ENGINE_TIME.labels(engine=engine.name).observe(time.perf_counter() - t0)
        return out

    async def close(self) -> None:
        """Wait for running batches, close every engine on its thread, stop the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for _ in self._workers:  # take every worker: waits for batches in flight
            await self._idle.get()
        await _close_workers(self._workers)
        metrics.INFERENCE_WORKERS.labels(engine=self.engine_name).dec(self.workers)


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
