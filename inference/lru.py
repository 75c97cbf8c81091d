"""A bounded least-recently-used map: the embedding cache (inference/encoder.py) and the search
results of repeated questions (bot/search_cache.py) are both one."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class LRUCache(Generic[V]):
    """At most ``size`` entries (0: holds nothing); the least recently used is evicted first."""

    def __init__(self, size: int) -> None:
        self.size = max(0, int(size))
        self._data: OrderedDict[Hashable, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: Hashable) -> V | None:
        """The value kept for ``key`` (now the most recently used), or None."""
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def get_or_put(self, key: Hashable, compute: Callable[[], V]) -> V:
        """The value kept for ``key``, else ``compute()`` kept for it (a value of None is never kept)."""
        if (value := self.get(key)) is None:
            value = compute()
            if value is not None:
                self.put(key, value)
        return value

    def put(self, key: Hashable, value: V) -> None:
        """Keep ``value`` for ``key``, evicting the least recently used beyond ``size``."""
        if not self.size:
            return
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.size:
            self._data.popitem(last=False)

    def clear(self) -> None:
        self._data.clear()
