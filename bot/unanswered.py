"""What users ask that the bot cannot answer (issue 25): kept for the team, never who asked.

With ``knowledge.record_unanswered`` on (off by default), :meth:`UnansweredRecorder.record`
keeps each computed reply whose intent is ``no_answer`` or ``refer_doctor`` — except the
"ask back" to a follow-up with nothing before it (notes ``follow_up: no_context``) and the
labelled questions of ``healthbot eval`` (channel ``eval``) — as one JSON object appended to
the day's list ``unanswered:<YYYY-MM-DD>`` (UTC) in the store::

    {"ts": 1764660000, "text": "放了支架多久能坐飞机 电话[PHONE]", "lang": "zh",
     "intent": "no_answer", "reason": null, "decided_by": "retrieval", "best_topic": "heart.hypertension"}

``text`` is the question with personal data masked (:func:`safety.pii.mask_pii`), cut to
:data:`MAX_TEXT_CHARS`; ``reason`` the rule that referred or declined it (a scope rule,
``head``, a care-team rule, a missing facet of a follow-up), ``decided_by`` what decided
(``rule``, ``head``, ``retrieval``, ``topic_scope``, ``topic_fit``, ``follow_up``, …),
``best_topic`` retrieval's best topic. No user, chat or message id, no pseudonym, no channel.

Each day's list expires ``knowledge.unanswered_retention_days`` after the day ends (the store
deletes it: an expired SQLite row is purged, a Redis key expires); :func:`read_unanswered`
leaves out anything older than the retention.

Recording never fails or slows a reply: the write runs in a background task once the reply
is computed; a store error is counted (``healthbot_store_unavailable_total{operation="unanswered"}``,
bot/store/health.py) and the entry dropped, as is a question that finds :data:`MAX_PENDING` writes
still waiting on a slow store. ``healthbot report unanswered`` reads the lists
back (bot/unanswered_report.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping

import structlog

from bot.config import KnowledgeConfig
from bot.store import Store, StoreError
from bot.store.health import store_unavailable
from bot.types import Inbound, Intent, Reply
from safety.pii import mask_pii

log = structlog.get_logger("healthbot.unanswered")

#: Store keys: one list per UTC day.
KEY_PREFIX = "unanswered:"
#: The intents recorded.
RECORDED_INTENTS = frozenset({Intent.NO_ANSWER, Intent.REFER_DOCTOR})
#: Channels never recorded: ``healthbot eval`` asks labelled questions, not users.
SKIPPED_CHANNELS = frozenset({"eval"})
#: A longer question is kept as its first this-many characters.
MAX_TEXT_CHARS = 500
#: Writes waiting on a slow store at most; beyond, a question is dropped (and counted) rather than queued.
MAX_PENDING = 1000
DAY_S = 86_400


def day_key(ts: float) -> str:
    """``unanswered:<YYYY-MM-DD>``: the list of the UTC day that holds Unix time ``ts``."""
    return KEY_PREFIX + datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d")


def ttl_for(ts: float, retention_days: int) -> float:
    """Seconds from ``ts`` until the end of its UTC day plus ``retention_days``: the day's list expiry."""
    day_end = (int(ts) // DAY_S + 1) * DAY_S
    return day_end + retention_days * DAY_S - ts


def unanswered_entry(inbound: Inbound, reply: Reply, notes: Mapping[str, Any], ts: float) -> dict | None:
    """What is kept of one computed reply, or None when it is not recorded (see the module docstring)."""
    if reply.intent not in RECORDED_INTENTS or inbound.channel in SKIPPED_CHANNELS:
        return None
    if notes.get("follow_up") == "no_context" or not (inbound.text or "").strip():
        return None
    reason = notes.get("rule")
    if reason is None and notes.get("facet") == "missing":
        reason = f"facet_missing:{notes.get('follow_up')}"
    return {"ts": int(ts), "text": mask_pii(inbound.text.strip())[:MAX_TEXT_CHARS], "lang": reply.lang,
            "intent": reply.intent.value, "reason": reason, "decided_by": notes.get("decided_by"),
            "best_topic": notes.get("best_topic") or reply.topic}


class UnansweredRecorder:
    """Appends the unanswered questions to the store in the background (``knowledge.record_unanswered``)."""

    def __init__(self, cfg: KnowledgeConfig) -> None:
        self.cfg = cfg
        self._tasks: set[asyncio.Task] = set()

    def record(self, store: Store, inbound: Inbound, reply: Reply, notes: Mapping[str, Any]) -> asyncio.Task | None:
        """Start recording ``inbound``'s question if it is recorded; the task writing it, else None.

        Never raises and never waits: the reply goes out while the entry is written.
        """
        if not self.cfg.record_unanswered:
            return None
        try:
            now = time.time()
            entry = unanswered_entry(inbound, reply, notes, now)
            if entry is None:
                return None
            if len(self._tasks) >= MAX_PENDING:
                store_unavailable("unanswered", StoreError(f"{MAX_PENDING} unanswered questions still being written"))
                return None
            value = json.dumps(entry, ensure_ascii=False, separators=(",", ":"))
            task = asyncio.get_running_loop().create_task(
                self._write(store, day_key(now), value, ttl_for(now, self.cfg.unanswered_retention_days)))
        except Exception as exc:  # noqa: BLE001 - recording must never fail a reply
            log.warning("unanswered.not_recorded", error=type(exc).__name__)
            return None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @staticmethod
    async def _write(store: Store, key: str, value: str, ttl_s: float) -> None:
        try:
            await store.push(key, value, ttl_s)
        except Exception as exc:  # noqa: BLE001 - StoreError, or any failure of the store: counted, dropped
            store_unavailable("unanswered", exc)

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait for the entries being written (at most ``timeout_s``): before the store closes, and in tests."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)


async def read_unanswered(store: Store, since_s: float, retention_days: int, now: float | None = None) -> list[dict]:
    """The recorded entries of the last ``since_s`` seconds (at most the retention), oldest first.

    Reads each day's list without removing it; an entry that is not a JSON object is skipped.

    Raises:
        StoreError: the store cannot be read.
    """
    now = time.time() if now is None else now
    start = now - min(since_s, retention_days * DAY_S)
    day = datetime.fromtimestamp(start, timezone.utc).date()
    last = datetime.fromtimestamp(now, timezone.utc).date()
    out: list[dict] = []
    while day <= last:
        for raw in await store.read_all(KEY_PREFIX + day.isoformat()):
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            ts = entry.get("ts") if isinstance(entry, dict) else None
            if isinstance(ts, (int, float)) and isinstance(entry.get("text"), str) and start <= ts <= now:
                out.append(entry)
        day += timedelta(days=1)
    return sorted(out, key=lambda e: e["ts"])
