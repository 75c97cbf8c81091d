"""Conversation state per user: last topic (for follow-up questions), the pending offer, no_answer streak.

Kept in the :class:`~bot.store.Store` under ``session:<channel>:<user>`` (JSON),
expiring after :data:`SESSION_TTL_S` of silence, so every replica sees it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

from bot.store import MemoryStore, Store

#: A conversation idle longer than this starts afresh, seconds.
SESSION_TTL_S = 30 * 60

@dataclass
class Session:
    """One user's conversation state."""

    last_topic: str | None = None
    #: the facet of ``last_topic`` last shown (bot/follow_up.py); None for its main answer
    last_facet: str | None = None
    #: the topics offered by the last reply ("您是想了解「…」吗？", bot/suggestion.py), best first
    suggested: list[str] = field(default_factory=list)
    #: the language, script and variant of that offer (safety.normalize): a choice such as "2" says none
    offer_form: list[str] = field(default_factory=list)
    #: the facet asked for while that offer stood ("那饮食上呢" after "您是想了解下面哪一个？"): the topic
    #: chosen next is answered with it (bot/dispatcher.py); None for its main answer
    offer_facet: str | None = None
    no_answer_streak: int = 0
    #: the kind of the last emergency reply ("emergency" or "crisis"), until a thanks or goodbye has had
    #: the reminder of what to do if the danger is still there (safety/safety_net.py); "" for none
    danger: str = ""
    updated: float = field(default_factory=time.time)


class Sessions:
    """Sessions keyed by (channel, user_id), in the store."""

    def __init__(self, store: Store | None = None, ttl_s: float = SESSION_TTL_S):
        self.store: Store = store if store is not None else MemoryStore()
        self.ttl_s = ttl_s

    @staticmethod
    def key(channel: str, user_id: str) -> str:
        """The store key of the user's session."""
        return f"session:{channel}:{user_id}"

    @staticmethod
    def parse(raw: str | None) -> Session:
        """The session stored as ``raw`` (a fresh one for None: none, or idle past the TTL)."""
        if not raw:
            return Session()
        known = {f.name for f in dataclasses.fields(Session)}  # a session written by another version
        return Session(**{k: v for k, v in json.loads(raw).items() if k in known})

    def dump(self, channel: str, user_id: str, session: Session) -> tuple[str, str, float]:
        """``(key, value, ttl_s)`` that write the session back, restarting its idle timeout."""
        session.updated = time.time()
        return self.key(channel, user_id), json.dumps(dataclasses.asdict(session)), self.ttl_s

    async def forget(self, channel: str, user_id: str) -> None:
        """Drop the user's state (unsubscribe, /stop)."""
        await self.store.delete(self.key(channel, user_id))
