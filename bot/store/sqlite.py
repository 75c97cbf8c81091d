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
* A write runs at once, alone (a plain write, one statement in autocommit: SQLite holds the
  write lock only inside its step; a read-modify-write in ``BEGIN IMMEDIATE`` … ``COMMIT``,
  which takes the lock at BEGIN, so two processes cannot both read "absent" and both write).
  When another process holds the lock, writes are queued and committed together (group
  commit, bot/store/sqlite_writes.py), so contending processes take the lock less often.
* Transactions run whole, synchronously, on the event loop's thread (tens of microseconds:
  WAL with ``synchronous=NORMAL`` does not fsync at commit), on a connection whose busy
  timeout is 0; nothing awaits inside one, so they never interleave. A locked database fails
  at once with ``SQLITE_BUSY`` and is tried again after short jittered ``asyncio.sleep`` calls, so
  the event loop never sleeps in SQLite's busy handler (whose waits, 1 … 100 ms, are a hundred
  times longer than the transactions it waits for). Reads need no lock (WAL). Checkpoints
  (which fsync) run on a second connection in a one-thread executor every
  :data:`CHECKPOINT_EVERY` commits, never at a commit on the loop.

  Measured (docs/loadtest.md, "The store on the event loop"): the earlier layout, every
  statement a hop to an aiosqlite thread, cost 4.7 of a message's 16.8 ms of server CPU.

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import structlog

from bot.store.base import Bucket, ClaimRead, StoreError
from bot.store.health import OK, PROBE_KEY, UNREACHABLE, UNWRITABLE
from bot.store.shm_guard import ShmGuard, enable_faulthandler
from bot.store.sqlite_connection import SCHEMA, SCHEMA_VERSION, abandon, connect, describe_error, is_busy, sqlite_path
from bot.store.sqlite_writes import RETRY_FIRST_S, GroupCommit, retry_delay, transaction

__all__ = ["CHECKPOINT_EVERY", "SqliteStore", "sqlite_path"]

log = structlog.get_logger("healthbot.store")

T = TypeVar("T")

#: Commits between two passive WAL checkpoints on the executor (SQLite's own default is a
#: checkpoint at every commit that leaves the WAL over 1,000 pages; a message writes a few pages).
CHECKPOINT_EVERY = 256


def _live(expires: float | None, now: float) -> bool:
    return expires is None or expires > now


def _expiry(ttl_s: float | None, now: float) -> float | None:
    return None if ttl_s is None else now + ttl_s


def _purge(conn: sqlite3.Connection, now: float) -> int:
    removed = 0
    for sql, params in (
        ("DELETE FROM kv WHERE expires IS NOT NULL AND expires <= ?", (now,)),
        ("DELETE FROM items WHERE key NOT IN (SELECT key FROM kv WHERE value IS NULL)", ()),
        ("DELETE FROM buckets WHERE full_at IS NOT NULL AND full_at <= ?", (now,)),
    ):
        removed += max(conn.execute(sql, params).rowcount, 0)
    return removed


def _distinct(*conns: sqlite3.Connection | None) -> list[sqlite3.Connection]:
    """The connections given, each once (``:memory:`` uses one for both roles), without None."""
    return list({id(c): c for c in conns if c is not None}.values())


#: ``get_many``'s query for N keys (``?`` × N, then the time); ``read_all``'s and ``set_if_absent``'s statements.
_GET_MANY = "SELECT key, value FROM kv WHERE key IN ({}) AND (expires IS NULL OR expires > ?)"
_READ_LIST = ("SELECT items.value FROM kv JOIN items ON items.key = kv.key WHERE kv.key = ? AND kv.value IS NULL"
              " AND (kv.expires IS NULL OR kv.expires > ?) ORDER BY items.id")
_CLAIM = ("INSERT INTO kv (key, value, expires) VALUES (?, ?, ?) ON CONFLICT (key) DO UPDATE SET"
          " value = excluded.value, expires = excluded.expires WHERE kv.expires IS NOT NULL AND kv.expires <= ?")


def _take_token(conn: sqlite3.Connection, now: float, key: str, rate_per_s: float, burst: int) -> bool:
    """:meth:`SqliteStore.take_token`'s body, inside a write transaction."""
    rows = conn.execute("SELECT tokens, updated FROM buckets WHERE key = ?", (key,)).fetchall()
    if rows:
        tokens, updated = rows[0]
        tokens = min(float(burst), tokens + max(0.0, now - updated) * rate_per_s)
    else:
        tokens = float(burst)
    took = tokens >= 1.0
    if took:
        tokens -= 1.0
    full_at = now + (burst - tokens) / rate_per_s if rate_per_s > 0 else None
    conn.execute("INSERT OR REPLACE INTO buckets (key, tokens, updated, full_at) VALUES (?, ?, ?, ?)",
                 (key, tokens, now, full_at))
    return took


class SqliteStore:
    """The :class:`~bot.store.base.Store` protocol on one SQLite file (see the module docstring).

    Open with :meth:`open`; close with :meth:`close` (it stops the executor's thread).
    Several ``SqliteStore`` objects, in one process or many, may share a file.
    Every method raises :class:`StoreError` on a SQLite error (locked longer than
    ``busy_timeout_s``, disk full, not a database, closed store), never ``sqlite3.Error``.
    """

    def __init__(self, conn: sqlite3.Connection, checkpointer: sqlite3.Connection, path: str, *,
                 busy_timeout_s: float, purge_interval_s: float) -> None:
        self._conn: sqlite3.Connection | None = conn  # on the event loop, busy timeout 0
        self._checkpointer = checkpointer  # on the executor (the same object for :memory:, never used)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="sqlite-store")
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self.purge_interval_s = purge_interval_s
        self._closing = asyncio.Lock()
        self._next_purge_at = 0.0
        self._writes = GroupCommit(self._open_conn, self._committed, self._error, self._purge_if_due,
                                   lambda: time.time() >= self._next_purge_at, busy_timeout_s)
        self._write = self._writes.write
        self._commits = 0
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
        full_path = path if memory else str(Path(path).absolute())
        checkpointer = conn = None
        try:
            checkpointer = connect(path, busy_timeout_s)
            conn = checkpointer if memory else connect(path, busy_timeout_s, autocheckpoint=False)
            conn.execute("PRAGMA busy_timeout = 0")  # after the pragmas, which may wait: see _run
        except (sqlite3.Error, StoreError) as e:
            for c in _distinct(checkpointer, conn):
                c.close()
            if isinstance(e, StoreError):
                raise
            raise describe_error(e, full_path, busy_timeout_s) from e
        store = cls(conn, checkpointer, full_path, busy_timeout_s=busy_timeout_s, purge_interval_s=purge_interval_s)
        try:
            await store._init_schema()
        except BaseException:
            await store.close()
            raise
        return store

    async def _init_schema(self) -> None:
        problem = self._guard.check() if self._guard is not None else None
        if problem is not None:  # a leftover -shm that would crash the process once mapped
            raise StoreError(f"SQLite store {self.path}: not opened while {problem}")

        def create(conn: sqlite3.Connection, _now: float) -> None:
            (version,), = conn.execute("PRAGMA user_version").fetchall()
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"SQLite store {self.path} has schema {version}, newer than this healthbot's "
                    f"{SCHEMA_VERSION}: upgrade healthbot or point HEALTHBOT_STORE_URL at another file"
                )
            for statement in SCHEMA:
                conn.execute(statement)
            if version < SCHEMA_VERSION:
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

        await self._run(lambda conn: transaction(conn, create))

    def _error(self, e: BaseException) -> StoreError:
        return describe_error(e, self.path, self.busy_timeout_s)

    def _open_conn(self) -> sqlite3.Connection:
        """The event loop's connection, once the ``-shm`` guard says it may be used now (call under the lock).

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

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """``work`` (a read, or the schema's transaction) on the event loop's connection; while another
        process keeps it out (``SQLITE_BUSY``), again after short, growing, jittered sleeps, for at
        most ``busy_timeout_s``. SQLite errors become :class:`StoreError`."""
        delay, deadline = RETRY_FIRST_S, None
        while True:
            conn = self._open_conn()
            try:
                return work(conn)
            except sqlite3.Error as e:
                now = time.monotonic()
                deadline = deadline or now + self.busy_timeout_s
                if not is_busy(e) or now >= deadline:
                    raise self._error(e) from e
            sleep, delay = retry_delay(delay, deadline - now)
            await asyncio.sleep(sleep)

    async def _statement(self, sql: str, params: tuple) -> int:
        """One write statement (bot/store/sqlite_writes.py); the number of rows it changed."""
        return await self._write(lambda conn, _now: conn.execute(sql, params).rowcount, statement=True)

    def _purge_if_due(self, conn: sqlite3.Connection, now: float) -> None:
        """The purge, inside the transaction that finds it due (every ``purge_interval_s``)."""
        if now >= self._next_purge_at:
            self._next_purge_at = now + self.purge_interval_s
            _purge(conn, now)

    def _committed(self) -> None:
        self._commits += 1
        if self._commits % CHECKPOINT_EVERY == 0 and self._checkpointer is not self._conn:
            self._executor.submit(self._checkpoint)

    def _checkpoint(self) -> None:
        """A passive checkpoint (never waits for readers or writers) on the executor's connection."""
        try:
            if self._conn is not None and (self._guard is None or self._guard.check() is None):
                self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as e:
            log.warning("store.checkpoint_failed", path=self.path, error=str(e))

    async def _read(self, sql: str, params: tuple) -> list[Any]:
        return await self._run(lambda conn: conn.execute(sql, params).fetchall())

    async def purge(self) -> int:
        """Delete expired keys and lists, and buckets that are full again; the number of rows removed.

        Raises:
            StoreError: a SQLite error.
        """
        self._next_purge_at = time.time() + self.purge_interval_s  # this purge is the one due: counted here
        return await self._write(_purge)

    async def get(self, key: str) -> str | None:
        """The string at ``key``, or None if absent, expired or a list."""
        rows = await self._read(
            "SELECT value FROM kv WHERE key = ? AND (expires IS NULL OR expires > ?)", (key, time.time()))
        return rows[0][0] if rows else None

    async def set(self, key: str, value: str, ttl_s: float | None = None) -> None:
        """Store ``value`` (replacing any string or list), expiring after ``ttl_s`` seconds.

        One statement: the items of a list it replaces are left without their key, invisible to
        every read (they join on a list row) and removed by the next purge or push."""
        await self._statement("INSERT OR REPLACE INTO kv (key, value, expires) VALUES (?, ?, ?)",
                              (key, value, _expiry(ttl_s, time.time())))

    async def get_many(self, keys: Sequence[str]) -> list[str | None]:
        """The strings at ``keys``, in order (None where absent, expired or a list): one ``SELECT``."""
        if not keys:
            return []
        found = dict(await self._read(_GET_MANY.format(",".join("?" * len(keys))), (*keys, time.time())))
        return [found.get(k) for k in keys]

    async def set_many(self, items: Sequence[tuple[str, str, float | None]]) -> None:
        """Each ``(key, value, ttl_s)`` as :meth:`set`, all in one transaction (one commit)."""
        if not items:
            return

        def body(conn: sqlite3.Connection, now: float) -> None:
            conn.executemany("INSERT OR REPLACE INTO kv (key, value, expires) VALUES (?, ?, ?)",
                             [(k, v, _expiry(ttl, now)) for k, v, ttl in items])

        await self._write(body)

    async def set_if_absent(self, key: str, value: str, ttl_s: float | None = None) -> bool:
        """Claim ``key``: store only if absent or expired (one conditional upsert statement).

        Returns True for exactly one of any number of concurrent callers, in any
        number of processes sharing the file.
        """
        now = time.time()
        return await self._statement(_CLAIM, (key, value, _expiry(ttl_s, now), now)) == 1

    async def claim_and_read(self, key: str, value: str, ttl_s: float | None = None, strings: Sequence[str] = (),
                             lists: Sequence[str] = (), bucket: Bucket | None = None,
                             if_found: tuple[str, float | None] | None = None,
                             record: tuple[str, str, float | None] | None = None) -> ClaimRead:
        """The record, the reads and the claim in one transaction (one check of the ``-shm`` file and one
        commit, not three: 56-73 -> 44-49 µs on a 2-core machine)."""
        def body(conn: sqlite3.Connection, now: float) -> ClaimRead:
            if record is not None and conn.execute(_CLAIM, (record[0], record[1], _expiry(record[2], now), now)
                                                   ).rowcount != 1 and conn.execute(
                    "SELECT value FROM kv WHERE key = ?", (record[0],)).fetchall() != [(record[1],)]:
                return ClaimRead(False, [None] * len(strings), [[] for _ in lists], None, conflict=True)
            found = dict(conn.execute(_GET_MANY.format(",".join("?" * len(strings))), (*strings, now))) if strings else {}
            read = [[v for (v,) in conn.execute(_READ_LIST, (k, now))] for k in lists]
            hit = if_found is not None and (any(v is not None for v in found.values()) or any(read))
            stored, ttl = if_found if hit else (value, ttl_s)
            claimed = conn.execute(_CLAIM, (key, stored, _expiry(ttl, now), now)).rowcount == 1
            token = None if bucket is None else _take_token(conn, now, *bucket)
            return ClaimRead(claimed, [found.get(k) for k in strings], read, token)

        return await self._write(body)

    async def delete(self, key: str) -> None:
        """Remove the string or list at ``key`` (no error if absent; buckets are kept). A key that
        is not there costs a read, not a write; a list's items go as in :meth:`set`."""
        if await self._read("SELECT 1 FROM kv WHERE key = ?", (key,)):
            await self._statement("DELETE FROM kv WHERE key = ?", (key,))

    async def delete_if_equal(self, key: str, value: str) -> bool:
        """Remove ``key`` only if it holds ``value`` and has not expired; True if removed.

        One conditional ``DELETE`` statement: the compare and the delete are atomic across processes.
        """
        return await self._statement("DELETE FROM kv WHERE key = ? AND value = ? AND (expires IS NULL OR expires > ?)",
                                     (key, value, time.time())) == 1

    async def take_token(self, key: str, rate_per_s: float, burst: int) -> bool:
        """Token bucket: capacity ``burst`` tokens, refilled at ``rate_per_s`` tokens per second.

        A bucket never seen (or purged because it was full again) starts full.
        Returns True if a token was taken. Atomic across processes (``BEGIN IMMEDIATE``).
        """
        return await self._write(lambda conn, now: _take_token(conn, now, key, rate_per_s, burst))

    async def push(self, key: str, value: str, ttl_s: float | None = None) -> None:
        """Append ``value`` to the list at ``key``; the whole list expires ``ttl_s`` seconds from now.

        A string at ``key`` (or an expired list) is replaced by a new list.
        """
        def body(conn: sqlite3.Connection, now: float) -> None:
            rows = conn.execute("SELECT value, expires FROM kv WHERE key = ?", (key,)).fetchall()
            expires = _expiry(ttl_s, now)
            if rows and rows[0][0] is None and _live(rows[0][1], now):
                conn.execute("UPDATE kv SET expires = ? WHERE key = ?", (expires, key))
            else:
                conn.execute("DELETE FROM items WHERE key = ?", (key,))
                conn.execute("INSERT OR REPLACE INTO kv (key, value, expires) VALUES (?, NULL, ?)", (key, expires))
            conn.execute("INSERT INTO items (key, value) VALUES (?, ?)", (key, value))

        await self._write(body)

    async def pop_all(self, key: str) -> list[str]:
        """Remove ``key`` and return its list, oldest first ([] if absent, expired or a string).

        Read and delete happen in one ``BEGIN IMMEDIATE`` transaction, so an item
        pushed concurrently is returned by exactly one pop_all.
        """
        if not await self._read("SELECT 1 FROM kv WHERE key = ?", (key,)):
            return []  # nothing to take: a read, not a write (an item pushed now waits for the next pop)

        def body(conn: sqlite3.Connection, now: float) -> list[str]:
            rows = conn.execute("SELECT value, expires FROM kv WHERE key = ?", (key,)).fetchall()
            if not rows:
                return []
            items: list[str] = []
            if rows[0][0] is None and _live(rows[0][1], now):
                items = [v for (v,) in conn.execute("SELECT value FROM items WHERE key = ? ORDER BY id", (key,))]
            conn.execute("DELETE FROM items WHERE key = ?", (key,))
            conn.execute("DELETE FROM kv WHERE key = ?", (key,))
            return items

        return await self._write(body)

    async def read_all(self, key: str) -> list[str]:
        """The list at ``key``, oldest first, left in place ([] if absent, expired or a string); one read."""
        return [v for (v,) in await self._read(_READ_LIST, (key, time.time()))]

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
        """Commit the writes already made, then close both connections and stop the executor's
        thread; safe to call twice.

        While the ``-shm`` file cannot be touched safely (see :mod:`bot.store.shm_guard`),
        closing (which checkpoints through the mapping) would crash the process: the
        connections are then abandoned instead, and the error logged.
        """
        async with self._closing:
            await self._writes.drain()  # the writes made before close
            conn, self._conn = self._conn, None
            if conn is None:
                return
            await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
            problem = self._guard.check() if self._guard is not None else None
            connections = _distinct(conn, self._checkpointer)
            if problem is None:
                for c in connections:
                    c.close()
                return
        for c in connections:
            abandon(c)
        log.error("store.close_skipped", path=self.path, reason=problem,
                  hint="the SQLite connection was left open; the -wal file is replayed at the next start")

    def __repr__(self) -> str:
        return f"SqliteStore({self.path!r})"

