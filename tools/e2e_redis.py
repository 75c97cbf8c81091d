"""The Redis store of tools/e2e_bench.py: a throwaway ``redis-server`` per layout on the GPU host.

The GPU image has no Redis and no network, so :func:`pack_redis` carries this machine's
``redis-server`` (Debian bookworm, Redis 7.0) in ``.e2e/redis/`` with the shared libraries a stock
Ubuntu 24.04 image lacks (:data:`REDIS_LIBS`; glibc, OpenSSL, libstdc++ and libsystemd are there),
and :class:`RedisServer` runs it there with ``LD_LIBRARY_PATH`` pointing at that folder: loopback
only, no persistence, default threads (one for commands, as a stock server).
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
from redis.exceptions import RedisError

#: The binary carried (on Debian a link to redis-check-rdb, which looks at its own name: copied as redis-server).
REDIS_BIN = Path("/usr/bin/redis-server")
#: The libraries of :data:`REDIS_BIN` a stock Ubuntu 24.04 image may lack.
REDIS_LIBS = ("liblzf.so.1", "libjemalloc.so.2", "libatomic.so.1")


def pack_redis(out: Path, binary: Path = REDIS_BIN) -> int:
    """Copy ``binary`` and :data:`REDIS_LIBS` (as ``ldd`` resolves them) into ``out/redis``; bytes
    copied, 0 (and a warning) without a binary, when the Redis layouts skip on the GPU host."""
    if not binary.exists():
        print(f"no {binary}: the Redis layouts will be skipped there (apt-get install redis-server)", file=sys.stderr)
        return 0
    dest = out / "redis"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    shutil.copy2(binary, dest / "redis-server")
    found = {}
    for line in subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout.splitlines():
        name, _, rest = line.strip().partition(" => ")
        if rest.startswith("/"):
            found[name] = Path(rest.split(" (")[0])
    for name in REDIS_LIBS:
        if name in found:
            shutil.copy2(found[name], dest / name)  # follows the soname link
        else:
            print(f"{binary} does not link {name}: not carried", file=sys.stderr)
    return sum(p.stat().st_size for p in dest.iterdir())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A ``redis-server`` on a free loopback port: :meth:`start`, ``client`` (redis-py, the wheel the
    carry already holds for the store), :meth:`stats`, :meth:`stop`."""

    def __init__(self, proc: subprocess.Popen, port: int, workdir: str, binary: Path) -> None:
        self.proc, self.port, self.workdir, self.binary = proc, port, workdir, binary
        self.url = f"redis://127.0.0.1:{port}/0"
        self.client = redis.Redis.from_url(self.url, socket_timeout=5.0)
        atexit.register(self.stop)

    @classmethod
    def start(cls, carry: Path, log_path: Path, log: Callable[[str], None],
              timeout_s: float = 20.0) -> RedisServer | None:
        """The carried server (``carry/redis-server``, else one on PATH) answering PING, or None
        (logged: missing, not executable, a library missing, no PONG within ``timeout_s`` seconds)."""
        binary = carry / "redis-server"
        if not binary.exists():
            which = shutil.which("redis-server")
            if which is None:
                log(f"no redis-server in {carry} nor on PATH")
                return None
            binary = Path(which)
        elif not os.access(binary, os.X_OK):
            try:
                binary.chmod(binary.stat().st_mode | 0o111)  # a carry may lose the mode bits
            except OSError as e:
                log(f"{binary} is not executable: {e}")
                return None
        env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
            p for p in (str(carry.resolve()), os.environ.get("LD_LIBRARY_PATH", "")) if p))
        port, workdir = _free_port(), tempfile.mkdtemp(prefix="e2e-redis-")
        cmd = [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "yes", "--save", "",
               "--appendonly", "no", "--dir", workdir, "--daemonize", "no", "--logfile", ""]
        with open(log_path, "ab") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        server = cls(proc, port, workdir, binary)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and proc.poll() is None:
            try:
                if server.client.ping():
                    return server
            except RedisError:  # not listening yet, or LOADING
                time.sleep(0.1)
        tail = log_path.read_text(errors="replace")[-600:].strip()
        log(f"{binary} did not answer PING within {timeout_s:g} s (exit {proc.poll()}): {tail}")
        server.stop()
        return None

    def stats(self) -> dict[str, float] | None:
        """``INFO cpu stats memory`` figures: its CPU seconds (user + system, all threads),
        commands processed so far, memory used (MiB); None if it does not answer."""
        try:
            info = self.client.info("all")
        except RedisError:
            return None
        return {"cpu_s": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
                "commands": float(info["total_commands_processed"]), "used_mib": int(info["used_memory"]) / 2**20}

    def version(self) -> str:
        return str(self.client.info("server").get("redis_version", "?"))

    def stop(self) -> int | None:
        """SIGTERM (nothing to save), then the exit status; idempotent."""
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
        return self.proc.returncode


def step_figures(before: dict[str, float] | None, after: dict[str, float] | None, sent: int) -> dict[str, float | None]:
    """Redis's share of a load step: CPU milliseconds and commands per message sent (the load
    test's server CPU is per message sent too), and memory used at its end (MiB); None where unread."""
    if before is None or after is None:
        return {"redis_cpu_ms_per_msg": None, "redis_commands_per_msg": None, "redis_used_mib": None}

    def per(key: str, scale: float) -> float | None:
        return round((after[key] - before[key]) * scale / sent, 3) if sent else None
    return {"redis_cpu_ms_per_msg": per("cpu_s", 1000.0), "redis_commands_per_msg": per("commands", 1.0),
            "redis_used_mib": round(after["used_mib"], 1)}
