"""The embedded :class:`~bot.store.base.Store`: one SQLite file, shared safely by processes (its
connection, pragmas, schema and error messages: bot/store/sqlite_connection.py).

``sqlite:///relative/path.db`` (relative to the working directory) or
``sqlite:////absolute/path.db``: the part after ``sqlite:///`` is the path, as in
SQLAlchemy's URLs; ``Config.effective_store_url`` writes the absolute form.
``sqlite:///:memory:`` is a private in-memory database (one store object only).

How it stays correct with several processes on one file:

* WAL journal mode (https://www.sqlite.org/wal.html): readers never block the
  writer nor the writer readers; ``synchronous=NORMAL`` keeps the file consistent
  on a crash (the last commits may be lost on power failure, which dedup keys,
  buckets and sessions tolerate).
* Every read-modify-write runs in ``BEGIN IMMEDIATE`` … ``COMMIT``
  (https://www.sqlite.org/lang_transaction.html): IMMEDIATE takes the write lock
  at BEGIN, so two processes cannot both read "absent" and both write; the loser
  waits in SQLite's busy handler (``busy_timeout_s``) instead of failing with
  SQLITE_BUSY the way a deferred transaction upgrading to a write can.
* Inside one process, one connection (aiosqlite's worker thread) is shared by all
  coroutines under an :class:`asyncio.Lock`, so transactions never interleave.

When the store fails (issue 21) every method raises :class:`StoreError` and the
caller goes on without it (bot/store/health.py); :meth:`SqliteStore.health` tells
``/readyz`` whether the file can be read and written (a write probe catches a full
disk or a read-only database), and comes back ``ok`` with the first write that
succeeds again. ``PRAGMA mmap_size = 0`` keeps the database file out of memory maps,
and :class:`~bot.store.shm_guard.ShmGuard` keeps the connection away from an
unwritable or truncated ``-shm`` mapping, so neither can end the process with SIGBUS.

Expired rows are ignored on read and purged every ``purge_interval_s`` by the
next write (and by :meth:`SqliteStore.purge`). Token buckets live in their own
table (their own key space, as in :class:`~bot.store.memory.MemoryStore`); a
bucket row is purged once the bucket would be full again, which is the same as
absent.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import aiosqlite
import structlog

from bot.store.base import StoreError
from bot.store.health import OK, PROBE_KEY, UNREACHABLE, UNWRITABLE
from bot.store.shm_guard import ShmGuard, enable_faulthandler
from bot.store.sqlite_connection import (SCHEMA, SCHEMA_VERSION, abandon, configure, connect, describe_error,
                                         sqlite_path)

__all__ = ["SqliteStore", "sqlite_path"]

log = structlog.get_logger("healthbot.store")


def _live(expires: float | None, now: float) -> bool:
    return expires is None or expires > now


def _expiry(ttl_s: float | None, now: float) -> float | None:
    return None if ttl_s is None else now + ttl_s


class SqliteStore:
    """The :class:`~bot.store.base.Store` protocol on one SQLite file (see the module docstring).

    Open with :meth:`open`; close with :meth:`close` (the aiosqlite worker is a
    non-daemon thread: an unclosed store keeps the interpreter from exiting).
    Several ``SqliteStore`` objects, in one process or many, may share a file.
    Every method raises :class:`StoreError` on a SQLite error (locked longer than
    ``busy_timeout_s``, disk full, not a database, closed store), never ``sqlite3.Error``.
    """

    def __init__(self, conn: aiosqlite.Connection, path: str, *,
                 busy_timeout_s: float, purge_interval_s: float) -> None:
        self._conn: aiosqlite.Connection | None = conn
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self.purge_interval_s = purge_interval_s
        self._lock = asyncio.Lock()
        self._next_purge_at = 0.0
        self._guard = None if path == ":memory:" else ShmGuard(self.path)

    @classmethod
    async def open(cls, url: str, *, busy_timeout_s: float = 10.0,
                   purge_interval_s: float = 60.0) -> "SqliteStore":
        """Open (creating the file, its parent folders and the tables) the store at ``url``.

        Args:
            url: ``sqlite:///relative.db``, ``sqlite:////absolute/path.db`` or ``sqlite:///:memory:``.
            busy_timeout_s: how long (seconds) a write waits for another process's write lock.
            purge_interval_s: seconds between purges of expired rows (done by the next write).

        Raises:
            StoreError: bad URL, folder not creatable, file not openable / not a SQLite
                database / from a newer schema, or WAL mode refused (e.g. a network filesystem).
        """
        path = sqlite_path(url)
        memory = path == ":memory:"
        enable_faulthandler()  # a fatal signal inside SQLite's C code leaves a traceback, not silence
        conn = await connect(path, busy_timeout_s)
        store = cls(conn, path if memory else str(Path(path).absolute()),
                    busy_timeout_s=busy_timeout_s, purge_interval_s=purge_interval_s)
        try:
            await store._init_schema(memory)
        except BaseException:
            await store.close()
            raise
        return store

    async def _init_schema(self, memory: bool) -> None:
        conn = self._conn
        assert conn is not None
        problem = self._guard.check() if self._guard is not None else None
        if problem is not None:  # a leftover -shm that would crash the process once mapped
            raise StoreError(f"SQLite store {self.path}: not opened while {problem}")
        try:
            await configure(conn, self.path, self.busy_timeout_s, memory)
            async with self._transaction(purge=False) as (conn, _now):
                (version,), = await conn.execute_fetchall("PRAGMA user_version")
                if version > SCHEMA_VERSION:
                    raise StoreError(
                        f"SQLite store {self.path} has schema {version}, newer than this healthbot's "
                        f"{SCHEMA_VERSION}: upgrade healthbot or point HEALTHBOT_STORE_URL at another file"
                    )
                for statement in SCHEMA:
                    await conn.execute(statement)
                if version < SCHEMA_VERSION:
                    await conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.Error as e:
            raise self._error(e) from e

    def _error(self, e: BaseException) -> StoreError:
        return describe_error(e, self.path, self.busy_timeout_s)

    def _open_conn(self) -> aiosqlite.Connection:
        """The connection, once the ``-shm`` guard says it may be used now (call under the lock).

        Raises:
            StoreError: closed, or the ``-shm`` mapping cannot be touched safely.
        """
        if self._conn is None:
            raise StoreError(f"SQLite store {self.path} is closed: open a new one with open_store(url)")
        if self._guard is not None:
            problem = self._guard.check()
            if problem is not None:
                raise StoreError(f"SQLite store {self.path}: not used while {problem}")
        return self._conn

    def _used(self) -> None:
        if self._guard is not None:
            self._guard.note()

    @asynccontextmanager
    async def _transaction(self, purge: bool = True) -> AsyncIterator[tuple[aiosqlite.Connection, float]]:
        """``BEGIN IMMEDIATE`` … ``COMMIT`` (``ROLLBACK`` on any exception), under the lock.

        Yields the connection and the transaction's clock (Unix time, seconds).
        Statements are queued FIFO on aiosqlite's thread, so a ROLLBACK queued by a
        cancelled caller always runs before the next caller's BEGIN.
        """
        async with self._lock:
            conn = self._open_conn()
            try:
                await conn.execute("BEGIN IMMEDIATE")
                now = time.time()
                try:
                    if purge and now >= self._next_purge_at:
                        await self._purge(conn, now)
                        self._next_purge_at = now + self.purge_interval_s
                    yield conn, now
                    await conn.commit()
                except BaseException:
                    await conn.rollback()
                    raise
            except sqlite3.Error as e:
                raise self._error(e) from e
            finally:
                self._used()

    async def _read(self, sql: str, params: tuple) -> list:
        async with self._lock:
            conn = self._open_conn()
            try:
                return list(await conn.execute_fetchall(sql, params))
            except sqlite3.Error as e:
                raise self._error(e) from e
            finally:
                self._used()

    @staticmethod
    async def _purge(conn: aiosqlite.Connection, now: float) -> int:
        removed = 0
        for sql, params in (
            ("DELETE FROM kv WHERE expires IS NOT NULL AND expires <= ?", (now,)),
            ("DELETE FROM items WHERE key NOT IN (SELECT key FROM kv WHERE value IS NULL)", ()),
            ("DELETE FROM buckets WHERE full_at IS NOT NULL AND full_at <= ?", (now,)),
        ):
            async with conn.execute(sql, params) as cur:
                removed += max(cur.rowcount, 0)
        return removed

    async def purge(self) -> int:
        """Delete expired keys and lists, and buckets that are full again; the number of rows removed.

        Raises:
            StoreError: a SQLite error.
        """
        async with self._transaction(purge=False) as (conn, now):
            removed = await self._purge(conn, now)
            self._next_purge_at = now + self.purge_interval_s
        return removed

    async def get(self, key: str) -> str | None:
        """The string at ``key``, or None if absent, expired or a list."""
        rows = await self._read(
            "SELECT value FROM kv WHERE key = ? AND (expires IS NULL OR expires > ?)", (key, time.time()))
        return rows[0][0] if rows else None

    async def set(self, key: str, value: str, ttl_s: float | None = None) -> None:
        """Store ``value`` (replacing any string or list), expiring after ``ttl_s`` seconds."""
        async with self._transaction() as (conn, now):
            await conn.execute("DELETE FROM items WHERE key = ?", (key,))
            await conn.execute("INSERT OR REPLACE INTO kv (key, value, expires) VALUES (?, ?, ?)",
                               (key, value, _expiry(ttl_s, now)))

    async def set_if_absent(self, key: str, value: str, ttl_s: float | None = None) -> bool:
        """Claim ``key``: store only if absent or expired (one ``BEGIN IMMEDIATE`` transaction).

        Returns True for exactly one of any number of concurrent callers, in any
        number of processes sharing the file.
        """
        async with self._transaction() as (conn, now):
            rows = await conn.execute_fetchall("SELECT value, expires FROM kv WHERE key = ?", (key,))
            if rows and _live(rows[0][1], now):
                return False
            if rows and rows[0][0] is None:
                await conn.execute("DELETE FROM items WHERE key = ?", (key,))
            await conn.execute("INSERT OR REPLACE INTO kv (key, value, expires) VALUES (?, ?, ?)",
                               (key, value, _expiry(ttl_s, now)))
            return True

    async def delete(self, key: str) -> None:
        """Remove the string or list at ``key`` (no error if absent; buckets are kept)."""
        async with self._transaction() as (conn, _now):
            await conn.execute("DELETE FROM kv WHERE key = ?", (key,))
            await conn.execute("DELETE FROM items WHERE key = ?", (key,))

    async def delete_if_equal(self, key: str, value: str) -> bool:
        """Remove ``key`` only if it holds ``value`` and has not expired; True if removed.

        One conditional ``DELETE`` statement: SQLite runs a lone statement as its own
        write transaction, so the compare and the delete are atomic across processes.
        """
        async with self._lock:
            conn = self._open_conn()
            try:
                async with conn.execute(
                    "DELETE FROM kv WHERE key = ? AND value = ? AND (expires IS NULL OR expires > ?)",
                    (key, value, time.time()),
                ) as cur:
                    return cur.rowcount == 1
            except sqlite3.Error as e:
                raise self._error(e) from e
            finally:
                self._used()

    async def take_token(self, key: str, rate_per_s: float, burst: int) -> bool:
        """Token bucket: capacity ``burst`` tokens, refilled at ``rate_per_s`` tokens per second.

        A bucket never seen (or purged because it was full again) starts full.
        Returns True if a token was taken. Atomic across processes (``BEGIN IMMEDIATE``).
        """
        async with self._transaction() as (conn, now):
            rows = await conn.execute_fetchall("SELECT tokens, updated FROM buckets WHERE key = ?", (key,))
            if rows:
                tokens, updated = rows[0]
                tokens = min(float(burst), tokens + max(0.0, now - updated) * rate_per_s)
            else:
                tokens = float(burst)
            took = tokens >= 1.0
            if took:
                tokens -= 1.0
            full_at = now + (burst - tokens) / rate_per_s if rate_per_s > 0 else None
            await conn.execute(
                "INSERT OR REPLACE INTO buckets (key, tokens, updated, full_at) VALUES (?, ?, ?, ?)",
                (key, tokens, now, full_at))
            return took

    async def push(self, key: str, value: str, ttl_s: float | None = None) -> None:
        """Append ``value`` to the list at ``key``; the whole list expires ``ttl_s`` seconds from now.

        A string at ``key`` (or an expired list) is replaced by a new list.
        """
        async with self._transaction() as (conn, now):
            rows = await conn.execute_fetchall("SELECT value, expires FROM kv WHERE key = ?", (key,))
            expires = _expiry(ttl_s, now)
            if rows and rows[0][0] is None and _live(rows[0][1], now):
                await conn.execute("UPDATE kv SET expires = ? WHERE key = ?", (expires, key))
            else:
                await conn.execute("DELETE FROM items WHERE key = ?", (key,))
                await conn.execute("INSERT OR REPLACE INTO kv (key, value, expires) VALUES (?, NULL, ?)",
                                   (key, expires))
            await conn.execute("INSERT INTO items (key, value) VALUES (?, ?)", (key, value))

    async def pop_all(self, key: str) -> list[str]:
        """Remove ``key`` and return its list, oldest first ([] if absent, expired or a string).

        Read and delete happen in one ``BEGIN IMMEDIATE`` transaction, so an item
        pushed concurrently is returned by exactly one pop_all.
        """
        async with self._transaction() as (conn, now):
            rows = await conn.execute_fetchall("SELECT value, expires FROM kv WHERE key = ?", (key,))
            if not rows:
                return []
            items: list[str] = []
            if rows[0][0] is None and _live(rows[0][1], now):
                items = [v for (v,) in await conn.execute_fetchall(
                    "SELECT value FROM items WHERE key = ? ORDER BY id", (key,))]
            await conn.execute("DELETE FROM items WHERE key = ?", (key,))
            await conn.execute("DELETE FROM kv WHERE key = ?", (key,))
            return items

    async def read_all(self, key: str) -> list[str]:
        """The list at ``key``, oldest first, left in place ([] if absent, expired or a string); one read."""
        rows = await self._read(
            "SELECT items.value FROM kv JOIN items ON items.key = kv.key WHERE kv.key = ? AND kv.value IS NULL"
            " AND (kv.expires IS NULL OR kv.expires > ?) ORDER BY items.id", (key, time.time()))
        return [v for (v,) in rows]

    async def ping(self) -> bool:
        """True if the file answers a query (False when closed or broken; never raises)."""
        try:
            await self._read("SELECT 1", ())
            return True
        except StoreError:
            return False

    async def health(self) -> str:
        """For ``/readyz``: ``"ok"`` when a read and a small write (:data:`~bot.store.health.PROBE_KEY`,
        expiring after a minute) succeed, ``"unwritable"`` when only the read does (disk full,
        read-only database), ``"unreachable"`` otherwise (closed, broken, ``-shm`` unusable).
        Never raises."""
        try:
            await self._read("SELECT 1", ())
        except StoreError:
            return UNREACHABLE
        try:
            await self.set(PROBE_KEY, repr(time.time()), ttl_s=60.0)
        except StoreError:
            return UNWRITABLE
        return OK

    async def close(self) -> None:
        """Close the connection and stop its worker thread; safe to call twice.

        While the ``-shm`` file cannot be touched safely (see :mod:`bot.store.shm_guard`),
        closing (which checkpoints through the mapping) would crash the process: the
        connection is then abandoned instead, and the error logged.
        """
        async with self._lock:
            conn, self._conn = self._conn, None
            if conn is None:
                return
            problem = self._guard.check() if self._guard is not None else None
            if problem is None:
                await conn.close()
                return
        abandon(conn)
        log.error("store.close_skipped", path=self.path, reason=problem,
                  hint="the SQLite connection was left open; the -wal file is replayed at the next start")

    def __repr__(self) -> str:
        return f"SqliteStore({self.path!r})"

