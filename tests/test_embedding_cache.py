"""The embedding cache of repeated texts (inference/encoder.py, ``CachedEncoder``): a repeated
question does not reach the engine, the LRU is bounded, a model change empties it, identical
texts in flight are computed once, bulk calls bypass it, and serving gets it from open_encoder."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bot.config import Config, ConfigError, load_config
from inference import metrics
from inference.batcher import DynamicBatcher
from inference.config import InferenceConfig
from inference.encoder import CACHED_CALL_TEXTS, CachedEncoder, EmbeddingCache, Encoder, open_encoder
from inference.pool import InferencePool
from tests.test_encoder import CharTokenizer, MeanPoolEngine

ENGINES_DIR = Config().engines_path
needs_model = pytest.mark.skipif(not (ENGINES_DIR / "manifest.json").is_file(),
                                 reason="engines/manifest.json absent: run 'healthbot prepare-model' first")


class CountingEngine(MeanPoolEngine):
    """MeanPoolEngine that counts its ``infer`` calls and the rows it was given."""

    calls = 0
    rows = 0

    def infer(self, input_ids, attention_mask):
        CountingEngine.calls += 1
        CountingEngine.rows += len(input_ids)
        return super().infer(input_ids, attention_mask)


@pytest.fixture
async def counted():
    """``(CachedEncoder(size 8) over the real Encoder wiring with a counting engine, the bare Encoder)``."""
    CountingEngine.calls = CountingEngine.rows = 0
    pool = await InferencePool.start(CountingEngine, workers=1, pad_id=CharTokenizer.pad_id)
    inner = Encoder(CharTokenizer(), pool, DynamicBatcher(pool.run_batch, max_queue_delay_ms=2))
    cached = CachedEncoder(inner, 8)
    yield cached, inner
    await inner.close()


def hits_misses() -> tuple[float, float]:
    return metrics.EMBEDDING_CACHE_HITS._value.get(), metrics.EMBEDDING_CACHE_MISSES._value.get()


async def test_a_repeated_question_does_not_reach_the_engine(counted):
    cached, inner = counted
    hits0, misses0 = hits_misses()
    first = await cached.encode(["失眠怎么调理"])
    assert CountingEngine.calls == 1
    for _ in range(5):
        again = await cached.encode(["失眠怎么调理"])
        np.testing.assert_array_equal(again, first)
    assert CountingEngine.calls == 1 and CountingEngine.rows == 1  # five hits, no engine call
    assert hits_misses() == (hits0 + 5, misses0 + 1)
    np.testing.assert_allclose(first, await inner.encode(["失眠怎么调理"]), atol=1e-6)  # same vector as uncached
    again[0, 0] = 42.0  # the caller's copy: the cached vector is not changed
    assert (await cached.encode(["失眠怎么调理"]))[0, 0] != 42.0


async def test_only_the_texts_not_cached_are_encoded_and_the_prefix_is_part_of_the_key(counted):
    cached, _ = counted
    await cached.encode(["头疼"])
    both = await cached.encode(["头疼 那饮食上呢", "头疼"])  # a follow-up's call: context + text
    assert both.shape == (2, 8) and CountingEngine.rows == 2  # only the new text went to the engine
    await cached.encode(["头疼"], prefix="passage: ")
    assert CountingEngine.rows == 3
    dup = await cached.encode(["嗓子疼", "嗓子疼"])
    assert CountingEngine.rows == 4 and np.array_equal(dup[0], dup[1])


async def test_eviction_bounds_the_size_least_recently_used_first(counted):
    cached, _ = counted
    texts = [f"问题{i}" for i in range(20)]
    for t in texts:
        await cached.encode([t])
    assert len(cached.cache) == 8 == cached.cache.size
    assert metrics.EMBEDDING_CACHE_ENTRIES._value.get() == 8
    calls = CountingEngine.calls
    await cached.encode([texts[12]])  # the oldest kept: a hit, and now the most recent
    assert CountingEngine.calls == calls
    await cached.encode(["新问题"])  # evicts texts[13], not texts[12]
    await cached.encode([texts[12]])
    assert CountingEngine.calls == calls + 1
    await cached.encode([texts[13]])
    assert CountingEngine.calls == calls + 2
    await cached.encode([texts[0]])  # long evicted
    assert CountingEngine.calls == calls + 3 and len(cached.cache) == 8


def test_the_lru_alone():
    cache = EmbeddingCache(2)
    for i in range(5):
        cache.put(i, np.full(3, i, dtype=np.float32))
    assert len(cache) == 2 and cache.get(0) is None and cache.get(4)[0] == 4
    assert not cache.get(3).flags.writeable
    off = EmbeddingCache(0)
    off.put("a", np.zeros(3))
    assert len(off) == 0


class FakeEncoder:
    """An encoder double whose model can change: vectors are (model number, text length, ...)."""

    def __init__(self):
        self.model = 1
        self.calls: list[list[str]] = []
        self.gate: asyncio.Event | None = None
        self.fail: Exception | None = None
        self.engine_name, self.variant, self.dim = "fake", "fake/fp32", 3

    @property
    def model_key(self):
        return ("fake", self.model)

    async def encode(self, texts, prefix="query: "):
        self.calls.append(list(texts))
        model = self.model  # the model the call started on
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return np.array([[model, len(t), 0.0] for t in texts], dtype=np.float32)


async def test_a_model_change_empties_the_cache():
    inner = FakeEncoder()
    cached = CachedEncoder(inner, 16)
    assert (await cached.encode(["abc"]))[0, 0] == 1
    await cached.encode(["abc"])
    assert len(inner.calls) == 1
    inner.model = 2  # a hot swap, or the circuit opened and the CPU fallback serves
    assert (await cached.encode(["abc"]))[0, 0] == 2 and len(inner.calls) == 2
    assert len(cached.cache) == 1


async def test_a_vector_computed_while_the_model_changed_is_not_kept():
    inner = FakeEncoder()
    cached = CachedEncoder(inner, 16)
    inner.gate = asyncio.Event()
    task = asyncio.create_task(cached.encode(["abc"]))
    await asyncio.sleep(0)
    inner.model = 2
    inner.gate.set()
    assert (await task)[0, 0] == 1
    assert (await cached.encode(["abc"]))[0, 0] == 2 and len(inner.calls) == 2


async def test_identical_texts_in_flight_are_computed_once():
    inner = FakeEncoder()
    cached = CachedEncoder(inner, 16)
    inner.gate = asyncio.Event()
    hits0, _ = hits_misses()
    tasks = [asyncio.create_task(cached.encode(["同一个问题"])) for _ in range(10)]
    await asyncio.sleep(0.01)
    inner.gate.set()
    out = await asyncio.gather(*tasks)
    assert inner.calls == [["同一个问题"]] and all(np.array_equal(o, out[0]) for o in out)
    assert hits_misses()[0] == hits0 + 9
    assert not cached._inflight


async def test_a_failed_computation_fails_its_waiters_and_a_cancelled_one_lets_them_compute():
    inner = FakeEncoder()
    cached = CachedEncoder(inner, 16)
    inner.gate, inner.fail = asyncio.Event(), RuntimeError("busy")
    owner = asyncio.create_task(cached.encode(["q"]))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(cached.encode(["q"]))
    await asyncio.sleep(0)
    inner.gate.set()
    for task in (owner, waiter):
        with pytest.raises(RuntimeError, match="busy"):
            await task
    assert len(cached.cache) == 0 and not cached._inflight
    inner.gate, inner.fail = asyncio.Event(), None
    owner = asyncio.create_task(cached.encode(["q"]))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(cached.encode(["q"]))
    await asyncio.sleep(0)
    owner.cancel()
    await asyncio.sleep(0)
    inner.gate.set()
    assert (await waiter)[0, 1] == 1 and len(inner.calls) == 3  # the waiter computed it itself
    with pytest.raises(asyncio.CancelledError):
        await owner


async def test_bulk_calls_bypass_the_cache_and_attributes_are_the_inner_encoders():
    inner = FakeEncoder()
    cached = CachedEncoder(inner, 16)
    texts = [f"t{i}" for i in range(CACHED_CALL_TEXTS + 1)]
    await cached.encode(texts)
    await cached.encode(texts)
    assert len(inner.calls) == 2 and len(cached.cache) == 0
    await cached.encode([])  # passed through as is
    assert inner.calls[-1] == [] and len(cached.cache) == 0
    assert cached.engine_name == "fake" and cached.variant == "fake/fp32" and cached.dim == 3
    assert not hasattr(cached, "alive")  # app.py's test for worker processes still works


def test_the_size_is_configured_in_the_inference_section():
    assert InferenceConfig().embedding_cache_size == 4096
    cfg = load_config(None, env={"HEALTHBOT_INFERENCE_EMBEDDING_CACHE_SIZE": "0"})
    assert cfg.inference.embedding_cache_size == 0
    with pytest.raises(ConfigError, match="embedding_cache_size"):
        load_config(None, env={"HEALTHBOT_INFERENCE_EMBEDDING_CACHE_SIZE": "-1"})


@needs_model
async def test_serving_encoder_with_the_real_model_caches_repeats_and_size_0_turns_it_off():
    cfg = InferenceConfig(engine_order=["onnxruntime"], onnx_precision="fp32", max_queue_delay_ms=2,
                          embedding_cache_size=64)
    enc = await open_encoder(cfg, ENGINES_DIR)
    try:
        assert isinstance(enc, CachedEncoder) and isinstance(enc.inner, Encoder)
        first = await enc.encode(["手脚冰凉怎么办"])
        batches = enc.pool.batches_run
        again = await enc.encode(["手脚冰凉怎么办"])
        assert enc.pool.batches_run == batches  # the engine was not asked
        np.testing.assert_array_equal(first, again)
        np.testing.assert_allclose(first, await enc.inner.encode(["手脚冰凉怎么办"]), atol=1e-6)
    finally:
        await enc.close()
    cfg.embedding_cache_size = 0
    bare = await open_encoder(cfg, ENGINES_DIR)
    try:
        assert isinstance(bare, Encoder)
    finally:
        await bare.close()


async def test_without_a_model_key_the_engine_and_variant_are_the_model():
    class PoolLike:  # what a process-pool encoder offers: no model_key
        engine_name, variant = "onnxruntime", "onnxruntime/fp32"

        async def encode(self, texts, prefix="query: "):
            return np.ones((len(texts), 2), dtype=np.float32)

    inner = PoolLike()
    cached = CachedEncoder(inner, 4)
    assert cached.model_key == ("onnxruntime", "onnxruntime/fp32")
    await cached.encode(["a"])
    inner.engine_name = "onnxruntime-fallback"  # a worker's circuit opened
    await cached.encode(["b"])
    assert len(cached.cache) == 1  # emptied, then b


@needs_model
async def test_worker_processes_sit_behind_the_cache_too():
    from inference.multiproc.router import ProcessPoolEncoder
    cfg = InferenceConfig(device_processes=1, engine_order=["onnxruntime"], onnx_precision="fp32", fallback_engine="",
                          intra_op_threads=1, embedding_cache_size=16)
    enc = await open_encoder(cfg, ENGINES_DIR)
    try:
        assert isinstance(enc, CachedEncoder) and isinstance(enc.inner, ProcessPoolEncoder)
        calls = []
        encode = enc.inner.encode

        async def counted_encode(texts, prefix="query: "):
            calls.append(list(texts))
            return await encode(texts, prefix)

        enc.inner.encode = counted_encode
        first = await enc.encode(["失眠怎么调理"])
        again = await enc.encode(["失眠怎么调理"])
        assert calls == [["失眠怎么调理"]] and np.array_equal(first, again)
        assert len(enc.alive) == 1  # the pool's own attributes, through the cache
    finally:
        await enc.close()
