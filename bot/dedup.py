"""One computation per channel message within a process: concurrent deliveries share it.

WeChat delivers a message up to 3 times when its 5 s deadline passes (WeChat
official-account docs, 接收普通消息: "微信服务器在五秒内收不到响应会断掉连接，并且重新发起请求，
总共重试三次"); Telegram re-sends an update whose webhook was slow. A delivery of a
message still being computed in this process awaits the same computation, which is
shielded: a retry's or a webhook's timeout never cancels it.

A message is known by :func:`message_key` (channel, user, message id). Finished replies
are kept in the store (:class:`ExactlyOnce`, ``reply:<channel>:<user>:<id>``), so that a
retry reaching another replica, or arriving after the computation ended, gets the same
reply.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Generic, Hashable, TypeVar

import structlog

from bot.store import Store, StoreError
from bot.store.health import LocalCache, store_unavailable
from bot.types import Inbound, Intent, Reply

log = structlog.get_logger("healthbot.dispatch")

T = TypeVar("T")

#: A claim on a message being computed expires after this, seconds (a replica that
#: died mid-computation does not block the next delivery for long).
CLAIM_TTL_S = 30.0
#: Finished replies are kept this long for channel retries, seconds.
REPLY_TTL_S = 3600.0
#: How long a replica that lost the claim waits for the winner's reply, seconds
#: (inside WeChat's 5 s deadline, with the adapter's own budget on top).
REPLICA_WAIT_S = 4.5


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


class ExactlyOnce:
    """Exactly once across replicas, through the store (see :meth:`run`).

    Args:
        store: the shared store (bot/store/).
    """

    def __init__(self, store: Store):
        self.store = store
        #: Finished replies this process could not store (the store failed): dedup in memory.
        self.replies_here: LocalCache[str, str] = LocalCache()

    async def run(self, inbound: Inbound, compute: Callable[[], Awaitable[Reply]]) -> Reply:
        """Exactly once across replicas: the replica that claims the message computes it.

        The claim (``dedup:<channel>:<user>:<id>``, :data:`CLAIM_TTL_S`) and the finished reply
        (``reply:<channel>:<user>:<id>``, :data:`REPLY_TTL_S`) live in the store; the key holds
        the user, so two users who send the same message id never share a reply. A replica that
        loses the claim waits up to :data:`REPLICA_WAIT_S` for the winner's reply, then
        answers nothing (the winner delivers it). A claim whose holder died expires, and
        a later delivery computes again. If the store fails, the message is computed here.
        """
        key = message_key(inbound)
        reply_key = f"reply:{key}"
        try:
            stored = await self.store.get(reply_key)
            if stored is not None:
                return Reply.from_json(stored)
            claimed = await self.store.set_if_absent(f"dedup:{key}", "1", CLAIM_TTL_S)
        except StoreError as exc:
            store_unavailable("dedup", exc)
            here = self.replies_here.get(reply_key)
            if here is not None:
                return Reply.from_json(here)
            reply = await compute()
            self.replies_here.set(reply_key, reply.to_json(), REPLY_TTL_S)
            return reply
        if claimed:
            reply = await compute()
            try:
                await self.store.set(reply_key, reply.to_json(), REPLY_TTL_S)
            except StoreError as exc:
                store_unavailable("dedup", exc)
                self.replies_here.set(reply_key, reply.to_json(), REPLY_TTL_S)
            return reply
        deadline = time.monotonic() + REPLICA_WAIT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            try:
                stored = await self.store.get(reply_key)
            except StoreError as exc:  # the winner's reply cannot be read: compute it here
                store_unavailable("dedup", exc)
                return await compute()
            if stored is not None:
                return Reply.from_json(stored)
        log.info("dedup.answered_elsewhere", channel=inbound.channel, message_id=inbound.message_id)
        return Reply("", Intent.SYSTEM, inbound.lang or "zh")
