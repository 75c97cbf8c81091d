"""Embedding the knowledge base at start-up (bot/retrieval.py, ``Retriever.build``)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import structlog

from bot.knowledge import load_knowledge_base
from bot.embedding import EMBED_CHUNK
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


async def test_a_slow_start_halves_the_chunks_and_embeds_every_question():
    kb = load_knowledge_base()
    slow = SlowEncoder(fits=EMBED_CHUNK // 4)
    with structlog.testing.capture_logs() as logs:
        retriever = await Retriever.build(kb, slow)
    texts, _ = Retriever.example_texts(kb)
    assert retriever.vectors.shape == (len(texts), 384)
    np.testing.assert_array_equal(retriever.vectors, np.stack([vector(t) for t in texts]))
    # Questions, then the topics' answers (as e5 passages): in each pass 64 and 32 timed out
    # once and every later call carried 16 texts (the pass's last one fewer).
    passes = [i for i, n in enumerate(slow.calls) if n == EMBED_CHUNK]
    assert len(passes) == 2 and slow.calls[:3] == [EMBED_CHUNK, EMBED_CHUNK // 2, EMBED_CHUNK // 4]
    for start, end in zip(passes, passes[1:] + [len(slow.calls)]):
        calls = slow.calls[start:end]
        assert calls[:3] == [EMBED_CHUNK, EMBED_CHUNK // 2, EMBED_CHUNK // 4]
        assert set(calls[2:-1]) <= {EMBED_CHUNK // 4} and 1 <= calls[-1] <= EMBED_CHUNK // 4
    assert retriever.answer_vectors.shape == (2 * len(kb.topics), 384)
    # Progress at info level: how many texts, each halving, and the duration; no warning.
    events = [(e["event"], e["log_level"]) for e in logs]
    assert events[0] == ("kb_embedding_started", "info") and events[-1] == ("kb_embedding_done", "info")
    assert set(events[1:-1]) == {("kb_embedding_smaller_calls", "info")} and len(events) == 6
    assert logs[0]["texts"] == sum(n for n in slow.calls if n <= slow.fits) and logs[-1]["seconds"] >= 0
    assert logs[1]["why"] == f"{EMBED_CHUNK} texts took longer than inference.deadline_ms"


async def test_start_fails_with_the_deadline_when_one_text_alone_is_too_slow():
    slow = SlowEncoder(fits=0)
    with structlog.testing.capture_logs() as logs, pytest.raises(DeadlineExceeded):
        await Retriever.build(load_knowledge_base(), slow)
    assert slow.calls == [64, 32, 16, 8, 4, 2, 1]
    # halving is progress (info); one text a call is an overloaded CPU (a warning)
    assert [(e["texts_per_call"], e["log_level"]) for e in logs if e["event"] == "kb_embedding_smaller_calls"] == [
        (32, "info"), (16, "info"), (8, "info"), (4, "info"), (2, "info"), (1, "warning")]



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
