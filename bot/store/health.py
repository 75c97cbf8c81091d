"""Degrade, do not fail, when the store fails (issue 21).

The store (SQLite, Redis) holds dedup claims, rate-limit buckets, sessions, handoffs
and transcripts: conveniences around an answer, never the answer itself. When a store
call fails, its caller goes on without it (the dispatcher computes and delivers the
reply: dedup in process memory, no rate limit, no transcript, a fresh session) and
reports it here with :func:`store_unavailable`: one ``store.unavailable`` log line
(at most one per operation every :data:`LOG_EVERY_S` seconds, with the number
suppressed meanwhile) and ``healthbot_store_unavailable_total{operation}``.

``/readyz`` asks :func:`check_store`: ``ok``, ``unwritable`` (the store answers
reads but cannot write: disk full, read-only database, Redis refusing writes) or
``unreachable`` (nothing answers); anything but ``ok`` is a 503, and the first
successful probe afterwards is a 200 again.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Final, Generic, Hashable, TypeVar

import structlog
from prometheus_client import Counter

from bot import metrics

log = structlog.get_logger("healthbot.store")

#: Key written (and expiring after a minute) by the write probe of ``health()``.
PROBE_KEY: Final = "_health:probe"
#: A ``store.unavailable`` line per operation at most this often, seconds.
LOG_EVERY_S: Final = 10.0
#: What :func:`check_store` returns.
OK: Final = "ok"
UNWRITABLE: Final = "unwritable"
UNREACHABLE: Final = "unreachable"

#: The ``operation`` label's values (a closed set): where a store call was given up on.
OPERATIONS: Final = ("dedup", "rate_limit", "session_get", "session_save", "handoff_active", "handoff_relay",
                     "handoff_start", "handoff_end", "handoff_agent_message", "transcript", "replay_check",
                     "unanswered", "feedback")

STORE_UNAVAILABLE: Final = Counter(
    "healthbot_store_unavailable",
    "Store calls that failed (Redis unreachable, disk full, read-only database, …) and were done "
    "without: the reply was still computed and delivered. By operation: dedup (claim or finished "
    "reply), rate_limit, session_get, session_save, handoff_active, handoff_relay, handoff_start, "
    "handoff_end, handoff_agent_message, transcript, unanswered (recording a question the bot could "
    "not answer, bot/unanswered.py), feedback (offering an answer for a vote, or recording one: bot/feedback.py).",
    ["operation"], registry=metrics.REGISTRY)
for _operation in OPERATIONS:
    STORE_UNAVAILABLE.labels(operation=_operation)

_last_logged: dict[str, tuple[float, int]] = {}
_last_health: dict[int, str] = {}


def store_unavailable(operation: str, exc: BaseException) -> None:
    """Count one store call given up on (``operation``, one of :data:`OPERATIONS`) and log it.

    The first failure of an operation is logged at once; later ones at most once per
    :data:`LOG_EVERY_S` seconds, with ``suppressed`` saying how many were not.
    """
    STORE_UNAVAILABLE.labels(operation=operation).inc()
    now = time.monotonic()
    last, suppressed = _last_logged.get(operation, (float("-inf"), 0))
    if now - last < LOG_EVERY_S:
        _last_logged[operation] = (last, suppressed + 1)
        return
    _last_logged[operation] = (now, 0)
    log.warning("store.unavailable", operation=operation, error=str(exc), suppressed=suppressed,
                then="answered without the store")


async def check_store(store: object, timeout_s: float) -> str:
    """The store's readiness: :data:`OK`, :data:`UNWRITABLE` or :data:`UNREACHABLE`; never raises.

    Uses the store's ``health()`` (a read and a write probe) when it has one, else its
    ``ping()``; a store that takes longer than ``timeout_s`` seconds is unreachable.
    Changes are logged (``store.not_ready`` / ``store.ready_again``).
    """
    try:
        health = getattr(store, "health", None)
        if health is not None:
            status = str(await asyncio.wait_for(health(), timeout_s))
        else:
            status = OK if await asyncio.wait_for(store.ping(), timeout_s) else UNREACHABLE  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - any failure (a timeout too) means "not reachable"
        status = UNREACHABLE
    if status not in (OK, UNWRITABLE, UNREACHABLE):
        status = UNREACHABLE
    previous = _last_health.get(id(store))
    if status != previous:
        _last_health[id(store)] = status
        if status != OK:
            log.warning("store.not_ready", store=repr(store), status=status)
        elif previous is not None:
            log.info("store.ready_again", store=repr(store), was=previous)
    return status


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LocalCache(Generic[K, V]):
    """A small in-process map with expiry and a size bound (least recently set dropped first):
    what must outlive a store outage inside this process (finished replies for channel retries)."""

    def __init__(self, max_items: int = 10_000) -> None:
        self.max_items = max_items
        self._items: OrderedDict[K, tuple[V, float]] = OrderedDict()

    def set(self, key: K, value: V, ttl_s: float) -> None:
        self._items[key] = (value, time.monotonic() + ttl_s)
        self._items.move_to_end(key)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, key: K) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        if time.monotonic() >= item[1]:
            del self._items[key]
            return None
        return item[0]

    def __len__(self) -> int:
        return len(self._items)
