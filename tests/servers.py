"""Processes the end-to-end tests start and wait for: ``healthbot serve`` (:class:`ServeProcess`,
ready when ``GET /readyz`` answers 200) and free loopback ports (:func:`free_port`).
Redis servers are in tests/redis_server.py."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Sequence

import pytest

from bot.config import REPO_ROOT


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """One ``healthbot serve --port PORT`` process (a free port), started from the repository root
    with the environment ``env`` (the whole environment: merge ``os.environ`` in yourself).

    ``command`` / ``cwd``: the ``healthbot`` command and the folder it starts in (default: this
    checkout's code, ``python -m bot.cli``, from the repository root).

    Attributes:
        name: for failure messages; port, base: where it listens (``http://127.0.0.1:PORT``);
        log: its stderr file; proc: the process.
    """

    def __init__(self, env: dict[str, str], log: Path, name: str = "server", *,
                 command: Sequence[str] = (sys.executable, "-m", "bot.cli"), cwd: Path = REPO_ROOT) -> None:
        self.name = name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([*command, "serve", "--port", str(self.port)],
                                         env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=out)

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until ``GET /readyz`` answers 200; fail the test if the process exits or ``timeout_s``
        seconds pass first (the message holds the end of its log)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited: {self._log_tail()}")
            try:
                with urllib.request.urlopen(self.base + "/readyz", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name} not ready within {timeout_s:.0f} s: {self._log_tail()}")
            time.sleep(0.3)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s`` seconds; safe to call twice."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
