"""Search results of repeated questions, kept per retriever.

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
from dataclasses import fields
from typing import TypeVar

import numpy as np

from inference.lru import LRUCache

T = TypeVar("T")


class SearchCache(LRUCache[T]):
    """A bounded LRU of search results (:class:`~inference.lru.LRUCache`) whose arrays are read-only."""

    def put(self, key: Hashable, result: T) -> None:
        """Keep ``result`` (a dataclass) for ``key``; its numpy arrays become read-only."""
        if not self.size:
            return
        for f in fields(result):
            value = getattr(result, f.name)
            if isinstance(value, np.ndarray):
                value.setflags(write=False)
        super().put(key, result)
