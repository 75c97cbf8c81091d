"""Keep SQLite's ``-shm`` mapping from killing the process with SIGBUS.

In WAL mode every connection maps the database's ``-shm`` file (the WAL index) into
memory with ``mmap(MAP_SHARED)`` (https://www.sqlite.org/walformat.html#shm). An
error while touching that memory is not an error code but a signal: SIGBUS, which
ends the process at once, with no log line. Measured on Linux 6.18 / SQLite 3.40:

* ``chattr +i`` on the ``-shm`` file (ext4 enforces the immutable flag on open files
  and their shared mappings: the next write through the mapping faults) — SIGBUS;
* the ``-shm`` file truncated under a running connection (``truncate -s 0``, or another
  process that believes it is the file's first user) — SIGBUS on the next access;
* a file system remounted read-only under a running process (ext4 ``errors=remount-ro``)
  faults the same way.

A full disk does not: SQLite extends the file by writing a byte into every new page
(an ``ENOSPC`` becomes ``SQLITE_IOERR_SHMSIZE``), and the database file itself is read
with ``read()``, never mapped, because the store sets ``PRAGMA mmap_size = 0``.

:class:`ShmGuard` is asked before each use of the connection (a ``statx`` and a
``statvfs``, about 5 µs; 25 µs under load, when the kernel's paths are out of the CPU's caches):
it refuses while the ``-shm`` file is immutable or
append-only or its file system is read-only (the store raises :class:`StoreError`
instead of touching the mapping), and grows a truncated ``-shm`` back to the size
this process has mapped (the new pages read as zeros, which SQLite treats as a WAL
index to rebuild from the ``-wal`` file). The size it remembers is the largest it has seen
before a use, not after one: a use that grows the file is remembered at the next check, and a
truncation before then that keeps more than the size seen before (not what SQLite or
``truncate -s 0`` do: both cut to zero) would go unrepaired. A second ``statx`` after every
use cost a third of the guard's time for that case. It never opens the file: closing any
descriptor of a file drops every POSIX lock this process holds on it, SQLite's
included (https://www.sqlite.org/howtocorrupt.html, section 2.2).

What it cannot close is the window between its check and SQLite's access (a few
microseconds): a change landing exactly there still faults. ``faulthandler`` is
enabled so that such a crash at least leaves a traceback in the log.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import faulthandler
import os
import sys
from typing import Final

import structlog

log = structlog.get_logger("healthbot.store")

#: ``statx`` attribute bits (linux/stat.h).
STATX_ATTR_IMMUTABLE: Final = 0x10
STATX_ATTR_APPEND: Final = 0x20
_AT_FDCWD: Final = -100
_STATX_BASIC_STATS: Final = 0x7FF


class _Statx(ctypes.Structure):
    """The head of ``struct statx`` (linux/stat.h); 256 bytes in all."""

    _fields_ = [("mask", ctypes.c_uint32), ("blksize", ctypes.c_uint32), ("attributes", ctypes.c_uint64),
                ("nlink", ctypes.c_uint32), ("uid", ctypes.c_uint32), ("gid", ctypes.c_uint32),
                ("mode", ctypes.c_uint16), ("_spare0", ctypes.c_uint16), ("ino", ctypes.c_uint64),
                ("size", ctypes.c_uint64), ("blocks", ctypes.c_uint64), ("attributes_mask", ctypes.c_uint64),
                ("_rest", ctypes.c_uint8 * 192)]


def _load_statx():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.statx  # glibc ≥ 2.28
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_Statx)]
    fn.restype = ctypes.c_int
    return fn


_statx = _load_statx()


def file_state(path: str | bytes, buf: "_Statx | None" = None) -> tuple[int, int]:
    """``(size in bytes, statx attributes)`` of ``path`` without opening it (attributes 0 where
    ``statx`` is unavailable); ``buf``: a :class:`_Statx` to reuse.

    Raises:
        OSError: e.g. FileNotFoundError.
    """
    if _statx is not None:
        buf = _Statx() if buf is None else buf
        if _statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_BASIC_STATS, ctypes.byref(buf)) == 0:
            return buf.size, buf.attributes
        err = ctypes.get_errno()
        if err != 38:  # ENOSYS: an old kernel; fall back to stat
            raise OSError(err, os.strerror(err), os.fsdecode(path))
    return os.stat(path).st_size, 0


def enable_faulthandler() -> None:
    """Have a fatal signal (SIGBUS, SIGSEGV) print the Python traceback to stderr before the
    process dies, instead of nothing (idempotent)."""
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable()
        except (RuntimeError, ValueError, OSError):  # no usable stderr
            pass


class ShmGuard:
    """Checks a WAL database's ``-shm`` file before the connection touches its mapping.

    Args:
        db_path: the database file (absolute); the guard watches ``db_path + "-shm"``.
    """

    def __init__(self, db_path: str) -> None:
        self.path = db_path + "-shm"
        self._path_bytes = os.fsencode(self.path)
        self._buf = _Statx()
        #: The largest size seen: what this process's connection may have mapped.
        self.mapped = 0
        #: How many times a truncated ``-shm`` was grown back.
        self.repairs = 0

    def check(self) -> str | None:
        """None when the connection may be used now; else why not (for the error message).

        Grows a truncated ``-shm`` back to :attr:`mapped` bytes (logged as an error).
        """
        try:
            size, attributes = file_state(self._path_bytes, self._buf)
        except FileNotFoundError:
            return None  # not created yet, or unlinked: a mapping of an unlinked file stays valid
        except OSError as e:
            return f"cannot inspect {self.path}: {e.strerror or e}"
        if attributes & (STATX_ATTR_IMMUTABLE | STATX_ATTR_APPEND):
            flag = "immutable" if attributes & STATX_ATTR_IMMUTABLE else "append-only"
            return (f"{self.path} is {flag} (chattr): SQLite writes to it through a memory map, which "
                    f"would crash the process (SIGBUS); clear the flag (chattr -i / -a {self.path})")
        try:
            if os.statvfs(self.path).f_flag & os.ST_RDONLY:
                return (f"{self.path} is on a read-only file system: SQLite writes to it through a memory "
                        "map, which would crash the process (SIGBUS); remount it read-write")
        except OSError:
            pass
        if size < self.mapped:
            try:
                os.truncate(self.path, self.mapped)  # by path: no descriptor opened, no lock dropped
            except OSError as e:
                return (f"{self.path} was truncated to {size} bytes under this process (which maps "
                        f"{self.mapped}) and cannot be grown back: {e.strerror or e}")
            self.repairs += 1
            log.error("store.shm_truncated", path=self.path, size=size, restored=self.mapped,
                      hint="another process truncated or replaced the SQLite -shm file; "
                           "SQLite rebuilds its WAL index from the -wal file")
            size = self.mapped
        self.mapped = max(self.mapped, size)
        return None
