"""In-process :class:`~bot.store.base.Store` for tests and single-process use."""

from __future__ import annotations

import time

from bot.store.base import Bucket, ClaimRead


class MemoryStore:
    """A dict with expiry times; atomic because asyncio runs one coroutine step at a time."""

    def __init__(self) -> None:
        self._values: dict[str, tuple[object, float | None]] = {}
        self._buckets: dict[str, tuple[float, float]] = {}

    def _live(self, key: str):
        item = self._values.get(key)
        if item is None:
            return None
        value, expires = item
        if expires is not None and time.time() >= expires:
            del self._values[key]
            return None
        return value

    @staticmethod
    def _expiry(ttl_s: float | None) -> float | None:
        return None if ttl_s is None else time.time() + ttl_s

    def _text(self, key: str) -> str | None:
        """The live string at ``key`` (None when absent, expired or a list)."""
        value = self._live(key)
        return value if isinstance(value, str) else None

    async def get(self, key: str) -> str | None:
        return self._text(key)

    async def set(self, key: str, value: str, ttl_s: float | None = None) -> None:
        self._values[key] = (value, self._expiry(ttl_s))

    async def get_many(self, keys) -> list[str | None]:
        return [self._text(k) for k in keys]

    async def set_many(self, items) -> None:
        for key, value, ttl_s in items:
            self._values[key] = (value, self._expiry(ttl_s))

    async def set_if_absent(self, key: str, value: str, ttl_s: float | None = None) -> bool:
        if self._live(key) is not None:
            return False
        self._values[key] = (value, self._expiry(ttl_s))
        return True

    async def claim_and_read(self, key: str, value: str, ttl_s: float | None = None, strings=(), lists=(),
                             bucket: Bucket | None = None, if_found: tuple[str, float | None] | None = None,
                             record: tuple[str, str, float | None] | None = None) -> ClaimRead:
        if record is not None and not await MemoryStore.set_if_absent(self, *record) and self._live(record[0]) != record[1]:
            return ClaimRead(False, [None] * len(strings), [[] for _ in lists], None, conflict=True)
        read = [self._text(k) for k in strings], [self._list(k) for k in lists]
        if if_found is not None and (any(v is not None for v in read[0]) or any(read[1])):
            value, ttl_s = if_found
        claimed = await MemoryStore.set_if_absent(self, key, value, ttl_s)
        return ClaimRead(claimed, *read, None if bucket is None else self._take(*bucket))

    async def delete(self, key: str) -> None:
        self._values.pop(key, None)

    async def delete_if_equal(self, key: str, value: str) -> bool:
        if self._live(key) == value:
            del self._values[key]
            return True
        return False

    async def take_token(self, key: str, rate_per_s: float, burst: int) -> bool:
        return self._take(key, rate_per_s, burst)

    def _take(self, key: str, rate_per_s: float, burst: int) -> bool:
        now = time.time()
        tokens, last = self._buckets.get(key, (float(burst), now))
        tokens = min(float(burst), tokens + (now - last) * rate_per_s)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return False
        self._buckets[key] = (tokens - 1.0, now)
        return True

    async def push(self, key: str, value: str, ttl_s: float | None = None) -> None:
        items = self._live(key)
        items = list(items) if isinstance(items, list) else []
        items.append(value)
        self._values[key] = (items, self._expiry(ttl_s))

    async def pop_all(self, key: str) -> list[str]:
        items = self._live(key)
        self._values.pop(key, None)
        return list(items) if isinstance(items, list) else []

    def _list(self, key: str) -> list[str]:
        items = self._live(key)
        return list(items) if isinstance(items, list) else []

    async def read_all(self, key: str) -> list[str]:
        return self._list(key)

    async def ping(self) -> bool:
        return True

    async def health(self) -> str:
        return "ok"

    async def close(self) -> None:
        return None
