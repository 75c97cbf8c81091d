"""DynamicBatcher behaviour, with a recording test double in place of the pool."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from inference.batcher import BatcherClosed, BusyError, DeadlineExceeded, DynamicBatcher
from inference.engines.base import EngineError

BOS, EOS = 0, 2


def window(tag: int, tokens: int = 8) -> list[int]:
    """A window of ``tokens`` ids whose content ids are all ``tag``."""
    return [BOS] + [tag] * (tokens - 2) + [EOS]


class RecordingRunBatch:
    """Records every batch; returns float32[N, 2] rows ``[len(window), tag]``.

    With a ``gate``, each batch waits for the gate to open (a busy worker).
    """

    def __init__(self, gate: asyncio.Event | None = None, fail: Exception | None = None):
        self.batches: list[list[list[int]]] = []
        self.started_at: list[float] = []
        self.gate = gate
        self.fail = fail
        self.running = asyncio.Event()

    async def __call__(self, windows: list[list[int]]) -> np.ndarray:
        self.batches.append(windows)
        self.started_at.append(asyncio.get_running_loop().time())
        self.running.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return np.array([[len(w), w[1]] for w in windows], dtype=np.float32)

    @property
    def sizes(self) -> list[int]:
        return [len(b) for b in self.batches]

    def tags(self) -> set[int]:
        return {w[1] for b in self.batches for w in b}


async def settle() -> None:
    """Let every ready task run (submits enqueue, the loop takes batches)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_concurrent_requests_form_one_batch():
    run = RecordingRunBatch()
    b = DynamicBatcher(run, max_batch_size=32, max_queue_delay_ms=50)
    results = await asyncio.gather(*(b.submit(window(tag)) for tag in range(10, 18)))
    assert run.sizes == [8]
    for tag, row in zip(range(10, 18), results):
        assert row.dtype == np.float32 and row.tolist() == [8.0, float(tag)]  # each caller gets its own row
    assert b.stats.batches_run == 1 and b.stats.batch_size_counts == {8: 1}
    await b.close()


async def test_lone_request_runs_after_max_queue_delay_not_before():
    run = RecordingRunBatch()
    b = DynamicBatcher(run, max_queue_delay_ms=150)
    t0 = asyncio.get_running_loop().time()
    await b.submit(window(1))
    waited = run.started_at[0] - t0
    assert 0.145 <= waited < 1.0  # ≈ the 150 ms delay; generous upper bound on a shared machine
    assert b.stats.queue_time_ms_max >= 145
    await b.close()


async def test_zero_delay_runs_a_lone_request_at_once():
    run = RecordingRunBatch()
    b = DynamicBatcher(run, max_queue_delay_ms=0)
    t0 = asyncio.get_running_loop().time()
    await b.submit(window(1))
    assert run.started_at[0] - t0 < 0.5  # no 10 ms-style wait; bound is generous on purpose
    await b.close()


async def test_max_batch_size_closes_a_batch_before_the_delay():
    run = RecordingRunBatch()
    b = DynamicBatcher(run, max_batch_size=4, max_queue_delay_ms=60_000)
    results = await asyncio.wait_for(asyncio.gather(*(b.submit(window(t)) for t in range(4))), timeout=5)
    assert run.sizes == [4] and len(results) == 4
    await b.close()


async def test_max_batch_size_splits_a_burst():
    run = RecordingRunBatch()
    b = DynamicBatcher(run, max_batch_size=4, max_queue_delay_ms=20)
    await asyncio.gather(*(b.submit(window(t)) for t in range(10)))
    assert run.sizes == [4, 4, 2]
    await b.close()


async def test_token_budget_splits_batches_by_padded_cost():
    run = RecordingRunBatch()
    # 30-token windows: 3 × 30 = 90 fits a 100-token budget, 4 × 30 = 120 does not.
    b = DynamicBatcher(run, max_batch_size=32, max_batch_tokens=100, max_queue_delay_ms=60_000)
    await asyncio.wait_for(asyncio.gather(*(b.submit(window(t, 30)) for t in range(6))), timeout=5)
    assert run.sizes == [3, 3]
    assert b.stats.batch_tokens_total == 2 * 3 * 30
    await b.close()


async def test_token_budget_counts_the_longest_window():
    run = RecordingRunBatch()
    # One 32-token window makes every slot cost 32: 64 // 32 = 2 per batch although 6+6+32 < 64.
    b = DynamicBatcher(run, max_batch_tokens=64, max_queue_delay_ms=30)
    await asyncio.gather(b.submit(window(1, 32)), b.submit(window(2, 20)), b.submit(window(3, 20)))
    assert run.sizes == [2, 1]
    await b.close()


async def test_short_and_long_windows_go_in_separate_buckets():
    run = RecordingRunBatch()
    b = DynamicBatcher(run, max_queue_delay_ms=30)
    short = [b.submit(window(t, 12)) for t in range(4)]
    long = [b.submit(window(t, 200)) for t in range(100, 102)]
    await asyncio.gather(*short, *long)
    assert sorted(run.sizes) == [2, 4]
    for batch in run.batches:
        assert len({len(w) for w in batch}) == 1  # no 12-token query padded to 200


async def test_full_queue_raises_busy_at_once():
    gate = asyncio.Event()
    run = RecordingRunBatch(gate)
    b = DynamicBatcher(run, max_queue_size=2, max_queue_delay_ms=0)
    first = asyncio.create_task(b.submit(window(1)))
    await run.running.wait()  # the only worker is busy with request 1
    waiting = [asyncio.create_task(b.submit(window(t))) for t in (2, 3)]
    await settle()
    assert b.pending == 2
    with pytest.raises(BusyError, match="queue full"):
        await b.submit(window(4))
    assert b.stats.rejected_busy == 1
    gate.set()
    await asyncio.gather(first, *waiting)
    assert 4 not in run.tags()
    await b.close()


async def test_cancelled_request_is_not_computed():
    gate = asyncio.Event()
    run = RecordingRunBatch(gate)
    b = DynamicBatcher(run, max_queue_delay_ms=0)
    first = asyncio.create_task(b.submit(window(1)))
    await run.running.wait()
    gone = asyncio.create_task(b.submit(window(2)))
    kept = asyncio.create_task(b.submit(window(3)))
    await settle()
    gone.cancel()
    await settle()
    assert b.pending == 1  # the cancelled one no longer holds a queue slot
    gate.set()
    await asyncio.gather(first, kept)
    assert gone.cancelled()
    assert run.tags() == {1, 3}
    assert b.stats.cancelled == 1
    await b.close()


async def test_request_past_its_deadline_is_not_computed():
    gate = asyncio.Event()
    run = RecordingRunBatch(gate)
    b = DynamicBatcher(run, max_queue_delay_ms=0)
    first = asyncio.create_task(b.submit(window(1)))
    await run.running.wait()
    with pytest.raises(DeadlineExceeded, match="deadline"):
        await b.submit(window(2), deadline_ms=50)
    gate.set()
    await first
    await b.close()
    assert run.tags() == {1}
    assert b.stats.expired == 1


async def test_close_drains_pending_requests_without_waiting_for_the_delay():
    run = RecordingRunBatch()
    b = DynamicBatcher(run, max_queue_delay_ms=60_000)
    tasks = [asyncio.create_task(b.submit(window(t))) for t in range(3)]
    await settle()
    assert b.pending == 3 and run.batches == []
    await asyncio.wait_for(b.close(), timeout=5)
    assert [t.result()[1] for t in tasks] == [0.0, 1.0, 2.0]
    with pytest.raises(BatcherClosed, match="shutting down"):
        await b.submit(window(9))


async def test_batch_failure_reaches_every_caller_and_the_batcher_keeps_going():
    run = RecordingRunBatch(fail=EngineError("engine exploded: check the logs"))
    b = DynamicBatcher(run, max_queue_delay_ms=20)
    results = await asyncio.gather(b.submit(window(1)), b.submit(window(2)), return_exceptions=True)
    assert all(isinstance(r, EngineError) for r in results)
    assert b.stats.failed == 2
    run.fail = None
    assert (await b.submit(window(3))).tolist() == [8.0, 3.0]
    await b.close()


async def test_submit_many_keeps_order_across_buckets():
    run = RecordingRunBatch()
    b = DynamicBatcher(run, max_queue_delay_ms=5)
    out = await b.submit_many([window(1, 300), window(2, 8), window(3, 40)])
    assert out.shape == (3, 2) and out.dtype == np.float32
    assert out[:, 1].tolist() == [1.0, 2.0, 3.0]
    await b.close()


async def test_window_longer_than_512_is_refused_with_advice():
    b = DynamicBatcher(RecordingRunBatch())
    with pytest.raises(ValueError, match="split long texts"):
        await b.submit(window(1, 513))
