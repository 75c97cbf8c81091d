"""WeChat adapter over real HTTP on loopback, against an independent test client.

The dispatcher here is a small stand-in that deduplicates like the real one
(bot/dedup.py): a retry of a running computation awaits it, a retry of a finished
one gets the stored Reply. End-to-end tests with the real dispatcher live elsewhere.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from adapters import wechat_constants as wc
from adapters.wechat import WECHAT_ADAPTER, fit_passive_text, setup_wechat
from bot.config import Config, ConfigError
from bot.types import Inbound, Intent, MessageKind, Reply
try:  # tests/ is a package or a rootdir-relative folder, depending on who adds __init__.py
    from tests import wechat_client as wx
except ImportError:  # pragma: no cover
    import wechat_client as wx  # type: ignore[no-redef]

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
        setup_wechat(app, cfg, dispatcher)
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


async def test_long_reply_is_cut_to_2048_bytes_keeping_the_disclaimer(serve, signer):
    answer = "".join(f"第{i}条：早睡早起，适当运动，饮食清淡。" for i in range(200))
    text = answer + "\n\n" + DISCLAIMER
    assert len(text.encode()) > 3 * wc.PASSIVE_TEXT_MAX_BYTES
    client = await serve(CachingDispatcher(text=text))
    status, body = await post(client, signer, wx.text_xml("x"))
    content = wx.parse_reply(body)["Content"]
    assert len(content.encode("utf-8")) <= wc.PASSIVE_TEXT_MAX_BYTES
    assert content.endswith("\n\n" + DISCLAIMER)
    head = content[: -len("\n\n" + DISCLAIMER)]
    assert head.endswith("。…")  # cut at a sentence end, marked
    assert answer.startswith(head[:-1])


async def test_long_reply_without_paragraphs_is_cut_on_a_character_boundary(serve, signer):
    text = "a" + "中" * 1000  # 3001 bytes; byte 2048 falls inside a character
    client = await serve(CachingDispatcher(text=text))
    status, body = await post(client, signer, wx.text_xml("x"))
    content = wx.parse_reply(body)["Content"]
    assert len(content.encode("utf-8")) <= wc.PASSIVE_TEXT_MAX_BYTES
    assert content.endswith("…") and text.startswith(content[:-1])
    assert len(content.encode("utf-8")) > wc.PASSIVE_TEXT_MAX_BYTES - 6  # nothing more than needed dropped


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
