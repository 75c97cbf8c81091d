"""Token buckets in memory: the per-user and per-address budgets of :class:`~bot.admission.Admission`
(requests, estimated encoder tokens, 4xx failures), per process."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable

__all__ = ["Buckets", "TABLE_MAX"]

#: Largest number of keys each in-memory table keeps (the least recently used are dropped).
TABLE_MAX = 100_000


class Buckets:
    """Token buckets by key, in memory, least recently used dropped beyond ``TABLE_MAX``
    (a dropped key starts full again: an attacker gains nothing by evicting, since
    new keys start full anyway)."""

    def __init__(self, per_minute: float, burst: float, clock: Callable[[], float] = time.monotonic):
        self.rate = per_minute / 60.0
        self.burst = float(burst)
        self.clock = clock
        self._t: OrderedDict[Any, tuple[float, float]] = OrderedDict()

    def level(self, key: Any) -> float:
        now = self.clock()
        tokens, at = self._t.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.rate)

    def take(self, key: Any, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens if there are that many (a cost above the burst needs a full bucket)."""
        now = self.clock()
        tokens = self.level(key)
        ok = tokens >= min(cost, self.burst)
        if ok:
            tokens -= cost
        self._t[key] = (tokens, now)
        self._t.move_to_end(key)
        if len(self._t) > TABLE_MAX:
            self._t.popitem(last=False)
        return ok

    def give(self, key: Any, tokens: float) -> None:
        """Put ``tokens`` back (a charge undone), up to the burst."""
        self._t[key] = (min(self.burst, self.level(key) + tokens), self.clock())

    def retry_after(self, key: Any, cost: float = 1.0) -> float:
        """Seconds until ``cost`` tokens are there."""
        missing = min(cost, self.burst) - self.level(key)
        return max(0.0, missing / self.rate) if self.rate > 0 else 60.0
