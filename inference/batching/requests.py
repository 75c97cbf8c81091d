"""What waits in the dynamic batcher: one :class:`Request` per caller, one :class:`Entry`
per token window of a multi-window request, and the batcher's :class:`BatcherStats`."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Sequence

# Request kinds: what the caller gets back.
KIND_ONE = 0  # submit(): float32[D], raw
KIND_MANY = 1  # submit_many(): float32[N, D], raw
KIND_TEXT = 2  # submit_text(): float32[D], windows combined and L2-normalized

# Request stages.
STAGE_INCOMING = 0  # text waiting for the tokenizer (counts 1 pending)
STAGE_TOKENIZING = 1  # in the tokenizer's hands (still counts 1 pending)
STAGE_QUEUED = 2  # windows in bucket queues
STAGE_DONE = 3  # finished, failed, expired or cancelled

# Window states.
W_QUEUED = 0
W_TAKEN = 1
W_DROPPED = 2


class Request:
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
        self.stage = STAGE_QUEUED
        self.entries: tuple[Entry, ...] = ()  # the windows of a multi-window request
        self.rows: list | None = None  # per-window rows of a multi-window request

    @property
    def request(self) -> Request:
        return self


class Entry:
    __slots__ = ("request", "index", "window", "tokens", "bucket", "state")

    def __init__(self, request: Request, index: int, window: Sequence[int], bucket: int) -> None:
        self.request = request
        self.index = index
        self.window = window
        self.tokens = len(window)
        self.bucket = bucket
        self.state = W_QUEUED


def release_request(req: Request) -> None:
    """Mark ``req`` done and drop what it references (the deadline FIFO keeps the
    small request object for up to ``deadline_ms``, not its vectors or future)."""
    req.stage = STAGE_DONE
    req.future = None
    req.entries = ()
    req.rows = None
    req.windows = None
    req.text = None
    req.window = None


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
