"""One computation per channel message within a process: concurrent deliveries share it.

WeChat delivers a message up to 3 times when its 5 s deadline passes (WeChat
official-account docs, 接收普通消息: "微信服务器在五秒内收不到响应会断掉连接，并且重新发起请求，
总共重试三次"); Telegram re-sends an update whose webhook was slow. A delivery of a
message still being computed in this process awaits the same computation, which is
shielded: a retry's or a webhook's timeout never cancels it.

A message is known by :func:`message_key` (channel, user, message id). Finished replies
are kept in the store, not here (bot/dispatcher.py, ``reply:<channel>:<user>:<id>``), so
that a retry reaching another replica, or arriving after the computation ended, gets the
same reply.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Generic, Hashable, TypeVar

from bot.types import Inbound

T = TypeVar("T")


def message_key(inbound: Inbound) -> str:
    """``<channel>:<user>:<message id>``: one message's identity for exactly-once delivery.

    A message id alone is chosen by the client (HTTP API) or unique only within a chat
    (Telegram), so the channel's user id is part of the key: a second user who sends the
    same id gets their own reply, never the first user's.
    """
    return f"{inbound.channel}:{inbound.user_id}:{inbound.message_id}"


class OnceCache(Generic[T]):
    """Runs ``compute`` once per key among concurrent callers."""

    def __init__(self) -> None:
        self._inflight: dict[Hashable, asyncio.Future[T]] = {}

    async def run(self, key: Hashable, compute: Callable[[], Awaitable[T]]) -> T:
        """The result for ``key``: a call made while one for ``key`` runs awaits that one.

        Raises:
            whatever ``compute`` raised, to every caller waiting on that key.
        """
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.ensure_future(compute())
            self._inflight[key] = fut
            fut.add_done_callback(lambda _, k=key: self._inflight.pop(k, None))
        return await asyncio.shield(fut)

    async def drain(self) -> None:
        """Wait for every in-flight computation (graceful shutdown)."""
        if self._inflight:
            await asyncio.gather(*self._inflight.values(), return_exceptions=True)
