"""Dynamic batcher: an asyncio queue that groups token windows into padded batches.

Shape of the queue (ARCHITECTURE.md, "The inference pool"; text-embeddings-inference
``core/src/queue.rs``; Triton's dynamic batcher):

- one :class:`_Entry` per request, carrying its own future, enqueue time, deadline
  and token count;
- entries wait in per-bucket FIFO queues, a bucket being the smallest power of two
  (16 … 512) that holds the window, so a 12-token query never pays for the padding
  of a 400-token passage;
- a batch is taken from the bucket whose head waited longest, as soon as a pool
  worker is free and one of these holds:
  * it has ``max_batch_size`` entries,
  * one more entry could not fit the token budget: padded cost = longest window ×
    batch size > ``max_batch_tokens`` (TEI's padded budget),
  * ``max_queue_delay_ms`` passed since the batch's FIRST (oldest) entry was
    enqueued (Triton's ``max_queue_delay_microseconds``; 0 = a free worker never
    waits),
  * the batcher is closing (drain without waiting);
- entries whose caller has gone (cancelled future) or whose deadline passed are
  dropped before any compute is spent on them.

While every worker is busy nothing is taken, so requests pile up and the next
batch is naturally fuller: at high load batches fill up; at low load a request
waits at most ``max_queue_delay_ms``.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

import numpy as np
import structlog

from bot import metrics

log = structlog.get_logger("healthbot.inference.batcher")

#: Sequence-length buckets (tokens, specials included). Powers of two up to BERT's
#: 512 positions: padding waste inside a bucket is below 2×.
DEFAULT_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)

RunBatch = Callable[[list[list[int]]], Awaitable[np.ndarray]]


class BusyError(RuntimeError):
    """The batcher cannot take the request now (queue full or shutting down).

    Callers answer politely ("busy, try again in a moment"); nothing was computed.
    """


class BatcherClosed(BusyError):
    """The batcher is closing or closed; no new requests are accepted."""


class DeadlineExceeded(TimeoutError):
    """The request's deadline passed before its result was ready; it was dropped
    (not computed) if its batch had not started yet."""


@dataclass(eq=False)  # identity: deque.remove must find this very entry
class _Entry:
    window: Sequence[int]
    future: asyncio.Future
    enqueued: float  # loop.time(), seconds
    deadline: float  # loop.time(), seconds
    tokens: int
    bucket: int
    taken: bool = False  # popped into a batch (or dropped) — no longer in its bucket queue


@dataclass
class BatcherStats:
    """Counters a metrics exporter can read (all monotonic except ``pending``).

    Attributes:
        batches_run: batches handed to ``run_batch``.
        requests_run: windows computed (sum of batch sizes).
        batch_size_counts: histogram, batch size → number of batches of that size.
        batch_tokens_total: padded tokens computed (longest × size, summed).
        queue_time_ms_total / queue_time_ms_max: enqueue → batch start, per
            computed request, in ms.
        rejected_busy: submits refused because the queue was full or closing.
        expired: requests dropped or failed with :class:`DeadlineExceeded`.
        cancelled: requests dropped because their caller went away.
        failed: requests whose batch raised.
    """

    batches_run: int = 0
    requests_run: int = 0
    batch_size_counts: collections.Counter = field(default_factory=collections.Counter)
    batch_tokens_total: int = 0
    queue_time_ms_total: float = 0.0
    queue_time_ms_max: float = 0.0
    rejected_busy: int = 0
    expired: int = 0
    cancelled: int = 0
    failed: int = 0

    @property
    def mean_batch_size(self) -> float:
        """Requests per batch, averaged over all batches (0.0 before the first)."""
        return self.requests_run / self.batches_run if self.batches_run else 0.0

    @property
    def mean_queue_time_ms(self) -> float:
        """Mean enqueue → batch start time in ms over computed requests."""
        return self.queue_time_ms_total / self.requests_run if self.requests_run else 0.0


def bucket_for(tokens: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket (tokens) holding a window of ``tokens`` tokens.

    Raises:
        ValueError: the window is longer than the largest bucket (the tokenizer
            must split long texts into windows of at most 512 tokens).
    """
    for b in buckets:
        if tokens <= b:
            return b
    raise ValueError(f"window of {tokens} tokens exceeds the largest bucket ({buckets[-1]}): "
                     "split long texts into windows (E5Tokenizer.encode_batch does)")


class DynamicBatcher:
    """Groups submitted token windows into batches for an async ``run_batch``.

    Args:
        run_batch: ``async (windows: list[list[int]]) -> float32[N, D]``, row i the
            vector of window i (the pool's :meth:`InferencePool.run_batch`).
        max_batch_size: windows per batch, ≥ 1.
        max_batch_tokens: padded-cost budget per batch in tokens (longest × count,
            TEI). A single window larger than the budget still runs, alone.
        max_queue_delay_ms: ms a batch may wait for more requests after its first
            one (Triton); 0 = never wait.
        max_queue_size: pending (not yet started) windows beyond which
            :meth:`submit` raises :class:`BusyError`.
        deadline_ms: default per-request deadline in ms, counted from submit.
        concurrency: batches in flight at once; set it to the pool's worker count.
        buckets: ascending sequence-length buckets in tokens.

    Start-up is lazy (the loop task starts on the first submit); :meth:`close`
    drains. ``stats`` (:class:`BatcherStats`) and :attr:`pending` are for tests and
    the bench; the Prometheus metrics (bot/metrics.py: queue time, batch size and
    tokens, pending windows, dropped windows) are recorded where each event happens.
    """

    def __init__(self, run_batch: RunBatch, *, max_batch_size: int = 32, max_batch_tokens: int = 8192,
                 max_queue_delay_ms: float = 10.0, max_queue_size: int = 1024, deadline_ms: float = 2000.0,
                 concurrency: int = 1, buckets: Sequence[int] = DEFAULT_BUCKETS) -> None:
        if max_batch_size < 1 or max_batch_tokens < 1 or max_queue_size < 1 or concurrency < 1:
            raise ValueError("max_batch_size, max_batch_tokens, max_queue_size and concurrency must be >= 1")
        if max_queue_delay_ms < 0 or deadline_ms <= 0:
            raise ValueError("max_queue_delay_ms must be >= 0 and deadline_ms > 0")
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue_delay_ms = max_queue_delay_ms
        self.max_queue_size = max_queue_size
        self.deadline_ms = deadline_ms
        self.concurrency = concurrency
        self.buckets = tuple(sorted(buckets))
        self.stats = BatcherStats()
        self._queues: dict[int, collections.deque[_Entry]] = {b: collections.deque() for b in self.buckets}
        self._pending = 0
        self._closing = False
        self._wakeup: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._loop_task: asyncio.Task | None = None
        self._in_flight: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ submit

    @property
    def pending(self) -> int:
        """Windows waiting in the queue (not yet taken into a batch)."""
        return self._pending

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
        return (await self.submit_many([window], deadline_ms))[0]

    async def submit_many(self, windows: Sequence[Sequence[int]], deadline_ms: float | None = None) -> np.ndarray:
        """Queue several windows at once (all or none) and wait for all vectors.

        The windows may land in different batches. If the caller is cancelled or
        one window fails, the others still waiting are dropped.

        Returns:
            float32[N, D], row i for ``windows[i]``.

        Raises:
            BusyError: fewer than ``len(windows)`` free queue slots; nothing queued.
            Others as :meth:`submit`.
        """
        if not windows:
            raise ValueError("submit_many needs at least one window")
        for w in windows:
            if len(w) == 0:
                raise ValueError("empty token window: a window holds at least [bos, eos]")
            bucket_for(len(w), self.buckets)
        if self._closing:
            self.stats.rejected_busy += len(windows)
            metrics.INFERENCE_DROPPED.labels(reason="closed").inc(len(windows))
            raise BatcherClosed("inference batcher is shutting down: retry on another replica or after restart")
        if self._pending + len(windows) > self.max_queue_size:
            self.stats.rejected_busy += len(windows)
            metrics.INFERENCE_DROPPED.labels(reason="busy").inc(len(windows))
            raise BusyError(f"inference queue full ({self._pending} of {self.max_queue_size} pending, "
                            f"{len(windows)} more asked): busy, try again in a moment "
                            "(or raise inference.max_queue_size / add workers)")
        self._ensure_started()
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = now + (self.deadline_ms if deadline_ms is None else deadline_ms) / 1000.0
        entries = [_Entry(w, loop.create_future(), now, deadline, len(w), bucket_for(len(w), self.buckets))
                   for w in windows]
        for e in entries:
            self._queues[e.bucket].append(e)
        self._pending += len(entries)
        metrics.INFERENCE_PENDING.inc(len(entries))
        self._wakeup.set()
        futures = [e.future for e in entries]
        expired = False
        try:
            async with asyncio.timeout_at(deadline):
                rows = await asyncio.gather(*futures)
        except TimeoutError:
            expired = True
            raise DeadlineExceeded(f"inference request not done within its {deadline - now:.3f} s deadline "
                                   "(server overloaded: try again, or raise inference.deadline_ms)") from None
        finally:
            # Caller gone, deadline hit or a sibling failed: drop what has not started.
            dropped = self._unqueue(entries)
            if expired:
                self.stats.expired += dropped
            else:
                self.stats.cancelled += dropped
            if dropped:
                metrics.INFERENCE_DROPPED.labels(reason="expired" if expired else "cancelled").inc(dropped)
            for f in futures:
                f.cancel()
        return np.stack(rows)

    def _unqueue(self, entries: list[_Entry]) -> int:
        """Remove entries not yet taken into a batch from their bucket queues; returns how many."""
        n = 0
        for e in entries:
            if not e.taken:
                self._queues[e.bucket].remove(e)
                e.taken = True
                n += 1
        self._pending -= n
        metrics.INFERENCE_PENDING.dec(n)
        return n

    # -------------------------------------------------------------- lifecycle

    def _ensure_started(self) -> None:
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._slots = asyncio.Semaphore(self.concurrency)
            self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop(), name="dynamic-batcher")
            self._loop_task.add_done_callback(_log_crash)

    async def close(self) -> None:
        """Stop accepting requests, run every pending request, wait for in-flight batches.

        Pending requests still honour their deadlines and cancellations. Idempotent.
        """
        self._closing = True
        if self._loop_task is None:
            return
        self._wakeup.set()
        await self._loop_task
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)

    # ------------------------------------------------------------- batch loop

    async def _batch_loop(self) -> None:
        while True:
            await self._slots.acquire()
            batch = await self._next_batch()
            if batch is None:
                self._slots.release()
                return
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    def _drop_expired_heads(self, q: collections.deque[_Entry], now: float) -> None:
        """Drop head entries whose deadline passed but whose caller's timer has not fired yet.

        (Gone callers remove their own entries in :meth:`submit_many`.)
        """
        while q and now >= q[0].deadline:
            e = q.popleft()
            e.taken = True
            self._pending -= 1
            self.stats.expired += 1
            metrics.INFERENCE_PENDING.dec()
            metrics.INFERENCE_DROPPED.labels(reason="expired").inc()
            if not e.future.done():
                e.future.set_exception(DeadlineExceeded("inference request expired in the queue"))

    def _take(self, q: collections.deque[_Entry]) -> tuple[int, bool]:
        """How many head entries of ``q`` form the next batch, and whether it is full.

        Full = no further entry could join (size or padded-token budget reached).
        """
        n, longest = 0, 0
        for e in q:
            new_longest = max(longest, e.tokens)
            if n >= self.max_batch_size or (n > 0 and new_longest * (n + 1) > self.max_batch_tokens):
                return n, True
            n, longest = n + 1, new_longest
        full = n >= self.max_batch_size or longest * (n + 1) > self.max_batch_tokens
        return n, full

    async def _next_batch(self) -> list[_Entry] | None:
        loop = asyncio.get_running_loop()
        delay_s = self.max_queue_delay_ms / 1000.0
        while True:
            now = loop.time()
            for q in self._queues.values():
                self._drop_expired_heads(q, now)
            heads = sorted((q for q in self._queues.values() if q), key=lambda q: q[0].enqueued)
            if not heads:
                if self._closing:
                    return None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            for q in heads:  # oldest first; a full bucket need not wait for an older one
                n, full = self._take(q)
                if full or self._closing or now >= q[0].enqueued + delay_s:
                    batch = [q.popleft() for _ in range(n)]
                    for e in batch:
                        e.taken = True
                    self._pending -= n
                    metrics.INFERENCE_PENDING.dec(n)
                    return batch
            # Nothing ready: wait for more requests or the oldest batch's delay bound.
            wake_at = heads[0][0].enqueued + delay_s
            self._wakeup.clear()
            try:
                async with asyncio.timeout_at(wake_at):
                    await self._wakeup.wait()
            except TimeoutError:
                pass

    async def _run(self, batch: list[_Entry]) -> None:
        try:
            now = asyncio.get_running_loop().time()
            longest = max(e.tokens for e in batch)
            st = self.stats
            st.batches_run += 1
            st.requests_run += len(batch)
            st.batch_size_counts[len(batch)] += 1
            st.batch_tokens_total += longest * len(batch)
            metrics.INFERENCE_BATCH_SIZE.observe(len(batch))
            metrics.INFERENCE_BATCH_TOKENS.observe(longest * len(batch))
            for e in batch:
                waited = (now - e.enqueued) * 1000.0
                st.queue_time_ms_total += waited
                st.queue_time_ms_max = max(st.queue_time_ms_max, waited)
                metrics.INFERENCE_QUEUE_TIME.observe(waited / 1000.0)
            try:
                out = await self._run_batch([list(e.window) for e in batch])
                if out.shape[0] != len(batch):
                    raise RuntimeError(f"run_batch returned {out.shape[0]} rows for {len(batch)} windows")
            except Exception as exc:  # noqa: BLE001 - handed to every caller of the batch
                log.warning("inference_batch_failed", size=len(batch), error=str(exc))
                st.failed += len(batch)
                metrics.INFERENCE_DROPPED.labels(reason="failed").inc(len(batch))
                for e in batch:
                    if not e.future.done():
                        e.future.set_exception(exc)
                return
            for i, e in enumerate(batch):
                if not e.future.done():  # caller may have gone while it ran
                    e.future.set_result(out[i])
        finally:
            self._slots.release()
            self._wakeup.set()


def _log_crash(task: asyncio.Task) -> None:
    """A dead batch loop would leave callers waiting until their deadlines: say so loudly."""
    if not task.cancelled() and task.exception() is not None:
        log.error("batch_loop_crashed", error=repr(task.exception()))
