"""How the SQLite store's writes reach the file: at once, or committed in groups (group commit).

A write is a *body*: a synchronous function of the connection and the transaction's clock.
With nothing queued and no other process seen holding the file's one write lock in the last
:data:`CONTENDED_S`, a body runs at once, alone (a single statement in autocommit: SQLite holds
the lock only inside its step). Otherwise it is queued, and one flusher task commits all the
queued bodies in one ``BEGIN IMMEDIATE`` … ``COMMIT``
(https://www.sqlite.org/lang_transaction.html), each inside its own ``SAVEPOINT`` so that one
that fails fails alone; a caller hears its result only after the COMMIT. While the flusher waits
for another process's lock (``SQLITE_BUSY``: tried again after :data:`RETRY_FIRST_S`, doubling to
:data:`RETRY_MAX_S`, with jitter), later writes join it: the more processes contend, the fewer
times each takes the lock. A write not committed ``busy_timeout_s`` after it was made fails.

Measured on the H200 host (docs/loadtest.md, "Group commit"): ten front-end processes on one
SQLite file went from queueing for seconds at 1,000 messages a second to p99 167 ms there.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from bot.store.base import StoreError
from bot.store.sqlite_connection import is_busy

T = TypeVar("T")
#: A write's body: runs inside ``BEGIN IMMEDIATE`` … ``COMMIT`` with the connection and the
#: transaction's clock (Unix time, seconds).
Body = Callable[[sqlite3.Connection, float], T]

#: First and longest wait (seconds) before trying again a transaction another process kept out.
#: A transaction holds the lock for well under a millisecond; a longer wait leaves the file idle
#: (4 processes x 8 users, 7 writes a message, on 2 cores: p99 28-52 ms with 5 ms, 20-23 ms with 1 ms,
#: at no more CPU a message; docs/loadtest.md "One read and one write a message").
RETRY_FIRST_S = 0.0002
RETRY_MAX_S = 0.001
#: Seconds after another process last kept a write out during which every write is queued.
CONTENDED_S = 1.0


def transaction(conn: sqlite3.Connection, body: Body[T]) -> T:
    """``BEGIN IMMEDIATE`` … ``COMMIT`` around ``body`` on ``conn`` (``ROLLBACK`` on any exception)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = body(conn, time.time())
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return result


def retry_delay(delay: float, left_s: float) -> tuple[float, float]:
    """(this sleep, the next ``delay``): ``delay`` jittered to 0.5–1.5×, at most ``left_s``; doubling."""
    return min(delay * (0.5 + random.random()), max(left_s, 0.0)), min(delay * 2.0, RETRY_MAX_S)


@dataclass
class _Queued(Generic[T]):
    body: Body[T]
    future: asyncio.Future[T]
    queued_at: float  # monotonic s


def _fail(writes: list[_Queued], error: BaseException) -> None:
    for queued in writes:
        if not queued.future.done():
            queued.future.set_exception(error)


class GroupCommit:
    """The writes of one store (module docstring).

    Args:
        connection: the connection to use now; raises :class:`StoreError` when closed or unusable.
        committed: called after each commit.
        error: turns a ``sqlite3.Error`` into the store's :class:`StoreError`.
        before: runs first inside every transaction (the store's purge when one is due);
            ``before_due()`` says whether it has work, so a lone statement may skip the transaction.
        busy_timeout_s: how long a write may wait for another process's lock.
    """

    def __init__(self, connection: Callable[[], sqlite3.Connection], committed: Callable[[], None],
                 error: Callable[[BaseException], StoreError], before: Callable[[sqlite3.Connection, float], None],
                 before_due: Callable[[], bool], busy_timeout_s: float) -> None:
        self._connection, self._committed, self._error = connection, committed, error
        self._before, self._before_due = before, before_due
        self.busy_timeout_s = busy_timeout_s
        self._queue: list[_Queued] = []  # for the next transaction, in the order made
        self._flusher: asyncio.Task | None = None
        self._contended_until = 0.0  # monotonic s

    async def write(self, body: Body[T], *, statement: bool = False) -> T:
        """``body``'s result, once committed; ``statement``: ``body`` is one SQL statement.

        Raises:
            StoreError: closed or failed, the lock kept by another process for ``busy_timeout_s``,
                or ``body`` raised a SQLite error; whatever else ``body`` raised.
        """
        if not self._queue and (self._flusher is None or self._flusher.done()) and time.monotonic() >= self._contended_until:
            conn = self._connection()  # closed or unusable: raises here; a queued write hears it from the flusher
            try:
                if statement and not self._before_due():
                    result = body(conn, time.time())
                else:
                    (_, result), = self._commit(conn, [body])
            except sqlite3.Error as e:
                if not is_busy(e):
                    raise self._error(e) from e
                self._contended_until = time.monotonic() + CONTENDED_S
            else:
                self._committed()
                return result
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queue.append(_Queued(body, future, time.monotonic()))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        return await future  # a caller cancelled before the commit cancels its write: the flusher skips it

    async def drain(self) -> None:
        """Wait until every write made so far is committed or has failed."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def _flush(self) -> None:
        delay = RETRY_FIRST_S
        while True:
            batch = [q for q in self._queue if not q.future.done()]
            self._queue = []
            if not batch:
                return
            try:
                outcomes = self._commit(self._connection(), [q.body for q in batch])
            except sqlite3.Error as e:
                now = time.monotonic()
                late = [q for q in batch if not is_busy(e) or now - q.queued_at >= self.busy_timeout_s]
                _fail(late, self._error(e))
                waiting = [q for q in batch if q not in late]
                if waiting:  # another process holds the lock: wait, then take what queued meanwhile too
                    self._contended_until = now + CONTENDED_S
                    self._queue = waiting + self._queue
                    sleep, delay = retry_delay(delay, min(q.queued_at for q in waiting) + self.busy_timeout_s - now)
                    await asyncio.sleep(sleep)
                continue
            except Exception as e:  # noqa: BLE001 (closed, unusable, or a lone write's own error: rolled back)
                _fail(batch, e)
                continue
            delay = RETRY_FIRST_S
            self._committed()
            for queued, (ok, value) in zip(batch, outcomes):
                if not queued.future.done():
                    if ok:
                        queued.future.set_result(value)
                    else:
                        queued.future.set_exception(value)

    def _commit(self, conn: sqlite3.Connection, bodies: list[Body]) -> list[tuple[bool, Any]]:
        """``bodies`` in one transaction, after ``before``: per write ``(True, result)`` or ``(False, its
        exception)``. Raises what fails the transaction itself (BEGIN, COMMIT, a rollback) and a lone
        write's error."""
        def run_all(c: sqlite3.Connection, now: float) -> list[tuple[bool, Any]]:
            self._before(c, now)
            if len(bodies) == 1:  # nothing to keep apart: no savepoint (its error rolls back the transaction)
                return [(True, bodies[0](c, now))]
            outcomes: list[tuple[bool, Any]] = []
            for body in bodies:
                c.execute("SAVEPOINT write")
                try:
                    outcomes.append((True, body(c, now)))
                except Exception as e:  # noqa: BLE001 (handed to the one caller whose write it was)
                    c.execute("ROLLBACK TO write")
                    outcomes.append((False, self._error(e) if isinstance(e, sqlite3.Error) else e))
                c.execute("RELEASE write")
            return outcomes

        return transaction(conn, run_all)
