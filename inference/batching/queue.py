"""The dynamic batcher's queue: admission, per-bucket FIFO queues of token windows,
deadlines, and the rule that takes the next batch (module doc of :mod:`inference.batching.batcher`).

:class:`WindowQueue` holds the queue half of :class:`~inference.batching.batcher.DynamicBatcher`
(which sets every attribute it uses in its ``__init__``).
"""

from __future__ import annotations

import asyncio
import collections
import heapq
from typing import Sequence

import numpy as np

from inference import metrics
from inference.batching.errors import BatcherClosed, BusyError, DeadlineExceeded
from inference.batching.requests import (STAGE_DONE, STAGE_INCOMING, STAGE_QUEUED, STAGE_TOKENIZING, W_DROPPED,
                                         W_QUEUED, W_TAKEN, Entry, Request, release_request)

#: Deadlines are checked by one timer at most this often (seconds): a request may
#: outlive its deadline by up to 5 ms, and 40,000 requests/s cost 200 timer
#: wake-ups, not 40,000.
DEADLINE_RESOLUTION_S = 0.005


class WindowQueue:
    """Queue state and batch formation of :class:`~inference.batching.batcher.DynamicBatcher`."""

    def _bucket_table(self) -> list[int]:
        """bucket of a window, indexed by its length (0 … largest bucket)."""
        table, b = [], 0
        for n in range(self.buckets[-1] + 1):
            while self.buckets[b] < n:
                b += 1
            table.append(self.buckets[b])
        return table


    @property
    def pending(self) -> int:
        """Windows waiting in the queue (not yet taken into a batch); a text not yet tokenized counts one."""
        return self._pending

    def _admit(self, n: int) -> None:
        """Raise if ``n`` more pending windows are not allowed now; start the loop tasks."""
        if self._closing:
            self.stats.rejected_busy += n
            metrics.INFERENCE_DROPPED.labels(reason="closed").inc(n)
            raise BatcherClosed("inference batcher is shutting down: retry on another replica or after restart")
        if self._pending + n > self.max_queue_size:
            self.stats.rejected_busy += n
            metrics.INFERENCE_DROPPED.labels(reason="busy").inc(n)
            raise BusyError(f"inference queue full ({self._pending} of {self.max_queue_size} pending, "
                            f"{n} more asked): busy, try again in a moment "
                            "(or raise inference.max_queue_size / add workers)")
        if self._loop_task is None:
            self._start()

    def _new_request(self, kind: int, deadline_ms: float | None) -> Request:
        loop = self._loop
        now = loop.time()
        if deadline_ms is None:
            req = Request(loop.create_future(), now, now + self.deadline_ms / 1000.0, kind)
            self._deadline_fifo.append(req)
        else:
            req = Request(loop.create_future(), now, now + deadline_ms / 1000.0, kind)
            heapq.heappush(self._deadline_heap, (req.deadline, next(self._seq), req))
        if self._sweep_handle is None or req.deadline < self._sweep_at:
            self._arm_sweep(req.deadline)
        return req

    def _queue_windows(self, req: Request, windows: Sequence[Sequence[int]]) -> None:
        """Put ``req``'s windows into their bucket queues (pending is counted by the caller)."""
        req.stage = STAGE_QUEUED
        table = self._bucket_of
        if len(windows) == 1:
            w = windows[0]
            req.window = w
            req.tokens = len(w)
            req.bucket = table[req.tokens]
            req.state = W_QUEUED
            req.remaining = 1
            self._push(req)
            return
        req.rows = [None] * len(windows)
        req.remaining = len(windows)
        req.windows = windows
        req.entries = tuple(Entry(req, i, w, table[len(w)]) for i, w in enumerate(windows))
        for e in req.entries:
            self._push(e)

    def _push(self, e: Entry | Request) -> None:
        q = self._queues[e.bucket]
        q.append(e)
        n = len(q)
        # Wake the batch loop only when this can change its decision: a new head
        # (ordering, wake time) or a bucket that may now be full. Otherwise the
        # loop wakes at the oldest head's delay anyway.
        if n == 1 or n >= self.max_batch_size or n * e.bucket >= self.max_batch_tokens or self.max_queue_delay_ms == 0:
            self._wakeup.set()

    async def _wait(self, req: Request) -> np.ndarray:
        try:
            return await req.future  # (the request may drop its reference once done)
        except asyncio.CancelledError:
            if req.stage != STAGE_DONE:
                self._abandon(req, "cancelled")
            raise

    def _abandon(self, req: Request, reason: str) -> int:
        """Drop what ``req`` still has queued (its caller is gone, it expired or a
        sibling failed); returns the windows dropped and records them."""
        stage = req.stage
        req.stage = STAGE_DONE
        if stage in (STAGE_INCOMING, STAGE_TOKENIZING):  # a text not yet in the gauge
            release_request(req)
            self._pending -= 1
            metrics.INFERENCE_DROPPED.labels(reason=reason).inc()
            self._count_drop(reason, 1)
            return 1
        if stage == STAGE_QUEUED:
            n = 0
            for e in (req.entries if req.rows is not None else (req,)):
                if e.state == W_QUEUED:
                    e.state = W_DROPPED
                    n += 1
        else:
            return 0
        release_request(req)
        if n:
            self._pending -= n
            metrics.INFERENCE_PENDING.dec(n)
            metrics.INFERENCE_DROPPED.labels(reason=reason).inc(n)
            self._count_drop(reason, n)
        return n

    def _count_drop(self, reason: str, n: int) -> None:
        if reason == "expired":
            self.stats.expired += n
        elif reason == "cancelled":
            self.stats.cancelled += n
        else:
            self.stats.failed += n

    # --------------------------------------------------------------- deadlines

    def _arm_sweep(self, when: float) -> None:
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
        at = max(when, self._loop.time() + DEADLINE_RESOLUTION_S)
        self._sweep_at = at
        self._sweep_handle = self._loop.call_at(at, self._sweep)

    def _sweep(self) -> None:
        """Fail every request whose deadline passed (one timer for all requests)."""
        self._sweep_handle = None
        now = self._loop.time()
        fifo, heap = self._deadline_fifo, self._deadline_heap
        while fifo and (fifo[0].stage == STAGE_DONE or fifo[0].deadline <= now):
            req = fifo.popleft()
            if req.stage != STAGE_DONE and not req.future.done():
                self._expire(req)
        while heap and (heap[0][2].stage == STAGE_DONE or heap[0][0] <= now):
            req = heapq.heappop(heap)[2]
            if req.stage != STAGE_DONE and not req.future.done():
                self._expire(req)
        nxt = min(fifo[0].deadline if fifo else float("inf"), heap[0][0] if heap else float("inf"))
        if nxt != float("inf"):
            self._arm_sweep(nxt)

    def _expire(self, req: Request) -> None:
        fut = req.future
        self._abandon(req, "expired")
        waited = self._loop.time() - req.enqueued
        fut.set_exception(DeadlineExceeded(
            f"inference request not done within its {req.deadline - req.enqueued:.3f} s deadline "
            f"(waited {waited:.3f} s; server overloaded: try again, or raise inference.deadline_ms)"))

    @staticmethod
    def _purge(q: collections.deque[Entry]) -> None:
        """Pop dropped head entries so ``q[0]`` (if any) is a queued window."""
        while q and q[0].state != W_QUEUED:
            q.popleft()

    def _take(self, q: collections.deque[Entry]) -> tuple[int, bool]:
        """How many queued head windows of ``q`` form the next batch, and whether it is full.

        Full = no further window could join (size or padded-token budget reached).
        """
        n, longest = 0, 0
        max_n, budget = self.max_batch_size, self.max_batch_tokens
        for e in q:
            if e.state != W_QUEUED:
                continue
            t = e.tokens
            new_longest = t if t > longest else longest
            if n >= max_n or (n > 0 and new_longest * (n + 1) > budget):
                return n, True
            n, longest = n + 1, new_longest
        return n, n >= max_n or longest * (n + 1) > budget

    def _pop(self, q: collections.deque[Entry], n: int) -> list[Entry]:
        batch = []
        while len(batch) < n:
            e = q.popleft()
            if e.state == W_QUEUED:
                e.state = W_TAKEN
                batch.append(e)
        self._pending -= n
        metrics.INFERENCE_PENDING.dec(n)
        return batch

    async def _next_batch(self) -> list[Entry] | None:
        loop = self._loop
        delay_s = self.max_queue_delay_ms / 1000.0
        while True:
            now = loop.time()
            heads = []
            for q in self._queues.values():
                self._purge(q)
                if q:
                    heads.append(q)
            if not heads:
                if self._closing and not self._incoming and not self._tokenizing:
                    return None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if len(heads) > 1:
                heads.sort(key=lambda q: q[0].request.enqueued)
            # nothing on the engine: waiting for company only adds latency (unless told to wait)
            idle = self.idle_dispatch and not self._running
            for q in heads:  # oldest first; a full bucket need not wait for an older one
                n, full = self._take(q)
                if full or self._closing or idle or now >= q[0].request.enqueued + delay_s:
                    return self._pop(q, n)
            # Nothing ready: wait for more requests or the oldest batch's delay bound.
            wake_at = heads[0][0].request.enqueued + delay_s
            self._wakeup.clear()
            try:
                async with asyncio.timeout_at(wake_at):
                    await self._wakeup.wait()
            except TimeoutError:
                pass
