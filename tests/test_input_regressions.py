"""Issue 21, "no 5xx from any input": each input that got a 500 or a traceback, as a regression
test over real HTTP on loopback (tests/abuse_stack.py: every route in one server, real
wechatpy crypto on the server side, the independent signer of tests/wechat_client.py on
the client side, python-telegram-bot against the fake Bot API).

Each test also asserts that nothing was logged at error level or with a traceback.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlencode

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from adapters.wechat import webhook as wechat_webhook
from adapters.wechat import PENDING_KEY, setup_wechat
from bot.config import Config
from bot.store import MemoryStore
from bot.types import Intent, Reply

try:  # tests/ is a package or a rootdir-relative folder, depending on who adds __init__.py
    from tests import abuse_stack as ab
    from tests import wechat_client as wx
except ImportError:  # pragma: no cover
    import abuse_stack as ab  # type: ignore[no-redef]
    import wechat_client as wx  # type: ignore[no-redef]


@pytest.fixture
async def stacks():
    """``await stacks(mode)`` → a started :class:`abuse_stack.Stack`, closed after the test."""
    made: list[ab.Stack] = []

    async def make(mode: str = "plaintext") -> ab.Stack:
        made.append(await ab.start_stack(mode))
        return made[-1]

    yield make
    for stack in made:
        await stack.close()


@pytest.fixture
def watch():
    with ab.LogWatch() as w:
        yield w


def message(msg_type: str = "text", msg_id: int = 1234567890123456, **fields: str) -> str:
    """A WeChat message whose fields are given as raw XML (so they can hold elements)."""
    inner = "".join(f"<{k}>{v}</{k}>" for k, v in fields.items())
    return (f"<xml><ToUserName><![CDATA[{wx.ACCOUNT}]]></ToUserName><FromUserName><![CDATA[{wx.USER}]]>"
            f"</FromUserName><CreateTime>{int(time.time())}</CreateTime><MsgType><![CDATA[{msg_type}]]></MsgType>"
            f"{inner}<MsgId>{msg_id}</MsgId></xml>")


def deep(depth: int, inner: str = "x") -> str:
    return "<xml>" + "<a>" * depth + inner + "</a>" * depth + "</xml>"


async def plain_post(stack: ab.Stack, xml: str) -> tuple[int, str]:
    path, body = stack.signer.plain_post(xml)
    status, answer = await stack.request("POST", path, data=body)
    return status, answer.decode()


async def safe_post(stack: ab.Stack, xml: str) -> tuple[int, str]:
    path, body = stack.signer.safe_post(xml)
    status, answer = await stack.request("POST", path, data=body)
    return status, answer.decode()


# --------------------------------------------------------------------------- WeChat


@pytest.mark.parametrize("mode", ["safe", "compatible"])
async def test_a_huge_timestamp_is_403_not_an_overflow(stacks, watch, mode):
    stack = await stacks(mode)
    enc = wx.encrypt(stack.signer.aes_key, ab.APPID, wx.text_xml("hi"))
    for ts in ("9" * 400, "9" * 5000, "-1", "1e9", "１７００００００００", ""):
        nonce = "123"
        q = {"timestamp": ts, "nonce": nonce, "encrypt_type": "aes", "openid": wx.USER,
             "msg_signature": wx.sign(ab.WECHAT_TOKEN, ts, nonce, enc)}  # correctly signed, all the same
        body = f"<xml><Encrypt><![CDATA[{enc}]]></Encrypt></xml>".encode()
        status, answer = await stack.request("POST", "/wechat?" + urlencode(q), data=body)
        assert status == 403, (ts[:20], status, answer)
        q["echostr"] = enc
        status, _ = await stack.request("GET", "/wechat?" + urlencode(q))
        assert status == 403
    assert stack.dispatcher.calls == []
    assert watch.found() == []


async def test_an_unauthenticated_deep_envelope_is_refused_before_any_xml_parser_runs(stacks, watch, monkeypatch):
    stack = await stacks("safe")
    parsed: list[int] = []
    real_parse = wechat_webhook.parse_xml
    monkeypatch.setattr(wechat_webhook, "parse_xml", lambda text: parsed.append(len(text)) or real_parse(text))
    ts, nonce = str(int(time.time())), "42"
    enc = wx.encrypt(stack.signer.aes_key, ab.APPID, wx.text_xml("hi"))
    envelope = deep(8000, f"<Encrypt><![CDATA[{enc}]]></Encrypt>")  # about 60 KB, under the 64 KiB limit
    q = {"timestamp": ts, "nonce": nonce, "encrypt_type": "aes", "msg_signature": "0" * 40}
    status, answer = await stack.request("POST", "/wechat?" + urlencode(q), data=envelope.encode())
    assert (status, answer) == (403, b"invalid signature")
    assert parsed == []  # authenticated first: the XML parser never saw the body
    q["msg_signature"] = wx.sign(ab.WECHAT_TOKEN, ts, nonce, enc)  # signed, but the envelope is 8,000 deep
    status, answer = await stack.request("POST", "/wechat?" + urlencode(q), data=envelope.encode())
    assert (status, answer) == (400, b"malformed xml")
    assert stack.dispatcher.calls == []
    assert watch.found() == []


@pytest.mark.parametrize("how", ["plaintext", "safe"])
async def test_1000_deep_signed_xml_is_400(stacks, watch, how):
    stack = await stacks(how)
    post = plain_post if how == "plaintext" else safe_post
    assert await post(stack, deep(1000)) == (400, "malformed xml")
    assert await post(stack, message(Content=deep(10))) == (400, "malformed xml")
    assert stack.dispatcher.calls == []
    assert watch.found() == []


@pytest.mark.parametrize("how", ["plaintext", "safe"])
async def test_voice_whose_recognition_holds_an_element_gets_the_please_type_reply(stacks, watch, how):
    stack = await stacks(how)
    xml = message("voice", MediaId="media_1", Format="amr", Recognition="<b>头痛</b><i>怎么办</i>")
    status, body = await (plain_post if how == "plaintext" else safe_post)(stack, xml)
    assert status == 200
    reply = wx.parse_reply(stack.signer.open_safe_reply(body) if how == "safe" else body)
    assert reply["Content"] == "暂不支持voice消息，请发文字。"
    (inbound,) = stack.dispatcher.calls
    assert inbound.raw["type"] == "voice" and inbound.text == ""
    assert watch.found() == []


@pytest.mark.parametrize("field,value", [
    ("Content", "<b>失眠</b>怎么办"),
    ("Content", "<![CDATA[a]]><x/>"),
    ("ToUserName", "<b>x</b>"),
    ("FromUserName", "<b>x</b>"),
    ("MsgId", "<b>1</b>"),
])
async def test_a_text_field_holding_elements_is_400(stacks, watch, field, value):
    stack = await stacks()
    xml = message(Content="hi").replace("<Content>hi</Content>", f"<Content>{value}</Content>") \
        if field == "Content" else message(Content="hi").replace(
            f"<{field}>", f"<{field}>{value}", 1)
    assert await plain_post(stack, xml) == (400, "malformed xml")
    assert stack.dispatcher.calls == []
    assert watch.found() == []


async def test_a_repeated_field_or_an_over_long_id_is_400(stacks, watch):
    stack = await stacks()
    assert await plain_post(stack, message(Content="a").replace("</xml>", "<Content>b</Content></xml>")) == \
        (400, "malformed xml")
    assert await plain_post(stack, message(msg_id=int("9" * 200), Content="a")) == (400, "malformed xml")
    status, _ = await plain_post(stack, message(Content="ok"))  # and a normal message still works
    assert status == 200
    assert watch.found() == []


class SlowDispatcher:
    async def handle(self, inbound: Any) -> Reply:
        await asyncio.sleep(0.4)
        return Reply("答：" + inbound.text, Intent.ANSWER)


async def test_the_late_answer_snippet_is_masked(watch):
    cfg = Config()
    cfg.wechat.token, cfg.wechat.appid, cfg.wechat.reply_budget_s = ab.WECHAT_TOKEN, ab.APPID, 0.1
    store = MemoryStore()
    app = web.Application()
    setup_wechat(app, cfg, SlowDispatcher(), store=store)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        signer = wx.WechatSigner(token=ab.WECHAT_TOKEN, appid=ab.APPID)
        path, body = signer.plain_post(wx.text_xml("我电话１３６１２３４５６７８头痛"))
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{server.port}{path}", data=body) as resp:
                assert (resp.status, await resp.text()) == (200, "success")
        for _ in range(100):
            items = await store.pop_all(PENDING_KEY.format(openid=wx.USER))
            if items:
                break
            await asyncio.sleep(0.02)
        (item,) = [json.loads(raw) for raw in items]
        assert "１３６１２３４５６７８" not in item["q"] and "[PHONE]" in item["q"]
    finally:
        await server.close()
    assert watch.found() == []


# --------------------------------------------------------------------------- the agent console


async def test_non_utf8_bytes_in_the_console_authorization_header_are_401(stacks, watch):
    stack = await stacks()
    for value in (b"Bearer \xff\xfe\x80", b"\xc3\x28", b"Bearer " + ab.CONSOLE_TOKEN.encode() + b"\xff"):
        status, body = await stack.raw(b"GET /console/api/handoffs HTTP/1.1\r\nHost: x\r\nAuthorization: " + value
                                       + b"\r\nConnection: close\r\n\r\n")
        assert status == 401 and "error" in json.loads(body)
    assert watch.found() == []


@pytest.mark.parametrize("ref", ["%C3%A9%C3%A9", "%E2%82%AC" * 8, "é" * 24, "A" * 24, "0" * 25, "%00"])
async def test_a_handoff_ref_that_cannot_be_one_is_404(stacks, watch, ref):
    stack = await stacks()
    auth = ab.console_headers()
    for method, suffix, kw in (("GET", "", {}), ("POST", "/reply", {"json": {"text": "hi"}}),
                               ("POST", "/close", {})):
        status, body = await stack.request(method, f"/console/api/handoffs/{ref}{suffix}", headers=auth, **kw)
        assert status == 404 and "error" in json.loads(body)
    status, _ = await stack.request("GET", f"/console/api/handoffs/{stack.ref}", headers=auth)
    assert status == 200  # the real one still works
    assert watch.found() == []


async def test_console_reply_bodies_that_are_not_utf8_json_are_4xx(stacks, watch):
    stack = await stacks()
    url = f"/console/api/handoffs/{stack.ref}/reply"
    headers = {**ab.console_headers(), "Content-Type": "application/json; charset=foo"}
    status, body = await stack.request("POST", url, data='{"text": "您好"}'.encode(), headers=headers)
    assert status == 200, body  # a declared charset is not trusted: JSON is UTF-8
    for bad in (b"[" * 50_000 + b"]" * 50_000 + b"", b'{"text": ' + b"1" * 5000 + b"}", b"\xff\xfe", b"{"):
        status, body = await stack.request("POST", url, data=bad, headers=headers)
        assert status in (400, 413) and "error" in json.loads(body), (bad[:20], status)
    status, _ = await stack.request("GET", "/api/messages", params={"user_id": "u" * 500})
    assert status == 400
    assert watch.found() == []


# --------------------------------------------------------------------------- Telegram


async def _tg(stack: ab.Stack, update: Any = None, raw: bytes | None = None) -> int:
    data = raw if raw is not None else json.dumps(update).encode()
    status, _ = await stack.request("POST", "/telegram", data=data, headers=ab.telegram_headers())
    await stack.telegram.idle()
    return status


@pytest.mark.parametrize("data", ["lang:zh\n", "", "lang:fr", "lang:zh\nlang:en", "foo", "lang:", "lang:en "])
async def test_callback_data_is_matched_whole_and_unknown_data_answered_politely(stacks, watch, data):
    stack = await stacks()
    user = 4242
    assert await _tg(stack, stack.updates.callback(user, data)) == 200
    assert str(user) not in stack.telegram.langs
    (answer,) = stack.fake_telegram.calls_to("answerCallbackQuery")
    assert "/lang" in answer.params.get("text", "")  # a short notice, not silence
    assert await _tg(stack, stack.updates.text(user, "头痛怎么办")) == 200
    assert stack.fake_telegram.texts_to(user) == ["答：头痛怎么办"]  # no KeyError for the user afterwards
    assert await _tg(stack, stack.updates.callback(user, "lang:en")) == 200
    assert stack.telegram.langs[str(user)] == "en"
    assert watch.found() == []


MALFORMED_UPDATES = [
    {"update_id": 1, "message": {"message_id": 1, "date": 1}},
    {"update_id": 2, "message": {"message_id": 1, "date": 1, "chat": "x"}},
    {"update_id": 3, "message": {"message_id": 1, "date": "abc", "chat": {"id": 5, "type": "private"}}},
    {"update_id": 4, "message": {"message_id": 10**30, "date": 1, "chat": {"id": 5, "type": "private"}}},
    {"update_id": 5, "message": {"message_id": 1, "date": 1, "chat": {"id": 6, "type": "private"}, "text": "/x",
                                 "entities": [{"type": "bot_command", "offset": 0, "length": "z"}],
                                 "from": {"id": 6, "is_bot": False, "first_name": "a"}}},
    {"update_id": 6, "message": {"message_id": 1, "date": 1, "chat": {"id": 7, "type": "private"}, "text": 5,
                                 "from": {"id": 7, "is_bot": False, "first_name": "a"}}},
    {"update_id": 7, "message": {"message_id": 1, "date": 1, "chat": {"id": "abc", "type": "private"},
                                 "text": "hi", "from": {"id": 9, "is_bot": False, "first_name": "a"}}},
    {"update_id": 8, "callback_query": {"id": "1", "chat_instance": "c", "data": "lang:zh"}},
    {"update_id": 9, "my_chat_member": {"chat": {"id": 1, "type": "private"}}},
    {"update_id": 10, "message": {"message_id": 1, "date": 10**15, "chat": {"id": 8, "type": "private"},
                                  "text": "hi", "from": {"id": 8, "is_bot": False, "first_name": "a"}}},
    {"update_id": 11, "message": {"message_id": 1, "date": 1, "chat": {"id": 8, "type": "private"},
                                  "text": "\ud800", "from": {"id": 8, "is_bot": False, "first_name": "a"}}},
    {"update_id": 12, "message": {"message_id": 1, "date": 1, "chat": {"id": 8, "type": "private"},
                                  "photo": "not a list", "from": {"id": 8, "is_bot": False, "first_name": "a"}}},
    # entities that cut an emoji's surrogate pair in half, or reach past the text
    {"update_id": 13, "message": {"message_id": 1, "date": 1, "chat": {"id": -1005, "type": "supergroup"},
                                  "text": "😀@healthbot_test_bot 头痛", "from": {"id": 8, "is_bot": False, "first_name": "a"},
                                  "entities": [{"type": "mention", "offset": 1, "length": 20}]}},
    {"update_id": 14, "message": {"message_id": 1, "date": 1, "chat": {"id": -1005, "type": "supergroup"},
                                  "caption": "😀😀", "photo": [], "from": {"id": 8, "is_bot": False, "first_name": "a"},
                                  "caption_entities": [{"type": "mention", "offset": 1, "length": 2}]}},
    {"update_id": 15, "message": {"message_id": 1, "date": 1, "chat": {"id": 8, "type": "private"}, "text": "hi",
                                  "from": {"id": 8, "is_bot": False, "first_name": "a"},
                                  "entities": [{"type": "bot_command", "offset": -5, "length": 10**6}]}},
]


async def test_malformed_updates_are_dropped_with_a_warning_not_a_traceback(stacks, watch):
    stack = await stacks()
    for update in MALFORMED_UPDATES:
        assert await _tg(stack, update) in (200, 400), update
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"update_id": ' + b"9" * 5000 + b"}", b"\xff"):
        assert await _tg(stack, raw=raw) == 400
    assert stack.dispatcher.calls == []
    warnings = [e for e in watch.events() if e["event"] in ("telegram.malformed_update", "telegram.unparsable_update")]
    assert len(warnings) == len(MALFORMED_UPDATES)
    assert await _tg(stack, stack.updates.text(31337, "还在吗")) == 200
    assert stack.fake_telegram.texts_to(31337) == ["答：还在吗"]
    assert watch.found() == []
