"""The store fails, the bot does not (issue 21): Redis killed, disk full, read-only database, an
unwritable or truncated SQLite ``-shm`` file, and handoffs across a Redis restart.

What is real and what is a stand-in:

* Redis: Debian's ``redis-server`` on loopback, killed with SIGKILL and started again on the same
  port and folder (``appendonly yes`` where state must survive the restart).
* Disk full: a real tmpfs of a few MiB (``mount -t tmpfs``, root only) filled up with a filler
  file, so SQLite meets ENOSPC. Where no tmpfs can be mounted those tests skip, and a test double
  raises SQLite's own ``sqlite3.OperationalError('database or disk is full')`` inside the real
  store (its connection's ``execute``), which always runs.
* Read-only database: ``chattr +i`` on the database, its ``-wal`` and ``-shm`` files on ext4
  (root; ext4 enforces the flag on files already open, so a running process's writes fail:
  EPERM, which SQLite reports as a disk I/O error, and a write through the ``-shm`` memory map
  faults: the SIGBUS the issue saw). Root ignores ``chmod``, so ``chmod 444`` would prove nothing
  here. Without ``chattr`` those tests skip; the double raises ``attempt to write a readonly
  database``.
* Every ``-shm`` case runs in a child process: a SIGBUS there fails the test instead of ending pytest.

The servers are real ``healthbot serve`` processes (the default model), asked over loopback.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from structlog.testing import capture_logs

from bot import metrics
from bot.app import ServerState, readiness
from bot.config import REPO_ROOT
from bot.handoff import HandoffManager
from bot.intents import HANDOFF_ENDED_REPLY, HANDOFF_UNAVAILABLE_REPLY
from bot.store import MemoryStore, StoreError, health, open_store
from bot.store.health import LocalCache, check_store, store_unavailable
from bot.store.sqlite import SqliteStore
from bot.types import Inbound, Intent, MessageKind
from tests.conftest import requires_model
from tests.redis_server import require_redis_server, wait_for_ping
from tests.servers import ServeProcess, free_port
from tests.wechat_client import WechatSigner, parse_reply, text_xml

# ---------------------------------------------------------------- helpers


def _root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


@contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (skips without root or where mounting is refused)."""
    if not _root():
        pytest.skip("mounting a tmpfs (a real full disk) needs root; the test double covers it")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(folder: Path) -> Path:
    """Fill ``folder``'s file system to the last byte; the filler file's path."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 16, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass
    return filler


def chattr(flag: str, *paths: Path) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing:
        subprocess.run(["chattr", flag, *existing], check=True, capture_output=True)


def sqlite_files(db: Path) -> list[Path]:
    return [db, Path(f"{db}-wal"), Path(f"{db}-shm")]


def immutable_flag_enforced(folder: Path) -> bool:
    """True when ``chattr +i`` works here and the kernel enforces it on a file already open (ext4)."""
    if not _root() or shutil.which("chattr") is None:
        return False
    probe = folder / "immutable-probe"
    probe.write_bytes(b"x")
    fd = os.open(probe, os.O_RDWR)
    try:
        if subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode != 0:
            return False
        try:
            os.pwrite(fd, b"y", 0)
            return False
        except PermissionError:
            return True
    finally:
        subprocess.run(["chattr", "-i", str(probe)], capture_output=True)
        os.close(fd)
        probe.unlink()


def needs_immutable(folder: Path) -> None:
    if not immutable_flag_enforced(folder):
        pytest.skip("needs root and a file system that enforces chattr +i on open files (ext4)")


def _loaded(store) -> SimpleNamespace:
    """What readiness reads from a dispatcher."""
    return SimpleNamespace(retriever=SimpleNamespace(encoder=SimpleNamespace(engine_name="onnxruntime")),
                           kb=[object()], store=store)


def _unavailable(operation: str) -> float:
    return metrics.REGISTRY.get_sample_value("healthbot_store_unavailable_total", {"operation": operation}) or 0.0


def run_child(script: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter from the repository root (a SIGBUS there is a failed test)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def child_result(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, (
        f"child exited with {done.returncode}"
        f"{' (' + signal.Signals(-done.returncode).name + ')' if done.returncode < 0 else ''}:\n"
        f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class RedisProcess:
    """``redis-server`` on a fixed loopback port and folder, so it can be killed and started again
    as the same server (``appendonly``: keep data in ``appendonly.aof``, fsync'd at every write)."""

    def __init__(self, folder: Path, appendonly: bool) -> None:
        self.binary = require_redis_server()
        self.folder = folder
        self.appendonly = appendonly
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        folder.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProcess":
        self.proc = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
             "--dir", str(self.folder), "--logfile", str(self.folder / "redis.log"), "--daemonize", "no"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        if wait_for_ping(self.proc, self.port, timeout_s=10):
            return self
        log = (self.folder / "redis.log").read_text(errors="replace")[-2000:]
        self.kill()
        raise RuntimeError(f"redis-server did not start on port {self.port}: {log}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None


# ---------------------------------------------------------------- the outage counter and log


def test_store_unavailable_counts_every_call_and_logs_once_per_interval(monkeypatch):
    monkeypatch.setattr(health, "_last_logged", {})
    before = _unavailable("session_get")
    with capture_logs() as logs:
        for _ in range(5):
            store_unavailable("session_get", StoreError("cannot reach Redis at 127.0.0.1:1"))
    lines = [e for e in logs if e["event"] == "store.unavailable"]
    assert _unavailable("session_get") == before + 5
    assert len(lines) == 1 and lines[0]["operation"] == "session_get" and "127.0.0.1:1" in lines[0]["error"]
    monkeypatch.setattr(health, "LOG_EVERY_S", 0.0)
    with capture_logs() as logs:
        store_unavailable("session_get", StoreError("still down"))
    assert [e["suppressed"] for e in logs if e["event"] == "store.unavailable"] == [4]


def test_local_cache_expires_and_stays_bounded():
    cache: LocalCache[str, str] = LocalCache(max_items=2)
    cache.set("a", "1", 60)
    cache.set("b", "2", 60)
    cache.set("c", "3", 60)
    assert (cache.get("a"), cache.get("b"), cache.get("c"), len(cache)) == (None, "2", "3", 2)
    cache.set("d", "4", -1)
    assert cache.get("d") is None


async def test_check_store_reads_health_else_ping_and_never_raises():
    class Unwritable:
        async def health(self):
            return "unwritable"

    class Raising:
        async def health(self):
            raise RuntimeError("boom")

    assert await check_store(MemoryStore(), 0.5) == "ok"
    assert await check_store(Unwritable(), 0.5) == "unwritable"
    assert await check_store(Raising(), 0.5) == "unreachable"


# ---------------------------------------------------------------- SQLite: disk full, read-only


async def test_sqlite_on_a_full_disk_is_unwritable_for_readyz_and_recovers_when_space_returns(tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        store = await open_store(f"sqlite:///{disk}/healthbot.db")
        try:
            await store.set("before", "kept")
            filler = fill(disk)
            with pytest.raises(StoreError, match="disk is full"):
                for i in range(400):
                    await store.set(f"reply:{i}", "答" * 1000)
            assert await store.get("before") == "kept"  # reads still work
            assert await store.health() == "unwritable"
            status, body = await readiness(_loaded(store), ServerState())
            assert status == 503 and body["store"] == "unwritable"

            filler.unlink()
            assert await store.health() == "ok"
            await store.set("after", "written")
            assert await store.get("after") == "written"
            assert (await readiness(_loaded(store), ServerState()))[0] == 200
        finally:
            await store.close()


@pytest.mark.parametrize("message", ["database or disk is full", "attempt to write a readonly database"])
async def test_sqlite_write_errors_double_make_readyz_503_then_200(tmp_path, monkeypatch, message):
    """Stand-in for a full disk / read-only file where neither can be made for real (no root)."""
    store = await open_store(f"sqlite:///{tmp_path}/healthbot.db")
    try:
        real = store._conn

        class Failing:  # the store's event-loop connection, failing every write statement
            def execute(self, sql, *args):
                if sql.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE")):
                    raise sqlite3.OperationalError(message)
                return real.execute(sql, *args)

            def __getattr__(self, name):
                return getattr(real, name)

        store._conn = Failing()
        with pytest.raises(StoreError, match=message):
            await store.set("k", "v")
        assert await store.health() == "unwritable"
        assert (await readiness(_loaded(store), ServerState()))[1]["store"] == "unwritable"
        store._conn = real
        assert await store.health() == "ok"
        assert (await readiness(_loaded(store), ServerState()))[0] == 200
    finally:
        await store.close()


_IMMUTABLE_CHILD = """
    import asyncio, json, subprocess, sys
    from bot.store import StoreError, open_store

    def chattr(flag, paths):
        subprocess.run(["chattr", flag, *paths], check=True)

    async def main(folder):
        db = f"{folder}/healthbot.db"
        store = await open_store(f"sqlite:///{db}")
        await store.set("before", "kept")
        out = {}
        # 1. the database and its -wal read-only: writes fail, reads work
        chattr("+i", [db, db + "-wal"])
        try:
            try:
                await store.set("during", "x")
                out["write_ro"] = "ok"
            except StoreError as e:
                out["write_ro"] = str(e)
            out["read_ro"] = await store.get("before")
            out["health_ro"] = await store.health()
            # 2. the -shm too: touching its memory map would be SIGBUS; the store refuses instead
            chattr("+i", [db + "-shm"])
            try:
                for call in (store.set("during", "x"), store.get("before"), store.take_token("t", 1, 1)):
                    try:
                        await call
                        out.setdefault("shm", []).append("ok")
                    except StoreError as e:
                        out.setdefault("shm", []).append(str(e))
                out["health_shm"] = await store.health()
            finally:
                chattr("-i", [db + "-shm"])
        finally:
            chattr("-i", [db, db + "-wal"])
        out["health_after"] = await store.health()
        await store.set("after", "written")
        out["after"] = await store.get("after")
        out["before"] = await store.get("before")
        # 3. closing while the -shm is immutable: the connection is left open, the process lives on
        chattr("+i", [db + "-shm"])
        await store.close()
        out["closed"] = True
        print(json.dumps(out))

    asyncio.run(main(sys.argv[1]))
"""


def test_sqlite_read_only_files_and_an_immutable_shm_never_crash_the_process(tmp_path):
    needs_immutable(tmp_path)
    db = tmp_path / "healthbot.db"
    try:
        done = run_child(_IMMUTABLE_CHILD, str(tmp_path))
    finally:
        chattr("-i", *sqlite_files(db))
    out = child_result(done)  # exit status 0: no SIGBUS, not even at exit with the -shm immutable
    assert "disk I/O error" in out["write_ro"] and out["read_ro"] == "kept" and out["health_ro"] == "unwritable"
    assert len(out["shm"]) == 3 and all("immutable" in e and "SIGBUS" in e for e in out["shm"]), out["shm"]
    assert out["health_shm"] == "unreachable"
    assert out["health_after"] == "ok" and out["after"] == "written" and out["before"] == "kept"
    assert out["closed"] is True and "store.close_skipped" in done.stdout + done.stderr


_TRUNCATED_CHILD = """
    import asyncio, json, os, sys
    from bot.store import open_store

    async def main(folder):
        db = f"{folder}/healthbot.db"
        store = await open_store(f"sqlite:///{db}")
        for i in range(50):
            await store.set(f"k{i}", "v" * 100)
        size = os.path.getsize(db + "-shm")
        os.truncate(db + "-shm", 0)  # what a rogue process, or one that thinks it is alone, does
        await store.set("after", "written")
        out = {"size": size, "after": await store.get("after"), "k7": await store.get("k7"),
               "repairs": store._guard.repairs, "shm_now": os.path.getsize(db + "-shm"),
               "health": await store.health()}
        await store.close()
        print(json.dumps(out))

    asyncio.run(main(sys.argv[1]))
"""


def test_sqlite_shm_truncated_under_the_process_is_grown_back_not_a_sigbus(tmp_path):
    out = child_result(run_child(_TRUNCATED_CHILD, str(tmp_path)))
    assert out["size"] > 0 and out["repairs"] == 1 and out["shm_now"] >= out["size"]
    assert out["after"] == "written" and out["k7"] == "v" * 100 and out["health"] == "ok"


async def test_sqlite_sets_mmap_size_zero(tmp_path):
    store = await open_store(f"sqlite:///{tmp_path}/healthbot.db")
    try:
        assert isinstance(store, SqliteStore)
        assert await store._read("PRAGMA mmap_size", ()) == [(0,)]
    finally:
        await store.close()


# ---------------------------------------------------------------- Redis: killed, restarted


async def test_redis_killed_fails_fast_reports_unreachable_and_recovers_on_restart(tmp_path):
    srv = RedisProcess(tmp_path / "redis", appendonly=False).start()
    store = await open_store(srv.url)
    try:
        await store.set("k", "v")
        assert await store.health() == "ok"
        srv.kill()
        with pytest.raises(StoreError, match="cannot reach Redis"):
            await store.get("k")
        started = time.monotonic()
        for _ in range(50):  # within RETRY_AFTER_S: no connection attempt, no retry back-off
            with pytest.raises(StoreError, match="not retried"):
                await store.take_token("rate:http:u", 1.0, 8)
        assert time.monotonic() - started < 0.5
        assert await store.health() == "unreachable"
        assert (await readiness(_loaded(store), ServerState()))[1]["store"] == "unreachable"

        srv.start()
        assert await store.health() == "ok"  # the probe always tries, and reopens the way for the rest
        await store.set("k2", "v2")
        assert await store.get("k2") == "v2"
        assert (await readiness(_loaded(store), ServerState()))[0] == 200
    finally:
        await store.close()
        srv.kill()


@pytest.mark.parametrize("appendonly", [True, False], ids=["appendonly", "no-persistence"])
async def test_handoff_survives_a_redis_restart_with_appendonly(tmp_path, appendonly):
    """The README's advice, tested: with ``appendonly yes`` a handoff outlives ``kill -9`` of Redis;
    without persistence Redis comes back empty and the user would be answered by the bot again."""
    srv = RedisProcess(tmp_path / "redis", appendonly=appendonly).start()
    store = await open_store(srv.url)
    try:
        handoff = HandoffManager(store)
        await store.set(*handoff.with_turns("http", "u-restart", None, ("user", "我晚上总是睡不着")))
        await handoff.start("http", "u-restart", "u-restart", "user_request")
        srv.kill()
        with pytest.raises(StoreError):
            await handoff.active("http", "u-restart")
        srv.start()
        assert await store.health() == "ok"
        session = await handoff.active("http", "u-restart")
        if appendonly:
            assert session is not None and session.state == "active"
            assert session.transcript == ["user: 我晚上总是睡不着"]
            assert [s.user_id for s in await handoff.sessions()] == ["u-restart"]
        else:
            assert session is None
    finally:
        await store.close()
        srv.kill()


# ---------------------------------------------------------------- the dispatcher without its store


class SwitchableStore(MemoryStore):
    """A MemoryStore that fails like a real one: every call raises StoreError while ``down``; only
    writes while ``read_only``."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.read_only = False

    def _gate(self, write: bool) -> None:
        if self.down:
            raise StoreError("cannot reach Redis at 127.0.0.1:6390 (test double)")
        if write and self.read_only:
            raise StoreError("SQLite store /data/healthbot.db: attempt to write a readonly database (test double)")

    async def get(self, key):
        self._gate(False)
        return await super().get(key)

    async def set(self, key, value, ttl_s=None):
        self._gate(True)
        return await super().set(key, value, ttl_s)

    async def get_many(self, keys):
        self._gate(False)
        return await super().get_many(keys)

    async def set_many(self, items):
        self._gate(bool(items))
        return await super().set_many(items)

    async def set_if_absent(self, key, value, ttl_s=None):
        self._gate(True)
        return await super().set_if_absent(key, value, ttl_s)

    async def claim_and_read(self, key, value, ttl_s=None, strings=(), lists=(), bucket=None, if_found=None, record=None):
        self._gate(True)
        return await super().claim_and_read(key, value, ttl_s, strings, lists, bucket, if_found, record)

    async def delete(self, key):
        self._gate(True)
        return await super().delete(key)

    async def take_token(self, key, rate_per_s, burst):
        self._gate(True)
        return await super().take_token(key, rate_per_s, burst)

    async def push(self, key, value, ttl_s=None):
        self._gate(True)
        return await super().push(key, value, ttl_s)

    async def pop_all(self, key):
        self._gate(True)
        return await super().pop_all(key)

    async def health(self):
        return "unreachable" if self.down else "unwritable" if self.read_only else "ok"


_ids = itertools.count()


def msg(text: str, user: str = "outage-user", kind: MessageKind = MessageKind.TEXT, **raw) -> Inbound:
    return Inbound(channel="http", user_id=user, chat_id=user, message_id=f"outage-{next(_ids)}", kind=kind,
                   text=text, raw=raw)


@pytest.fixture
def outage(dispatcher, cfg):
    """A dispatcher on the shared real model whose store can be switched off; the agent console
    is on, so the http channel can hand a chat to a person."""
    from bot.dispatcher import Dispatcher

    async def notify(session, text):
        return None

    store = SwitchableStore()
    handoff = HandoffManager(store)
    handoff.console = True
    handoff.register("http", notify_user=notify)
    return Dispatcher(cfg, dispatcher.retriever, dispatcher.head, dispatcher.topic_fit, handoff, store), store


@pytest.mark.model
@requires_model
async def test_every_kind_of_message_is_answered_while_the_store_is_down(outage, monkeypatch):
    d, store = outage
    monkeypatch.setattr(health, "_last_logged", {})
    store.down = True
    before = {op: _unavailable(op) for op in health.OPERATIONS}
    with capture_logs() as logs:
        answer = await d.handle(msg("手脚冰凉怎么办"))
        emergency = await d.handle(msg("我爸胸口像压了块石头，一直出冷汗"))
        dose = await d.handle(msg("布洛芬一次吃几片"))
        greeting = await d.handle(msg("你好"))
        person = await d.handle(msg("转人工"))
        end = await d.handle(msg("结束人工"))
        follow = await d.handle(msg("", kind=MessageKind.SUBSCRIBE))
        photo = await d.handle(msg("", kind=MessageKind.UNSUPPORTED, type="image"))

    assert answer.intent is Intent.ANSWER and answer.topic == "body.cold_hands_feet" and "医生" in answer.text
    assert emergency.intent is Intent.EMERGENCY and "120" in emergency.text
    assert dose.intent is Intent.REFER_DOCTOR and dose.text
    assert greeting.intent is Intent.GREETING and greeting.text
    # Nothing can be recorded, so no person would see the chat: an honest "nobody can take it now".
    assert person.intent is Intent.HANDOFF and person.text == HANDOFF_UNAVAILABLE_REPLY["zh"]
    assert end.text == HANDOFF_ENDED_REPLY["zh"]
    assert follow.intent is Intent.GREETING and photo.text
    after = {op: _unavailable(op) for op in health.OPERATIONS}
    for op in ("dedup", "handoff_active", "handoff_start", "transcript", "session_get", "rate_limit"):
        assert after[op] > before[op], op
    events = [e for e in logs if e["event"] == "store.unavailable"]
    assert {e["operation"] for e in events} >= {"dedup", "handoff_active", "transcript", "session_get"}
    assert not [e for e in logs if e.get("log_level") == "error"]


@pytest.mark.model
@requires_model
async def test_no_rate_limit_while_the_store_is_down_and_the_limit_returns_with_it(outage):
    d, store = outage
    store.down = True
    down = [await d.handle(msg("失眠怎么调理", user="burst-user")) for _ in range(12)]
    assert all(r.intent is Intent.ANSWER for r in down), [r.intent for r in down]
    store.down = False
    up = [await d.handle(msg("失眠怎么调理", user="burst-user-2")) for _ in range(12)]
    assert [r.intent for r in up].count(Intent.SYSTEM) >= 3  # the burst is 8: the store limits again


@pytest.mark.model
@requires_model
async def test_a_retry_during_the_outage_is_answered_from_memory_computed_once(outage):
    d, store = outage
    store.down = True
    first = msg("how much water should I drink a day")
    hits = metrics.REGISTRY.get_sample_value("healthbot_dedup_hits_total", {"channel": "http"}) or 0.0
    a = await d.handle(first)
    b = await d.handle(first)  # the channel's retry after the first delivery was answered
    assert a.intent is Intent.ANSWER and b.text == a.text
    assert metrics.REGISTRY.get_sample_value("healthbot_dedup_hits_total", {"channel": "http"}) == hits + 1


@pytest.mark.model
@requires_model
async def test_a_store_that_fails_mid_handoff_relays_or_answers_never_raises(outage):
    d, store = outage
    user = "handoff-" + uuid.uuid4().hex[:8]
    started = await d.handle(msg("转人工", user=user))
    assert started.intent is Intent.HANDOFF and started.handoff
    # Writes fail (disk full, read-only): the handoff is still read, the message still goes to the
    # agents; only its record is missing. The bot stays silent, as a person has the chat.
    store.read_only = True
    relayed = await d.handle(msg("我晚上总是睡不着", user=user))
    assert relayed.intent is Intent.HANDOFF and relayed.text == ""
    # Nothing answers: whether a person has the chat is unknown, so the bot answers.
    store.down = True
    answered = await d.handle(msg("晚上总是睡不着怎么办", user=user))
    assert answered.intent is Intent.ANSWER and answered.text
    # Back: the handoff, kept in the store all along, holds again.
    store.down = store.read_only = False
    again = await d.handle(msg("还在吗", user=user))
    assert again.intent is Intent.HANDOFF and again.text == ""


# ---------------------------------------------------------------- real servers: Redis killed, disk full, read-only

WECHAT_TOKEN = "outage-token"
APPID = "wx00aa11bb22cc33dd"
CONSOLE_TOKEN = "console-token-for-outage-tests"
START_TIMEOUT_S = 600.0  # a first start embeds the knowledge base and trains the decision head (minutes on 2 busy cores)
QUESTIONS = ["手脚冰凉怎么办", "失眠怎么调理", "how much water should I drink a day", "晚上总是睡不着怎么办",
             "便秘怎么办", "感冒了怎么办", "每天应该走多少步"]


class Server(ServeProcess):
    """One ``healthbot serve`` process with this module's secrets; ``base`` is its URL, ``log`` its stderr."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        super().__init__({**os.environ, "HEALTHBOT_WECHAT_TOKEN": WECHAT_TOKEN, "HEALTHBOT_WECHAT_APPID": APPID,
                          "HEALTHBOT_CONSOLE_TOKEN": CONSOLE_TOKEN, "HEALTHBOT_KNOWLEDGE_RELOAD_INTERVAL_S": "0",
                          **env}, log)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        super().wait_ready(timeout_s)


class Traffic:
    """Users asking over /api/chat and WeChat (plaintext), and a /readyz poller, for a while; every
    outcome kept. A lost answer: a 5xx, an empty reply to a question, WeChat's ``success`` instead
    of a text, a request that failed."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.signer = WechatSigner(WECHAT_TOKEN, appid=APPID)
        self.answered = 0
        self.lost: list[str] = []
        self.readyz: list[tuple[float, int, str]] = []
        self._n = itertools.count()

    async def _chat(self, http, worker: int) -> None:
        n = next(self._n)
        text = QUESTIONS[n % len(QUESTIONS)]
        user = f"outage-{worker}-{n // 4}-{uuid.uuid4().hex[:6]}"  # 4 messages a user: under the burst
        try:
            async with http.post(self.base + "/api/chat", json={"text": text, "user_id": user}) as resp:
                body = await resp.text()
                if resp.status != 200:
                    self.lost.append(f"http {resp.status}: {body[:200]}")
                    return
                reply = json.loads(body)
                if not reply.get("reply") or reply.get("intent") == "system":
                    self.lost.append(f"http empty or system reply: {body[:200]}")
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.lost.append(f"http {type(e).__name__}: {e}")
            return
        self.answered += 1

    async def _wechat(self, http) -> None:
        n = next(self._n)
        xml = text_xml(QUESTIONS[n % len(QUESTIONS)], msg_id=9_100_000_000_000_000 + n,
                       user="oOUTAGE" + uuid.uuid4().hex[:20])
        path, body = self.signer.plain_post(xml, nonce=uuid.uuid4().hex[:10])
        try:
            async with http.post(self.base + path, data=body, headers={"Content-Type": "text/xml"}) as resp:
                text = await resp.text()
                if resp.status != 200 or not text.startswith("<xml>"):
                    self.lost.append(f"wechat {resp.status}: {text[:200]}")
                    return
                reply = parse_reply(text)
                if reply.get("MsgType") != "text" or not reply.get("Content"):
                    self.lost.append(f"wechat: {text[:200]}")
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.lost.append(f"wechat {type(e).__name__}: {e}")
            return
        self.answered += 1

    async def run(self, seconds: float, users: int = 3, pause_s: float = 0.8) -> None:
        """``users`` senders (the first over WeChat), each pausing ``pause_s`` between messages:
        about 3 requests a second from 127.0.0.1, under the per-address admission limit (5/s)."""
        deadline = time.monotonic() + seconds
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async def user(worker: int) -> None:
                while time.monotonic() < deadline:
                    if worker == 0:
                        await self._wechat(http)
                    else:
                        await self._chat(http, worker)
                    await asyncio.sleep(pause_s)

            async def poll() -> None:
                while time.monotonic() < deadline:
                    try:
                        async with http.get(self.base + "/readyz") as resp:
                            body = await resp.json()
                            self.readyz.append((time.monotonic(), resp.status, str(body.get("store"))))
                    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                        self.readyz.append((time.monotonic(), 0, type(e).__name__))
                    await asyncio.sleep(1.0)

            await asyncio.gather(poll(), *(user(w) for w in range(users)))


async def _readyz(base: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        async with http.get(base + "/readyz") as resp:
            return resp.status, await resp.json()


async def _wait_readyz(base: str, status: int, within_s: float) -> float:
    """Seconds until /readyz answers ``status`` (fails after ``within_s``)."""
    started = time.monotonic()
    last = None
    while time.monotonic() - started < within_s:
        last = await _readyz(base)
        if last[0] == status:
            return time.monotonic() - started
        await asyncio.sleep(0.2)
    pytest.fail(f"/readyz not {status} within {within_s} s: {last}")


async def _metric_sum(base: str, name: str) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(base + "/metrics") as resp:
            text = await resp.text()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})?\s+(\S+)$", text, re.M))


async def _chat(base: str, user: str, text: str) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.post(base + "/api/chat", json={"text": text, "user_id": user}) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


def _assert_outage_report(traffic: Traffic, server: Server, label: str) -> None:
    assert server.proc.poll() is None, f"{label}: the server died: {server.log.read_text()[-3000:]}"
    assert traffic.lost == [], f"{label}: {len(traffic.lost)} lost of {traffic.answered + len(traffic.lost)}: " \
                               f"{traffic.lost[:5]}"
    assert traffic.answered > 0


@pytest.mark.model
@requires_model
async def test_server_with_redis_killed_for_15_s_loses_no_answer_and_keeps_its_handoffs(tmp_path):
    redis = RedisProcess(tmp_path / "redis", appendonly=True).start()
    server = Server({"HEALTHBOT_STORE_URL": redis.url, "HEALTHBOT_DATA_DIR": str(tmp_path / "data")},
                    tmp_path / "serve.log")
    try:
        server.wait_ready()
        person = "outage-handoff-" + uuid.uuid4().hex[:8]
        assert (await _chat(server.base, person, "转人工"))["intent"] == "handoff"
        assert (await _chat(server.base, person, "我晚上总是睡不着"))["reply"] == ""  # relayed to agents

        before = Traffic(server.base)
        await before.run(3)
        _assert_outage_report(before, server, "before")

        redis.kill()
        killed_at = time.monotonic()
        during = Traffic(server.base)
        await during.run(15)
        _assert_outage_report(during, server, "Redis down")
        late = [(round(t - killed_at, 1), s, why) for t, s, why in during.readyz if t - killed_at > 1.5]
        assert late and all(s == 503 for _, s, _ in late), late  # "unreachable" (a slow probe reads the same)

        redis.start()
        back_s = await _wait_readyz(server.base, 200, 10)
        after = Traffic(server.base)
        await after.run(3)
        _assert_outage_report(after, server, "after")
        # The handoff outlived the restart (appendonly): the person still has the chat.
        still = await _chat(server.base, person, "还在吗")
        assert still["intent"] == "handoff" and still["reply"] == ""
        assert await _metric_sum(server.base, "healthbot_store_unavailable_total") > 0
        log = server.log.read_text(errors="replace")
        assert "store.unavailable" in log
        print(f"\nRedis killed 15 s: answered before/during/after = {before.answered}/{during.answered}/"
              f"{after.answered}, lost 0; /readyz 200 again {back_s:.1f} s after the restart; "
              f"tracebacks in the log: {log.count('Traceback')}")
    finally:
        server.stop()
        redis.kill()


@pytest.mark.model
@requires_model
async def test_server_on_a_full_disk_loses_no_answer_and_readyz_follows_the_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "16m") as disk:
        server = Server({"HEALTHBOT_STORE_URL": f"sqlite:///{disk}/healthbot.db",
                         "HEALTHBOT_DATA_DIR": str(tmp_path / "data")}, tmp_path / "serve.log")
        try:
            server.wait_ready()
            before = Traffic(server.base)
            await before.run(2)
            _assert_outage_report(before, server, "before")

            filler = fill(disk)
            full_at = time.monotonic()
            during = Traffic(server.base)
            await during.run(10)
            _assert_outage_report(during, server, "disk full")
            late = [(round(t - full_at, 1), s, why) for t, s, why in during.readyz if t - full_at > 1.0]
            assert late and all(s == 503 for _, s, _ in late), late
            assert "unwritable" in {why for _, _, why in late}  # reads work, writes do not

            filler.unlink()
            back_s = await _wait_readyz(server.base, 200, 10)
            after = Traffic(server.base)
            await after.run(2)
            _assert_outage_report(after, server, "after")
            assert "store.unavailable" in server.log.read_text(errors="replace")
            print(f"\ndisk full 10 s: answered {before.answered}/{during.answered}/{after.answered}, lost 0; "
                  f"/readyz 200 again {back_s:.1f} s after space returned")
        finally:
            server.stop()


@pytest.mark.model
@requires_model
async def test_server_on_a_read_only_database_loses_no_answer_and_never_dies_of_sigbus(tmp_path):
    needs_immutable(tmp_path)
    db = tmp_path / "state" / "healthbot.db"
    server = Server({"HEALTHBOT_STORE_URL": f"sqlite:///{db}", "HEALTHBOT_DATA_DIR": str(tmp_path / "data")},
                    tmp_path / "serve.log")
    try:
        server.wait_ready()
        before = Traffic(server.base)
        await before.run(2)
        _assert_outage_report(before, server, "before")

        # Between requests (the server is idle: nothing is inside SQLite while the flags change).
        chattr("+i", *sqlite_files(db))
        during = Traffic(server.base)
        await during.run(10)
        _assert_outage_report(during, server, "read-only database")
        assert during.readyz and all(s == 503 for _, s, _ in during.readyz), during.readyz

        chattr("-i", *sqlite_files(db))
        back_s = await _wait_readyz(server.base, 200, 10)
        after = Traffic(server.base)
        await after.run(2)
        _assert_outage_report(after, server, "after")
        log = server.log.read_text(errors="replace")
        assert "store.unavailable" in log and "Fatal Python error" not in log
        print(f"\nread-only database 10 s: answered {before.answered}/{during.answered}/{after.answered}, "
              f"lost 0; /readyz 200 again {back_s:.1f} s after")
    finally:
        chattr("-i", *sqlite_files(db))
        server.stop()
