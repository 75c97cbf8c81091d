"""A throw-away ``redis-server`` on loopback for tests (Debian's binary, no downloads).

Use the session fixture in a test module (or a conftest)::

    from tests.redis_server import redis_server  # noqa: F401  (pytest fixture)

    async def test_x(redis_server):
        store = await open_store(redis_server.url)

or start one by hand (``with RedisServer() as srv: srv.url``). The server binds
127.0.0.1 on a free port, keeps nothing on disk (``--save ""``, no AOF) and is
killed on stop. When the binary is missing the fixture skips with the install
command, except in CI (``CI=true``), where a missing server must fail the run:
``.ci/run`` installs it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.servers import free_port

#: How long a starting server may take to answer PING (seconds).
START_TIMEOUT_S = 10.0
INSTALL_HINT = "apt-get install -y redis-server"


def in_ci() -> bool:
    """True when the ``CI`` environment variable says so (``.ci/run`` runs with CI=true)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def redis_server_binary() -> str | None:
    """Path of ``redis-server`` on PATH (or Debian's /usr/bin/redis-server), or None."""
    found = shutil.which("redis-server")
    if found:
        return found
    debian = Path("/usr/bin/redis-server")
    return str(debian) if debian.exists() else None


def require_redis_server() -> str:
    """The ``redis-server`` path; else skip the test (outside CI) or fail it (in CI).

    Raises:
        pytest.skip.Exception / pytest.fail.Exception: binary missing.
    """
    binary = redis_server_binary()
    if binary:
        return binary
    reason = f"redis-server not found: {INSTALL_HINT} (CI installs it in .ci/run)"
    if in_ci():
        pytest.fail(f"{reason}; CI=true, so the Redis tests must run", pytrace=False)
    pytest.skip(reason)


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def wait_for_ping(proc: subprocess.Popen, port: int, timeout_s: float = START_TIMEOUT_S) -> bool:
    """True once the ``redis-server`` ``proc`` answers PING on 127.0.0.1:``port``; False when it
    exits or ``timeout_s`` seconds pass first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if _answers_ping(port):
            return True
        time.sleep(0.01)
    return False


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1:``port`` (a free port unless given).

    Attributes:
        host, port: where it listens; ``url`` is ``redis://127.0.0.1:PORT/0``.
    """

    def __init__(self, binary: str | None = None, port: int | None = None) -> None:
        self.binary = binary or redis_server_binary()
        if not self.binary:
            raise RuntimeError(f"redis-server not found: {INSTALL_HINT}")
        self.host = "127.0.0.1"
        self.port = port or 0
        self._want_port = port
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def pid(self) -> int:
        """The server's process id (raises when it is not running)."""
        if self._proc is None:
            raise RuntimeError("redis-server is not running")
        return self._proc.pid

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return self.url_for_db(0)

    def url_for_db(self, db: int) -> str:
        """``redis://127.0.0.1:PORT/DB`` (Redis has databases 0..15 by default)."""
        return f"redis://{self.host}:{self.port}/{db}"

    def start(self) -> "RedisServer":
        """Start and wait until it answers PING (at most :data:`START_TIMEOUT_S`).

        A port taken between choosing and binding is retried on another free port.

        Raises:
            RuntimeError: the server exited or did not answer; the message holds its log.
        """
        self._dir = tempfile.TemporaryDirectory(prefix="healthbot-redis-")
        log = Path(self._dir.name) / "redis.log"
        for _ in range(5):
            self.port = self._want_port or free_port()
            self._proc = subprocess.Popen(
                [self.binary, "--bind", self.host, "--port", str(self.port),
                 "--save", "", "--appendonly", "no", "--dir", self._dir.name,
                 "--logfile", str(log), "--daemonize", "no"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            )
            if wait_for_ping(self._proc, self.port):
                return self
            self._kill()
            if self._want_port:
                break
        text = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
        self.stop()
        raise RuntimeError(f"redis-server did not start on {self.host}:{self.port}:\n{text}")

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=5)
        self._proc = None

    def stop(self) -> None:
        """Kill the server (data is discarded) and remove its folder; safe to call twice."""
        self._kill()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture(scope="session")
def redis_server():
    """A running :class:`RedisServer` for the whole session (skipped/failed if the binary is missing)."""
    binary = require_redis_server()
    server = RedisServer(binary).start()
    try:
        yield server
    finally:
        server.stop()
