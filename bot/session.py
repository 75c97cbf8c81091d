"""Conversation state per user: last topic (for follow-up questions), language, no_answer streak.

Kept in the :class:`~bot.store.Store` under ``session:<channel>:<user>`` (JSON),
expiring after :data:`SESSION_TTL_S` of silence, so every replica sees it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass, field

from bot.store import MemoryStore, Store

#: A conversation idle longer than this starts afresh, seconds.
SESSION_TTL_S = 30 * 60

#: How a follow-up question starts: "那饮食上呢", "还有呢", "what about at night?"
FOLLOW_UP = re.compile(r"^(那|那么|那要是|那如果|还有|另外|再问|再请问|如果是|要是|and\b|what about\b|how about\b|"
                       r"what if\b|and what about\b|also\b)", re.IGNORECASE)
#: Follow-ups are short: longer messages are read on their own, characters.
FOLLOW_UP_MAX_CHARS = 24


@dataclass
class Session:
    """One user's conversation state."""

    last_topic: str | None = None
    lang: str | None = None
    no_answer_streak: int = 0
    updated: float = field(default_factory=time.time)


class Sessions:
    """Sessions keyed by (channel, user_id), in the store."""

    def __init__(self, store: Store | None = None, ttl_s: float = SESSION_TTL_S):
        self.store: Store = store if store is not None else MemoryStore()
        self.ttl_s = ttl_s

    async def get(self, channel: str, user_id: str) -> Session:
        """The user's session (a fresh one if none, or if it was idle past the TTL)."""
        raw = await self.store.get(f"session:{channel}:{user_id}")
        return Session(**json.loads(raw)) if raw else Session()

    async def save(self, channel: str, user_id: str, session: Session) -> None:
        """Write the session back, restarting its idle timeout."""
        session.updated = time.time()
        await self.store.set(f"session:{channel}:{user_id}", json.dumps(dataclasses.asdict(session)), ttl_s=self.ttl_s)

    async def forget(self, channel: str, user_id: str) -> None:
        """Drop the user's state (unsubscribe, /stop)."""
        await self.store.delete(f"session:{channel}:{user_id}")


def is_follow_up(text: str) -> bool:
    """True for a short message that reads as a continuation of the previous question."""
    text = text.strip()
    return len(text) <= FOLLOW_UP_MAX_CHARS and bool(FOLLOW_UP.match(text))
