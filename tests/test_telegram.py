"""Telegram adapter: python-telegram-bot's real client against a fake Bot API on loopback,
and real HTTP to the aiohttp webhook on loopback.

Most tests use :class:`ScriptedDispatcher`, a stand-in that deduplicates and relays
during handoff like the real dispatcher (bot/dispatcher.py) and answers predictably;
the last tests run the real dispatcher (real model) end to end.
"""

from __future__ import annotations

import asyncio
import datetime as dtm
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from telegram.error import RetryAfter

from adapters.telegram import constants as tc
from adapters.telegram import (SendPolicy, TelegramAdapter, parse_update, redact, render_html,
                               retry_after_seconds, setup_telegram, split_text, use_polling, utf16_len,
                               webhook_admin)
from bot.config import REPO_ROOT, ConfigError, load_config
from bot.dedup import OnceCache
from bot.feedback import FeedbackBook
from bot.handoff import HandoffManager
from bot.types import Inbound, Intent, MessageKind, Reply

try:  # tests/ is a package or a rootdir-relative folder, depending on who adds __init__.py
    from tests.fake_telegram import FakeBotAPI, Updates
except ImportError:  # pragma: no cover
    from fake_telegram import FakeBotAPI, Updates  # type: ignore[no-redef]

TOKEN = "123456:TEST-token"
SECRET = "healthbot_Webhook-secret_0123"
AGENTS = -1001234567890
AGENT = 777001  # an agent's user id in the agents' group
GREETING = {"zh": "您好！我是健康小助手。【提示】内容仅供科普参考，不能代替医生。",
            "en": "Hello! I am the health assistant. Note: general information, not medical advice."}


class ScriptedDispatcher:
    """Deduplicates on (channel, message_id) like the real dispatcher (bot.dedup.OnceCache),
    records transcript turns and relays to agents during a handoff like it; answers
    ``"答：<text>"`` (``"Answer: <text>"`` when ``Inbound.lang`` is en), or
    :attr:`replies[text]`; as an offer of :attr:`offers[text]` (a no_answer) when there is one.

    Attributes:
        calls: every Inbound handed in (retries included).
        computed: computations (one per distinct message).
        delays: text → seconds to sleep before answering it.
        fail: texts whose computation raises.
        offers: text → the topic ids its reply offers ("您是想了解「…」吗？", ``Reply.suggested``).
    """

    def __init__(self, handoff: HandoffManager):
        self.handoff = handoff
        self.once: OnceCache[Reply] = OnceCache()
        self.calls: list[Inbound] = []
        self.computed = 0
        self.replies: dict[str, str] = {}
        self.delays: dict[str, float] = {}
        self.fail: set[str] = set()
        self.offers: dict[str, tuple[str, ...]] = {}

    async def handle(self, inbound: Inbound) -> Reply:
        self.calls.append(inbound)
        return await self.once.run((inbound.channel, inbound.message_id), lambda: self._compute(inbound))

    async def _compute(self, inbound: Inbound) -> Reply:
        self.computed += 1
        lang = inbound.lang or "zh"
        await asyncio.sleep(self.delays.get(inbound.text, 0.0))
        if inbound.text in self.fail:
            raise RuntimeError("dispatcher exploded")
        if inbound.kind is MessageKind.SUBSCRIBE:
            return Reply(GREETING[lang], Intent.GREETING, lang)
        if inbound.kind is MessageKind.EVENT:
            return Reply("", Intent.SYSTEM, lang)
        if inbound.kind is MessageKind.UNSUPPORTED:
            return Reply(f"暂时看不懂这类消息（{inbound.raw.get('type')}），请用文字描述您的问题。", Intent.SYSTEM, lang)
        session = await self.handoff.active(inbound.channel, inbound.user_id)
        if session is not None:
            await self.handoff.user_message(session, inbound.text)
            return Reply("", Intent.HANDOFF, lang, handoff=True)
        text = self.replies.get(inbound.text) or (("Answer: " if lang == "en" else "答：") + inbound.text)
        kept = await self.handoff.store.get(self.handoff.turns_key(inbound.channel, inbound.user_id))
        await self.handoff.store.set(*self.handoff.with_turns(inbound.channel, inbound.user_id, kept,
                                                              ("user", inbound.text), ("bot", text)))
        if inbound.text in self.offers:
            return Reply(text, Intent.NO_ANSWER, lang, suggested=self.offers[inbound.text])
        return Reply(text, Intent.ANSWER, lang)


@dataclass
class Harness:
    fake: FakeBotAPI
    adapter: TelegramAdapter
    dispatcher: Any
    handoff: HandoffManager
    server: TestServer
    http: aiohttp.ClientSession
    sleeps: list[float]
    u: Updates

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}{tc.WEBHOOK_PATH}"

    async def post(self, update: Any, secret: str | None = SECRET, raw: bytes | None = None) -> tuple[int, float]:
        """POST one delivery as Telegram does; (HTTP status, seconds until the answer)."""
        headers = {"Content-Type": "application/json"}
        if secret is not None:
            headers[tc.SECRET_HEADER] = secret
        started = time.perf_counter()
        async with self.http.post(self.url, json=update if raw is None else None, data=raw,
                                  headers=headers) as resp:
            await resp.read()
            return resp.status, time.perf_counter() - started

    async def deliver(self, *updates: dict[str, Any]) -> None:
        """POST each update (200 expected) and wait until all are processed."""
        for update in updates:
            status, _ = await self.post(update)
            assert status == 200
        await self.adapter.idle()

    def texts(self, chat_id: int, thread_id: int | None = None) -> list[str]:
        return self.fake.texts_to(chat_id, thread_id)


async def _harness(dispatcher_factory=None, agent_chat: int = AGENTS, api_base: str | None = None,
                   polling: bool = False, feedback: FeedbackBook | None = None):
    fake = await FakeBotAPI(token=TOKEN).start()
    cfg = load_config(env={
        "HEALTHBOT_TELEGRAM_TOKEN": TOKEN, "HEALTHBOT_TELEGRAM_SECRET": SECRET,
        "HEALTHBOT_TELEGRAM_API_BASE": api_base or fake.api_base,
        "HEALTHBOT_TELEGRAM_AGENT_CHAT": str(agent_chat)})
    handoff = HandoffManager()
    dispatcher = (dispatcher_factory or ScriptedDispatcher)(handoff)
    sleeps: list[float] = []

    async def short_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        await asyncio.sleep(min(seconds, 0.01))

    app = web.Application()
    adapter = setup_telegram(app, cfg, dispatcher, getattr(dispatcher, "handoff", handoff),
                             policy=SendPolicy(sleep=short_sleep), feedback=feedback)
    if polling:
        use_polling(app)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    http = aiohttp.ClientSession()
    return Harness(fake, adapter, dispatcher, getattr(dispatcher, "handoff", handoff), server, http, sleeps,
                   Updates(bot_id=fake.bot_user["id"], bot_username=fake.bot_user["username"]))


async def _close(h: Harness) -> None:
    await h.http.close()
    await h.server.close()
    await h.fake.close()


@pytest.fixture
async def tg():
    h = await _harness()
    yield h
    await _close(h)


USER = 42424242
OTHER = 51515151
GROUP = -1009876543210


# --------------------------------------------------------------------------- webhook


async def test_wrong_or_missing_secret_token_is_403(tg: Harness):
    update = tg.u.text(USER, "失眠怎么办")
    assert (await tg.post(update, secret="wrong"))[0] == 403
    assert (await tg.post(update, secret=None))[0] == 403
    assert (await tg.post(update, secret=SECRET[:-1]))[0] == 403
    await tg.adapter.idle()
    assert tg.dispatcher.calls == []
    assert tg.fake.calls_to("sendMessage") == []


async def test_matching_secret_is_answered_200_before_the_reply_is_computed(tg: Harness):
    tg.dispatcher.delays["慢问题"] = 1.0
    status, elapsed = await tg.post(tg.u.text(USER, "慢问题"))
    assert status == 200
    assert elapsed < 0.5, f"webhook answered after {elapsed:.3f} s; it must not wait for the dispatcher"
    assert tg.texts(USER) == []
    await tg.fake.wait_for(lambda: tg.texts(USER), timeout=5)
    assert tg.texts(USER) == ["答：慢问题"]


async def test_malformed_body_is_400(tg: Harness):
    assert (await tg.post(None, raw=b"{not json"))[0] == 400
    assert (await tg.post(None, raw=b"\xff\xfe"))[0] == 400
    assert (await tg.post([1, 2]))[0] == 400
    assert (await tg.post({"message": {}}))[0] == 400
    assert (await tg.post({"update_id": "7"}))[0] == 400
    assert (await tg.post({"update_id": True}))[0] == 400


async def test_update_the_client_cannot_parse_is_acknowledged_and_dropped(tg: Harness):
    # A 4xx/5xx would make Telegram re-send it for ever; it is logged and answered 200.
    assert (await tg.post({"update_id": 91, "message": {"text": "no date, no chat"}}))[0] == 200
    assert (await tg.post({"update_id": 92, "some_future_update": {"x": 1}}))[0] == 200
    await tg.adapter.idle()
    assert tg.dispatcher.calls == []
    await tg.deliver(tg.u.text(USER, "还在吗"))
    assert tg.texts(USER) == ["答：还在吗"]


async def test_a_dispatcher_error_never_reaches_the_webhook(tg: Harness):
    tg.dispatcher.fail.add("炸了")
    status, _ = await tg.post(tg.u.text(USER, "炸了"))
    assert status == 200
    await tg.deliver(tg.u.text(USER, "下一个问题"))
    assert tg.texts(USER) == ["答：下一个问题"]


async def test_webhook_answers_503_until_the_bot_api_is_reachable():
    # Nothing listens on this port: getMe fails at start-up, the server still starts.
    h = await _harness(api_base="http://127.0.0.1:9/bot")
    try:
        status, _ = await h.post(h.u.text(USER, "在吗"))
        assert status == 503
    finally:
        await _close(h)


async def test_start_up_retries_until_the_bot_api_answers():
    fake = FakeBotAPI(token=TOKEN)
    fake.fail("getMe", 502, "Bad Gateway", times=1)  # python-telegram-bot retries nothing at start-up
    await fake.start()
    cfg = load_config(env={"HEALTHBOT_TELEGRAM_TOKEN": TOKEN, "HEALTHBOT_TELEGRAM_SECRET": SECRET,
                           "HEALTHBOT_TELEGRAM_API_BASE": fake.api_base})
    handoff = HandoffManager()
    dispatcher = ScriptedDispatcher(handoff)
    waits: list[float] = []

    async def short_sleep(seconds: float) -> None:
        waits.append(seconds)
        await asyncio.sleep(0.01)

    app = web.Application()
    adapter = setup_telegram(app, cfg, dispatcher, handoff, policy=SendPolicy(sleep=short_sleep))
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    h = Harness(fake, adapter, dispatcher, handoff, server, aiohttp.ClientSession(), waits, Updates())
    try:
        await fake.wait_for(lambda: len(fake.calls_to("getMe")) >= 2)
        await fake.wait_for(lambda: adapter.accepting)
        await h.deliver(h.u.text(USER, "连上了吗"))
        assert h.texts(USER) == ["答：连上了吗"] and waits[0] == 1.0
    finally:
        await _close(h)


# --------------------------------------------------------------------------- messages


async def test_text_is_sent_as_html_with_lt_and_amp_escaped(tg: Harness):
    question = "<b>失眠</b> & 多梦怎么办？"
    tg.dispatcher.replies[question] = "注意 <script> 和 a < b & c > d；<b>不是加粗</b>"
    await tg.deliver(tg.u.text(USER, question))
    assert tg.dispatcher.calls[0].text == question  # the question reaches the core unchanged
    (call,) = tg.fake.calls_to("sendMessage", chat_id=USER)
    assert call.params["parse_mode"] == "HTML"
    assert call.params["text"] == ("注意 &lt;script&gt; 和 a &lt; b &amp; c &gt; d；"
                                   "&lt;b&gt;不是加粗&lt;/b&gt;")
    assert tg.texts(USER) == ["注意 <script> 和 a < b & c > d；<b>不是加粗</b>"]
    assert "MarkdownV2" not in str([c.params for c in tg.fake.calls])


async def test_the_same_update_id_twice_is_answered_once(tg: Harness):
    update = tg.u.text(USER, "手脚冰凉怎么办")
    tg.dispatcher.delays["手脚冰凉怎么办"] = 0.2
    statuses = await asyncio.gather(tg.post(update), tg.post(update))  # a re-delivery while still working
    assert [s for s, _ in statuses] == [200, 200]
    await tg.deliver(update)  # and one after the answer
    assert tg.texts(USER) == ["答：手脚冰凉怎么办"]
    assert tg.dispatcher.computed == 1
    assert tg.adapter.stats["duplicates"] == 2


async def test_an_edited_message_is_not_answered_again(tg: Harness):
    original = tg.u.text(USER, "头痛怎么办")
    message_id = original["message"]["message_id"]
    await tg.deliver(original, tg.u.edited(USER, "偏头痛怎么办", message_id))
    assert tg.texts(USER) == ["答：头痛怎么办"]
    edit = tg.dispatcher.calls[-1]
    assert edit.kind is MessageKind.EVENT
    assert edit.raw["type"] == "edited_message" and edit.raw["content_type"] == "text"
    assert edit.message_id.startswith(f"{USER}:{message_id}:edit:")
    assert tg.adapter.stats["errors"] == 0


async def test_sticker_photo_and_voice_get_a_helpful_text(tg: Harness):
    await tg.deliver(tg.u.sticker(USER), tg.u.photo(USER, caption="这个皮疹是什么"), tg.u.voice(USER))
    kinds = [(c.kind, c.raw["type"]) for c in tg.dispatcher.calls]
    assert kinds == [(MessageKind.UNSUPPORTED, "sticker"), (MessageKind.UNSUPPORTED, "photo"),
                     (MessageKind.UNSUPPORTED, "voice")]
    assert tg.dispatcher.calls[1].raw["caption"] == "这个皮疹是什么"
    assert tg.texts(USER) == [f"暂时看不懂这类消息（{t}），请用文字描述您的问题。" for t in ("sticker", "photo", "voice")]


async def test_updates_without_a_message_never_crash(tg: Harness):
    u = tg.u
    service = u.message(USER, USER, None, new_chat_title="x")
    callback = u.callback(USER, "something-else")
    from_bot = u.text(USER, "hi")
    from_bot["message"]["from"]["is_bot"] = True
    channel_post = {"update_id": 95, "channel_post": {"message_id": 3, "date": int(time.time()),
                                                      "chat": {"id": -100555, "type": "channel", "title": "c"},
                                                      "text": "news"}}
    await tg.deliver(service, callback, from_bot, channel_post, u.my_chat_member(OTHER, "member"))
    assert tg.dispatcher.calls == []
    assert tg.fake.calls_to("sendMessage") == []
    assert tg.adapter.stats["errors"] == 0


async def test_group_message_is_answered_only_when_addressed_to_the_bot(tg: Harness):
    await tg.deliver(tg.u.group_text(GROUP, USER, "大家好，今天吃什么"))
    assert tg.dispatcher.calls == [] and tg.texts(GROUP) == []

    mention = tg.u.group_text(GROUP, USER, "失眠怎么办", mention=True)
    await tg.deliver(mention)
    assert tg.dispatcher.calls[-1].text == "失眠怎么办"  # without the @mention
    assert tg.texts(GROUP) == ["答：失眠怎么办"]
    (call,) = tg.fake.calls_to("sendMessage", chat_id=GROUP)
    assert call.params["reply_parameters"]["message_id"] == mention["message"]["message_id"]

    await tg.deliver(tg.u.group_text(GROUP, USER, "那晚上呢", reply_to_bot=True))
    assert tg.texts(GROUP) == ["答：失眠怎么办", "答：那晚上呢"]

    await tg.deliver(tg.u.message(GROUP, USER, "/help@some_other_bot", chat_type="supergroup"),
                     tg.u.message(GROUP, USER, "/unknown", chat_type="supergroup"))
    assert len(tg.texts(GROUP)) == 2


async def test_messages_of_one_chat_are_answered_in_order_other_chats_are_not_held_up(tg: Harness):
    tg.dispatcher.delays["第一个问题"] = 0.4
    await tg.post(tg.u.text(USER, "第一个问题"))
    await tg.post(tg.u.text(USER, "第二个问题"))
    await tg.post(tg.u.text(OTHER, "别人的问题"))
    await tg.fake.wait_for(lambda: tg.texts(OTHER))
    assert tg.texts(USER) == []  # OTHER was answered while USER's first question was still running
    await tg.adapter.idle()
    assert tg.texts(USER) == ["答：第一个问题", "答：第二个问题"]


# --------------------------------------------------------------------------- commands


async def test_start_sends_a_subscribe_and_the_greeting(tg: Harness):
    await tg.deliver(tg.u.command(USER, "/start"))
    (inbound,) = tg.dispatcher.calls
    assert inbound.kind is MessageKind.SUBSCRIBE and inbound.channel == "telegram"
    assert inbound.lang == "zh"  # from language_code zh-hans
    assert tg.texts(USER) == [GREETING["zh"]]


async def test_help_lists_the_commands_and_the_emergency_number(tg: Harness):
    await tg.deliver(tg.u.command(USER, "/help"))
    (text,) = tg.texts(USER)
    for command in ("/start", "/help", "/human", "/stop", "/lang"):
        assert command in text
    assert "120" in text and "不能代替医生" in text
    await tg.deliver(tg.u.command(OTHER, "/help", language_code="en"))
    assert "In an emergency call 112 / 911" in tg.texts(OTHER)[0]


async def test_lang_en_then_a_question_is_answered_in_english(tg: Harness):
    await tg.deliver(tg.u.command(USER, "/lang en"), tg.u.text(USER, "手脚冰凉怎么办"))
    assert tg.dispatcher.calls[-1].lang == "en"
    assert tg.texts(USER) == ["OK, I will answer in English from now on.", "Answer: 手脚冰凉怎么办"]
    await tg.deliver(tg.u.command(USER, "/lang zh"), tg.u.text(USER, "失眠"))
    assert tg.dispatcher.calls[-1].lang == "zh"
    assert tg.texts(USER)[-1] == "答：失眠"


async def test_lang_without_argument_offers_buttons(tg: Harness):
    await tg.deliver(tg.u.command(USER, "/lang"))
    (call,) = tg.fake.calls_to("sendMessage", chat_id=USER)
    buttons = call.params["reply_markup"]["inline_keyboard"][0]
    assert [b["callback_data"] for b in buttons] == ["lang:zh", "lang:en"]
    await tg.deliver(tg.u.callback(USER, "lang:en"), tg.u.text(USER, "头痛"))
    assert tg.fake.calls_to("answerCallbackQuery")
    assert tg.dispatcher.calls[-1].lang == "en"
    assert tg.texts(USER)[-1] == "Answer: 头痛"


async def test_question_without_a_lang_choice_has_no_lang(tg: Harness):
    await tg.deliver(tg.u.text(USER, "how to sleep better", language_code="en"))
    assert tg.dispatcher.calls[0].lang is None  # the dispatcher detects it from the text


async def test_unknown_command_gets_a_hint_not_an_answer(tg: Harness):
    await tg.deliver(tg.u.command(USER, "/foo"))
    assert tg.dispatcher.calls == []
    assert tg.texts(USER) == ["没有这个命令。发送 /help 查看可用命令，或直接输入您的问题。"]


# --------------------------------------------------------------------------- "did you mean …?" offers

YES_NO = {"keyboard": [[{"text": "是"}, {"text": "不是"}]], "one_time_keyboard": True, "resize_keyboard": True}


async def test_an_offer_carries_yes_no_reply_buttons_on_its_last_part_only(tg: Harness):
    tg.dispatcher.replies["长"] = "多喝温水，注意保暖。" * 500  # two parts
    tg.dispatcher.offers.update({"长": ("sleep.insomnia",), "失眠怎么办": ("sleep.insomnia",), "water": ("nutri.water",),
                                 "两个": ("sleep.insomnia", "sleep.early_waking")})
    await tg.deliver(tg.u.text(USER, "长"), tg.u.text(USER, "好的"))
    first, last, answer = tg.fake.calls_to("sendMessage", chat_id=USER)
    assert "reply_markup" not in first.params and last.params["reply_markup"] == YES_NO
    assert "reply_markup" not in answer.params  # not an offer: no buttons
    await tg.deliver(tg.u.text(USER, "两个"))  # a list of topics: their numbers, then the no
    assert tg.fake.calls_to("sendMessage", chat_id=USER)[-1].params["reply_markup"]["keyboard"] == \
        [[{"text": "1"}, {"text": "2"}, {"text": "不是"}]]
    await tg.deliver(tg.u.command(OTHER, "/lang en"), tg.u.text(OTHER, "water"))
    assert tg.fake.calls_to("sendMessage", chat_id=OTHER)[-1].params["reply_markup"]["keyboard"] == \
        [[{"text": "Yes"}, {"text": "No"}]]
    # In a group a tap would be neither a mention nor a reply: the bot would not hear it.
    await tg.deliver(tg.u.group_text(GROUP, USER, "失眠怎么办", mention=True))
    (offer,) = tg.fake.calls_to("sendMessage", chat_id=GROUP)
    assert "reply_markup" not in offer.params


# --------------------------------------------------------------------------- output limits and errors


async def test_a_5000_character_answer_arrives_as_two_ordered_messages(tg: Harness):
    sentence = "多喝温水，注意保暖。"  # 10 characters
    answer = sentence * 500
    tg.dispatcher.replies["长"] = answer
    await tg.deliver(tg.u.text(USER, "长"))
    parts = tg.texts(USER)
    assert len(parts) == 2
    assert all(len(p) <= tc.MAX_TEXT_LENGTH for p in parts)
    assert all(p.endswith("。") for p in parts)  # cut at a sentence end
    assert "".join(parts) == answer


async def test_a_10000_character_answer_arrives_in_order_each_part_within_4096(tg: Harness):
    paragraphs = [f"第{i}段：" + "饮食清淡，少油少盐，规律作息。" * 12 for i in range(1, 60)]
    answer = "\n\n".join(paragraphs)[:10_000]
    tg.dispatcher.replies["很长"] = answer
    await tg.deliver(tg.u.text(USER, "很长"))
    parts = tg.texts(USER)
    assert len(parts) == 3
    assert all(utf16_len(p) <= tc.MAX_TEXT_LENGTH for p in parts)
    assert "".join(parts).replace("\n", "") == answer.replace("\n", "")
    calls = tg.fake.calls_to("sendMessage", chat_id=USER)
    assert [c.at for c in calls] == sorted(c.at for c in calls)


async def test_429_retry_after_is_waited_out_and_delivered_once(tg: Harness):
    tg.fake.fail("sendMessage", 429, "Too Many Requests: retry after 3", retry_after=3,
                 match=lambda p: p["chat_id"] == USER)
    await tg.deliver(tg.u.text(USER, "快问题"))
    attempts = tg.fake.calls_to("sendMessage", chat_id=USER)
    assert len(attempts) == 2
    assert tg.sleeps == [3.0]  # exactly the server's retry_after
    assert tg.texts(USER) == ["答：快问题"]
    assert tg.adapter.sender.stats["flood_waits"] == 1


async def test_retry_after_beyond_the_bound_is_not_waited(tg: Harness):
    tg.fake.fail("sendMessage", 429, "Too Many Requests: retry after 3600", retry_after=3600)
    await tg.deliver(tg.u.text(USER, "问题"))
    assert len(tg.fake.calls_to("sendMessage", chat_id=USER)) == 1
    assert tg.sleeps == []


def test_retry_after_is_read_as_int_or_timedelta(monkeypatch):
    assert retry_after_seconds(RetryAfter(7)) == 7.0
    assert retry_after_seconds(RetryAfter(dtm.timedelta(seconds=2.5))) == 2.5
    monkeypatch.setenv("PTB_TIMEDELTA", "true")  # v22 then returns a timedelta
    assert retry_after_seconds(RetryAfter(7)) == 7.0


async def test_403_forbidden_is_recorded_and_not_retried(tg: Harness):
    tg.fake.block(USER)
    await tg.deliver(tg.u.text(USER, "问题"))
    assert len(tg.fake.calls_to("sendMessage", chat_id=USER)) == 1
    assert USER in tg.adapter.sender.blocked
    assert tg.sleeps == []
    # The user unblocks and writes again: answered.
    tg.fake.blocked.clear()
    await tg.deliver(tg.u.text(USER, "又来了"))
    assert USER not in tg.adapter.sender.blocked
    assert tg.texts(USER) == ["答：又来了"]


async def test_blocking_the_bot_is_recorded_from_my_chat_member(tg: Harness):
    await tg.deliver(tg.u.my_chat_member(USER, "kicked"))
    assert USER in tg.adapter.sender.blocked
    await tg.deliver(tg.u.my_chat_member(USER, "member"))
    assert USER not in tg.adapter.sender.blocked


async def test_transient_network_errors_are_retried_with_backoff(tg: Harness):
    tg.fake.fail("sendMessage", 502, "Bad Gateway", times=2)
    await tg.deliver(tg.u.text(USER, "网络"))
    assert len(tg.fake.calls_to("sendMessage", chat_id=USER)) == 3
    assert tg.texts(USER) == ["答：网络"]
    first, second = tg.sleeps
    assert 0.25 <= first <= 0.75 and 0.5 <= second <= 1.5  # 0.5 s doubled, ±50 % jitter


async def test_network_errors_are_retried_a_bounded_number_of_times(tg: Harness):
    tg.fake.fail("sendMessage", 502, "Bad Gateway", times=100)
    await tg.deliver(tg.u.text(USER, "网络"))
    assert len(tg.fake.calls_to("sendMessage", chat_id=USER)) == tc.SEND_MAX_ATTEMPTS
    assert len(tg.sleeps) == tc.SEND_MAX_ATTEMPTS - 1


async def test_message_is_too_long_from_the_server_is_split_again(tg: Harness):
    answer = "补充水分。" * 600  # 3000 characters: one part for us
    tg.dispatcher.replies["水"] = answer
    tg.fake.fail("sendMessage", 400, "Bad Request: message is too long")
    await tg.deliver(tg.u.text(USER, "水"))
    parts = tg.texts(USER)
    assert len(parts) == 2 and "".join(parts) == answer


async def test_other_bad_requests_are_not_retried(tg: Harness):
    tg.fake.fail("sendMessage", 400, "Bad Request: chat not found")
    await tg.deliver(tg.u.text(USER, "问题"))
    assert len(tg.fake.calls_to("sendMessage", chat_id=USER)) == 1
    assert tg.sleeps == []


# --------------------------------------------------------------------------- handoff to the agents' group


def _topic_calls(h: Harness) -> list[Any]:
    return h.fake.calls_to("createForumTopic", chat_id=AGENTS)


async def _start_handoff(h: Harness, user: int = USER) -> int:
    await h.deliver(h.u.text(user, "最近总失眠"), h.u.command(user, "/human"))
    (topic,) = _topic_calls(h)[-1:]
    thread = max(h.fake.topics)
    assert h.fake.topics[thread]["name"] == topic.params["name"]
    return thread


async def test_handoff_round_trip_user_topic_agent_user_done(tg: Harness):
    thread = await _start_handoff(tg)
    # /human: a topic in the agents' group, opened with the transcript; the user is told.
    assert tg.fake.topics[thread]["name"] == f"TG …{str(USER)[-4:]} · 用户请求"
    (opening,) = tg.texts(AGENTS, thread)
    assert "user: 最近总失眠" in opening and "bot: 答：最近总失眠" in opening and "/done" in opening
    assert tg.texts(USER)[-1].startswith("已为您转接人工客服")
    assert await tg.handoff.active("telegram", str(USER)) is not None

    # The user's next message goes to the topic (personal data masked), not to the bot.
    await tg.deliver(tg.u.text(USER, "我的电话是13812345678，晚上总醒"))
    forwarded = tg.texts(AGENTS, thread)[-1]
    assert "晚上总醒" in forwarded and "13812345678" not in forwarded
    assert tg.texts(USER)[-1].startswith("已为您转接人工客服")  # the bot stayed silent

    # An agent's message in the topic reaches the user.
    await tg.deliver(tg.u.topic_message(AGENTS, AGENT, thread, "您好，睡前别看手机 <试试> & 泡脚"))
    assert tg.texts(USER)[-1] == "人工客服：\n您好，睡前别看手机 <试试> & 泡脚"

    # /done ends it: the topic is closed and the user told.
    await tg.deliver(tg.u.topic_message(AGENTS, AGENT, thread, "/done"))
    assert await tg.handoff.active("telegram", str(USER)) is None
    assert tg.fake.calls_to("closeForumTopic", chat_id=AGENTS, message_thread_id=thread)
    assert tg.texts(USER)[-1].startswith("人工客服已结束本次对话")

    # Back to the bot.
    await tg.deliver(tg.u.text(USER, "那吃什么好"))
    assert tg.texts(USER)[-1] == "答：那吃什么好"


async def test_agent_closing_the_topic_ends_the_handoff(tg: Harness):
    thread = await _start_handoff(tg)
    tg.fake.topics[thread]["closed"] = True
    await tg.deliver(tg.u.topic_closed(AGENTS, AGENT, thread))
    assert await tg.handoff.active("telegram", str(USER)) is None
    assert tg.texts(USER)[-1].startswith("人工客服已结束本次对话")
    assert tg.fake.calls_to("closeForumTopic") == []  # already closed by the agent
    assert tg.adapter.stats["errors"] == 0


async def test_a_deleted_topic_is_recreated(tg: Harness):
    thread = await _start_handoff(tg)
    tg.fake.delete_topic(thread)
    await tg.deliver(tg.u.text(USER, "还在吗，我又醒了"))
    assert len(_topic_calls(tg)) == 2
    new_thread = max(tg.fake.topics)
    assert new_thread != thread
    (opening,) = tg.texts(AGENTS, new_thread)
    assert "已被删除" in opening and "user: 最近总失眠" in opening and "还在吗，我又醒了" in opening
    # The agent answers in the new topic.
    await tg.deliver(tg.u.topic_message(AGENTS, AGENT, new_thread, "在的"))
    assert tg.texts(USER)[-1] == "人工客服：\n在的"


async def test_stop_ends_the_handoff_and_forgets_the_session(tg: Harness):
    thread = await _start_handoff(tg)
    await tg.deliver(tg.u.command(USER, "/lang en"), tg.u.command(USER, "/stop"))
    assert await tg.handoff.active("telegram", str(USER)) is None
    assert tg.fake.calls_to("closeForumTopic", chat_id=AGENTS, message_thread_id=thread)
    assert "ended by the user" in tg.texts(AGENTS, thread)[-1]
    assert tg.texts(USER)[-1] == ("The conversation with the agent has ended and this session is forgotten. "
                                  "Ask me anything any time.")
    assert str(USER) not in tg.adapter.langs
    # A new handoff starts a new topic with no old turns.
    await tg.deliver(tg.u.command(USER, "/human"))
    new_thread = max(tg.fake.topics)
    assert new_thread != thread
    assert "最近总失眠" not in tg.texts(AGENTS, new_thread)[0]


async def test_a_second_handoff_reopens_the_users_topic(tg: Harness):
    thread = await _start_handoff(tg)
    await tg.deliver(tg.u.topic_message(AGENTS, AGENT, thread, "/done"))
    await tg.deliver(tg.u.command(USER, "/human"))
    assert len(_topic_calls(tg)) == 1
    assert tg.fake.calls_to("reopenForumTopic", message_thread_id=thread)
    assert (await tg.handoff.active("telegram", str(USER))).relay_ref == thread


async def test_human_twice_says_already_connected(tg: Harness):
    await _start_handoff(tg)
    await tg.deliver(tg.u.command(USER, "/human"))
    assert tg.texts(USER)[-1].startswith("您已在人工客服对话中")
    assert len(_topic_calls(tg)) == 1


async def test_human_in_a_group_asks_for_a_private_chat(tg: Harness):
    await tg.deliver(tg.u.command(USER, "/human", chat_id=GROUP, chat_type="supergroup"))
    assert await tg.handoff.active("telegram", str(USER)) is None
    assert tg.texts(GROUP) == ["为保护您的隐私，请私聊我并发送 /human 转人工客服。"]


async def test_agent_message_to_a_user_who_blocked_the_bot_tells_the_agents(tg: Harness):
    thread = await _start_handoff(tg)
    tg.fake.block(USER)
    await tg.deliver(tg.u.topic_message(AGENTS, AGENT, thread, "您好"))
    assert "屏蔽" in tg.texts(AGENTS, thread)[-1]
    assert USER in tg.adapter.sender.blocked


async def test_agent_photo_is_copied_to_the_user(tg: Harness):
    thread = await _start_handoff(tg)
    photo = [{"file_id": "AgAC", "file_unique_id": "AQAD", "width": 90, "height": 90}]
    await tg.deliver(tg.u.topic_message(AGENTS, AGENT, thread, None, photo=photo))
    (copy,) = tg.fake.calls_to("copyMessage")
    assert copy.params["chat_id"] == USER and copy.params["from_chat_id"] == AGENTS


async def test_agents_group_chatter_is_never_answered_as_a_question(tg: Harness):
    thread = await _start_handoff(tg)
    before = len(tg.dispatcher.calls)
    other_topic = 999  # made by an agent by hand, or before the bot restarted
    tg.fake.topics[other_topic] = {"name": "notes", "closed": False, "deleted": False, "chat_id": AGENTS}
    await tg.deliver(tg.u.message(AGENTS, AGENT, "大家辛苦了", chat_type="supergroup"),
                     tg.u.topic_message(AGENTS, AGENT, other_topic, "这个话题是谁的"),
                     tg.u.topic_message(AGENTS, AGENT, thread, "/start"))
    assert len(tg.dispatcher.calls) == before
    assert "未关联" in tg.texts(AGENTS, other_topic)[-1]
    assert tg.texts(AGENTS, None)[-1] == tg.texts(AGENTS, other_topic)[-1]  # nothing said in General


# --------------------------------------------------------------------------- polling, set-webhook, units


async def test_polling_delivers_updates_from_get_updates():
    h = await _harness(polling=True)
    try:
        assert h.fake.calls_to("deleteWebhook")  # polling removes a registered webhook
        h.fake.push_update(h.u.text(USER, "轮询的问题"))
        await h.fake.wait_for(lambda: h.texts(USER))
        assert h.texts(USER) == ["答：轮询的问题"]
    finally:
        await _close(h)


async def test_set_webhook_registers_the_url_and_the_secret():
    fake = await FakeBotAPI(token=TOKEN).start()
    try:
        cfg = load_config(env={"HEALTHBOT_TELEGRAM_TOKEN": TOKEN, "HEALTHBOT_TELEGRAM_SECRET": SECRET,
                               "HEALTHBOT_TELEGRAM_API_BASE": fake.api_base,
                               "HEALTHBOT_TELEGRAM_WEBHOOK_URL": "https://bot.example.org/telegram"}).telegram
        info = await webhook_admin(cfg, "set-webhook")
        assert fake.webhook == {"url": "https://bot.example.org/telegram", "secret_token": SECRET,
                                "allowed_updates": list(tc.ALLOWED_UPDATES), "max_connections": 40}
        assert info["url"] == "https://bot.example.org/telegram"
        cfg.webhook_url = "http://bot.example.org/telegram"
        with pytest.raises(ConfigError, match="https"):
            await webhook_admin(cfg, "set-webhook")
    finally:
        await fake.close()


def test_a_secret_telegram_would_refuse_is_a_config_error():
    cfg = load_config(env={"HEALTHBOT_TELEGRAM_TOKEN": TOKEN, "HEALTHBOT_TELEGRAM_SECRET": "has space"})
    with pytest.raises(ConfigError, match="telegram.secret"):
        TelegramAdapter(cfg, ScriptedDispatcher(HandoffManager()), HandoffManager())


def test_split_text_prefers_sentence_ends_and_counts_utf16():
    assert split_text("") == [] and split_text("  \n ") == []
    assert split_text("短。") == ["短。"]
    text = "第一句话。第二句话！第三句话？"
    assert split_text(text, limit=12) == ["第一句话。第二句话！", "第三句话？"]
    emoji = "😀" * 10  # 20 UTF-16 units
    parts = split_text(emoji, limit=7)
    assert all(utf16_len(p) <= 7 for p in parts) and "".join(parts) == emoji
    assert split_text("a" * 10, limit=4) == ["aaaa", "aaaa", "aa"]  # hard cut without boundaries
    words = "one two three four five six"
    assert all(len(p) <= 10 for p in split_text(words, limit=10))
    assert " ".join(split_text(words, limit=10)) == words


def test_the_token_stays_out_of_logs(tg: Harness):
    # Bot API URLs carry the token; httpx would log each one at INFO.
    assert logging.getLogger("httpx").getEffectiveLevel() >= logging.WARNING
    assert redact(f"The token `{TOKEN}` was rejected", TOKEN) == "The token `<token>` was rejected"


def test_render_html_escapes_markup():
    assert render_html('<b>&"x"') == '&lt;b&gt;&amp;"x"'


def test_parse_update_without_a_message_is_none():
    from telegram import Update
    assert parse_update(Update(update_id=1), bot_username="b", bot_id=1) is None


# --------------------------------------------------------------------------- end to end: the real dispatcher


def _real(dispatcher_fixture):
    """A dispatcher factory handing the session's real dispatcher to the harness."""
    return lambda _handoff: dispatcher_fixture


@pytest.fixture
async def tg_real(dispatcher):
    h = await _harness(_real(dispatcher))
    h.u = Updates(bot_id=h.fake.bot_user["id"], bot_username=h.fake.bot_user["username"])
    yield h
    await _close(h)


def _fresh_user() -> int:
    return random.randint(10**8, 10**9)


@pytest.mark.model
async def test_e2e_lang_en_then_a_chinese_question_is_answered_in_english(tg_real: Harness):
    user = _fresh_user()
    await tg_real.deliver(tg_real.u.command(user, "/lang en"), tg_real.u.text(user, "手脚冰凉怎么办"))
    confirm, answer = tg_real.texts(user)
    assert confirm == "OK, I will answer in English from now on."
    letters = [ch for ch in answer if ch.isalpha()]
    assert sum(ch.isascii() for ch in letters) / len(letters) > 0.9, answer


@pytest.mark.model
async def test_e2e_start_greets_and_markup_in_a_question_is_harmless(tg_real: Harness):
    user = _fresh_user()
    await tg_real.deliver(tg_real.u.command(user, "/start"), tg_real.u.text(user, "<b>失眠</b> & 多梦怎么办"),
                          tg_real.u.sticker(user))
    greeting, answer, sticker = tg_real.texts(user)  # every one accepted by the fake's HTML parser
    assert greeting and answer and sticker
    assert tg_real.adapter.stats["errors"] == 0


@pytest.mark.model
async def test_e2e_an_offer_gets_choice_buttons_and_a_tap_gets_the_topic(dispatcher, monkeypatch):
    monkeypatch.setattr(dispatcher.cfg.decision, "topic_fit", 0.999)  # every topic answer becomes an offer
    monkeypatch.setattr(dispatcher.cfg.decision, "topic_fit_sibling", 0.999)
    monkeypatch.setattr(dispatcher.cfg.decision, "suggest", 0.0)
    h = await _harness(_real(dispatcher), feedback=FeedbackBook(dispatcher.store))
    try:
        user = _fresh_user()
        await h.deliver(h.u.text(user, "失眠怎么调理"))
        (offer,) = h.fake.calls_to("sendMessage", chat_id=user)
        (labels,) = offer.params["reply_markup"]["keyboard"]  # no 👍/👎
        assert "您是想了解" in offer.params["_shown"] and labels[0]["text"] in ("是", "1") and labels[-1]["text"] == "不是"
        await h.deliver(h.u.text(user, labels[0]["text"]))  # the tap: the button's text as an ordinary message
        answer = h.fake.calls_to("sendMessage", chat_id=user)[1:]
        assert answer[0].params["_shown"].startswith(dispatcher.kb.topics["sleep.insomnia"].render("zh")[:20])
        assert list(answer[-1].params["reply_markup"]) == ["inline_keyboard"]  # an answer: 👍 / 👎 only

        english = _fresh_user()
        await h.deliver(h.u.command(english, "/lang en"), h.u.text(english, "how much water should I drink every day"))
        offer = h.fake.calls_to("sendMessage", chat_id=english)[-1]
        (labels,) = offer.params["reply_markup"]["keyboard"]
        assert labels[0]["text"] in ("Yes", "1") and labels[-1]["text"] == "No"
        await h.deliver(h.u.text(english, labels[0]["text"]))
        answer = h.fake.calls_to("sendMessage", chat_id=english)[-1]
        assert answer.params["_shown"].startswith(dispatcher.kb.topics["nutri.water"].render("en")[:20])
        assert "keyboard" not in answer.params["reply_markup"]
    finally:
        await _close(h)


@pytest.mark.model
async def test_e2e_handoff_round_trip_with_the_real_dispatcher(tg_real: Harness):
    user = _fresh_user()
    await tg_real.deliver(tg_real.u.text(user, "失眠怎么调理"), tg_real.u.command(user, "/human"))
    thread = max(tg_real.fake.topics)
    assert "失眠怎么调理" in tg_real.texts(AGENTS, thread)[0]
    await tg_real.deliver(tg_real.u.text(user, "还是睡不着"))
    assert "还是睡不着" in tg_real.texts(AGENTS, thread)[-1]
    await tg_real.deliver(tg_real.u.topic_message(AGENTS, AGENT, thread, "试试固定起床时间"),
                          tg_real.u.topic_message(AGENTS, AGENT, thread, "/done"))
    texts = tg_real.texts(user)
    assert texts[-2] == "人工客服：\n试试固定起床时间" and texts[-1].startswith("人工客服已结束本次对话")


@pytest.mark.model
async def test_create_app_with_a_token_serves_post_telegram(tmp_path):
    if not (REPO_ROOT / "engines" / "manifest.json").exists():
        pytest.skip("engines/manifest.json missing: run 'make model'")
    from bot.app import create_app  # noqa: PLC0415
    fake = await FakeBotAPI(token=TOKEN).start()
    cfg = load_config(env={"HEALTHBOT_DATA_DIR": str(tmp_path), "HEALTHBOT_TELEGRAM_TOKEN": TOKEN,
                           "HEALTHBOT_TELEGRAM_SECRET": SECRET, "HEALTHBOT_TELEGRAM_API_BASE": fake.api_base})
    server = TestServer(create_app(cfg), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        user, u = _fresh_user(), Updates()
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{server.port}/telegram", json=u.text(user, "失眠怎么调理"),
                                 headers={tc.SECRET_HEADER: SECRET}) as resp:
                assert resp.status == 200
        (answer,) = await fake.wait_for(lambda: fake.texts_to(user), timeout=10)
        assert "睡" in answer
    finally:
        await server.close()
        await fake.close()


async def test_human_without_an_agents_group_or_console_says_nobody_is_available():
    h = await _harness(agent_chat=0)
    try:
        await h.deliver(h.u.command(USER, "/human"))
        assert await h.handoff.active("telegram", str(USER)) is None
        assert h.texts(USER)[-1].startswith("抱歉，现在没有人工客服可以接待您。")
        # With the agent console on, the console can answer Telegram users: the handoff starts.
        h.handoff.console = True
        await h.deliver(h.u.command(USER, "/human"))
        assert await h.handoff.active("telegram", str(USER)) is not None
        assert h.texts(USER)[-1].startswith("已为您转接人工客服")
    finally:
        await _close(h)
