"""Helpful / not-helpful feedback on answers (issue 25): one vote per user per answer, counted per topic.

Only answers take feedback: a reply with intent ``answer`` and a knowledge-base topic. The
channel adapter that delivers such an answer with buttons (Telegram's inline keyboard, a WeChat
service account's ``msgmenu``) or to a client that may vote (``POST /api/v1/feedback``) first
calls :meth:`FeedbackBook.offer`; a vote then names the answer by the channel, the user and the
message id the user's question came with (:attr:`bot.types.Inbound.message_id`), and
:meth:`FeedbackBook.vote` records it. What the store keeps (keys in :data:`OFFER_KEY`,
:data:`VOTED_KEY`, :data:`VOTES_KEY`):

* ``feedback:offer:<channel>:<pseudonym>:<message id>`` → ``{"topic", "lang"}``, for
  :data:`VOTE_WINDOW_S` (7 days): which topic the answer was; a vote after that is refused as
  unknown. ``<pseudonym>`` is :func:`safety.pii.pseudonym` of the user id (``u_`` and 12 hex
  digits of its SHA-256), never the id itself.
* ``feedback:voted:<channel>:<pseudonym>:<message id>`` → the vote, for the same 7 days: the
  claim that makes the first vote the one that counts. **A second vote on the same answer is
  ignored** (set-if-absent, atomic across replicas): a user who changes their mind, or presses
  both buttons, or whose channel re-delivers the press, counts once, with the first vote.
* ``feedback:votes:<YYYY-MM-DD>`` (UTC day) — one JSON object per vote,
  ``{"ts": 1764660000, "topic": "sleep.insomnia", "vote": "not_helpful", "channel": "telegram"}``,
  kept :data:`RETENTION_DAYS` after its day ends. No user id, pseudonym, message id or text:
  ``healthbot report feedback`` (bot/feedback_report.py) counts these per topic.

Each recorded vote also counts in ``healthbot_feedback_total{topic, vote}`` (bot/metrics.py).
The texts users see around a vote (button labels, thanks) are :data:`TEXTS`, one place for
every channel.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import structlog

from bot import metrics
from bot.store import Store, StoreError
from bot.store.health import store_unavailable
from bot.types import Intent, Reply
from bot.unanswered import DAY_S, ttl_for
from safety.pii import pseudonym

log = structlog.get_logger("healthbot.feedback")

__all__ = ["OFFER_KEY", "RETENTION_DAYS", "TEXTS", "VOTED_KEY", "VOTES", "VOTES_KEY", "VOTE_WINDOW_S",
           "FeedbackBook", "Outcome", "VoteResult", "day_key", "read_votes", "votable"]

VOTES = ("helpful", "not_helpful")
"""The two votes (the ``vote`` label of ``healthbot_feedback_total``)."""
VOTE_WINDOW_S = 7 * DAY_S
"""Seconds after an answer during which its user may vote on it."""
RETENTION_DAYS = 365
"""Days each day's list of votes is kept after the day ends (votes carry no personal data)."""
OFFER_KEY = "feedback:offer:{channel}:{user}:{message_id}"
VOTED_KEY = "feedback:voted:{channel}:{user}:{message_id}"
VOTES_KEY = "feedback:votes:"

TEXTS: dict[str, dict[str, str]] = {
    "question": {"zh": "这个回答对您有帮助吗？", "en": "Was this answer helpful?"},
    "helpful": {"zh": "👍 有帮助", "en": "👍 Helpful"},
    "not_helpful": {"zh": "👎 没帮助", "en": "👎 Not helpful"},
    "tail": {"zh": "点一下即可。", "en": "Tap one."},
    "recorded": {"zh": "谢谢反馈！", "en": "Thanks for the feedback!"},
    "repeated": {"zh": "您已经评价过这个回答了，谢谢！", "en": "You have already rated this answer. Thank you!"},
    "unknown": {"zh": "这个回答现在无法评价（只有提问的人可以在 7 天内评价）。",
                "en": "This answer cannot be rated now (only the person who asked can, within 7 days)."},
    "failed": {"zh": "暂时无法记录您的评价，请稍后再试。",
               "en": "Your rating could not be saved right now. Please try again later."},
}
"""What users see around a vote, per language: the question and button labels, and the answer to a
press (by :class:`Outcome` value, plus ``failed`` when the store is down)."""


class Outcome(str, enum.Enum):
    """What became of one vote."""

    RECORDED = "recorded"  #: the first vote on this answer: counted
    REPEATED = "repeated"  #: the answer already had a vote: this one is ignored
    UNKNOWN = "unknown"    #: no answer of this user with this message id takes a vote (any more)


@dataclass(frozen=True)
class VoteResult:
    """The outcome of :meth:`FeedbackBook.vote`; ``topic``, ``lang`` and ``vote`` (the vote that
    counts: the first one) are None for :attr:`Outcome.UNKNOWN`."""

    outcome: Outcome
    topic: str | None = None
    lang: str | None = None
    vote: str | None = None


def votable(reply: Reply) -> bool:
    """True for the replies that take feedback: intent ``answer`` with a topic."""
    return reply.intent is Intent.ANSWER and bool(reply.topic)


def _ids(channel: str, user_id: str, message_id: str) -> dict[str, str]:
    return {"channel": channel, "user": pseudonym(user_id), "message_id": message_id}


class FeedbackBook:
    """Offers answers for feedback and records votes in the store (see the module docstring).

    Args:
        store: the shared store; may be set later through :attr:`store` (the app sets it when
            the core starts, as for :class:`bot.handoff.HandoffManager`).
    """

    def __init__(self, store: Store | None = None) -> None:
        self.store = store

    def _store(self) -> Store:
        if self.store is None:
            raise StoreError("feedback: no store yet (the server is still starting)")
        return self.store

    async def offer(self, channel: str, user_id: str, message_id: str, reply: Reply) -> bool:
        """Let ``user_id`` vote on ``reply``, the answer to their message ``message_id``, for
        :data:`VOTE_WINDOW_S`. Returns True when the answer takes votes (:func:`votable`) and the
        offer is stored; False otherwise. Never raises: a store failure is counted
        (``healthbot_store_unavailable_total{operation="feedback"}``) and the answer goes out without buttons."""
        if not votable(reply):
            return False
        key = OFFER_KEY.format(**_ids(channel, user_id, message_id))
        try:
            await self._store().set(key, json.dumps({"topic": reply.topic, "lang": reply.lang}), VOTE_WINDOW_S)
        except StoreError as exc:
            store_unavailable("feedback", exc)
            return False
        return True

    async def vote(self, channel: str, user_id: str, message_id: str, vote: str) -> VoteResult:
        """Record ``user_id``'s ``vote`` (one of :data:`VOTES`) on their answer to ``message_id``.

        The first vote on an answer counts (the day's list, ``healthbot_feedback_total``); any
        later one is :attr:`Outcome.REPEATED` and changes nothing.

        Raises:
            ValueError: ``vote`` is not one of :data:`VOTES`.
            StoreError: the store failed (nothing was counted: the user may vote again later).
        """
        if vote not in VOTES:
            raise ValueError(f"vote must be one of {', '.join(VOTES)}, not {vote!r}")
        store, ids = self._store(), _ids(channel, user_id, message_id)
        raw = await store.get(OFFER_KEY.format(**ids))
        try:
            offered = json.loads(raw) if raw else None
        except ValueError:
            offered = None
        if not isinstance(offered, dict) or not isinstance(offered.get("topic"), str):
            return VoteResult(Outcome.UNKNOWN)
        topic, lang = offered["topic"], offered.get("lang")
        voted_key = VOTED_KEY.format(**ids)
        if not await store.set_if_absent(voted_key, vote, VOTE_WINDOW_S):
            first = await store.get(voted_key)
            return VoteResult(Outcome.REPEATED, topic, lang, first if first in VOTES else vote)
        now = time.time()
        entry = {"ts": int(now), "topic": topic, "vote": vote, "channel": channel}
        try:
            await store.push(day_key(now), json.dumps(entry, separators=(",", ":")), ttl_for(now, RETENTION_DAYS))
        except StoreError:
            try:  # not counted: let the user vote again
                await store.delete(voted_key)
            except StoreError:
                pass
            raise
        metrics.FEEDBACK.labels(topic=topic, vote=vote).inc()
        log.info("feedback.vote", channel=channel, topic=topic, vote=vote)
        return VoteResult(Outcome.RECORDED, topic, lang, vote)


def day_key(ts: float) -> str:
    """``feedback:votes:<YYYY-MM-DD>``: the list of the UTC day that holds Unix time ``ts``."""
    return VOTES_KEY + datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d")


async def read_votes(store: Store, since_s: float, now: float | None = None) -> list[dict]:
    """The votes of the last ``since_s`` seconds (at most :data:`RETENTION_DAYS`), oldest first,
    each ``{"ts", "topic", "vote", "channel"}``; an entry of another shape is skipped.

    Raises:
        StoreError: the store cannot be read.
    """
    now = time.time() if now is None else now
    start = now - min(since_s, RETENTION_DAYS * DAY_S)
    day = datetime.fromtimestamp(start, timezone.utc).date()
    last = datetime.fromtimestamp(now, timezone.utc).date()
    out: list[dict] = []
    while day <= last:
        for raw in await store.read_all(VOTES_KEY + day.isoformat()):
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if (isinstance(entry, dict) and isinstance(entry.get("ts"), (int, float))
                    and isinstance(entry.get("topic"), str) and entry.get("vote") in VOTES
                    and start <= entry["ts"] <= now):
                out.append(entry)
        day += timedelta(days=1)
    return sorted(out, key=lambda e: e["ts"])
