"""One suite for every Store backend: memory, SQLite (a temporary file) and Redis (a real redis-server).

The Redis cases start Debian's ``redis-server`` on 127.0.0.1 (tests/redis_server.py);
without the binary they are skipped, except in CI, where they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time

import pytest

from bot.config import REPO_ROOT
from bot.store import MemoryStore, Store, StoreError, open_store
from bot.store.sqlite import SqliteStore, sqlite_path
from tests.redis_server import RedisServer, redis_server, require_redis_server  # noqa: F401 (fixture)


def _flush(url: str) -> None:
    import redis
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def _url(backend: str, request, tmp_path) -> str:
    if backend == "memory":
        return "memory://"
    if backend == "sqlite":
        return f"sqlite:///{tmp_path}/state/healthbot.db"  # tmp_path is absolute: sqlite:////tmp/...
    server = request.getfixturevalue("redis_server")
    _flush(server.url)
    return server.url


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def store(request, tmp_path):
    """A fresh, empty store of each backend."""
    s = await open_store(_url(request.param, request, tmp_path))
    yield s
    await s.close()


@pytest.fixture(params=["sqlite", "redis"])
def shared_url(request, tmp_path):
    """The URL of an empty backend that several processes can share."""
    return _url(request.param, request, tmp_path)


# --- keys, values, TTL -------------------------------------------------------------------------

async def test_every_backend_satisfies_the_store_protocol(store):
    assert isinstance(store, Store)
    assert await store.ping() is True
    assert await store.health() == "ok"  # a read and a small write probe (bot/store/health.py)


async def test_get_returns_what_set_stored_and_none_when_absent(store):
    assert await store.get("session:telegram:42") is None
    await store.set("session:telegram:42", '{"topic": "sleep"}')
    assert await store.get("session:telegram:42") == '{"topic": "sleep"}'
    await store.set("session:telegram:42", "replaced")
    assert await store.get("session:telegram:42") == "replaced"
    await store.set("unicode", "失眠怎么办 🌙")
    assert await store.get("unicode") == "失眠怎么办 🌙"


async def test_value_expires_after_its_ttl_and_can_be_claimed_again(store):
    await store.set("dedup:wechat:1", "seen", ttl_s=0.2)
    assert await store.get("dedup:wechat:1") == "seen"
    await asyncio.sleep(0.3)
    assert await store.get("dedup:wechat:1") is None
    assert await store.set_if_absent("dedup:wechat:1", "again", ttl_s=5) is True
    assert await store.get("dedup:wechat:1") == "again"


async def test_get_many_reads_several_keys_in_order_and_set_many_writes_them_with_their_ttls(store):
    await store.set("session:http:1", '{"last_topic": "sleep.insomnia"}')
    await store.push("pending:1", "queued")  # a list reads as None, as with get
    await store.set("gone", "x", ttl_s=0.1)
    await asyncio.sleep(0.2)
    assert await store.get_many(["absent", "session:http:1", "pending:1", "gone"]) == [
        None, '{"last_topic": "sleep.insomnia"}', None, None]
    assert await store.get_many([]) == []
    await store.set_many([("reply:http:1:m1", "答", 3600.0), ("turns:http:1", '["user: 失眠"]', 0.15),
                          ("pending:1", "a string replaces the list", None)])
    assert await store.get_many(["reply:http:1:m1", "turns:http:1", "pending:1"]) == [
        "答", '["user: 失眠"]', "a string replaces the list"]
    assert await store.pop_all("pending:1") == []
    await asyncio.sleep(0.25)
    assert await store.get_many(["reply:http:1:m1", "turns:http:1"]) == ["答", None]  # each its own TTL
    await store.set_many([])  # nothing to send


async def test_set_without_ttl_removes_an_earlier_ttl(store):
    await store.set("token", "a", ttl_s=0.15)
    await store.set("token", "b")
    await asyncio.sleep(0.25)
    assert await store.get("token") == "b"


async def test_delete_removes_strings_and_lists_and_ignores_absent_keys(store):
    await store.set("a", "1")
    await store.push("l", "x")
    await store.delete("a")
    await store.delete("l")
    await store.delete("never-there")
    assert await store.get("a") is None
    assert await store.pop_all("l") == []


async def test_list_and_string_at_one_key_replace_each_other(store):
    await store.push("k", "item")
    assert await store.get("k") is None  # a list is not a string
    assert await store.set_if_absent("k", "claim") is False  # but the key is taken
    await store.set("k", "text")
    assert await store.get("k") == "text"
    await store.push("k", "item2")  # push over a string starts a new list
    assert await store.pop_all("k") == ["item2"]


# --- claims and locks --------------------------------------------------------------------------

async def test_concurrent_claims_exactly_one_wins(store):
    results = await asyncio.gather(*(store.set_if_absent("dedup:wechat:777", f"worker-{i}", ttl_s=30)
                                     for i in range(200)))
    assert sum(results) == 1
    winner = results.index(True)
    assert await store.get("dedup:wechat:777") == f"worker-{winner}"


async def test_claim_is_free_again_after_delete(store):
    assert await store.set_if_absent("lock", "me") is True
    assert await store.set_if_absent("lock", "you") is False
    await store.delete("lock")
    assert await store.set_if_absent("lock", "you") is True


async def test_claim_and_read_reads_strings_and_lists_then_claims_exactly_once(store):
    await store.set("reply", "stored")
    await store.push("pending", "a", ttl_s=60)
    await store.push("pending", "b", ttl_s=60)
    await store.set("a-string", "not a list")
    await store.push("a-list", "not a string", ttl_s=60)
    first = await store.claim_and_read("claim", "me", 30, strings=["reply", "absent", "a-list"],
                                       lists=["pending", "nothing", "a-string"])
    assert first == (True, ["stored", None, None], [["a", "b"], [], []], None, False)
    assert await store.read_all("pending") == ["a", "b"]  # read, left in place
    results = await asyncio.gather(*(store.claim_and_read("claim2", f"w{i}", 30, strings=["reply"]) for i in range(50)))
    assert sum(r.claimed for r in results) == 1 and {tuple(r.strings) for r in results} == {("stored",)}
    assert (await store.claim_and_read("claim", "you", 30)) == (False, [], [], None, False)
    assert await store.get("claim") == "me"
    short = await store.claim_and_read("short", "x", 0.1)
    await asyncio.sleep(0.2)
    assert short.claimed and (await store.claim_and_read("short", "y", 30)).claimed  # an expired claim is free


async def test_claim_and_read_stores_value_if_found_only_when_a_read_finds_something(store):
    await store.set("a-string", "x")
    await store.push("a-list", "item", ttl_s=60)
    await store.push("held", "item", ttl_s=60)
    await store.set("held", "a string now")  # a list replaced by a string reads as no list
    empty = await store.claim_and_read("c1", "final", 30, strings=["nope"], lists=["none", "held"], if_found=("busy", 30))
    assert empty == (True, [None], [[], []], None, False) and await store.get("c1") == "final"
    by_string = await store.claim_and_read("c2", "final", 30, strings=["a-string"], lists=["none"], if_found=("busy", 30))
    assert by_string.strings == ["x"] and await store.get("c2") == "busy"
    by_list = await store.claim_and_read("c3", "final", 30, strings=["nope"], lists=["a-list"], if_found=("busy", None),
                                         bucket=("rate:v", 0.001, 1))
    assert by_list == (True, [None], [["item"]], True, False) and await store.get("c3") == "busy"
    short = await store.claim_and_read("c4", "final", 30, lists=["a-list"], if_found=("busy", 0.1))
    await asyncio.sleep(0.2)
    assert short.claimed and await store.get("c4") is None  # stored with the if_found TTL
    again = await store.claim_and_read("c3", "final", 30, lists=["a-list"], if_found=("busy", 30))
    assert again.claimed is False and await store.get("c3") == "busy"


async def test_claim_and_read_records_first_and_does_nothing_else_on_a_conflicting_record(store):
    """A WeChat request's replay record (adapters/wechat/webhook.py): stored if absent, the same value
    again passes (a re-delivery), another value stops the call before any read, claim or token."""
    await store.set("reply", "stored")
    bucket = ("rate:r", 0.001, 2)
    first = await store.claim_and_read("c1", "1", 30, strings=["reply"], bucket=bucket, record=("nonce:1", "digest-a", 60))
    assert first == (True, ["stored"], [], True, False) and await store.get("nonce:1") == "digest-a"
    again = await store.claim_and_read("c1", "1", 30, strings=["reply"], record=("nonce:1", "digest-a", 60))
    assert again == (False, ["stored"], [], None, False)  # the same body: a re-delivery, read as before
    forged = await store.claim_and_read("c2", "1", 30, strings=["reply"], lists=["pending"], bucket=bucket,
                                        record=("nonce:1", "digest-b", 60))
    assert forged == (False, [None], [[]], None, True)
    assert await store.get("c2") is None and await store.get("nonce:1") == "digest-a"
    assert await store.take_token(*bucket) is True  # the forged call took none: the second of the burst of 2
    await store.push("a-list", "x", ttl_s=60)
    assert (await store.claim_and_read("c3", "1", 30, record=("a-list", "digest-a", 60))).conflict  # another type
    short = await store.claim_and_read("c4", "1", 30, record=("nonce:2", "digest-a", 0.1))
    await asyncio.sleep(0.2)
    assert short.claimed and not (await store.claim_and_read("c5", "1", 30, record=("nonce:2", "digest-b", 60))).conflict


async def test_claim_and_read_takes_from_the_same_bucket_as_take_token(store):
    tokens = [(await store.claim_and_read(f"m{i}", "1", 30, bucket=("rate:u", 0.001, 3))).token for i in range(2)]
    assert tokens == [True, True]
    assert await store.take_token("rate:u", 0.001, 3) is True  # the third of the burst of 3
    assert (await store.claim_and_read("m9", "1", 30, bucket=("rate:u", 0.001, 3))).token is False
    assert (await store.claim_and_read("m9", "1", 30, bucket=("rate:other", 0.001, 3))).token is True  # per key


async def test_delete_if_equal_releases_only_the_holders_lock(store):
    assert await store.delete_if_equal("wechat:token_lock", "owner-a") is False  # absent
    await store.set("wechat:token_lock", "owner-a", ttl_s=30)
    assert await store.delete_if_equal("wechat:token_lock", "owner-b") is False
    assert await store.get("wechat:token_lock") == "owner-a"
    assert await store.delete_if_equal("wechat:token_lock", "owner-a") is True
    assert await store.get("wechat:token_lock") is None
    assert await store.delete_if_equal("wechat:token_lock", "owner-a") is False


async def test_delete_if_equal_ignores_an_expired_lock(store):
    await store.set("lock", "owner", ttl_s=0.1)
    await asyncio.sleep(0.2)
    assert await store.delete_if_equal("lock", "owner") is False
    await store.push("list", "owner")
    assert await store.delete_if_equal("list", "owner") is False


# --- token buckets -----------------------------------------------------------------------------

async def test_token_bucket_allows_the_burst_then_refuses(store):
    taken = [await store.take_token("ratelimit:telegram:1", rate_per_s=0.01, burst=5) for _ in range(8)]
    assert taken == [True] * 5 + [False] * 3


async def test_token_bucket_refills_at_its_rate(store):
    key = "ratelimit:wechat:2"
    assert [await store.take_token(key, rate_per_s=4, burst=2) for _ in range(3)] == [True, True, False]
    await asyncio.sleep(0.35)  # 0.35 s x 4 tokens/s = 1.4 tokens
    assert await store.take_token(key, rate_per_s=4, burst=2) is True
    assert await store.take_token(key, rate_per_s=4, burst=2) is False


async def test_token_bucket_refill_is_capped_at_the_burst(store):
    key = "ratelimit:http:3"
    assert [await store.take_token(key, rate_per_s=10, burst=2) for _ in range(2)] == [True, True]
    await asyncio.sleep(0.4)  # 4 tokens' worth of time, but the bucket holds 2
    assert [await store.take_token(key, rate_per_s=10, burst=2) for _ in range(3)] == [True, True, False]


async def test_token_buckets_are_per_key_and_apart_from_values(store):
    assert [await store.take_token("user-a", 0.01, 1) for _ in range(2)] == [True, False]
    assert await store.take_token("user-b", 0.01, 1) is True
    await store.set("user-a", "a value")
    await store.delete("user-a")  # deletes the value, not the bucket
    assert await store.take_token("user-a", 0.01, 1) is False


async def test_concurrent_token_takes_never_exceed_the_burst(store):
    taken = await asyncio.gather(*(store.take_token("ratelimit:burst", 0.001, 10) for _ in range(100)))
    assert sum(taken) == 10


# --- lists -------------------------------------------------------------------------------------

async def test_pop_all_returns_pushed_values_oldest_first_and_empties_the_list(store):
    assert await store.pop_all("pending:telegram:1") == []
    for text in ("first", "second", "第三"):
        await store.push("pending:telegram:1", text, ttl_s=60)
    assert await store.pop_all("pending:telegram:1") == ["first", "second", "第三"]
    assert await store.pop_all("pending:telegram:1") == []


async def test_push_renews_the_lists_ttl_and_an_expired_list_is_empty(store):
    await store.push("q", "a", ttl_s=0.3)
    await asyncio.sleep(0.2)
    await store.push("q", "b", ttl_s=0.3)
    await asyncio.sleep(0.2)  # 0.4 s after the first push, 0.2 s after the second
    assert await store.pop_all("q") == ["a", "b"]
    await store.push("q", "c", ttl_s=0.1)
    await asyncio.sleep(0.2)
    assert await store.pop_all("q") == []
    await store.push("q", "d", ttl_s=30)  # an expired list is not resurrected
    assert await store.pop_all("q") == ["d"]


async def test_read_all_returns_the_list_oldest_first_and_leaves_it_in_place(store):
    assert await store.read_all("unanswered:2026-01-01") == []
    for text in ("first", "second", "第三"):
        await store.push("unanswered:2026-01-01", text, ttl_s=60)
    assert await store.read_all("unanswered:2026-01-01") == ["first", "second", "第三"]
    assert await store.read_all("unanswered:2026-01-01") == ["first", "second", "第三"]  # not consumed
    await store.set("a-string", "text")
    assert await store.read_all("a-string") == []  # a string is not a list
    await store.push("short", "x", ttl_s=0.1)
    await asyncio.sleep(0.2)
    assert await store.read_all("short") == []  # an expired list is gone
    assert await store.pop_all("unanswered:2026-01-01") == ["first", "second", "第三"]
    assert await store.read_all("unanswered:2026-01-01") == []


async def test_concurrent_pushes_and_pops_lose_and_duplicate_nothing(store):
    producers, per_producer = 8, 40
    done = asyncio.Event()
    popped: list[str] = []

    async def produce(p: int) -> None:
        for i in range(per_producer):
            await store.push("pending", f"{p}:{i}", ttl_s=60)
            if i % 8 == 0:
                await asyncio.sleep(0)

    async def consume() -> None:
        while not done.is_set():
            popped.extend(await store.pop_all("pending"))
            await asyncio.sleep(0)
        popped.extend(await store.pop_all("pending"))

    consumer = asyncio.create_task(consume())
    await asyncio.gather(*(produce(p) for p in range(producers)))
    done.set()
    await consumer
    assert sorted(popped) == sorted(f"{p}:{i}" for p in range(producers) for i in range(per_producer))
    for p in range(producers):  # each producer's items come out in its order
        assert [int(x.split(":")[1]) for x in popped if x.startswith(f"{p}:")] == list(range(per_producer))


# --- several processes on one backend ------------------------------------------------------------

_WORKER = r"""
import asyncio, json, sys
from bot.store import open_store

async def main(url, name, claims, takes, pushes):
    store = await open_store(url)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    async def push_all():
        for i in range(pushes):
            await store.push("pending", f"{name}:{i}", ttl_s=60)

    won, took, _ = await asyncio.gather(
        asyncio.gather(*(store.set_if_absent(f"claim:{i}", name, ttl_s=60) for i in range(claims))),
        asyncio.gather(*(store.take_token("shared-bucket", 0.001, 20) for _ in range(takes))),
        push_all())
    await store.close()
    print(json.dumps({"won": [i for i, ok in enumerate(won) if ok], "took": sum(took)}), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])))
"""


async def test_processes_sharing_a_backend_claim_each_key_once_and_share_buckets_and_lists(shared_url):
    workers, claims, takes, pushes = 3, 100, 15, 40
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-c", _WORKER, shared_url, f"w{n}", str(claims), str(takes), str(pushes),
        cwd=REPO_ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        for n in range(workers)]
    parent = await open_store(shared_url)
    try:
        for p in procs:  # barrier: every worker has opened the store
            assert (await asyncio.wait_for(p.stdout.readline(), 30)).strip() == b"ready"
        for p in procs:
            p.stdin.write(b"go\n")
            await p.stdin.drain()
        popped: list[str] = []
        parent_claims = asyncio.gather(*(parent.set_if_absent(f"claim:{i}", "parent", ttl_s=60)
                                         for i in range(claims)))
        finished = asyncio.gather(*(p.communicate() for p in procs))
        while not finished.done():
            popped.extend(await parent.pop_all("pending"))
            await asyncio.sleep(0.005)
        outputs = [json.loads(out) for out, _ in await finished]
        popped.extend(await parent.pop_all("pending"))
        parent_won = [i for i, ok in enumerate(await parent_claims) if ok]
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
        await parent.close()
    assert [p.returncode for p in procs] == [0] * workers

    winners = parent_won + [i for o in outputs for i in o["won"]]
    assert sorted(winners) == list(range(claims))  # every key claimed, none twice
    assert sum(o["took"] for o in outputs) == 20  # one bucket of 20 across 45 takes
    assert sorted(popped) == sorted(f"w{n}:{i}" for n in range(workers) for i in range(pushes))
    for n in range(workers):
        assert [int(x.split(":")[1]) for x in popped if x.startswith(f"w{n}:")] == list(range(pushes))


# --- SQLite specifics ----------------------------------------------------------------------------

async def test_sqlite_creates_the_folder_and_uses_wal(tmp_path):
    db = tmp_path / "a" / "b" / "healthbot.db"
    store = await open_store(f"sqlite:///{db}")
    try:
        assert isinstance(store, SqliteStore) and store.path == str(db)
        await store.set("k", "v")
    finally:
        await store.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT value FROM kv WHERE key = 'k'").fetchone()[0] == "v"


async def test_sqlite_the_configs_default_url_opens_under_the_data_directory(cfg):
    store = await open_store(cfg.effective_store_url)
    try:
        assert await store.ping()
        assert store.path == str(cfg.path(cfg.data_dir) / "healthbot.db")
    finally:
        await store.close()


async def test_sqlite_two_store_objects_on_one_file_see_each_other(tmp_path):
    url = f"sqlite:///{tmp_path}/shared.db"
    a, b = await open_store(url), await open_store(url)
    try:
        results = await asyncio.gather(*(s.set_if_absent("claim", name) for name in "xyz" * 20 for s in (a, b)))
        assert sum(results) == 1
        await a.push("q", "from-a")
        await b.push("q", "from-b")
        assert await b.pop_all("q") == ["from-a", "from-b"]
    finally:
        await a.close()
        await b.close()


async def test_sqlite_purge_removes_expired_rows_and_full_buckets(tmp_path):
    store = await SqliteStore.open(f"sqlite:///{tmp_path}/p.db")
    try:
        await store.set("short", "x", ttl_s=0.05)
        await store.set("long", "y", ttl_s=60)
        await store.push("short-list", "i", ttl_s=0.05)
        await store.take_token("bucket", rate_per_s=100, burst=2)  # full again after 10 ms
        await asyncio.sleep(0.1)
        assert await store.purge() == 4  # short, short-list, its item, the bucket
        assert await store.get("long") == "y"
        assert await store.purge() == 0
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def _store_beside_a_writer(db, busy_timeout_s: float):
    """A SQLite store on ``db`` and a plain connection to the same file, standing for another process."""
    store = await SqliteStore.open(f"sqlite:///{db}", busy_timeout_s=busy_timeout_s)
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    try:
        yield store, holder
    finally:
        holder.close()
        await store.close()


async def test_sqlite_a_write_waits_without_blocking_the_event_loop_while_another_process_holds_the_lock(tmp_path):
    """The loop's connection fails at once on SQLITE_BUSY; the write is tried again after short
    asynchronous sleeps, so the event loop keeps running while it waits for the lock."""
    async with _store_beside_a_writer(tmp_path / "locked.db", busy_timeout_s=5.0) as (store, holder):
        holder.execute("BEGIN IMMEDIATE")  # another process's write lock
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, holder.execute, "COMMIT")
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        started = time.monotonic()
        assert await store.set_if_absent("claim", "mine") is True
        waited = time.monotonic() - started
        task.cancel()
        assert 0.25 <= waited < 2.0
        assert ticks >= 15  # the loop was not blocked while the write waited
        assert await store.get("claim") == "mine"


async def test_sqlite_a_lock_held_past_the_busy_timeout_is_a_store_error(tmp_path):
    async with _store_beside_a_writer(tmp_path / "stuck.db", busy_timeout_s=0.2) as (store, holder):
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreError, match="still locked after 0.2 s"):
            await store.set("k", "v")
        holder.execute("ROLLBACK")
        await store.set("k", "v")  # and works again once the lock is gone
        assert await store.get("k") == "v"


async def test_sqlite_writes_queued_behind_another_processes_lock_commit_together_each_with_its_own_result(tmp_path):
    """Group commit: writes made while another process holds the lock share one COMMIT once it is
    free; a claim is still won once per key, by the first made; a write whose caller gave up
    before the commit is not made."""
    async with _store_beside_a_writer(tmp_path / "group.db", busy_timeout_s=5.0) as (store, holder):
        await store.set("warm", "up")
        holder.execute("BEGIN IMMEDIATE")  # another process's write lock
        before = store._commits
        claims = [asyncio.ensure_future(store.set_if_absent(f"claim{i % 5}", str(i))) for i in range(20)]
        others = [asyncio.ensure_future(w) for w in (store.set("plain", "v"), store.push("list", "item"))]
        abandoned = asyncio.ensure_future(store.set("gave-up", "v"))
        await asyncio.sleep(0.05)
        later = [asyncio.ensure_future(store.set(f"k{i}", "v")) for i in range(5)]
        abandoned.cancel()
        await asyncio.sleep(0.05)
        holder.execute("COMMIT")
        won = await asyncio.gather(*claims)
        await asyncio.gather(*others, *later)
        assert store._commits == before + 1
        assert won == [True] * 5 + [False] * 15  # the first of each key, in the order they were made
        assert [await store.get(f"claim{k}") for k in range(5)] == ["0", "1", "2", "3", "4"]
        assert await store.read_all("list") == ["item"] and await store.get("plain") == "v"
        assert [await store.get(f"k{i}") for i in range(5)] == ["v"] * 5
        assert await store.get("gave-up") is None


async def test_sqlite_a_write_that_fails_fails_alone_and_the_others_in_its_transaction_commit(tmp_path):
    async with _store_beside_a_writer(tmp_path / "alone.db", busy_timeout_s=5.0) as (store, holder):
        await store.set("warm", "up")
        holder.execute("BEGIN IMMEDIATE")
        writes = [asyncio.ensure_future(w) for w in (store.set("a", "1"), store.set("bad", object()), store.set("b", "2"))]
        await asyncio.sleep(0.05)
        holder.execute("COMMIT")
        results = await asyncio.gather(*writes, return_exceptions=True)
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], StoreError)
        assert (await store.get("a"), await store.get("bad"), await store.get("b")) == ("1", None, "2")


async def test_sqlite_close_commits_the_writes_already_queued(tmp_path):
    db = tmp_path / "close.db"
    async with _store_beside_a_writer(db, busy_timeout_s=5.0) as (store, holder):
        holder.execute("BEGIN IMMEDIATE")
        pending = [asyncio.ensure_future(store.set(f"k{i}", str(i))) for i in range(5)]
        await asyncio.sleep(0.02)  # queued behind the other connection's lock
        asyncio.get_running_loop().call_later(0.1, holder.execute, "COMMIT")
        await store.close()
        assert [p.result() for p in pending] == [None] * 5
        with pytest.raises(StoreError, match="closed"):
            await store.set("late", "x")
    again = await SqliteStore.open(f"sqlite:///{db}")
    try:
        assert [await again.get(f"k{i}") for i in range(5)] == [str(i) for i in range(5)]
    finally:
        await again.close()


async def test_sqlite_commits_on_the_event_loop_never_checkpoint_the_executor_does(tmp_path):
    from bot.store.sqlite import CHECKPOINT_EVERY
    db = tmp_path / "ckpt.db"
    store = await SqliteStore.open(f"sqlite:///{db}")
    try:
        assert store._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        empty = db.stat().st_size
        for i in range(CHECKPOINT_EVERY + 1):
            await store.set(f"k{i}", "x" * 200)
        await asyncio.get_running_loop().run_in_executor(store._executor, lambda: None)  # the checkpoint ran
        assert db.stat().st_size > empty + 100 * 200  # the rows reached the database file
    finally:
        await store.close()


def test_sqlite_url_forms():
    assert sqlite_path("sqlite:///relative/x.db") == "relative/x.db"
    assert sqlite_path("sqlite:////abs/x.db") == "/abs/x.db"
    assert sqlite_path("sqlite:///:memory:") == ":memory:"
    for bad in ("sqlite://host/x.db", "sqlite:///", "sqlite:///x.db?mode=ro"):
        with pytest.raises(StoreError, match="sqlite:////absolute/path.db"):
            sqlite_path(bad)


async def test_sqlite_unusable_paths_say_what_to_do(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(StoreError, match=r"cannot create the folder .*a-file.*HEALTHBOT_STORE_URL"):
        await open_store(f"sqlite:///{blocker}/sub/healthbot.db")
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database file" * 100)
    with pytest.raises(StoreError, match=r"garbage.db is not a usable SQLite database.*HEALTHBOT_STORE_URL"):
        await open_store(f"sqlite:///{garbage}")


async def test_sqlite_a_closed_store_says_so(tmp_path):
    store = await open_store(f"sqlite:///{tmp_path}/c.db")
    await store.close()
    await store.close()  # twice is fine
    assert await store.ping() is False
    with pytest.raises(StoreError, match="is closed"):
        await store.get("k")


# --- errors: unknown scheme, Redis unreachable or gone -------------------------------------------

async def test_unknown_scheme_names_the_supported_ones():
    with pytest.raises(StoreError) as err:
        await open_store("mongodb://localhost/healthbot")
    assert "mongodb://localhost/healthbot" in str(err.value)
    for scheme in ("sqlite:///", "redis://", "memory://"):
        assert scheme in str(err.value)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_unreachable_redis_fails_fast_with_what_to_do():
    port = _closed_port()
    started = time.monotonic()
    with pytest.raises(StoreError) as err:
        await open_store(f"redis://:s3cret@127.0.0.1:{port}/0")
    assert time.monotonic() - started < 3.0
    message = str(err.value)
    assert f"cannot reach Redis at 127.0.0.1:{port}" in message
    assert f"redis-server --port {port}" in message and "HEALTHBOT_STORE_URL" in message
    assert "s3cret" not in message and "***" in message


async def test_redis_going_away_turns_ping_false_and_comes_back_with_redis():
    binary = require_redis_server()
    server = RedisServer(binary).start()
    store = await open_store(server.url)
    try:
        await store.set("k", "v")
        server.stop()
        assert await store.ping() is False
        with pytest.raises(StoreError, match=f"cannot reach Redis at 127.0.0.1:{server.port}"):
            await store.get("k")
        server = RedisServer(binary, port=server.port).start()  # a restart loses the data (no persistence)
        assert await store.ping() is True
        assert await store.set_if_absent("k", "again") is True
    finally:
        await store.close()
        server.stop()


async def test_memory_url_gives_a_memory_store():
    assert isinstance(await open_store("memory://"), MemoryStore)


_OPENER = r"""
import asyncio, sys, time
from bot.store import open_store

async def main(url, start_at):
    time.sleep(max(0.0, start_at - time.time()))  # every process opens the new file at the same moment
    store = await open_store(url)
    for i in range(300):  # writing while the others still open it
        await store.set_if_absent(f"claim:{i}", "1", 60.0)
    await store.close()
    print("opened", flush=True)

asyncio.run(main(sys.argv[1], float(sys.argv[2])))
"""


async def test_sqlite_processes_opening_one_new_file_at_the_same_moment_all_open_it(tmp_path):
    # `healthbot serve --processes N` on a fresh data directory: N front ends create the file at once.
    # SQLite answers "database is locked" to a PRAGMA journal_mode = WAL that meets another
    # connection's, without calling the busy handler: the store tries again.
    for attempt in range(3):
        url = f"sqlite:///{tmp_path}/fresh-{attempt}.db"
        start_at = time.time() + 1.5
        procs = [subprocess.Popen([sys.executable, "-c", _OPENER, url, repr(start_at)], cwd=REPO_ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
        outs = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0] * 8, [err[-300:] for _, err in outs if err]
        assert all(out.strip() == "opened" for out, _ in outs)


async def test_redis_commands_of_one_loop_turn_share_a_pipeline_and_keep_their_own_replies(redis_server):
    """bot/store/redis_batch.py: concurrent callers' commands go out together; each gets its own
    reply, a command's own error stays with its caller, and a lone command is sent at once."""
    _flush(redis_server.url)
    store = await open_store(redis_server.url)
    try:
        before = (store.batcher.pipelines, store.batcher.commands)  # open's PING
        await store.set("lone", "1")
        assert (store.batcher.pipelines - before[0], store.batcher.commands - before[1]) == (1, 1)  # alone
        await store.push("a_list", "x")  # a list: GET on it is WRONGTYPE, which get() reads as absent
        claims = [store.set_if_absent("claim", str(i), 30.0) for i in range(20)]
        results = await asyncio.gather(
            *claims, store.get("lone"), store.get("a_list"), store.take_token("bucket", 1.0, 2),
            store.set_many([(f"k{i}", str(i), 30.0) for i in range(5)]), store.get_many(["k1", "lone", "nope"]))
        assert results[:20].count(True) == 1  # SET NX: exactly one claim, as when sent alone
        # in submission order: set_many's k1 lands before get_many reads it
        assert results[20:25] == ["1", None, True, None, ["1", "1", None]]
        assert store.batcher.pipelines - before[0] < 10  # 28 commands after the first in a few pipelines, not 27 round trips
        assert await store.get_many(["k1", "k4"]) == ["1", "4"]
        with pytest.raises(StoreError, match="WRONGTYPE"):  # a command's own error, raised to its caller
            await asyncio.gather(store._send(lambda p: p.lpush("lone", "x")), store.get("lone"))
    finally:
        await store.close()



async def test_redis_a_caller_cancelled_mid_pipeline_leaves_no_reply_for_the_next(redis_server):
    """bot/store/redis_batch.py keeps its connections between pipelines: one whose replies were
    left unread (its caller cancelled while Redis was still answering) is dropped, never reused,
    so the next caller reads its own reply, not the cancelled one's."""
    _flush(redis_server.url)
    store = await open_store(redis_server.url)
    try:
        await store.set("k", "mine")
        slow = asyncio.ensure_future(store._send(lambda p: p.blpop(["empty_list"], timeout=0.3)))
        await asyncio.sleep(0.05)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert [await store.get("k") for _ in range(3)] == ["mine"] * 3
        await asyncio.sleep(0.4)  # BLPOP's nil would have arrived by now on a reused connection
        assert await store.get_many(["k", "nope"]) == ["mine", None]
        assert await store.set_if_absent("k", "other", 5.0) is False
    finally:
        await store.close()

async def test_redis_that_stops_answering_fails_each_call_within_the_timeout():
    """The pool's sockets have no read timeout (bot/store/redis_batch.py): the pipeline's deadline
    ends a call to a Redis that holds the connection open but answers nothing (SIGSTOP), and the
    store answers again once Redis does."""
    from bot.store.redis import RedisStore

    binary = require_redis_server()
    server = RedisServer(binary).start()
    store = await RedisStore.open(server.url, timeout_s=0.5)
    try:
        await store.set("k", "v")
        os.kill(server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(StoreError, match="no reply within 0.5 s"):
                await asyncio.gather(store.get("k"), store.set_if_absent("c", "1", 5.0))
            assert time.monotonic() - started < 2.0
            assert await store.ping() is False
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert await store.ping() is True
        assert await store.get("k") == "v"  # the connection the deadline dropped was replaced
    finally:
        await store.close()
        server.stop()
