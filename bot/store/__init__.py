"""Shared state behind one :class:`Store` protocol (ARCHITECTURE.md, "State").

Implementations: :class:`MemoryStore` (tests, one process), SQLite (the embedded
default, ``sqlite:///path/file.db``) and Redis (several replicas,
``redis://host:port/db``), chosen by ``HEALTHBOT_STORE_URL`` through
:func:`open_store`. Values are strings (JSON where structured); keys are
namespaced by the caller (``dedup:wechat:123``, ``session:telegram:42``,
``wechat:access_token``).
"""

from __future__ import annotations

from bot.store.base import Bucket, ClaimRead, Store, StoreError
from bot.store.memory import MemoryStore

__all__ = ["Bucket", "ClaimRead", "Store", "StoreError", "MemoryStore", "open_store"]


async def open_store(url: str) -> Store:
    """The store for ``url``: ``memory://``, ``sqlite:///path.db`` or ``redis://host:port/db``.

    Raises:
        StoreError: unknown scheme, or the backend cannot be reached/opened.
    """
    if url.startswith("memory://"):
        return MemoryStore()
    if url.startswith("sqlite://"):
        from bot.store.sqlite import SqliteStore
        return await SqliteStore.open(url)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from bot.store.redis import RedisStore
        return await RedisStore.open(url)
    raise StoreError(f"unknown store URL {url!r}: use sqlite:///path.db, redis://host:port/db or memory://")
