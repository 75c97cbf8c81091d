"""The SQLite connections under :class:`~bot.store.sqlite.SqliteStore`: its URL, opening the file,
the pragmas that keep it safe to share and free of memory maps, the schema, the error messages
a user can act on, and abandoning a connection that cannot be closed safely.

Pragmas (https://www.sqlite.org/pragma.html): ``busy_timeout`` (a write waits that long for
another process's write lock), ``mmap_size = 0`` (the database is read with read(), never
through a memory map: a file shortened or made unreadable under a map faults with SIGBUS
instead of returning an error), ``journal_mode = WAL`` (https://www.sqlite.org/wal.html;
refused on network filesystems) and ``synchronous = NORMAL``.
"""

from __future__ import annotations

import ctypes
import sqlite3
import time
from pathlib import Path

from bot.store.base import StoreError

__all__ = ["SCHEMA", "SCHEMA_VERSION", "abandon", "connect", "describe_error", "is_busy", "sqlite_path"]

#: Bumped when the tables change; a file from a newer healthbot is refused.
SCHEMA_VERSION = 1

SCHEMA = (
    # value NULL: the key holds a list, whose items are rows of ``items``.
    # expires: Unix time in seconds; NULL = no expiry.
    "CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT, expires REAL) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS kv_expires ON kv(expires) WHERE expires IS NOT NULL",
    # id: insertion order (always max(id)+1, so oldest first within a key).
    "CREATE TABLE IF NOT EXISTS items (id INTEGER PRIMARY KEY, key TEXT NOT NULL, value TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS items_key ON items(key, id)",
    # updated: Unix time (s) of the last take; full_at: when it is full again (NULL: never, rate 0).
    "CREATE TABLE IF NOT EXISTS buckets (key TEXT PRIMARY KEY, tokens REAL NOT NULL,"
    " updated REAL NOT NULL, full_at REAL) WITHOUT ROWID",
)

USE_REDIS = "for several processes on several machines use Redis (HEALTHBOT_STORE_URL=redis://host:6379/0)"


def sqlite_path(url: str) -> str:
    """The file path in a ``sqlite:///…`` URL (``":memory:"`` for ``sqlite:///:memory:``).

    Raises:
        StoreError: not a ``sqlite:///`` URL, a host is given, or the path is empty.
    """
    if not url.startswith("sqlite://"):
        raise StoreError(f"not a SQLite URL: {url!r}: use sqlite:///relative.db or sqlite:////absolute/path.db")
    rest = url[len("sqlite://"):]
    if not rest.startswith("/") or len(rest) == 1 or "?" in rest:
        raise StoreError(
            f"bad SQLite URL {url!r}: use sqlite:///relative/path.db (from the working directory) "
            "or sqlite:////absolute/path.db, with no host and no query"
        )
    return rest[1:]


def connect(path: str, busy_timeout_s: float, *, autocheckpoint: bool = True) -> sqlite3.Connection:
    """An autocommit connection to ``path`` (its parent folders created) with the pragmas of the
    module docstring, or to a private in-memory database for ``":memory:"``.

    Args:
        path: the database file, or ``":memory:"``.
        busy_timeout_s: how long (seconds) a write waits for another process's write lock; 0 makes
            a locked database fail at once with ``SQLITE_BUSY`` (see :func:`is_busy`).
        autocheckpoint: False turns off checkpoints at commit (``PRAGMA wal_autocheckpoint = 0``),
            for a connection whose caller checkpoints elsewhere.

    The connection may be used from any thread (``check_same_thread=False``), one at a time.

    Raises:
        StoreError: the folder cannot be created, the file cannot be opened, or WAL journal mode
            is refused (e.g. a network filesystem).
        sqlite3.Error: any other SQLite error (the caller describes it with :func:`describe_error`).
    """
    memory = path == ":memory:"
    if not memory:
        parent = Path(path).absolute().parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"cannot create the folder {parent} for the SQLite store: {e.strerror or e}: "
                "point HEALTHBOT_STORE_URL=sqlite:////absolute/path.db at a writable folder "
                "(or set HEALTHBOT_DATA_DIR)"
            ) from e
    try:
        conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as e:
        raise StoreError(
            f"cannot open the SQLite store {Path(path).absolute()}: {e}: "
            "point HEALTHBOT_STORE_URL=sqlite:////absolute/path.db at a writable file"
        ) from e
    try:
        conn.execute("PRAGMA mmap_size = 0")
        mode = _journal_mode_wal(conn, busy_timeout_s)
        if not memory and str(mode).lower() != "wal":
            raise StoreError(
                f"SQLite store {path}: WAL journal mode refused (got {mode!r}); keep the file "
                f"on a local disk, not a network filesystem; {USE_REDIS}"
            )
        conn.execute("PRAGMA synchronous = NORMAL")
        if not autocheckpoint:
            conn.execute("PRAGMA wal_autocheckpoint = 0")
    except BaseException:
        conn.close()
        raise
    return conn


def _journal_mode_wal(conn: sqlite3.Connection, busy_timeout_s: float) -> str:
    """``PRAGMA journal_mode = WAL``; the mode now in force.

    SQLite may answer ``SQLITE_BUSY`` at once, without its busy handler, where waiting could
    deadlock ("The presence of a busy handler does not guarantee that it will be invoked when
    there is lock contention", https://www.sqlite.org/c3ref/busy_handler.html). Seen once here when
    processes opened one new file together (`healthbot serve --processes N` on a fresh data
    directory): tried again every 10 ms for up to ``busy_timeout_s``.
    """
    deadline = time.monotonic() + busy_timeout_s
    while True:
        try:
            (mode,), = conn.execute("PRAGMA journal_mode = WAL").fetchall()
            return mode
        except sqlite3.OperationalError as e:
            if not is_busy(e) or time.monotonic() >= deadline:
                raise
        time.sleep(0.01)


def is_busy(e: BaseException) -> bool:
    """True for ``SQLITE_BUSY`` (any extended code): another connection holds the lock wanted."""
    return isinstance(e, sqlite3.OperationalError) and (getattr(e, "sqlite_errorcode", 0) & 0xFF) == sqlite3.SQLITE_BUSY


def describe_error(e: BaseException, path: str, busy_timeout_s: float) -> StoreError:
    """A :class:`StoreError` for the SQLite error ``e`` on ``path``, saying what to do about it."""
    text = str(e)
    if "locked" in text or "busy" in text:
        return StoreError(
            f"SQLite store {path}: still locked after {busy_timeout_s:g} s by another "
            f"process: look for a stuck healthbot process; {USE_REDIS}"
        )
    if "not a database" in text or "malformed" in text:
        return StoreError(
            f"{path} is not a usable SQLite database ({text}): move it away or point "
            "HEALTHBOT_STORE_URL=sqlite:////absolute/path.db at another file"
        )
    return StoreError(f"SQLite store {path}: {text}")


#: SQLite connections left open on purpose (:func:`abandon`).
ABANDONED: list = []


def abandon(conn: sqlite3.Connection) -> None:
    """Keep ``conn`` open, unused and never finalized for the life of the process: closing or
    finalizing it checkpoints through the ``-shm`` mapping, which would end the process with SIGBUS."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(conn))
    ABANDONED.append(conn)
