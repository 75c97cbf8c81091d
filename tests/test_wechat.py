"""WeChat adapter over real HTTP on loopback, against an independent test client.

The dispatcher here is a small stand-in that deduplicates like the real one
(bot/dedup.py): a retry of a running computation awaits it, a retry of a finished
one gets the stored Reply. End-to-end tests with the real dispatcher live elsewhere.
"""

from __future__ import annotations

import asyncio
import random
import time
import xml.etree.ElementTree as ET
from typing import Any
from urllib.parse import urlencode

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs
from wechatpy.crypto import WeChatCrypto

from adapters.wechat import constants as wc
from adapters.wechat import late as wechat_late
from adapters.wechat import SEGMENT_SEPARATOR, WECHAT_ADAPTER, fit_passive_text, paginate, setup_wechat, split_text
from bot.config import Config, ConfigError
from bot.store import MemoryStore
from bot.types import Inbound, Intent, MessageKind, Reply
try:  # tests/ is a package or a rootdir-relative folder, depending on who adds __init__.py
    from tests import wechat_client as wx
    from tests.conftest import requires_model
    from tests.fake_wechat_api import SEND as SEND_PATH, TOKEN as TOKEN_PATH, FakeWechatApi
except ImportError:  # pragma: no cover
    import wechat_client as wx  # type: ignore[no-redef]
    from conftest import requires_model  # type: ignore[no-redef]
    from fake_wechat_api import SEND as SEND_PATH, TOKEN as TOKEN_PATH, FakeWechatApi  # type: ignore[no-redef]

TOKEN = "healthbot_test_token"
APPID = "wx0123456789abcdef"
DISCLAIMER = "【提示】以上内容仅供健康科普参考，不能代替医生的诊断和治疗。"


class CachingDispatcher:
    """Counts calls and computations; one computation per (channel, message_id).

    Args:
        delay_s: seconds each computation sleeps (to outlast a short reply budget).
        text: fixed reply text for TEXT messages (default ``"答：<text>"``).
        fail: raise inside the computation.
    """

    def __init__(self, delay_s: float = 0.0, text: str | None = None, fail: bool = False):
        self.delay_s = delay_s
        self.text = text
        self.fail = fail
        self.calls: list[Inbound] = []
        self.started = 0
        self.completed = 0
        self.cancelled = 0
        self._once: dict[tuple[str, str], asyncio.Task[Reply]] = {}

    async def handle(self, inbound: Inbound) -> Reply:
        self.calls.append(inbound)
        key = (inbound.channel, inbound.message_id)
        task = self._once.get(key)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.ensure_future(self._compute(inbound))
            self._once[key] = task
        return await asyncio.shield(task)

    async def _compute(self, inbound: Inbound) -> Reply:
        self.started += 1
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail:
            raise RuntimeError("dispatcher exploded")
        self.completed += 1
        if inbound.kind is MessageKind.SUBSCRIBE:
            return Reply("欢迎关注健康小助手！", Intent.GREETING)
        if inbound.kind is MessageKind.EVENT:
            return Reply("", Intent.SYSTEM)
        if inbound.kind is MessageKind.UNSUPPORTED:
            return Reply(f"暂不支持{inbound.raw.get('type')}消息，请发文字。", Intent.SYSTEM)
        return Reply(self.text if self.text is not None else f"答：{inbound.text}", Intent.ANSWER)


@pytest.fixture
async def serve():
    """``await serve(dispatcher, mode=..., **wechat_overrides)`` → a started TestClient on 127.0.0.1."""
    clients: list[TestClient] = []

    async def _serve(dispatcher: Any, mode: str = "plaintext", max_body_bytes: int = 64 * 1024,
                     aes_key: str = "", token: str = TOKEN, **wechat: Any) -> TestClient:
        cfg = Config()
        cfg.server.max_body_bytes = max_body_bytes
        cfg.wechat.token, cfg.wechat.appid, cfg.wechat.mode, cfg.wechat.aes_key = token, APPID, mode, aes_key
        for key, value in wechat.items():
            setattr(cfg.wechat, key, value)
        app = web.Application()
        setup_wechat(app, cfg, dispatcher, store=MemoryStore())
        client = TestClient(TestServer(app, host="127.0.0.1", port=0))
        await client.start_server()
        clients.append(client)
        return client

    yield _serve
    for client in clients:
        await client.close()


@pytest.fixture
def signer() -> wx.WechatSigner:
    return wx.WechatSigner(token=TOKEN, appid=APPID, aes_key=wx.new_aes_key())


async def post(client: TestClient, signer: wx.WechatSigner, xml: str, **kw: Any) -> tuple[int, str]:
    path, body = signer.plain_post(xml, **kw)
    async with client.post(path, data=body, headers={"Content-Type": "text/xml"}) as resp:
        return resp.status, await resp.text()


# --------------------------------------------------------------------------- URL verification


async def test_get_verification_echoes_echostr(serve, signer):
    client = await serve(CachingDispatcher())
    async with client.get(signer.verify_url("echo_5829301")) as resp:
        assert resp.status == 200
        assert await resp.text() == "echo_5829301"


@pytest.mark.parametrize("tamper", ["signature", "timestamp", "missing"])
async def test_get_verification_with_bad_signature_is_403(serve, signer, tamper):
    client = await serve(CachingDispatcher())
    q = signer.query(echostr="echo_1")
    if tamper == "signature":
        q["signature"] = "0" * 40
    elif tamper == "timestamp":
        q["timestamp"] = str(int(q["timestamp"]) - 1)  # signature no longer matches
    else:
        del q["signature"]
    async with client.get("/wechat", params=q) as resp:
        assert resp.status == 403
        assert "echo_1" not in await resp.text()


async def test_safe_mode_get_with_msg_signature_decrypts_echostr(serve, signer):
    client = await serve(CachingDispatcher(), mode="safe", aes_key=signer.aes_key)
    enc = wx.encrypt(signer.aes_key, APPID, "plain_echo_77")
    ts, nonce = str(int(time.time())), "5551"
    q = {"msg_signature": wx.sign(TOKEN, ts, nonce, enc), "timestamp": ts, "nonce": nonce, "echostr": enc}
    async with client.get("/wechat", params=q) as resp:
        assert (resp.status, await resp.text()) == (200, "plain_echo_77")
    q["msg_signature"] = wx.sign(TOKEN, ts, nonce, "other")
    async with client.get("/wechat", params=q) as resp:
        assert resp.status == 403


async def test_safe_mode_get_without_msg_signature_echoes_plainly(serve, signer):
    """Official accounts verify the URL with the plain signature even in safe mode."""
    client = await serve(CachingDispatcher(), mode="safe", aes_key=signer.aes_key)
    async with client.get(signer.verify_url("echo_plain")) as resp:
        assert (resp.status, await resp.text()) == (200, "echo_plain")


# --------------------------------------------------------------------------- request checks


async def test_text_message_gets_passive_reply_with_swapped_users(serve, signer):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher)
    status, body = await post(client, signer, wx.text_xml("手脚冰凉怎么办", msg_id=42))
    assert status == 200
    reply = wx.parse_reply(body)
    assert reply["ToUserName"] == wx.USER
    assert reply["FromUserName"] == wx.ACCOUNT
    assert reply["MsgType"] == "text"
    assert reply["Content"] == "答：手脚冰凉怎么办"
    assert abs(int(reply["CreateTime"]) - time.time()) < 60
    (inbound,) = dispatcher.calls
    assert (inbound.channel, inbound.kind, inbound.text) == ("wechat", MessageKind.TEXT, "手脚冰凉怎么办")
    assert inbound.message_id == "42"
    assert inbound.user_id == inbound.chat_id == wx.USER
    assert inbound.raw["ToUserName"] == wx.ACCOUNT and inbound.raw["type"] == "text"


@pytest.mark.parametrize("how", ["wrong", "missing", "other_token"])
async def test_bad_signature_is_403(serve, signer, how):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher)
    path, body = signer.plain_post(wx.text_xml("hi"))
    q = signer.query(openid="x")
    if how == "wrong":
        q["signature"] = q["signature"][::-1]
    elif how == "missing":
        del q["signature"]
    else:
        q["signature"] = wx.sign("not_the_token", q["timestamp"], q["nonce"])
    async with client.post("/wechat", params=q, data=body) as resp:
        assert resp.status == 403
        assert await resp.text() == "invalid signature"
    assert dispatcher.calls == []


async def test_stale_timestamp_is_403(serve, signer):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher, timestamp_window_s=300)
    for ts in (int(time.time()) - 301 - 5, int(time.time()) + 400):
        status, body = await post(client, signer, wx.text_xml("hi"), timestamp=ts)  # correctly signed, but old
        assert status == 403
        assert "timestamp" in body
    assert dispatcher.calls == []


async def test_a_nonce_reused_with_another_body_is_refused_and_a_redelivery_is_not(serve, signer):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher)
    path, first = signer.plain_post(wx.text_xml("失眠怎么办", msg_id=70001), nonce="555000111")
    for _ in range(2):  # WeChat's re-delivery: the same query and the same body
        async with client.post(path, data=first) as resp:
            assert resp.status == 200 and "失眠怎么办" in await resp.text()
    forged = wx.text_xml("给我转账", msg_id=70002).encode()  # the captured signature with another body
    async with client.post(path, data=forged) as resp:
        assert resp.status == 403 and await resp.text() == "replayed nonce"
    assert {c.text for c in dispatcher.calls} == {"失眠怎么办"}


async def test_oversize_body_is_413(serve, signer):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher, max_body_bytes=1024)
    xml = wx.text_xml("长" * 400)  # > 1024 bytes
    status, _ = await post(client, signer, xml)
    assert status == 413

    async def chunks():  # no Content-Length: the limit still holds while streaming
        for _ in range(10):
            yield b"<xml>" + b"x" * 200

    path, _ = signer.plain_post("")
    async with client.post(path, data=chunks()) as resp:
        assert resp.status == 413
    assert dispatcher.calls == []


@pytest.mark.parametrize("body", [
    b"not xml at all",
    b"<xml><ToUserName>a</ToUserName>",
    b"<xml><MsgType>text</MsgType></xml>",  # not a WeChat message
    b"<notxml><MsgType>text</MsgType></notxml>",
    b"<xml><Content>\xff\xfe</Content></xml>",  # not UTF-8
    b"",
])
async def test_malformed_xml_is_400(serve, signer, body):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher)
    path, _ = signer.plain_post("")
    async with client.post(path, data=body) as resp:
        assert resp.status == 400
        text = await resp.text()
        assert text == "malformed xml" and "Traceback" not in text
    assert dispatcher.calls == []


BILLION_LAUGHS = (
    '<?xml version="1.0"?><!DOCTYPE xml [<!ENTITY a "aaaaaaaaaa">'
    + "".join(f'<!ENTITY {chr(98 + i)} "{("&" + chr(97 + i) + ";") * 10}">' for i in range(8))
    + "]><xml><ToUserName>a</ToUserName><FromUserName>u</FromUserName><CreateTime>1</CreateTime>"
    "<MsgType>text</MsgType><Content>&i;</Content><MsgId>1</MsgId></xml>"
)
XXE = ('<?xml version="1.0"?><!DOCTYPE xml [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
       "<xml><ToUserName>a</ToUserName><FromUserName>u</FromUserName><CreateTime>1</CreateTime>"
       "<MsgType>text</MsgType><Content>&x;</Content><MsgId>1</MsgId></xml>")
PLAIN_DOCTYPE = '<!DOCTYPE xml><xml><ToUserName>a</ToUserName><FromUserName>u</FromUserName>' \
                "<CreateTime>1</CreateTime><MsgType>text</MsgType><Content>x</Content><MsgId>1</MsgId></xml>"


@pytest.mark.parametrize("xml", [BILLION_LAUGHS, XXE, PLAIN_DOCTYPE], ids=["bomb", "xxe", "doctype"])
async def test_xml_bomb_and_doctype_are_400(serve, signer, xml):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher)
    status, body = await post(client, signer, xml)
    assert (status, body) == (400, "malformed xml")
    assert dispatcher.calls == []


async def test_control_characters_in_content_are_dropped_and_the_rest_kept(serve, signer):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher)
    content = "失眠\x08怎么\x1b办\t😀 ①Ａ\x7f ok"
    status, body = await post(client, signer, wx.text_xml(content))
    assert status == 200
    assert dispatcher.calls[0].text == "失眠怎么办\t😀 ①Ａ\x7f ok"
    assert wx.parse_reply(body)["Content"] == "答：失眠怎么办\t😀 ①Ａ\x7f ok"


# --------------------------------------------------------------------------- message kinds


async def test_voice_with_recognition_is_text(serve, signer):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher)
    status, body = await post(client, signer, wx.voice_xml("口腔溃疡怎么办"))
    (inbound,) = dispatcher.calls
    assert (inbound.kind, inbound.text, inbound.raw["type"]) == (MessageKind.TEXT, "口腔溃疡怎么办", "voice")
    assert wx.parse_reply(body)["Content"] == "答：口腔溃疡怎么办"


@pytest.mark.parametrize("recognition", [None, ""])
async def test_voice_without_recognition_is_unsupported(serve, signer, recognition):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher)
    status, body = await post(client, signer, wx.voice_xml(recognition))
    (inbound,) = dispatcher.calls
    assert (inbound.kind, inbound.text, inbound.raw["type"]) == (MessageKind.UNSUPPORTED, "", "voice")
    assert wx.parse_reply(body)["Content"] == "暂不支持voice消息，请发文字。"


@pytest.mark.parametrize("msg_type", ["image", "video", "shortvideo", "location", "link", "file"])
async def test_media_messages_reach_the_dispatcher_as_unsupported(serve, signer, msg_type):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher)
    status, body = await post(client, signer, wx.media_xml(msg_type, msg_id=777))
    assert status == 200
    (inbound,) = dispatcher.calls
    assert (inbound.kind, inbound.raw["type"], inbound.message_id) == (MessageKind.UNSUPPORTED, msg_type, "777")
    assert wx.parse_reply(body)["Content"] == f"暂不支持{msg_type}消息，请发文字。"


@pytest.mark.parametrize("key", [None, "qrscene_123"])
async def test_subscribe_is_subscribe_kind_and_gets_the_greeting(serve, signer, key):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher)
    status, body = await post(client, signer, wx.event_xml("subscribe", key=key, create_time=1700000000))
    (inbound,) = dispatcher.calls
    assert inbound.kind is MessageKind.SUBSCRIBE
    assert inbound.message_id == f"{wx.USER}:1700000000:subscribe"  # FromUserName + CreateTime
    assert wx.parse_reply(body)["Content"] == "欢迎关注健康小助手！"


async def test_unsubscribe_answers_success(serve, signer):
    dispatcher = CachingDispatcher(text="should never be sent")
    client = await serve(dispatcher)
    status, body = await post(client, signer, wx.event_xml("unsubscribe"))
    assert (status, body) == (200, "success")
    assert dispatcher.calls[0].kind is MessageKind.EVENT
    assert dispatcher.calls[0].raw["event"] == "unsubscribe"


@pytest.mark.parametrize("event,key", [("CLICK", "V1001_TIPS"), ("VIEW", "https://example.com"), ("SCAN", "123")])
async def test_menu_and_scan_events_are_event_kind_answered_success_without_text(serve, signer, event, key):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher)
    status, body = await post(client, signer, wx.event_xml(event, key=key))
    assert (status, body) == (200, "success")
    (inbound,) = dispatcher.calls
    assert (inbound.kind, inbound.text) == (MessageKind.EVENT, "")
    assert (inbound.raw["event"], inbound.raw["event_key"]) == (event.lower(), key)


async def test_event_answered_with_text_by_the_dispatcher_is_sent(serve, signer):
    class MenuDispatcher(CachingDispatcher):
        async def _compute(self, inbound):
            return Reply("今日养生小贴士：多喝温水。", Intent.SYSTEM)

    client = await serve(MenuDispatcher())
    status, body = await post(client, signer, wx.event_xml("CLICK", key="V1001_TIPS"))
    assert wx.parse_reply(body)["Content"] == "今日养生小贴士：多喝温水。"


# --------------------------------------------------------------------------- retries and the deadline


async def test_retried_msgid_gets_the_same_text_and_is_computed_once(serve, signer):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher)
    xml = wx.text_xml("怎么缓解颈椎痛", msg_id=9001)
    bodies = [(await post(client, signer, xml, nonce=f"n{i}"))[1] for i in range(wc.MAX_DELIVERIES)]
    contents = {wx.parse_reply(b)["Content"] for b in bodies}
    assert contents == {"答：怎么缓解颈椎痛"}
    assert len(dispatcher.calls) == wc.MAX_DELIVERIES
    assert {c.message_id for c in dispatcher.calls} == {"9001"}
    assert dispatcher.started == 1


async def test_retry_during_the_computation_awaits_it_and_both_get_the_text(serve, signer):
    dispatcher = CachingDispatcher(delay_s=0.3)
    client = await serve(dispatcher, reply_budget_s=2.0)
    xml = wx.text_xml("同时到达", msg_id=7007)
    results = await asyncio.gather(*(post(client, signer, xml, nonce=f"c{i}") for i in range(2)))
    assert [wx.parse_reply(body)["Content"] for _, body in results] == ["答：同时到达"] * 2
    assert (len(dispatcher.calls), dispatcher.started) == (2, 1)


async def test_slow_dispatcher_gets_success_within_budget_and_keeps_computing(serve, signer):
    dispatcher = CachingDispatcher(delay_s=1.0)
    client = await serve(dispatcher, reply_budget_s=0.3)
    xml = wx.text_xml("慢问题", msg_id=5150)
    t0 = time.monotonic()
    status, body = await post(client, signer, xml)
    elapsed = time.monotonic() - t0
    assert (status, body) == (200, "success")
    assert 0.25 <= elapsed < 0.9, elapsed  # answered at the budget, not at the computation's end
    adapter = client.app[WECHAT_ADAPTER]
    assert dispatcher.started == 1 and dispatcher.completed == 0
    await adapter.drain(timeout_s=5)
    assert (dispatcher.completed, dispatcher.cancelled) == (1, 0)  # the timeout did not cancel it
    # The answer is kept, not lost: a delivery that still comes gets it, computed once.
    status, body = await post(client, signer, xml, nonce="retry")
    assert wx.parse_reply(body)["Content"] == "答：慢问题"
    assert dispatcher.started == 1


class UnshieldedSlowDispatcher:
    """Computes inside ``handle`` itself (no task, no shield of its own), so only the
    adapter's shield can keep a timeout from cancelling it."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.completed = 0
        self.cancelled = 0

    async def handle(self, inbound: Inbound) -> Reply:
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.completed += 1
        return Reply("late", Intent.ANSWER)


async def test_reply_budget_timeout_never_cancels_the_computation(serve, signer):
    dispatcher = UnshieldedSlowDispatcher(delay_s=0.6)
    client = await serve(dispatcher, reply_budget_s=0.2)
    status, body = await post(client, signer, wx.text_xml("x"))
    assert (status, body) == (200, "success")
    assert len(client.app[WECHAT_ADAPTER].pending) == 1
    await client.app[WECHAT_ADAPTER].drain(timeout_s=5)
    assert (dispatcher.completed, dispatcher.cancelled) == (1, 0)
    assert not client.app[WECHAT_ADAPTER].pending


async def test_dispatcher_error_answers_success_without_trace(serve, signer):
    client = await serve(CachingDispatcher(fail=True))
    status, body = await post(client, signer, wx.text_xml("x"))
    assert (status, body) == (200, "success")


# --------------------------------------------------------------------------- safe / compatible mode


async def test_safe_mode_round_trip(serve, signer):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher, mode="safe", aes_key=signer.aes_key)
    path, body = signer.safe_post(wx.text_xml("秋天干燥怎么养生", msg_id=31))
    async with client.post(path, data=body) as resp:
        assert resp.status == 200
        reply = wx.parse_reply(signer.open_safe_reply(await resp.text()))
    assert reply["Content"] == "答：秋天干燥怎么养生"
    assert (reply["ToUserName"], reply["FromUserName"]) == (wx.USER, wx.ACCOUNT)
    assert dispatcher.calls[0].message_id == "31"


async def test_safe_mode_checks_msg_signature_not_only_signature(serve, signer):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher, mode="safe", aes_key=signer.aes_key)
    path, body = signer.safe_post(wx.text_xml("x"))
    tampered = body.replace(b"<Encrypt><![CDATA[", b"<Encrypt><![CDATA[AAAA")  # signature still valid
    async with client.post(path, data=tampered) as resp:
        assert (resp.status, await resp.text()) == (403, "invalid signature")
    # A plaintext request signed with `signature` only is refused in safe mode.
    path, plain = signer.plain_post(wx.text_xml("x"))
    async with client.post(path, data=plain) as resp:
        assert resp.status == 403
    assert dispatcher.calls == []


async def test_safe_mode_other_appid_is_403(serve, signer):
    client = await serve(CachingDispatcher(), mode="safe", aes_key=signer.aes_key)
    other = wx.WechatSigner(token=TOKEN, appid="wxOTHERAPPID00000", aes_key=signer.aes_key)
    path, body = other.safe_post(wx.text_xml("x"))
    async with client.post(path, data=body) as resp:
        assert resp.status == 403


async def test_safe_mode_event_without_text_is_plain_success(serve, signer):
    client = await serve(CachingDispatcher(), mode="safe", aes_key=signer.aes_key)
    path, body = signer.safe_post(wx.event_xml("unsubscribe"))
    async with client.post(path, data=body) as resp:
        assert (resp.status, await resp.text()) == (200, "success")


async def test_compatible_mode_accepts_plaintext_and_encrypted(serve, signer):
    client = await serve(CachingDispatcher(), mode="compatible", aes_key=signer.aes_key)
    status, body = await post(client, signer, wx.text_xml("明文", msg_id=1))
    assert wx.parse_reply(body)["Content"] == "答：明文"
    path, body = signer.safe_post(wx.text_xml("密文", msg_id=2))
    async with client.post(path, data=body) as resp:
        assert wx.parse_reply(signer.open_safe_reply(await resp.text()))["Content"] == "答：密文"


async def test_safe_mode_control_character_inside_encrypted_message(serve, signer):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher, mode="safe", aes_key=signer.aes_key)
    path, body = signer.safe_post(wx.text_xml("头\x08疼"))
    async with client.post(path, data=body) as resp:
        assert resp.status == 200
    assert dispatcher.calls[0].text == "头疼"


# --------------------------------------------------------------------------- reply rendering


async def test_cdata_terminator_in_reply_survives(serve, signer):
    text = "a]]>b <tag> & ]]]]> end"
    client = await serve(CachingDispatcher(text=text))
    status, body = await post(client, signer, wx.text_xml("x"))
    assert wx.parse_reply(body)["Content"] == text


async def test_cdata_terminator_survives_safe_mode(serve, signer):
    client = await serve(CachingDispatcher(text="x]]>y"), mode="safe", aes_key=signer.aes_key)
    path, body = signer.safe_post(wx.text_xml("x"))
    async with client.post(path, data=body) as resp:
        assert wx.parse_reply(signer.open_safe_reply(await resp.text()))["Content"] == "x]]>y"


MORE = "回复 1 查看更多"


async def read_pages(client: TestClient, signer: wx.WechatSigner, first: str, msg_id: int) -> list[str]:
    """Page 1 (``first``), then one "1" after another while a page says there is more."""
    pages = [first]
    while MORE in pages[-1]:
        msg_id += 1
        assert len(pages) < 50
        status, body = await post(client, signer, wx.text_xml("1", msg_id=msg_id))
        pages.append(wx.parse_reply(body)["Content"])
    return pages


async def test_long_reply_is_paged_with_the_disclaimer_on_every_page(serve, signer):
    answer = "".join(f"第{i}条：早睡早起，适当运动，饮食清淡。" for i in range(200))
    text = answer + "\n\n" + DISCLAIMER
    assert len(text.encode()) > 3 * wc.PASSIVE_TEXT_MAX_BYTES
    client = await serve(CachingDispatcher(text=text))
    status, body = await post(client, signer, wx.text_xml("x", msg_id=100))
    pages = await read_pages(client, signer, wx.parse_reply(body)["Content"], 100)
    assert len(pages) >= 4
    bodies = []
    for i, page in enumerate(pages):
        assert len(page.encode("utf-8")) <= wc.PASSIVE_TEXT_MAX_BYTES
        assert page.endswith("\n\n" + DISCLAIMER)  # whoever stops reading still saw it
        head = page[: -len("\n\n" + DISCLAIMER)]
        if i < len(pages) - 1:
            assert head.endswith("\n\n" + MORE)
            head = head[: -len("\n\n" + MORE)]
        assert head.endswith("。")  # cut at a sentence end
        bodies.append(head)
    assert "".join(bodies) == answer  # nothing lost, nothing repeated, in order


async def test_long_reply_without_paragraphs_is_cut_on_a_character_boundary(serve, signer):
    text = "a" + "中" * 1000  # 3001 bytes; byte 2048 falls inside a character
    client = await serve(CachingDispatcher(text=text))
    status, body = await post(client, signer, wx.text_xml("x", msg_id=200))
    pages = await read_pages(client, signer, wx.parse_reply(body)["Content"], 200)
    assert len(pages) == 2
    assert all(len(p.encode("utf-8")) <= wc.PASSIVE_TEXT_MAX_BYTES for p in pages)
    first = pages[0].removesuffix("\n\n" + MORE)
    assert first + pages[1] == text
    assert len(first.encode()) > wc.PASSIVE_TEXT_MAX_BYTES - len(("\n\n" + MORE).encode()) - 3


def test_fit_passive_text_never_exceeds_the_limit_or_splits_a_character():
    rng = random.Random(7)
    alphabet = ["a", " ", ".", "。", "\n", "\n\n", "中", "é", "😀", "👨\u200d👩\u200d👧", "！"]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 1500)))
        limit = rng.choice([1, 2, 3, 4, 10, 100, wc.PASSIVE_TEXT_MAX_BYTES])
        out = fit_passive_text(text, limit)
        assert len(out.encode("utf-8")) <= limit
        if len(text.encode()) <= limit:
            assert out == text
    assert fit_passive_text("短", 2048) == "短"


# --------------------------------------------------------------------------- configuration


async def test_without_token_the_webhook_answers_503(serve, signer):
    client = await serve(CachingDispatcher(), token="")
    unsigned = wx.WechatSigner(token="")
    async with client.get(unsigned.verify_url("e")) as resp:
        assert resp.status == 503
    path, body = unsigned.plain_post(wx.text_xml("x"))
    async with client.post(path, data=body) as resp:
        assert resp.status == 503


@pytest.mark.parametrize("budget", [0.0, wc.REPLY_DEADLINE_S, 10.0])
def test_reply_budget_must_be_below_wechats_deadline(budget):
    cfg = Config()
    cfg.wechat.token, cfg.wechat.reply_budget_s = TOKEN, budget
    with pytest.raises(ConfigError, match="reply_budget_s"):
        setup_wechat(web.Application(), cfg, CachingDispatcher())


def test_bad_aes_key_is_a_config_error():
    cfg = Config()
    cfg.wechat.token, cfg.wechat.mode, cfg.wechat.aes_key = TOKEN, "safe", "!" * 43
    with pytest.raises(ConfigError, match="aes_key"):
        setup_wechat(web.Application(), cfg, CachingDispatcher())


# --------------------------------------------------------------------------- issue 4: late answers, exactly once

APPSECRET = "app-secret-for-tests"
SEP = SEGMENT_SEPARATOR


@pytest.fixture
async def fake_api():
    server = FakeWechatApi(APPID, APPSECRET)
    server.url = await server.start()
    yield server
    await server.close()


@pytest.fixture
def quick_follow_up(monkeypatch):
    """Customer-service pages after a passive page 1 follow at once (not 1 s later)."""
    monkeypatch.setattr(wechat_late, "KF_FOLLOW_UP_DELAY_S", 0.01)


def service(fake: FakeWechatApi, **kw: Any) -> dict[str, Any]:
    return {"account_type": "service", "appsecret": APPSECRET, "api_base": fake.url, **kw}


def wechatpy_safe_post(aes_key: str, xml: str, nonce: str = "4455667788") -> tuple[str, bytes]:
    """A safe-mode POST as WeChat sends it, encrypted and signed by wechatpy (not by tests/wechat_client.py)."""
    ts = str(int(time.time()))
    envelope = WeChatCrypto(TOKEN, aes_key, APPID).encrypt_message(xml, nonce, ts)
    fields = wx.parse_reply(envelope)  # <Encrypt>, <MsgSignature>, <TimeStamp>, <Nonce>
    q = {"signature": wx.sign(TOKEN, ts, nonce), "timestamp": ts, "nonce": nonce, "openid": wx.USER,
         "encrypt_type": "aes", "msg_signature": fields["MsgSignature"]}
    body = f"<xml><ToUserName><![CDATA[{wx.ACCOUNT}]]></ToUserName><Encrypt><![CDATA[{fields['Encrypt']}]]></Encrypt></xml>"
    return "/wechat?" + urlencode(q), body.encode()


def wechatpy_open_reply(aes_key: str, body: str) -> dict[str, str]:
    env = wx.parse_reply(body)
    xml = WeChatCrypto(TOKEN, aes_key, APPID).decrypt_message(body, env["MsgSignature"], env["TimeStamp"], env["Nonce"])
    return wx.parse_reply(xml)


async def test_three_deliveries_while_slow_subscription_computes_once_and_delivers_once(serve, signer):
    dispatcher = CachingDispatcher(delay_s=2.0)  # the three deliveries (0.2 s each) all end before it does
    client = await serve(dispatcher, reply_budget_s=0.2)
    adapter = client.app[WECHAT_ADAPTER]
    xml = wx.text_xml("手脚冰凉怎么办", msg_id=4242)
    results = [await post(client, signer, xml, nonce=f"d{i}") for i in range(wc.MAX_DELIVERIES)]
    assert results == [(200, "success")] * wc.MAX_DELIVERIES  # each within its budget, no error for the user
    await adapter.drain(timeout_s=5)
    assert (dispatcher.started, dispatcher.completed) == (1, 1)
    # WeChat's next delivery of the same message gets the kept answer, passively...
    status, body = await post(client, signer, xml, nonce="d3")
    assert wx.parse_reply(body)["Content"] == "答：手脚冰凉怎么办"
    # ...and the user's next message gets only its own answer: delivered exactly once.
    dispatcher.delay_s = 0
    status, body = await post(client, signer, wx.text_xml("失眠怎么办", msg_id=4243))
    assert wx.parse_reply(body)["Content"] == "答：失眠怎么办"
    status, body = await post(client, signer, xml, nonce="d4")  # one more stray delivery: replayed, same text
    assert wx.parse_reply(body)["Content"] == "答：手脚冰凉怎么办"
    assert (adapter.stats["late_pending"], adapter.stats["pending_delivered"]) == (1, 1)
    assert dispatcher.started == 2


async def test_subscription_late_answer_comes_with_the_users_next_message(serve, signer):
    dispatcher = CachingDispatcher(delay_s=0.6)
    client = await serve(dispatcher, reply_budget_s=0.2)
    assert await post(client, signer, wx.text_xml("手脚冰凉怎么办", msg_id=51)) == (200, "success")
    await client.app[WECHAT_ADAPTER].drain(timeout_s=5)
    dispatcher.delay_s = 0
    status, body = await post(client, signer, wx.text_xml("失眠怎么办", msg_id=52))
    expected = "您之前问的“手脚冰凉怎么办”：\n答：手脚冰凉怎么办" + SEP + "答：失眠怎么办"
    assert wx.parse_reply(body)["Content"] == expected
    # Neither comes again: a re-delivery of 51 finds it delivered, of 52 gets the same reply.
    assert await post(client, signer, wx.text_xml("手脚冰凉怎么办", msg_id=51), nonce="r1") == (200, "success")
    status, body = await post(client, signer, wx.text_xml("失眠怎么办", msg_id=52), nonce="r2")
    assert wx.parse_reply(body)["Content"] == expected
    status, body = await post(client, signer, wx.text_xml("口干怎么办", msg_id=53))
    assert wx.parse_reply(body)["Content"] == "答：口干怎么办"


async def test_three_deliveries_while_slow_service_account_sends_once_through_the_api(serve, signer, fake_api):
    dispatcher = CachingDispatcher(delay_s=2.0)
    client = await serve(dispatcher, reply_budget_s=0.2, **service(fake_api))
    adapter = client.app[WECHAT_ADAPTER]
    xml = wx.text_xml("手脚冰凉怎么办", msg_id=4300)
    results = [await post(client, signer, xml, nonce=f"d{i}") for i in range(wc.MAX_DELIVERIES)]
    assert results == [(200, "success")] * wc.MAX_DELIVERIES
    await adapter.drain(timeout_s=5)
    assert dispatcher.started == 1
    assert fake_api.contents == ["答：手脚冰凉怎么办"]
    assert fake_api.sent[0]["touser"] == wx.USER and fake_api.calls[TOKEN_PATH] == 1
    assert await post(client, signer, xml, nonce="d3") == (200, "success")  # already sent: not again
    dispatcher.delay_s = 0
    status, body = await post(client, signer, wx.text_xml("失眠怎么办", msg_id=4301))
    assert wx.parse_reply(body)["Content"] == "答：失眠怎么办"
    assert fake_api.contents == ["答：手脚冰凉怎么办"]
    assert adapter.stats["late_kf"] == 1 and adapter.api.stats["kf_sent"] == 1


async def test_answer_ready_when_the_late_sender_and_a_retry_race_is_delivered_once(serve, signer, fake_api):
    """The retry arrives just as the computation ends: one of them claims it, never both."""
    for round_ in range(5):
        dispatcher = CachingDispatcher(delay_s=0.25)
        client = await serve(dispatcher, reply_budget_s=0.2, **service(fake_api))
        xml = wx.text_xml("问", msg_id=7000 + round_)
        first = asyncio.create_task(post(client, signer, xml, nonce="a"))
        await asyncio.sleep(0.22)
        status, body = await post(client, signer, xml, nonce="b")
        await first
        await client.app[WECHAT_ADAPTER].drain(timeout_s=5)
        passive = body != "success"
        sent = fake_api.contents.count("答：问")
        assert passive + sent == 1, (round_, body, fake_api.contents)
        fake_api.sent.clear()


@pytest.mark.parametrize("errcode", [wc.ERR_KF_OUT_OF_LIMIT, wc.ERR_API_QUOTA])
async def test_refused_customer_service_send_is_logged_and_the_answer_waits_for_the_next_message(
        serve, signer, fake_api, errcode):
    dispatcher = CachingDispatcher(delay_s=0.5)
    client = await serve(dispatcher, reply_budget_s=0.2, **service(fake_api))
    adapter = client.app[WECHAT_ADAPTER]
    fake_api.fail(SEND_PATH, errcode)
    with capture_logs() as logs:
        assert await post(client, signer, wx.text_xml("手脚冰凉怎么办", msg_id=81)) == (200, "success")
        await adapter.drain(timeout_s=5)
    assert fake_api.contents == [] and fake_api.calls[SEND_PATH] == 1
    expected_event = "wechat_api.kf_limit" if errcode == wc.ERR_KF_OUT_OF_LIMIT else "wechat_api.quota_exceeded"
    assert any(e["event"] == expected_event for e in logs)
    assert adapter.api.stats["kf_limit" if errcode == wc.ERR_KF_OUT_OF_LIMIT else "quota_exceeded"] == 1
    dispatcher.delay_s = 0
    status, body = await post(client, signer, wx.text_xml("失眠怎么办", msg_id=82))
    assert wx.parse_reply(body)["Content"] == "您之前问的“手脚冰凉怎么办”：\n答：手脚冰凉怎么办" + SEP + "答：失眠怎么办"


async def test_40001_during_a_late_send_refetches_the_token_once(serve, signer, fake_api):
    dispatcher = CachingDispatcher(delay_s=0.4)
    client = await serve(dispatcher, reply_budget_s=0.2, **service(fake_api))
    adapter = client.app[WECHAT_ADAPTER]
    await adapter.store.set("wechat:access_token", "token-another-worker-replaced", 6000)
    assert await post(client, signer, wx.text_xml("x", msg_id=91)) == (200, "success")
    await adapter.drain(timeout_s=5)
    assert fake_api.contents == ["答：x"]
    assert (fake_api.calls[TOKEN_PATH], fake_api.calls[SEND_PATH]) == (1, 2)


# --------------------------------------------------------------------------- issue 4: long answers

ANSWER_6000 = "".join(f"第{i}条建议：规律作息，早睡早起，饮食清淡，适量运动，保持心情舒畅。" for i in range(400))[:6000]


def _bodies(pages: list[str], hint: bool) -> list[str]:
    """Page bodies without the disclaimer tail (and the continuation line where ``hint``)."""
    out = []
    for page in pages:
        assert len(page.encode("utf-8")) <= wc.PASSIVE_TEXT_MAX_BYTES, len(page.encode())
        assert page.endswith("\n\n" + DISCLAIMER)
        page = page[: -len("\n\n" + DISCLAIMER)]
        if hint:
            page = page.removesuffix("\n\n" + MORE)
        out.append(page)
    return out


async def test_6000_character_answer_subscription_pages_in_order_under_2048_bytes(serve, signer):
    assert len(ANSWER_6000) == 6000
    client = await serve(CachingDispatcher(text=ANSWER_6000 + "\n\n" + DISCLAIMER))
    status, body = await post(client, signer, wx.text_xml("怎么养生", msg_id=300))
    pages = await read_pages(client, signer, wx.parse_reply(body)["Content"], 300)
    assert len(pages) >= 9
    assert "".join(_bodies(pages, hint=True)) == ANSWER_6000


async def test_6000_character_answer_service_page_1_passive_rest_through_the_api(serve, signer, fake_api,
                                                                                  quick_follow_up):
    client = await serve(CachingDispatcher(text=ANSWER_6000 + "\n\n" + DISCLAIMER), **service(fake_api))
    status, body = await post(client, signer, wx.text_xml("怎么养生", msg_id=400))
    first = wx.parse_reply(body)["Content"]
    assert MORE not in first  # the rest comes by itself
    await client.app[WECHAT_ADAPTER].drain(timeout_s=5)
    sent = fake_api.contents
    assert len(sent) == wc.KF_MESSAGES_PER_USER_MESSAGE  # the user's quota for one message
    assert MORE in sent[-1] and all(MORE not in p for p in sent[:-1])
    pages = await read_pages(client, signer, sent[-1], 400)  # the rest on "1"
    bodies = _bodies([first], hint=False) + _bodies(sent[:-1], hint=False) + _bodies(pages, hint=True)
    assert "".join(bodies) == ANSWER_6000


async def test_retried_continuation_gets_the_same_page_not_the_next(serve, signer):
    client = await serve(CachingDispatcher(text=ANSWER_6000))
    await post(client, signer, wx.text_xml("怎么养生", msg_id=500))
    one = wx.text_xml("1", msg_id=501)
    _, a = await post(client, signer, one, nonce="x")
    _, b = await post(client, signer, one, nonce="y")
    _, c = await post(client, signer, wx.text_xml("1", msg_id=502))
    assert wx.parse_reply(a)["Content"] == wx.parse_reply(b)["Content"] != wx.parse_reply(c)["Content"]


async def test_1_without_unread_pages_is_an_ordinary_message(serve, signer):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher)
    status, body = await post(client, signer, wx.text_xml("1", msg_id=600))
    assert wx.parse_reply(body)["Content"] == "答：1" and dispatcher.calls[0].text == "1"


async def test_a_new_answer_drops_unread_pages_of_the_old_one(serve, signer):
    dispatcher = CachingDispatcher(text=ANSWER_6000)
    client = await serve(dispatcher)
    await post(client, signer, wx.text_xml("怎么养生", msg_id=700))
    dispatcher.text = None
    await post(client, signer, wx.text_xml("别的问题", msg_id=701))
    status, body = await post(client, signer, wx.text_xml("1", msg_id=702))
    assert wx.parse_reply(body)["Content"] == "答：1"


def test_split_text_random_texts_keep_every_character_in_order():
    rng = random.Random(11)
    alphabet = ["a", " ", ".", "。", "，", "\n", "中", "é", "😀", "👨\u200d👩\u200d👧", "！", "e\u0301", "]]>"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000)))
        limit = rng.choice([4, 16, 100, 700, wc.PASSIVE_TEXT_MAX_BYTES])
        parts = split_text(text, limit)
        assert all(len(p.encode("utf-8")) <= limit for p in parts)
        assert "".join(parts).replace(" ", "").replace("\n", "") == text.replace(" ", "").replace("\n", "")


def test_paginate_leaves_room_for_the_hint_and_the_tail():
    text = "。".join(["很长的一句话" * 20] * 60) + "\n\n" + DISCLAIMER
    pages = paginate(text, "zh")
    assert pages.tail == DISCLAIMER and len(pages.bodies) > 3
    for i in range(len(pages.bodies)):
        assert len(pages.page(i, more=True).encode()) <= wc.PASSIVE_TEXT_MAX_BYTES
    assert paginate("短", "en").page(0) == "短"
    assert "Reply 1 for more" in paginate("x. " * 2000, "en").page(0, more=True)


# --------------------------------------------------------------------------- issue 4: XML safety, safe mode

async def test_u0002_in_a_message_and_cdata_end_in_the_answer_give_valid_xml(serve, signer):
    class Echo(CachingDispatcher):
        async def _compute(self, inbound):
            return Reply(f"答：{inbound.text}]]><b>&amp;\x02结束", Intent.ANSWER)

    client = await serve(Echo())
    status, body = await post(client, signer, wx.text_xml("头\x02疼", msg_id=800))
    assert status == 200
    assert wx.parse_reply(body)["Content"] == "答：头疼]]><b>&amp;结束"  # parses; \x02 gone both ways


async def test_safe_mode_round_trip_built_and_encrypted_by_wechatpy(serve, signer):
    dispatcher = CachingDispatcher()
    client = await serve(dispatcher, mode="safe", aes_key=signer.aes_key)
    path, body = wechatpy_safe_post(signer.aes_key, wx.text_xml("秋燥\x02怎么办]]>", msg_id=900))
    async with client.post(path, data=body) as resp:
        assert resp.status == 200
        reply = wechatpy_open_reply(signer.aes_key, await resp.text())
    assert reply["Content"] == "答：秋燥怎么办]]>"
    assert (reply["ToUserName"], reply["FromUserName"], reply["MsgType"]) == (wx.USER, wx.ACCOUNT, "text")


async def test_safe_mode_late_answer_arrives_encrypted_with_the_next_message(serve, signer):
    dispatcher = CachingDispatcher(delay_s=0.5)
    client = await serve(dispatcher, mode="safe", aes_key=signer.aes_key, reply_budget_s=0.2)
    path, body = wechatpy_safe_post(signer.aes_key, wx.text_xml("头疼", msg_id=910))
    async with client.post(path, data=body) as resp:
        assert (resp.status, await resp.text()) == (200, "success")
    await client.app[WECHAT_ADAPTER].drain(timeout_s=5)
    dispatcher.delay_s = 0
    path, body = wechatpy_safe_post(signer.aes_key, wx.text_xml("眼干", msg_id=911))
    async with client.post(path, data=body) as resp:
        reply = wechatpy_open_reply(signer.aes_key, await resp.text())
    assert reply["Content"] == "您之前问的“头疼”：\n答：头疼" + SEP + "答：眼干"


# --------------------------------------------------------------------------- issue 4: handoff, unsubscribe

class HandoffDispatcher(CachingDispatcher):
    """"转人工" → the dispatcher's HANDOFF reply (bot/intents.py wording)."""

    async def _compute(self, inbound):
        await asyncio.sleep(self.delay_s)
        if "人工" in inbound.text:
            return Reply("好的，正在为您转接人工客服，请稍候。", Intent.HANDOFF, handoff=True)
        return Reply(f"答：{inbound.text}", Intent.ANSWER)


@pytest.mark.parametrize("kf_account", ["", "nurse1@gh_test_account"])
async def test_zhuan_rengong_replies_transfer_customer_service(serve, signer, kf_account):
    client = await serve(HandoffDispatcher(), kf_account=kf_account)
    status, body = await post(client, signer, wx.text_xml("转人工", msg_id=1000))
    root = ET.fromstring(body)
    assert root.findtext("MsgType") == "transfer_customer_service"
    assert (root.findtext("ToUserName"), root.findtext("FromUserName")) == (wx.USER, wx.ACCOUNT)
    assert root.findtext("Content") is None
    assert root.findtext("TransInfo/KfAccount") == (kf_account or None)
    status, again = await post(client, signer, wx.text_xml("转人工", msg_id=1000), nonce="retry")
    assert ET.fromstring(again).findtext("MsgType") == "transfer_customer_service"


async def test_service_account_handoff_also_sends_the_text(serve, signer, fake_api, quick_follow_up):
    client = await serve(HandoffDispatcher(), **service(fake_api))
    status, body = await post(client, signer, wx.text_xml("我要人工客服", msg_id=1100))
    assert ET.fromstring(body).findtext("MsgType") == "transfer_customer_service"
    await client.app[WECHAT_ADAPTER].drain(timeout_s=5)
    assert fake_api.contents == ["好的，正在为您转接人工客服，请稍候。"]


async def test_late_handoff_text_is_not_queued_for_a_subscription_account(serve, signer):
    dispatcher = HandoffDispatcher(delay_s=0.4)
    client = await serve(dispatcher, reply_budget_s=0.2)
    assert await post(client, signer, wx.text_xml("转人工", msg_id=1200)) == (200, "success")
    await client.app[WECHAT_ADAPTER].drain(timeout_s=5)
    dispatcher.delay_s = 0
    status, body = await post(client, signer, wx.text_xml("口干", msg_id=1201))
    assert wx.parse_reply(body)["Content"] == "答：口干"


async def test_unsubscribe_forgets_the_user_everywhere(serve, signer):
    core = CachingDispatcher(text=ANSWER_6000)
    forgotten: list[tuple[str, str]] = []

    async def forget_user(channel: str, user_id: str) -> None:  # Dispatcher.forget_user
        forgotten.append((channel, user_id))

    core.forget_user = forget_user
    client = await serve(core)
    store = client.app[WECHAT_ADAPTER].store
    await post(client, signer, wx.text_xml("怎么养生", msg_id=1300))  # leaves unread pages
    await store.push(f"wechat:pending:{wx.USER}", '{"msgid": "1", "q": "x", "text": "y"}')
    assert await post(client, signer, wx.event_xml("unsubscribe")) == (200, "success")
    assert forgotten == [("wechat", wx.USER)]
    assert await store.get(f"wechat:more:{wx.USER}") is None
    assert await store.pop_all(f"wechat:pending:{wx.USER}") == []


class BrokenStore(MemoryStore):
    async def set_if_absent(self, key, value, ttl_s=None):
        raise ConnectionError("store down")

    async def claim_and_read(self, key, value, ttl_s=None, strings=(), lists=(), bucket=None, if_found=None, record=None):
        raise ConnectionError("store down")


async def test_store_outage_still_answers_passively(serve, signer):
    clients: list[TestClient] = []
    cfg = Config()
    cfg.wechat.token, cfg.wechat.appid = TOKEN, APPID
    app = web.Application()
    setup_wechat(app, cfg, CachingDispatcher(), store=BrokenStore())
    client = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    clients.append(client)
    try:
        status, body = await post(client, signer, wx.text_xml("头疼", msg_id=1400))
        assert wx.parse_reply(body)["Content"] == "答：头疼"
        assert client.app[WECHAT_ADAPTER].stats["store_errors"] == 1
    finally:
        await client.close()


def test_service_account_without_appsecret_is_a_config_error():
    cfg = Config()
    cfg.wechat.token, cfg.wechat.appid, cfg.wechat.account_type = TOKEN, APPID, "service"
    with pytest.raises(ConfigError, match="appsecret"):
        setup_wechat(web.Application(), cfg, CachingDispatcher(), store=MemoryStore())


# --------------------------------------------------------------------------- issue 4: with the real dispatcher


@requires_model
async def test_real_dispatcher_zhuan_rengong_transfers_and_records_the_handoff(serve, signer, dispatcher):
    user = "oREAL_handoff_user_" + str(time.time_ns())
    client = await serve(dispatcher)
    status, body = await post(client, signer, wx.text_xml("转人工", msg_id=time.time_ns() % 10**15, user=user))
    assert ET.fromstring(body).findtext("MsgType") == "transfer_customer_service"
    assert await dispatcher.handoff.active("wechat", user) is not None
    # In handoff, the user's next message goes to the agents too (the bot stays silent).
    status, body = await post(client, signer, wx.text_xml("你好，在吗", msg_id=time.time_ns() % 10**15, user=user))
    assert ET.fromstring(body).findtext("MsgType") == "transfer_customer_service"
    event = wx.event_xml("unsubscribe").replace(wx.USER, user)
    assert await post(client, signer, event) == (200, "success")
    assert await dispatcher.handoff.active("wechat", user) is None


@requires_model
async def test_real_dispatcher_records_a_requests_nonce_with_its_claim_and_refuses_another_body(signer, dispatcher, cfg):
    """With the dispatcher's own store, a text message's replay record goes with its claim (one store
    round trip, bot/dedup.py); a captured query string with another body is still refused 403 before
    anything is computed, read or written for it, on the text path, the "1" path and while the first
    computation is in flight."""
    wcfg = Config()
    wcfg.wechat.token, wcfg.wechat.appid = TOKEN, APPID
    app = web.Application()
    setup_wechat(app, wcfg, dispatcher, store=dispatcher.store)
    client = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    try:
        stamp = time.time_ns()
        user, victim = f"oREPLAY_{stamp}", f"oVICTIM_{stamp}"
        path, first = signer.plain_post(wx.text_xml("失眠怎么调理", msg_id=stamp % 10**15, user=user),
                                        nonce=str(stamp % 10**9))
        answers = []
        for _ in range(2):  # WeChat's re-delivery: the same query and body, the same answer
            async with client.post(path, data=first) as resp:
                answers.append((resp.status, await resp.text()))
        assert answers[0] == answers[1] and answers[0][0] == 200 and "睡" in answers[0][1]
        forged_msg = stamp % 10**15 + 1
        for forged in (wx.text_xml("手脚冰凉怎么办", msg_id=forged_msg, user=victim),
                       wx.text_xml("1", msg_id=forged_msg + 1, user=victim)):
            async with client.post(path, data=forged.encode()) as resp:
                assert (resp.status, await resp.text()) == (403, "replayed nonce")
        assert await dispatcher.store.get(f"dedup:wechat:{victim}:{forged_msg}") is None  # never claimed
        assert await dispatcher.store.get(dispatcher.sessions.key("wechat", victim)) is None  # nothing computed

        # A forged body with the same user and message id as a computation in flight shares no reply
        # (the legitimate request's record already stored, as by its first delivery).
        record = (f"wechat:nonce:{stamp}:n", "digest-a", 60.0)
        await dispatcher.store.set(*record)
        legit = Inbound("wechat", user, user, f"m{stamp}", MessageKind.TEXT, "口腔溃疡怎么办", replay_record=record)
        forged_in = Inbound("wechat", user, user, f"m{stamp}", MessageKind.TEXT, "口腔溃疡怎么办 ",
                            replay_record=(record[0], "digest-b", 60.0))
        results = await asyncio.gather(dispatcher.handle(legit), dispatcher.handle(forged_in), return_exceptions=True)
        assert results[0].intent is Intent.ANSWER and type(results[1]).__name__ == "ReplayRefused"
    finally:
        await client.close()
