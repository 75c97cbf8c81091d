"""The Store protocol: the few primitives every piece of shared state is built from."""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence, runtime_checkable


class StoreError(RuntimeError):
    """The store is misconfigured, unreachable or cannot write; the message says which and what to do.

    At run time callers degrade instead of failing (bot/store/health.py): the reply is
    still computed and delivered without the store.
    """


class ClaimRead(NamedTuple):
    """What :meth:`Store.claim_and_read` found: whether this call claimed the key, the string at
    each key of ``strings`` (None where absent, expired or a list), the list at each key of
    ``lists`` (oldest first, [] where absent, expired or a string), whether a token was taken
    from ``bucket`` (None: no bucket given) and whether ``record``'s key held another value
    (``conflict``: nothing else was done; the strings are then None and the lists empty)."""

    claimed: bool
    strings: list[str | None]
    lists: list[list[str]]
    token: bool | None = None
    conflict: bool = False


#: A token bucket for :meth:`Store.claim_and_read`: (key, rate in tokens a second, burst in tokens).
Bucket = tuple[str, float, int]


@runtime_checkable
class Store(Protocol):
    """Key/value state with TTLs, atomic claims, token buckets, locks and queues.

    Every method is atomic with respect to other processes sharing the same
    backend (SQLite file or Redis). Times are seconds; TTL None = no expiry.
    """

    async def get(self, key: str) -> str | None:
        """The value, or None if absent or expired."""
        ...

    async def set(self, key: str, value: str, ttl_s: float | None = None) -> None:
        """Store ``value`` under ``key`` (replacing any), expiring after ``ttl_s``."""
        ...

    async def get_many(self, keys: Sequence[str]) -> list[str | None]:
        """The string at each of ``keys``, in order (None where absent, expired or a list), in one
        round trip; a message reads what it needs with this (bot/dedup.py)."""
        ...

    async def set_many(self, items: Sequence[tuple[str, str, float | None]]) -> None:
        """Each ``(key, value, ttl_s)`` as :meth:`set`, in one round trip: one transaction on SQLite,
        one pipeline on Redis (there each SET is atomic, the group is not). Empty: nothing is sent."""
        ...

    async def set_if_absent(self, key: str, value: str, ttl_s: float | None = None) -> bool:
        """Store only if ``key`` is absent or expired; True if this call stored it (a claim)."""
        ...

    async def claim_and_read(self, key: str, value: str, ttl_s: float | None = None, strings: Sequence[str] = (),
                             lists: Sequence[str] = (), bucket: Bucket | None = None,
                             if_found: tuple[str, float | None] | None = None,
                             record: tuple[str, str, float | None] | None = None) -> ClaimRead:
        """:meth:`get_many` of ``strings``, :meth:`read_all` of each of ``lists``, :meth:`set_if_absent`
        of ``key`` and :meth:`take_token` of ``bucket``, in that order, in one round trip (one
        transaction on SQLite; one pipeline on Redis: each command atomic on its own, the group not):
        a message's claim and what it reads with it (bot/dedup.py, adapters/wechat/passive.py).

        ``if_found``: ``(value, ttl_s)`` the claim stores instead when a read finds something (a string,
        or a list with items), decided atomically with the reads (one Lua script on Redis).
        ``record``: ``(key, value, ttl_s)`` stored first if ``key`` is absent; where ``key`` holds
        another value nothing else is done (no read, claim or token) and ``conflict`` is True, decided
        atomically with the claim (a WeChat request's replay record, bot/dedup.py).
        Raises StoreError when any of them fails."""
        ...

    async def delete(self, key: str) -> None:
        """Remove ``key`` (no error if absent)."""
        ...

    async def delete_if_equal(self, key: str, value: str) -> bool:
        """Remove ``key`` only if it holds ``value`` (lock release); True if removed."""
        ...

    async def take_token(self, key: str, rate_per_s: float, burst: int) -> bool:
        """Token bucket (capacity ``burst``, refilled at ``rate_per_s``): True if a token was taken."""
        ...

    async def push(self, key: str, value: str, ttl_s: float | None = None) -> None:
        """Append ``value`` to the list at ``key`` (FIFO); the list expires after ``ttl_s``."""
        ...

    async def pop_all(self, key: str) -> list[str]:
        """Remove and return the whole list at ``key``, oldest first ([] if none)."""
        ...

    async def read_all(self, key: str) -> list[str]:
        """The whole list at ``key``, oldest first, left in place ([] if none, expired or a string)."""
        ...

    async def ping(self) -> bool:
        """True if the backend answers; never raises."""
        ...

    async def health(self) -> str:
        """For /readyz: ``"ok"`` (reads and a small write succeed), ``"unwritable"`` (reads only:
        disk full, read-only database, Redis refusing writes) or ``"unreachable"``; never raises."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
