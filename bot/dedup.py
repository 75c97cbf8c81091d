"""Exactly-once computation per channel message: channel retries share one answer.

WeChat delivers a message up to 3 times when its 5 s deadline passes (WeChat
official-account docs, 接收普通消息: "微信服务器在五秒内收不到响应会断掉连接，并且重新发起请求，
总共重试三次"); Telegram re-sends an update whose webhook was slow. A retry of a
message still being computed awaits the same computation; a retry of a finished
one gets the stored reply. The computation is shielded: a retry's or a webhook's
timeout never cancels it.

This is the in-process implementation (one server process). Several replicas
share dedup keys through the store (issue 10).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Awaitable, Callable, Generic, Hashable, TypeVar

T = TypeVar("T")


class OnceCache(Generic[T]):
    """Runs ``compute`` once per key; later calls with the key get the same result.

    Args:
        ttl_s: how long a finished result is kept, seconds (default 3600: well past
            WeChat's three deliveries within ~15 s and Telegram's retries).
        max_entries: finished results kept at most; the oldest are dropped first.
    """

    def __init__(self, ttl_s: float = 3600.0, max_entries: int = 100_000):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._inflight: dict[Hashable, asyncio.Future[T]] = {}
        self._done: OrderedDict[Hashable, tuple[float, T]] = OrderedDict()
        self.hits = 0

    def _expire(self, now: float) -> None:
        while self._done:
            key, (at, _) = next(iter(self._done.items()))
            if now - at <= self.ttl_s and len(self._done) <= self.max_entries:
                break
            self._done.popitem(last=False)

    async def run(self, key: Hashable, compute: Callable[[], Awaitable[T]]) -> T:
        """The result for ``key``, computing it only if no call for ``key`` did before.

        Raises:
            whatever ``compute`` raised, to every caller waiting on that key (a
            failed computation is not cached: the next delivery tries again).
        """
        now = time.monotonic()
        self._expire(now)
        done = self._done.get(key)
        if done is not None:
            self.hits += 1
            return done[1]
        fut = self._inflight.get(key)
        if fut is None:
            task = asyncio.ensure_future(compute())
            self._inflight[key] = task
            task.add_done_callback(lambda t, k=key: self._finish(k, t))
            fut = task
        else:
            self.hits += 1
        return await asyncio.shield(fut)

    def _finish(self, key: Hashable, task: asyncio.Future[T]) -> None:
        self._inflight.pop(key, None)
        if not task.cancelled() and task.exception() is None:
            self._done[key] = (time.monotonic(), task.result())

    async def drain(self) -> None:
        """Wait for every in-flight computation (graceful shutdown)."""
        if self._inflight:
            await asyncio.gather(*self._inflight.values(), return_exceptions=True)
