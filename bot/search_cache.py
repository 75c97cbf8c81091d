"""What a search returns (:class:`Match`, :class:`SearchResult`), and the results of repeated
questions, kept per retriever (:class:`SearchCache`).

Real traffic repeats its top questions ("失眠怎么调理"). The embedding cache in front of the
encoder (``inference.embedding_cache_size``, inference/encoder.py) already skips the encoder
for them, but scoring the vector against every example question (a float32[7,237 × 384]
matrix–vector product, 11 MB read from memory each time) and BM25 were still done again: on
the H200 host at 1,600 messages a second, ``Retriever.search`` was a third of a front-end
process's busy time, its matrix product 16 % (docs/loadtest.md).

A :class:`~bot.retrieval.Retriever`'s results depend only on its question, its arguments and the
retriever's own state (knowledge base and model, both fixed for a retriever: a reload or a
model swap builds a new retriever, and with it a new, empty cache), so a result can be reused
as it is. Its arrays are made read-only, so no caller can change what the next one reads.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, fields, is_dataclass
from typing import TypeVar

import numpy as np

from inference.lru import LRUCache

T = TypeVar("T")


@dataclass(frozen=True)
class Match:
    """One retrieved topic.

    Attributes:
        topic_id: knowledge-base topic id.
        score: hybrid score (dense cosine plus saturated BM25 bonus).
        dense: mean of the DENSE_TOP_K best cosines to the topic's example questions.
        lexical: raw BM25 score (>= 0).
        confidence: calibrated probability-like confidence in [0, 1].
    """

    topic_id: str
    score: float
    dense: float
    lexical: float
    confidence: float


@dataclass(frozen=True)
class SearchResult:
    """Top topics and the decision of the nearest-neighbour intent check.

    Attributes:
        matches: the top-k topics, best first.
        off_topic: "out_of_scope" or "no_answer" when a labelled example of that
            kind is nearer than the best topic by the kind's margin, else None.
        nearest: best cosine to the examples of each non-answer kind.
        vector: float32[D], the embedding of the question alone (no context), which the
            decision head (bot/classifier.py) reads: one encoder call serves both.
        context_vector: float32[D] of ``context + question`` for a follow-up, else None.
        fit_features: float32[N_SCORES + D] of the best topic (:func:`bot.retrieval.fit_features`), which
            the topic-fit verifier (bot/topic_fit.py) reads.
        scores: float32[topics], the hybrid score of every topic (in ``bot.retrieval.Retriever.topic_ids`` order;
            :meth:`score_of`), so a caller can tell how far the best topic is ahead of another one.
        contested: the topic prior (bot/topic_prior.py) put first a topic that the hybrid score
            alone ranks lower: the two rankers disagree, and the policy asks more of the verifier.
        prior_terms: float32[2], the topic prior's :meth:`~bot.topic_prior.TopicPrior.terms` of the best
            topic, read by the verifier beside ``fit_features``; None while no prior is set.
    """

    matches: list[Match]
    off_topic: str | None
    nearest: dict[str, float]
    vector: np.ndarray | None = None
    context_vector: np.ndarray | None = None
    fit_features: np.ndarray | None = None
    scores: np.ndarray | None = None
    contested: bool = False
    prior_terms: np.ndarray | None = None
    topic_index: dict[str, int] | None = None

    def score_of(self, topic_id: str) -> float:
        """The hybrid score of topic ``topic_id``.

        Raises:
            KeyError: no such topic.
        """
        return float(self.scores[self.topic_index[topic_id]])


class SearchCache(LRUCache[T]):
    """A bounded LRU of search results (:class:`~inference.lru.LRUCache`) whose arrays are read-only."""

    def put(self, key: Hashable, result: T) -> None:
        """Keep ``result`` (a dataclass, or a tuple of arrays) for ``key``; its numpy arrays become read-only."""
        if not self.size:
            return
        for value in (getattr(result, f.name) for f in fields(result)) if is_dataclass(result) else result:
            if isinstance(value, np.ndarray):
                value.setflags(write=False)
        super().put(key, result)
