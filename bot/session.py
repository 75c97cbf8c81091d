"""Conversation state per user: last topic (for follow-up questions), language, no_answer streak.

In process memory with an idle timeout; several replicas need the shared store (issue 10).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

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
    """Sessions keyed by (channel, user_id)."""

    def __init__(self, ttl_s: float = SESSION_TTL_S):
        self.ttl_s = ttl_s
        self._by_user: dict[tuple[str, str], Session] = {}

    def get(self, channel: str, user_id: str) -> Session:
        """The user's session (a fresh one if none, or if it was idle past the TTL)."""
        key = (channel, user_id)
        s = self._by_user.get(key)
        if s is None or time.time() - s.updated > self.ttl_s:
            s = self._by_user[key] = Session()
        return s

    def forget(self, channel: str, user_id: str) -> None:
        """Drop the user's state (unsubscribe, /stop)."""
        self._by_user.pop((channel, user_id), None)


def is_follow_up(text: str) -> bool:
    """True for a short message that reads as a continuation of the previous question."""
    text = text.strip()
    return len(text) <= FOLLOW_UP_MAX_CHARS and bool(FOLLOW_UP.match(text))
