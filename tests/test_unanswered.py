"""What users ask that the bot cannot answer (issue 25): recording (bot/unanswered.py) on the real
dispatcher and model, and ``healthbot report unanswered`` (bot/unanswered_report.py) through the
real command line on a SQLite store."""

from __future__ import annotations

import asyncio
import itertools
import json
import sqlite3
import time

import pytest

from bot import metrics
from bot.config import ConfigError, load_config
from bot.store import MemoryStore, StoreError, open_store
from bot.store.sqlite import sqlite_path
from bot.types import Inbound, Intent, MessageKind, Reply
from bot.unanswered import DAY_S, UnansweredRecorder, day_key, read_unanswered, ttl_for
from bot.unanswered_report import group_vectors, parse_period
from safety.pii import pseudonym
from tests.conftest import requires_model

_ids = itertools.count()
#: Every id of the asking user holds this, so a test can look for it in what was stored.
USER = "oUserSecretOpenId"
PHONE = "13812345678"
KEYS = {"ts", "text", "lang", "intent", "reason", "decided_by", "best_topic"}


def ask(q: str) -> Inbound:
    n = next(_ids)
    return Inbound(channel="http", user_id=f"{USER}-{n}", chat_id=f"chat-{USER}-{n}",
                   message_id=f"msg-{USER}-{n}", kind=MessageKind.TEXT, text=q)


def recording_cfg(tmp_path, on: bool = True):
    return load_config(env={"HEALTHBOT_DATA_DIR": str(tmp_path),
                            "HEALTHBOT_KNOWLEDGE_RECORD_UNANSWERED": "true" if on else "false"})


def sharing_the_model(dispatcher, cfg, store):
    """A dispatcher with its own config and store on the session's real model, retriever and head."""
    from bot.dispatcher import Dispatcher
    return Dispatcher(cfg, dispatcher.retriever, dispatcher.head, dispatcher.topic_fit, None, store)


def unavailable(operation: str) -> float:
    return metrics.REGISTRY.get_sample_value("healthbot_store_unavailable_total", {"operation": operation}) or 0.0


# ---------------------------------------------------------------- configuration

def test_recording_is_off_by_default_and_kept_30_days():
    cfg = load_config(env={})
    assert cfg.knowledge.record_unanswered is False
    assert cfg.knowledge.unanswered_retention_days == 30


def test_recording_and_retention_from_the_environment_and_the_config_file(tmp_path):
    cfg = load_config(env={"HEALTHBOT_KNOWLEDGE_RECORD_UNANSWERED": "1",
                           "HEALTHBOT_KNOWLEDGE_UNANSWERED_RETENTION_DAYS": "7"})
    assert cfg.knowledge.record_unanswered is True and cfg.knowledge.unanswered_retention_days == 7
    toml = tmp_path / "healthbot.toml"
    toml.write_text("[knowledge]\nrecord_unanswered = true\nunanswered_retention_days = 14\n", encoding="utf-8")
    cfg = load_config(toml, env={})
    assert cfg.knowledge.record_unanswered is True and cfg.knowledge.unanswered_retention_days == 14
    with pytest.raises(ConfigError, match="knowledge.record_unanswered"):
        load_config(env={"HEALTHBOT_KNOWLEDGE_RECORD_UNANSWERED": "maybe"})
    with pytest.raises(ConfigError, match="knowledge.unanswered_retention_days"):
        load_config(env={"HEALTHBOT_KNOWLEDGE_UNANSWERED_RETENTION_DAYS": "0"})


# ---------------------------------------------------------------- expiry, reading back, grouping

async def test_a_days_list_expires_the_retention_after_its_day_ends(monkeypatch):
    store = MemoryStore()
    recorder = UnansweredRecorder(load_config(env={"HEALTHBOT_KNOWLEDGE_RECORD_UNANSWERED": "1"}).knowledge)
    now = time.time()
    await recorder.record(store, ask("做完心脏支架手术后多久可以坐飞机"), Reply("…", Intent.NO_ANSWER), {})
    key = day_key(now)
    assert len(await store.read_all(key)) == 1
    ttl = ttl_for(now, 30)
    assert 30 * DAY_S < ttl <= 31 * DAY_S
    monkeypatch.setattr(time, "time", lambda: now + ttl - 5)
    assert len(await store.read_all(key)) == 1
    monkeypatch.setattr(time, "time", lambda: now + ttl + 1)
    assert await store.read_all(key) == []


async def test_read_unanswered_keeps_the_period_and_never_more_than_the_retention():
    store = MemoryStore()
    now = time.time()
    for age_days in (0.5, 3, 10, 40):
        ts = now - age_days * DAY_S
        await store.push(day_key(ts), json.dumps({"ts": ts, "text": f"{age_days} days old"}), ttl_s=DAY_S)
    await store.push(day_key(now), "not json", ttl_s=DAY_S)
    texts = lambda entries: [e["text"] for e in entries]  # noqa: E731
    assert texts(await read_unanswered(store, parse_period("7d"), 30, now)) == ["3 days old", "0.5 days old"]
    assert texts(await read_unanswered(store, parse_period("6h"), 30, now)) == []
    assert texts(await read_unanswered(store, parse_period("1w"), 30, now)) == ["3 days old", "0.5 days old"]
    assert texts(await read_unanswered(store, parse_period("90d"), 30, now)) == [
        "10 days old", "3 days old", "0.5 days old"]  # 40 days is past the retention
    with pytest.raises(ValueError):
        parse_period("soon")


def test_grouping_joins_vectors_above_the_threshold_largest_group_first():
    import numpy as np
    a, b = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    near_a = np.array([0.99, 0.141])
    vectors = np.stack([b, a, near_a / np.linalg.norm(near_a), a])
    assert group_vectors(vectors, 0.95) == [[1, 2, 3], [0]]
    assert group_vectors(vectors, 0.999) == [[1, 3], [0], [2]]


# ---------------------------------------------------------------- recording on the real dispatcher

@pytest.mark.model
@requires_model
async def test_unanswered_and_referred_questions_are_recorded_masked_without_ids_and_expire(dispatcher, tmp_path):
    cfg = recording_cfg(tmp_path)
    store = await open_store(cfg.effective_store_url)
    try:
        d = sharing_the_model(dispatcher, cfg, store)
        asked = [ask(f"心脏支架手术以后能坐飞机吗 我手机{PHONE}"), ask("布洛芬一次吃几片"),
                 ask("手脚冰凉怎么办"), ask("我爸胸口像压了块石头，一直出冷汗"), ask("那饮食上呢")]
        replies = [await d.handle(inbound) for inbound in asked]
        assert [r.intent for r in replies] == [Intent.NO_ANSWER, Intent.REFER_DOCTOR, Intent.ANSWER,
                                               Intent.EMERGENCY, Intent.NO_ANSWER]  # the last: "ask back"
        await d.unanswered.flush()
        now = time.time()
        keys = sorted({day_key(now - DAY_S), day_key(now)})
        raw = [v for key in keys for v in await store.read_all(key)]
        entries = await read_unanswered(store, DAY_S, 30)
    finally:
        await store.close()

    assert len(raw) == 2, raw  # not the answer, the emergency, nor the ask-back to a follow-up
    assert [e["intent"] for e in entries] == ["no_answer", "refer_doctor"]
    assert all(set(e) == KEYS for e in entries)
    assert entries[0]["text"] == "心脏支架手术以后能坐飞机吗 我手机[PHONE]"
    assert entries[1]["text"] == "布洛芬一次吃几片" and entries[1]["reason"] == "dose"
    assert all(e["lang"] == "zh" and e["decided_by"] and e["best_topic"] for e in entries)
    assert all(now - 60 <= e["ts"] <= now for e in entries)
    for value in raw:  # nothing that identifies who asked, in any form
        assert PHONE not in value and USER not in value and "chat-" not in value and "msg-" not in value
        for inbound in asked:
            assert pseudonym(inbound.user_id) not in value
    with sqlite3.connect(sqlite_path(cfg.effective_store_url)) as db:  # the day's list expires with the retention
        for key in {day_key(e["ts"]) for e in entries}:
            (expires,), = db.execute("SELECT expires FROM kv WHERE key = ?", (key,)).fetchall()
            assert now + 30 * DAY_S <= expires <= now + 31 * DAY_S


@pytest.mark.model
@requires_model
async def test_with_recording_off_nothing_is_stored(dispatcher, tmp_path):
    store = MemoryStore()
    d = sharing_the_model(dispatcher, recording_cfg(tmp_path, on=False), store)
    assert (await d.handle(ask("做完心脏支架手术后多久可以坐飞机"))).intent is Intent.NO_ANSWER
    assert (await d.handle(ask("布洛芬一次吃几片"))).intent is Intent.REFER_DOCTOR
    await d.unanswered.flush()
    assert await read_unanswered(store, DAY_S, 30) == []


class FailingPush(MemoryStore):
    """Every list write fails as a full disk or an unreachable Redis would."""

    async def push(self, key, value, ttl_s=None):
        raise StoreError("SQLite store /data/healthbot.db: database or disk is full (test double)")


class StalledPush(MemoryStore):
    """List writes wait until released: a store that answers, but slowly."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def push(self, key, value, ttl_s=None):
        self.entered.set()
        await self.release.wait()
        await super().push(key, value, ttl_s)


async def test_writes_piling_up_on_a_stalled_store_are_dropped_and_counted(monkeypatch):
    monkeypatch.setattr("bot.unanswered.MAX_PENDING", 2)
    store = StalledPush()
    recorder = UnansweredRecorder(load_config(env={"HEALTHBOT_KNOWLEDGE_RECORD_UNANSWERED": "1"}).knowledge)
    before = unavailable("unanswered")
    tasks = [recorder.record(store, ask(f"问题{n}"), Reply("…", Intent.NO_ANSWER), {}) for n in range(3)]
    assert tasks[0] is not None and tasks[1] is not None and tasks[2] is None
    assert unavailable("unanswered") == before + 1
    store.release.set()
    await recorder.flush()
    assert [e["text"] for e in await read_unanswered(store, DAY_S, 30)] == ["问题0", "问题1"]


@pytest.mark.model
@requires_model
async def test_a_failing_store_is_counted_and_the_reply_still_goes_out(dispatcher, tmp_path):
    d = sharing_the_model(dispatcher, recording_cfg(tmp_path), FailingPush())
    before = unavailable("unanswered")
    reply = await d.handle(ask("做完心脏支架手术后多久可以坐飞机"))
    await d.unanswered.flush()
    assert reply.intent is Intent.NO_ANSWER and "医生" in reply.text
    assert unavailable("unanswered") == before + 1


@pytest.mark.model
@requires_model
async def test_a_slow_store_does_not_hold_the_reply(dispatcher, tmp_path):
    store = StalledPush()
    d = sharing_the_model(dispatcher, recording_cfg(tmp_path), store)
    reply = await asyncio.wait_for(d.handle(ask("布洛芬一次吃几片")), timeout=10)
    assert reply.intent is Intent.REFER_DOCTOR
    await asyncio.wait_for(store.entered.wait(), timeout=5)  # the write had started: the reply did not wait for it
    assert await read_unanswered(store, DAY_S, 30) == []
    store.release.set()
    await d.unanswered.flush()
    assert [e["text"] for e in await read_unanswered(store, DAY_S, 30)] == ["布洛芬一次吃几片"]


# ---------------------------------------------------------------- the report, through the command line

STENT = ["做完心脏支架手术后多久可以坐飞机", "心脏支架手术后多久可以坐飞机", "做完心脏支架手术多久以后可以坐飞机",
         f"我妈做完心脏支架手术后多久可以坐飞机，电话{PHONE}"]
DOSE = ["布洛芬一次吃几片", "布洛芬每次吃多少片"]
THYROID = ["甲状腺结节要手术吗", "甲状腺结节需要做手术吗"]


@pytest.mark.model
@requires_model
async def test_report_groups_near_identical_questions_and_prints_the_nearest_topic(dispatcher, tmp_path, monkeypatch,
                                                                                   cli_main, capsys):
    cfg = recording_cfg(tmp_path)
    store = await open_store(cfg.effective_store_url)
    try:
        d = sharing_the_model(dispatcher, cfg, store)
        for q in STENT + DOSE + THYROID + ["手脚冰凉怎么办"]:
            await d.handle(ask(q))
        await d.unanswered.flush()
        assert len(await read_unanswered(store, DAY_S, 30)) == len(STENT + DOSE + THYROID)
    finally:
        await store.close()
    monkeypatch.setenv("HEALTHBOT_DATA_DIR", str(tmp_path))  # the report reads the same SQLite file
    capsys.readouterr()

    assert await asyncio.to_thread(cli_main, ["report", "unanswered", "--since", "1d", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["questions"] == 8 and report["groups_total"] == 3
    stent, dose, thyroid = report["groups"]
    assert stent["size"] == 4 and stent["intents"] == {"no_answer": 4}
    assert len(stent["examples"]) == 3 and set(stent["examples"]) <= {q.replace(PHONE, "[PHONE]") for q in STENT}
    assert stent["nearest_topic"]["id"] == "longterm.after_heart_attack"
    assert sorted(dose["examples"]) == sorted(DOSE) and dose["reasons"] == {"dose": 2}
    assert sorted(thyroid["examples"]) == sorted(THYROID)
    assert thyroid["nearest_topic"]["id"] == "living.thyroid_iodine"

    assert await asyncio.to_thread(cli_main, ["report", "unanswered", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "8 in 3 group(s)" in out and " 1. 4 question(s) (no_answer 4" in out
    assert 'nearest topic: longterm.after_heart_attack "心梗、放支架后的康复与日常生活"' in out
    assert "布洛芬" not in out  # --top 1: the largest group only
    assert PHONE not in out


def test_report_with_nothing_recorded_says_how_to_turn_recording_on(tmp_path, monkeypatch, cli_main, capsys):
    monkeypatch.setenv("HEALTHBOT_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("HEALTHBOT_KNOWLEDGE_RECORD_UNANSWERED", raising=False)
    assert cli_main(["report", "unanswered"]) == 0
    assert "HEALTHBOT_KNOWLEDGE_RECORD_UNANSWERED=1" in capsys.readouterr().out
    assert cli_main(["report", "unanswered", "--since", "soon"]) == 2
    assert "--since 'soon'" in capsys.readouterr().err
