"""Helpful / not-helpful feedback on answers (issue 25), on real behaviour:

* the votes in each store backend (memory, SQLite, Redis): the first vote per user and answer
  counts, only answers take votes, and what is kept names no user;
* the HTTP API on a real ``healthbot serve`` (real model) on loopback: the chat reply's ids,
  ``POST /api/v1/feedback`` and its errors, ``healthbot_feedback_total`` on ``/metrics``, and
  ``healthbot report feedback`` reading the same store;
* Telegram: python-telegram-bot's real client against the fake Bot API, the real dispatcher:
  the 👍 / 👎 keyboard under answers, a press, a second press, someone else's press;
* WeChat: a service account in safe mode (wechatpy's crypto), the real dispatcher, the fake
  server API: the ``msgmenu`` after a late answer and a click on it as a vote.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from wechatpy.crypto import WeChatCrypto

from adapters.http import setup_http
from adapters.telegram import SendPolicy, setup_telegram
from adapters.telegram import constants as tc
from adapters.wechat import WECHAT_ADAPTER, setup_wechat
from adapters.wechat import constants as wc
from adapters.wechat import late as wechat_late
from bot import metrics
from bot.config import Config, ConfigError, load_config
from bot.feedback import TEXTS, FeedbackBook, Outcome, read_votes
from bot.store import MemoryStore, StoreError
from bot.types import Intent, Reply
from tests import wechat_client as wx
from tests.conftest import requires_model
from tests.fake_telegram import FakeBotAPI, Updates
from tests.fake_wechat_api import FakeWechatApi
from tests.redis_server import redis_server  # noqa: F401 (pytest fixture, used by the store fixture)
from tests.servers import ServeProcess
from tests.test_store import store  # noqa: F401 (pytest fixture: a fresh store of each backend)

ANSWER = Reply("失眠的调理……", Intent.ANSWER, "zh", topic="sleep.insomnia", confidence=0.9)


def counted(topic: str, vote: str) -> float:
    """``healthbot_feedback_total{topic, vote}`` now (0 before the first vote)."""
    return metrics.REGISTRY.get_sample_value("healthbot_feedback_total", {"topic": topic, "vote": vote}) or 0.0


# --------------------------------------------------------------------------- the store


async def test_the_first_vote_counts_and_a_second_is_ignored(store):  # noqa: F811
    book = FeedbackBook(store)
    before = counted("sleep.insomnia", "not_helpful")
    assert await book.offer("telegram", "42", "42:7", ANSWER)
    first = await book.vote("telegram", "42", "42:7", "not_helpful")
    assert (first.outcome, first.topic, first.lang, first.vote) == (Outcome.RECORDED, "sleep.insomnia", "zh",
                                                                    "not_helpful")
    second = await book.vote("telegram", "42", "42:7", "helpful")  # a change of mind, or both buttons
    assert (second.outcome, second.vote) == (Outcome.REPEATED, "not_helpful")
    assert counted("sleep.insomnia", "not_helpful") == before + 1
    (kept,) = await read_votes(store, 3600)
    assert set(kept) == {"ts", "topic", "vote", "channel"}  # no user, pseudonym, message id or text
    assert (kept["topic"], kept["vote"], kept["channel"]) == ("sleep.insomnia", "not_helpful", "telegram")


async def test_only_answers_take_votes_and_only_from_the_user_who_asked(store):  # noqa: F811
    book = FeedbackBook(store)
    greeting = Reply("您好！", Intent.GREETING, "zh")
    no_topic = Reply("答：……", Intent.ANSWER, "zh")
    assert not await book.offer("http", "u1", "m1", greeting)
    assert not await book.offer("http", "u1", "m2", no_topic)
    assert await book.offer("http", "u1", "m3", ANSWER)
    for user, message in (("u1", "m1"), ("u1", "m2"), ("u2", "m3"), ("u1", "nothing")):
        assert (await book.vote("http", user, message, "helpful")).outcome is Outcome.UNKNOWN
    assert await read_votes(store, 3600) == []
    with pytest.raises(ValueError, match="helpful"):
        await book.vote("http", "u1", "m3", "meh")


async def test_votes_are_read_back_by_period_and_from_each_day():
    store = MemoryStore()
    now = time.time()
    for days_ago, topic in ((0, "a"), (2, "b"), (10, "c")):
        ts = now - days_ago * 86_400
        day = time.strftime("%Y-%m-%d", time.gmtime(ts))
        await store.push(f"feedback:votes:{day}", json.dumps({"ts": int(ts), "topic": topic, "vote": "helpful",
                                                              "channel": "http"}))
    await store.push(f"feedback:votes:{time.strftime('%Y-%m-%d', time.gmtime(now))}", "not json")
    assert [v["topic"] for v in await read_votes(store, 7 * 86_400, now)] == ["b", "a"]
    assert [v["topic"] for v in await read_votes(store, 30 * 86_400, now)] == ["c", "b", "a"]


class FailingStore(MemoryStore):
    """A memory store whose ``get`` / ``set`` / ``push``, when named in :attr:`failing`, raise StoreError
    as a store that is down does."""

    def __init__(self, *failing: str) -> None:
        super().__init__()
        self.failing = set(failing)

    def _check(self, name: str) -> None:
        if name in self.failing:
            raise StoreError(f"{name}: store down")

    async def get(self, key: str) -> str | None:
        self._check("get")
        return await super().get(key)

    async def set(self, key: str, value: str, ttl_s: float | None = None) -> None:
        self._check("set")
        await super().set(key, value, ttl_s)

    async def push(self, key: str, value: str, ttl_s: float | None = None) -> None:
        self._check("push")
        await super().push(key, value, ttl_s)


def unavailable() -> float:
    return metrics.REGISTRY.get_sample_value("healthbot_store_unavailable_total", {"operation": "feedback"}) or 0.0


async def test_a_store_outage_costs_the_buttons_or_the_vote_never_a_wrong_count():
    before = unavailable()
    assert not await FeedbackBook(FailingStore("set")).offer("http", "u", "m", ANSWER)  # no buttons, counted
    assert unavailable() == before + 1
    store = FailingStore("push")
    book = FeedbackBook(store)
    assert await book.offer("http", "u", "m", ANSWER)
    with pytest.raises(StoreError):
        await book.vote("http", "u", "m", "helpful")
    store.failing.clear()  # back: the vote that was not counted can be sent again
    assert (await book.vote("http", "u", "m", "helpful")).outcome is Outcome.RECORDED
    assert len(await read_votes(store, 3600)) == 1


async def test_the_api_answers_503_while_the_store_cannot_record_a_vote():
    app = web.Application()
    setup_http(app, dispatcher=None, feedback=FeedbackBook(FailingStore("get")))
    async with TestClient(TestServer(app, host="127.0.0.1", port=0)) as client:
        async with client.post("/api/v1/feedback", json={"user_id": "u", "message_id": "m", "vote": "helpful"}) as resp:
            assert (resp.status, resp.headers["Retry-After"]) == (503, "5")
            assert "again later" in (await resp.json())["error"]


def test_the_wechat_menu_needs_a_service_account():
    with pytest.raises(ConfigError, match="feedback_menu"):
        load_config(env={"HEALTHBOT_WECHAT_FEEDBACK_MENU": "1"})
    cfg = load_config(env={"HEALTHBOT_WECHAT_FEEDBACK_MENU": "1", "HEALTHBOT_WECHAT_ACCOUNT_TYPE": "service"})
    assert cfg.wechat.feedback_menu


# --------------------------------------------------------------------------- HTTP, a real server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A real ``healthbot serve`` with its own data directory (the store the report reads)."""
    data = tmp_path_factory.mktemp("feedback-data")
    env = {**os.environ, "HEALTHBOT_DATA_DIR": str(data), "HEALTHBOT_KNOWLEDGE_RELOAD_INTERVAL_S": "0"}
    for name in ("HEALTHBOT_STORE_URL", "HEALTHBOT_SERVER_METRICS_PORT", "HEALTHBOT_SERVER_METRICS_TOKEN",
                 "HEALTHBOT_CONFIG"):
        env.pop(name, None)
    server = ServeProcess(env, tmp_path_factory.mktemp("feedback-log") / "serve.log", name="feedback server")
    try:
        server.wait_ready(180.0)
        yield server, data
    finally:
        server.stop()


@pytest.mark.model
@requires_model
async def test_http_vote_metrics_and_the_report(served, cli_main, capsys, monkeypatch):
    server, data = served
    user = f"fb-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as http:
        async def post(path: str, body: Any) -> tuple[int, dict]:
            kw = {"data": body} if isinstance(body, bytes) else {"json": body}
            async with http.post(server.base + path, **kw) as resp:
                assert resp.content_type == "application/json"
                return resp.status, await resp.json()

        status, answer = await post("/api/v1/chat", {"text": "失眠怎么调理", "user_id": user})
        assert status == 200 and answer["intent"] == "answer" and answer["topic"]
        assert answer["message_id"] and answer["user_id"] == user  # a random message id, sent back
        topic, ids = answer["topic"], {"user_id": user, "message_id": answer["message_id"]}
        assert await post("/api/v1/feedback", {**ids, "vote": "not_helpful"}) == (
            200, {"recorded": True, "topic": topic, "vote": "not_helpful"})
        assert await post("/api/v1/feedback", {**ids, "vote": "helpful"}) == (
            200, {"recorded": False, "topic": topic, "vote": "not_helpful"})
        status, greeting = await post("/api/v1/chat", {"text": "你好", "user_id": user, "message_id": 7})
        assert status == 200 and greeting["intent"] == "greeting" and greeting["message_id"] == "7"
        status, error = await post("/api/v1/feedback", {"user_id": user, "message_id": 7, "vote": "helpful"})
        assert status == 404 and "only answers" in error["error"]
        for body, needle in ((b"{", "not valid JSON"), (b"[]", "JSON object"),
                             ({"message_id": "m", "vote": "helpful"}, "user_id"),
                             ({**ids, "message_id": "m" * 129}, "message_id"),
                             ({**ids, "vote": "meh"}, "vote"), ({**ids, "vote": None}, "vote")):
            status, error = await post("/api/v1/feedback", body)
            assert status == 400 and needle in error["error"], (body, error)
        async with http.get(server.base + "/metrics") as resp:
            exposed = await resp.text()
    assert f'healthbot_feedback_total{{topic="{topic}",vote="not_helpful"}} 1.0' in exposed
    assert f'healthbot_feedback_total{{topic="{topic}",vote="helpful"}}' not in exposed

    monkeypatch.setenv("HEALTHBOT_DATA_DIR", str(data))
    for name in ("HEALTHBOT_STORE_URL", "HEALTHBOT_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    report = lambda *args: asyncio.to_thread(cli_main, ["report", "feedback", *args])  # noqa: E731 (own loop)
    assert await report("--since", "1d") == 0
    text = capsys.readouterr().out
    assert "1 vote(s) on 1 topic(s)" in text
    line = next(ln for ln in text.splitlines() if topic in ln)
    assert "not helpful    1" in line and "helpful    0" in line and '"' in line  # the topic's title
    assert await report("--json") == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["votes"] == 1 and printed["topics"][0]["topic"] == topic
    assert (printed["topics"][0]["not_helpful"], printed["topics"][0]["helpful"]) == (1, 0)
    assert await report("--since", "soon") == 2


# --------------------------------------------------------------------------- Telegram

TG_TOKEN = "123456:TEST-token"
TG_SECRET = "healthbot_Webhook-secret_0123"


@pytest.fixture
async def tg(dispatcher):
    """The Telegram adapter on the real dispatcher, votes in its store; (fake Bot API, deliver, updates)."""
    fake = await FakeBotAPI(token=TG_TOKEN).start()
    cfg = load_config(env={"HEALTHBOT_TELEGRAM_TOKEN": TG_TOKEN, "HEALTHBOT_TELEGRAM_SECRET": TG_SECRET,
                           "HEALTHBOT_TELEGRAM_API_BASE": fake.api_base})
    app = web.Application()

    async def no_wait(_seconds: float) -> None:
        await asyncio.sleep(0)

    adapter = setup_telegram(app, cfg, dispatcher, dispatcher.handoff, policy=SendPolicy(sleep=no_wait),
                             feedback=FeedbackBook(dispatcher.store))
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    http = aiohttp.ClientSession()

    async def deliver(*updates: dict[str, Any]) -> None:
        for update in updates:
            async with http.post(f"http://127.0.0.1:{server.port}{tc.WEBHOOK_PATH}", json=update,
                                 headers={tc.SECRET_HEADER: TG_SECRET}) as resp:
                assert resp.status == 200
        await adapter.idle()

    yield fake, deliver, Updates(bot_id=fake.bot_user["id"], bot_username=fake.bot_user["username"])
    await http.close()
    await server.close()
    await fake.close()


def _keyboard(fake: FakeBotAPI, chat: int) -> list[dict[str, str]]:
    """The buttons under the last message sent to ``chat`` ([] when it has none)."""
    (last,) = fake.calls_to("sendMessage", chat_id=chat)[-1:]
    markup = last.params.get("reply_markup") or {"inline_keyboard": [[]]}
    return markup["inline_keyboard"][0]


@pytest.mark.model
async def test_telegram_answer_buttons_record_one_vote_and_go(tg, dispatcher):
    fake, deliver, u = tg
    user, other = random.randint(10**8, 10**9), random.randint(10**8, 10**9)
    await deliver(u.command(user, "/start"))
    assert _keyboard(fake, user) == []  # a greeting takes no feedback
    await deliver(u.text(user, "失眠怎么调理"))
    up, down = _keyboard(fake, user)
    assert (up["text"], down["text"]) == ("👍 有帮助", "👎 没帮助")
    assert all(len(b["callback_data"].encode()) <= tc.CALLBACK_DATA_MAX_BYTES for b in (up, down))
    before = await read_votes(dispatcher.store, 3600)

    await deliver(u.callback(other, down["callback_data"], message_chat=user))  # not the user who asked
    assert fake.calls_to("answerCallbackQuery")[-1].params["text"] == TEXTS["unknown"]["zh"]
    assert not fake.calls_to("editMessageReplyMarkup")
    await deliver(u.callback(user, down["callback_data"]))
    assert fake.calls_to("answerCallbackQuery")[-1].params["text"] == "谢谢反馈！"
    (removed,) = fake.calls_to("editMessageReplyMarkup", chat_id=user)
    assert "reply_markup" not in removed.params or not removed.params["reply_markup"].get("inline_keyboard")
    await deliver(u.callback(user, up["callback_data"]))  # a second press: ignored
    assert fake.calls_to("answerCallbackQuery")[-1].params["text"] == TEXTS["repeated"]["zh"]
    votes = (await read_votes(dispatcher.store, 3600))[len(before):]
    assert [(v["vote"], v["channel"]) for v in votes] == [("not_helpful", "telegram")]


@pytest.mark.model
async def test_telegram_english_answer_buttons_and_thanks(tg):
    fake, deliver, u = tg
    user = random.randint(10**8, 10**9)
    await deliver(u.command(user, "/lang en"), u.text(user, "I can never fall asleep at night, any tips?"))
    up, down = _keyboard(fake, user)
    assert (up["text"], down["text"]) == ("👍 Helpful", "👎 Not helpful")
    await deliver(u.callback(user, up["callback_data"]))
    assert fake.calls_to("answerCallbackQuery")[-1].params["text"] == "Thanks for the feedback!"


# --------------------------------------------------------------------------- WeChat

WX_TOKEN = "healthbot_test_token"
WX_APPID = "wx0123456789abcdef"
WX_SECRET = "app-secret-for-tests"


class Late:
    """The real dispatcher, answering after ``delay_s`` (past the reply budget: the answer goes
    out through the customer-service API); records what it was asked."""

    def __init__(self, real: Any, delay_s: float) -> None:
        self.real, self.delay_s, self.texts = real, delay_s, []

    async def handle(self, inbound):
        self.texts.append(inbound.text)
        await asyncio.sleep(self.delay_s)
        return await self.real.handle(inbound)


def _safe_post(aes_key: str, xml: str) -> tuple[str, bytes]:
    """A safe-mode POST as WeChat sends it, encrypted and signed by wechatpy."""
    ts, nonce = str(int(time.time())), str(random.randint(10**8, 10**10))
    envelope = wx.parse_reply(WeChatCrypto(WX_TOKEN, aes_key, WX_APPID).encrypt_message(xml, nonce, ts))
    query = {"signature": wx.sign(WX_TOKEN, ts, nonce), "timestamp": ts, "nonce": nonce, "encrypt_type": "aes",
             "msg_signature": envelope["MsgSignature"]}
    body = f"<xml><ToUserName><![CDATA[{wx.ACCOUNT}]]></ToUserName><Encrypt><![CDATA[{envelope['Encrypt']}]]></Encrypt></xml>"
    return "/wechat?" + "&".join(f"{k}={v}" for k, v in query.items()), body.encode()


@pytest.fixture
async def wechat(dispatcher):
    """A service account in safe mode with the feedback menu on: (client, fake API, aes key, dispatcher)."""
    api = FakeWechatApi(WX_APPID, WX_SECRET)
    base = await api.start()
    cfg, aes_key = Config(), wx.new_aes_key()
    for key, value in {"token": WX_TOKEN, "appid": WX_APPID, "mode": "safe", "aes_key": aes_key,
                       "account_type": "service", "appsecret": WX_SECRET, "api_base": base, "reply_budget_s": 0.2,
                       "feedback_menu": True}.items():
        setattr(cfg.wechat, key, value)
    late = Late(dispatcher, delay_s=0.5)
    app = web.Application()
    setup_wechat(app, cfg, late, store=MemoryStore(), feedback=FeedbackBook(dispatcher.store))
    client = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    yield client, api, aes_key, late
    await client.close()
    await api.close()


async def _send(client: TestClient, aes_key: str, fields: dict[str, Any]) -> dict[str, str] | None:
    """POST one message; the decrypted passive reply's fields (None for ``success``)."""
    path, body = _safe_post(aes_key, wx.message_xml(fields))
    async with client.post(path, data=body) as resp:
        assert resp.status == 200
        text = await resp.text()
    if text == "success":
        return None
    env = wx.parse_reply(text)
    xml = WeChatCrypto(WX_TOKEN, aes_key, WX_APPID).decrypt_message(text, env["MsgSignature"], env["TimeStamp"],
                                                                      env["Nonce"])
    return wx.parse_reply(xml)


@pytest.mark.model
async def test_wechat_late_answer_gets_a_menu_and_a_click_is_a_vote(wechat, dispatcher):
    client, api, aes_key, late = wechat
    openid = f"oFB{uuid.uuid4().hex[:25]}"
    msgid = random.randint(10**18, 9 * 10**18)
    question = {"ToUserName": wx.ACCOUNT, "FromUserName": openid, "CreateTime": int(time.time()),
                "MsgType": "text", "Content": "失眠怎么调理", "MsgId": msgid}
    assert await _send(client, aes_key, question) is None  # not ready in 0.2 s: success, then the API
    await client.app[WECHAT_ADAPTER].drain(timeout_s=10)
    assert any("睡" in text for text in api.contents)
    (menu,) = api.menus_sent
    assert menu["head_content"] == "这个回答对您有帮助吗？"
    assert menu["list"] == [{"id": f"1{msgid}", "content": "👍 有帮助"}, {"id": f"2{msgid}", "content": "👎 没帮助"}]
    before = await read_votes(dispatcher.store, 3600)

    def click(n: int, line: dict[str, str]) -> dict[str, Any]:
        return {**question, "CreateTime": int(time.time()), "Content": line["content"], "MsgId": msgid + n,
                "bizmsgmenuid": line["id"]}

    reply = await _send(client, aes_key, click(1, menu["list"][1]))
    assert reply is not None and (reply["MsgType"], reply["Content"]) == ("text", "谢谢反馈！")
    reply = await _send(client, aes_key, click(2, menu["list"][0]))  # a second click: thanked, not counted
    assert reply is not None and reply["Content"] == "谢谢反馈！"
    votes = (await read_votes(dispatcher.store, 3600))[len(before):]
    assert [(v["vote"], v["channel"]) for v in votes] == [("not_helpful", "wechat")]
    assert late.texts == ["失眠怎么调理"]  # the clicks never reached the dispatcher as questions
    assert len(api.menus_sent) == 1


@pytest.mark.model
async def test_wechat_passive_answer_carries_no_menu(wechat):
    client, api, aes_key, late = wechat
    late.delay_s = 0.0
    reply = await _send(client, aes_key, {"ToUserName": wx.ACCOUNT, "FromUserName": f"oFB{uuid.uuid4().hex[:25]}",
                                          "CreateTime": int(time.time()), "MsgType": "text",
                                          "Content": "失眠怎么调理", "MsgId": random.randint(10**18, 9 * 10**18)})
    assert reply is not None and "睡" in reply["Content"]
    await client.app[WECHAT_ADAPTER].drain(timeout_s=5)
    assert api.menus_sent == []


class LongAnswer:
    """Answers every question with ``chars`` characters of advice on topic ``sleep.insomnia``."""

    def __init__(self, chars: int) -> None:
        self.text = "".join(f"第{i}条：规律作息，早睡早起，睡前少看手机。" for i in range(chars // 10))[:chars]

    async def handle(self, inbound):
        return Reply(self.text, Intent.ANSWER, "zh", topic="sleep.insomnia", confidence=0.9)


@pytest.mark.parametrize("chars,menu", [(900, True), (4000, False)])
async def test_wechat_long_answer_menu_follows_its_pages_within_the_quota(chars, menu, monkeypatch):
    """Page 1 passive, the rest through the API, then the menu; none when the pages took the
    user's five customer-service messages (the rest waits for "1")."""
    monkeypatch.setattr(wechat_late, "KF_FOLLOW_UP_DELAY_S", 0.0)
    api = FakeWechatApi(WX_APPID, WX_SECRET)
    base = await api.start()
    cfg = Config()
    for key, value in {"token": WX_TOKEN, "appid": WX_APPID, "account_type": "service", "appsecret": WX_SECRET,
                       "api_base": base, "feedback_menu": True}.items():
        setattr(cfg.wechat, key, value)
    app = web.Application()
    setup_wechat(app, cfg, LongAnswer(chars), store=MemoryStore(), feedback=FeedbackBook(MemoryStore()))
    client = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    try:
        path, body = wx.WechatSigner(token=WX_TOKEN, appid=WX_APPID).plain_post(
            wx.text_xml("失眠怎么调理", msg_id=1234567890123456))
        async with client.post(path, data=body) as resp:
            assert "第0条" in wx.parse_reply(await resp.text())["Content"]
        await client.app[WECHAT_ADAPTER].drain(timeout_s=5)
        assert len(api.contents) == (1 if menu else wc.KF_MESSAGES_PER_USER_MESSAGE)  # pages 2.. by the API
        assert [m["list"][0]["id"] for m in api.menus_sent] == (["11234567890123456"] if menu else [])
        assert api.sent[-1]["msgtype"] == ("msgmenu" if menu else "text")  # the menu comes last
    finally:
        await client.close()
        await api.close()
