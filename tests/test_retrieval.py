"""Embedding the knowledge base at start-up (bot/retrieval.py, ``Retriever.build``)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import structlog

from bot.knowledge import load_knowledge_base
from bot.embedding import embed_all
from bot.retrieval import Retriever
from inference.batcher import DeadlineExceeded


class SlowEncoder:
    """Gives each text a fixed unit vector (from its hash); calls with more than
    ``fits`` texts raise DeadlineExceeded, as a CPU shared with other work does."""

    engine_name = "fake"

    def __init__(self, fits: int) -> None:
        self.fits = fits
        self.calls: list[int] = []

    async def encode(self, texts: list[str], prefix: str = "query: ") -> np.ndarray:
        self.calls.append(len(texts))
        if len(texts) > self.fits:
            raise DeadlineExceeded("inference request not done within its 2.000 s deadline")
        return np.stack([vector(t) for t in texts])


def vector(text: str) -> np.ndarray:
    v = np.random.default_rng(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")).normal(size=384)
    return (v / np.linalg.norm(v)).astype(np.float32)


async def test_the_knowledge_base_is_embedded_one_text_a_call():
    kb = load_knowledge_base()
    slow = SlowEncoder(fits=1)
    with structlog.testing.capture_logs() as logs:
        retriever = await Retriever.build(kb, slow)
    texts, _ = Retriever.example_texts(kb)
    np.testing.assert_array_equal(retriever.vectors, np.stack([vector(t) for t in texts]))
    assert retriever.answer_vectors.shape == (2 * len(kb.topics), 384)
    assert set(slow.calls) == {1}  # the examples, the answers (as passages), the intent examples
    assert len(slow.calls) > len(texts) + 2 * len(kb.topics)
    # progress at info level: how many texts, and the duration
    assert [(e["event"], e["log_level"]) for e in logs] == [("kb_embedding_started", "info"),
                                                            ("kb_embedding_done", "info")]
    assert logs[0]["texts"] == len(slow.calls) and logs[-1]["seconds"] >= 0


async def test_start_fails_with_the_deadline_when_one_text_alone_is_too_slow():
    slow = SlowEncoder(fits=0)
    with pytest.raises(DeadlineExceeded):
        await Retriever.build(load_knowledge_base(), slow)
    assert slow.calls == [1]


async def test_a_texts_training_vector_is_the_same_in_any_order_and_any_company(dispatcher):
    """bot/embedding.py: the real model gives each text its vector alone (in a batch a shorter text
    is padded and moves by about 1e-8), so any build embeds it the same; the embedding cache of
    users' questions is neither read nor filled."""
    encoder = dispatcher.retriever.encoder
    texts = ["失眠怎么调理", "my knee hurts when I climb stairs, what can I do at home", "血压高", "手脚冰凉怎么办"]
    before = len(encoder.cache)
    forward, backward = await embed_all(encoder, texts), await embed_all(encoder, texts[::-1])
    for i, text in enumerate(texts):
        alone = (await encoder.inner.encode([text]))[0]
        assert np.array_equal(forward[i], alone) and np.array_equal(backward[-1 - i], alone)
    assert len(encoder.cache) == before


async def test_a_repeated_question_is_scored_once_per_retriever_behind_the_embedding_cache():
    """bot/search_cache.py: the second ask of a question reuses the first result (no encoder call,
    no scoring), read-only; a follow-up is its own entry; without an embedding cache nothing is kept."""
    from inference.encoder import CachedEncoder

    kb = load_knowledge_base()
    inner = SlowEncoder(fits=10**6)
    inner.variant = "test"
    retriever = await Retriever.build(kb, CachedEncoder(inner, 16))
    calls = len(inner.calls)
    first = await retriever.search("失眠怎么调理")
    assert await retriever.search("失眠怎么调理") is first and len(inner.calls) == calls + 1
    assert not first.vector.flags.writeable and not first.fit_features.flags.writeable
    follow_up = await retriever.search("失眠怎么调理", context="饮食")
    assert follow_up is not first and follow_up.context_vector is not None and len(retriever.results) == 2
    # the follow-up scored only "饮食 失眠怎么调理": the text alone was scored for the first search
    assert len(retriever.scores) == 2
    texts = retriever.search_texts("失眠怎么调理", "饮食")
    fresh = retriever.read(texts, np.stack([(await inner.encode([t]))[0] for t in texts]))
    np.testing.assert_array_equal(follow_up.scores, fresh.scores)
    assert follow_up.matches == fresh.matches and follow_up.fit_features.tolist() == fresh.fit_features.tolist()

    plain = await Retriever.build(kb, inner)
    a, b = await plain.search("失眠怎么调理"), await plain.search("失眠怎么调理")
    assert a is not b and [m.topic_id for m in a.matches] == [m.topic_id for m in b.matches] and len(plain.results) == 0
    assert len(plain.scores) == 0


def test_get_or_put_computes_a_missing_value_once_and_never_keeps_none():
    from inference.lru import LRUCache

    calls: list[str] = []
    cache: LRUCache[str] = LRUCache(2)
    assert cache.get_or_put("a", lambda: calls.append("a") or "A") == "A"
    assert cache.get_or_put("a", lambda: calls.append("a") or "other") == "A" and calls == ["a"]
    assert cache.get_or_put("b", lambda: None) is None and len(cache) == 1
    assert LRUCache(0).get_or_put("a", lambda: "A") == "A"
