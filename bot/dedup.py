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

A message's other state (the user's handoff, session, transcript) is read with the lookup of
its reply, its claim and its rate-limit token, in one round trip, and written with its reply, in
one (:class:`MessageState`): two store round trips a message instead of about ten
(docs/loadtest.md, "One read and one write a message"). Two messages of one user computed at
the same moment each write back what they read plus their own: the later write wins, so the
transcript kept for agents may miss the other's turns (the session was already read and
written this way). Not measured how often a user's messages overlap like this; a person's
messages are usually seconds apart, a computation tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, Hashable, Sequence, TypeVar

import structlog

from bot.store import Bucket, Store, StoreError
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


class ReplayRefused(Exception):
    """The store holds another value at the message's :attr:`~bot.types.Inbound.replay_record` key:
    the request replays an earlier one's credentials with another body. Nothing was read, claimed,
    computed or counted for it."""


async def record_once(store: Store, record: tuple[str, str, float | None]) -> bool:
    """Store ``record`` (``key, value, ttl_s``) unless ``key`` holds a value; False only when it holds
    another one (a replayed request's record, :class:`ReplayRefused`). True when stored now, when the same
    value was there (a re-delivery), or when it expired between the two store calls.

    Raises:
        StoreError: the store failed (callers let the request through, counted).
    """
    key, value, ttl_s = record
    return await store.set_if_absent(key, value, ttl_s) or await store.get(key) in (None, value)


def message_key(inbound: Inbound) -> str:
    """``<channel>:<user>:<message id>``: one message's identity for exactly-once delivery.

    A message id alone is chosen by the client (HTTP API) or unique only within a chat
    (Telegram), so the channel's user id is part of the key: a second user who sends the
    same id gets their own reply, never the first user's.
    """
    return f"{inbound.channel}:{inbound.user_id}:{inbound.message_id}"


@dataclass
class MessageState:
    """What one message reads from the store and what it will write, for :meth:`ExactlyOnce.run`.

    Attributes:
        values: the value at each key read (None where absent).
        error: why the read failed (the store is down); :meth:`get` raises it.
        writes: ``(operation, key, value, ttl_s)`` to write with the reply; ``operation`` names it
            in ``store.unavailable`` (bot/store/health.py) if the write fails.
        token: whether the message's rate-limit token was taken with the read (None: not asked, or
            the read failed).
    """

    values: dict[str, str | None] = field(default_factory=dict)
    error: StoreError | None = None
    writes: list[tuple[str, str, str, float | None]] = field(default_factory=list)
    token: bool | None = None

    def get(self, key: str) -> str | None:
        """The value read at ``key`` (None: absent), as written by :meth:`set` since.

        Raises:
            StoreError: the read failed.
            KeyError: ``key`` was not among the keys read (a programming error).
        """
        if self.error is not None:
            raise self.error
        return self.values[key]

    def set(self, operation: str, key: str, value: str, ttl_s: float | None) -> None:
        """Write ``value`` at ``key`` with the reply (a later write of the same key replaces it)."""
        self.writes = [w for w in self.writes if w[1] != key] + [(operation, key, value, ttl_s)]
        self.values[key] = value


class OnceCache(Generic[T]):
    """Runs ``compute`` once per key among concurrent callers."""

    def __init__(self) -> None:
        self._inflight: dict[Hashable, asyncio.Future[T]] = {}

    async def run(self, key: Hashable, compute: Callable[[], Awaitable[T]],
                  joining: Callable[[], Awaitable[None]] | None = None) -> T:
        """The result for ``key``: a call made while one for ``key`` runs awaits that one, after
        ``joining()`` (a check the shared computation made only for its own caller).

        Raises:
            whatever ``compute`` raised, to every caller waiting on that key; whatever ``joining`` raised.
        """
        fut = self._inflight.get(key)
        if fut is not None and joining is not None:
            await joining()
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

    async def check_record(self, inbound: Inbound) -> None:
        """``inbound.replay_record`` recorded on its own, for a delivery that shares a computation
        already running in this process (which never reaches :meth:`run`'s claim), or one refused
        before the dispatcher (bot/app.py: the admission's work budget).

        Raises:
            ReplayRefused: the key holds another value.
        """
        if inbound.replay_record is None:
            return
        try:
            if await record_once(self.store, inbound.replay_record):
                return
        except StoreError as exc:  # let through, as run() does
            store_unavailable("replay_check", exc)
            return
        raise ReplayRefused(inbound.message_id)

    async def run(self, inbound: Inbound, compute: Callable[[MessageState], Awaitable[Reply]],
                  reads: Sequence[str] = (), bucket: Bucket | None = None) -> Reply:
        """Exactly once across replicas: the replica that claims the message computes it.

        The claim (``dedup:<channel>:<user>:<id>``, :data:`CLAIM_TTL_S`) and the finished reply
        (``reply:<channel>:<user>:<id>``, :data:`REPLY_TTL_S`) live in the store; the key holds
        the user, so two users who send the same message id never share a reply. A replica that
        loses the claim waits up to :data:`REPLICA_WAIT_S` for the winner's reply, then
        answers nothing (the winner delivers it). A claim whose holder died expires, and
        a later delivery computes again. If the store fails, the message is computed here.

        ``inbound.replay_record`` is recorded with the claim, atomically (a conflict raises
        :class:`ReplayRefused` before anything is read); when the store fails, the message is let
        through, as every store use of the dispatch path is.

        Args:
            reads: further keys ``compute`` reads; they are read with the stored reply in one
                round trip and given to ``compute`` as a :class:`MessageState`, whose writes are
                made with the reply in one.
            bucket: the sender's rate-limit token bucket, a token taken in the same round trip
                (``MessageState.token``), for a message that turns out to be a retry too.
        """
        key = message_key(inbound)
        reply_key = f"reply:{key}"
        try:
            claimed, (stored, *values), _, token, conflict = await self.store.claim_and_read(
                f"dedup:{key}", "1", CLAIM_TTL_S, strings=[reply_key, *reads], bucket=bucket,
                record=inbound.replay_record)
            if conflict:
                raise ReplayRefused(inbound.message_id)
            if stored is not None:  # computed already (the claim just made, if any, is never read)
                return Reply.from_json(stored)
        except StoreError as exc:  # nothing answers, or it reads but cannot write (disk full, read-only)
            store_unavailable("dedup", exc)
            here = self.replies_here.get(reply_key)
            if here is not None:
                return Reply.from_json(here)
            try:  # what can still be read
                state = MessageState(dict(zip(reads, await self.store.get_many(reads))))
            except StoreError as read_error:
                state = MessageState(error=read_error)
            reply = await compute(state)
            self.replies_here.set(reply_key, reply.to_json(), REPLY_TTL_S)
            for operation, *_ in state.writes:  # not tried: the claim, a write, has just failed
                store_unavailable(operation, exc)
            return reply
        if claimed:
            state = MessageState(dict(zip(reads, values)), token=token)
            reply = await compute(state)
            try:
                await self.store.set_many([(reply_key, reply.to_json(), REPLY_TTL_S),
                                           *((k, v, ttl) for _, k, v, ttl in state.writes)])
            except StoreError as exc:
                for operation in {"dedup", *(w[0] for w in state.writes)}:
                    store_unavailable(operation, exc)
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
