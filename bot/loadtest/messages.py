"""What the load generator sends: the requests a WeChat or Telegram server would deliver to the
webhooks, and the reading of WeChat's answers.

The load generator is a WeChat *client*, so it holds its own copy of the few protocol values
it needs (the server's are in adapters/wechat/, which bot/ does not import). Sources: the
WeChat official-account developer documentation, https://developers.weixin.qq.com/doc/offiaccount/
(pages "消息管理 / 接收普通消息", "被动回复用户消息", "消息加解密说明", "消息转发到客服"); the
Telegram Bot API, https://core.telegram.org/bots/api#setwebhook (``secret_token``).
"""

from __future__ import annotations

import json
import random
import time
from urllib.parse import urlencode

import defusedxml.ElementTree as safe_et
from wechatpy.crypto import WeChatCrypto
from wechatpy.utils import WeChatSigner

__all__ = ["AES_KEY_CHARS", "BUSY_TEXTS", "LATE_MARKERS", "MORE_MARKERS", "NO_REPLY", "REPLY_DEADLINE_S",
           "SLOW_DOWN_TEXTS", "TELEGRAM_PATH", "TRANSFER_MSG_TYPE", "TelegramRequests", "WechatRequests",
           "answer_kind"]

REPLY_DEADLINE_S = 5.0
"""Seconds WeChat waits for the webhook's HTTP response. Source: 接收普通消息 —
"微信服务器在五秒内收不到响应会断掉连接，并且重新发起请求"."""

NO_REPLY = "success"
"""The body that means "no reply, do not retry". Source: 被动回复用户消息 — "直接回复success（推荐方式）"."""

AES_KEY_CHARS = 43
"""Length of the EncodingAESKey (base64 of 32 bytes without the trailing ``=``). Source: 消息加解密说明."""

TRANSFER_MSG_TYPE = "transfer_customer_service"
"""Passive reply MsgType that hands the message to the customer-service system. Source: 消息转发到客服."""

TELEGRAM_PATH = "/telegram"
"""The server's Telegram webhook route."""


# The server's own texts that tell what a passive reply carries (copies: bot/ does not import
# adapters/; tests/test_loadtest.py checks they match adapters/wechat/ and bot/dispatcher.py).
LATE_MARKERS = ("您之前问的“", 'Your earlier question "')
"""How a passive reply starts an answer to an *earlier* message of the same user (an answer
that missed its reply budget and waited for the user's next message; PENDING_HEADER in
adapters/wechat/store_state.py)."""
MORE_MARKERS = ("回复 1 查看更多", "Reply 1 for more")
"""The line on page 1 of an answer longer than one passive reply (MORE_HINT in adapters/wechat/pages.py)."""
BUSY_TEXTS = ("现在咨询的人有点多，请稍等几秒再发一次您的问题",
              "I'm a little busy right now. Please send your question again")
"""The start of the dispatcher's "busy, send it again" reply (BUSY_REPLY in bot/dispatcher.py)."""
SLOW_DOWN_TEXTS = ("您发消息有点快，请稍等几秒再发", "You're sending messages a little fast.")
"""The start of the per-user rate limit's reply (SLOW_DOWN_REPLY in bot/dispatcher.py)."""


def answer_kind(content: str) -> str:
    """What a text reply is beyond an answer: ``busy`` or ``slow_down`` (not a real answer),
    ``late`` (it carries an earlier message's answer), ``paged`` (more pages follow on "1"),
    else ``""`` (one whole answer)."""
    if content.startswith(BUSY_TEXTS):
        return "busy"
    if content.startswith(SLOW_DOWN_TEXTS):
        return "slow_down"
    if any(m in content for m in LATE_MARKERS):
        return "late"
    if any(m in content for m in MORE_MARKERS):
        return "paged"
    return ""


def _cdata(value: str) -> str:
    return "<![CDATA[" + value.replace("]]>", "]]]]><![CDATA[>") + "]]>"


class WechatRequests:
    """Builds signed (and in safe mode encrypted) WeChat deliveries; checks their answers."""

    ACCOUNT = "gh_loadtest_account"

    def __init__(self, token: str, appid: str = "", aes_key: str = "", mode: str = "plaintext"):
        self.token = token
        self.encrypted = mode == "safe"  # compatible mode: plaintext requests are accepted too
        self.crypto = WeChatCrypto(token, aes_key, appid) if self.encrypted else None
        self.msg_base = (int(time.time() * 1000) << 20) % (1 << 62)  # unique MsgIds per run (64-bit)

    def _sign(self, *parts: str) -> str:
        signer = WeChatSigner()
        signer.add_data(self.token, *parts)
        return signer.signature

    def build(self, openid: str, seq: int, text: str) -> tuple[str, bytes, dict[str, str]]:
        now = int(time.time())
        xml = ("<xml>" f"<ToUserName>{_cdata(self.ACCOUNT)}</ToUserName><FromUserName>{_cdata(openid)}</FromUserName>"
               f"<CreateTime>{now}</CreateTime><MsgType>{_cdata('text')}</MsgType>"
               f"<Content>{_cdata(text)}</Content><MsgId>{self.msg_base + seq}</MsgId></xml>")
        ts, nonce = str(now), str(random.randint(10**8, 10**10))
        query = {"signature": self._sign(ts, nonce), "timestamp": ts, "nonce": nonce, "openid": openid}
        if self.crypto is not None:
            envelope = safe_et.fromstring(self.crypto.encrypt_message(xml, nonce, ts))
            encrypt = envelope.findtext("Encrypt") or ""
            query.update(encrypt_type="aes", msg_signature=envelope.findtext("MsgSignature") or "")
            xml = (f"<xml><ToUserName>{_cdata(self.ACCOUNT)}</ToUserName>"
                   f"<Encrypt>{_cdata(encrypt)}</Encrypt></xml>")
        return "/wechat?" + urlencode(query), xml.encode("utf-8"), {"Content-Type": "text/xml"}

    def outcome(self, body: str, openid: str) -> str:
        return self.answer(body, openid)[0]

    def answer(self, body: str, openid: str) -> tuple[str, str]:
        """``(outcome, text)``: the outcome (``text``, ``transfer``, ``deferred`` or an error
        kind) and a text reply's content ("" otherwise)."""
        if body == NO_REPLY:
            return "deferred", ""
        try:
            root = safe_et.fromstring(body)
            if self.crypto is not None:
                root = safe_et.fromstring(self.crypto.decrypt_message(
                    body, root.findtext("MsgSignature"), root.findtext("TimeStamp"), root.findtext("Nonce")))
        except Exception:  # noqa: BLE001 — any unreadable answer is an error of the server
            return "bad_reply", ""
        if root.findtext("ToUserName") != openid:
            return "wrong_user", ""
        kind = root.findtext("MsgType")
        content = (root.findtext("Content") or "").strip()
        if kind == "text" and content:
            return "text", content
        if kind == TRANSFER_MSG_TYPE:
            return "transfer", ""
        return "bad_reply", ""


class TelegramRequests:
    """Builds Telegram webhook deliveries (an Update JSON and the secret-token header)."""

    def __init__(self, secret: str):
        self.secret = secret
        self.update_base = int(time.time()) % 10**6 * 10**3

    def build(self, user: int, seq: int, text: str) -> tuple[str, bytes, dict[str, str]]:
        update = {"update_id": self.update_base + seq, "message": {
            "message_id": seq + 1, "date": int(time.time()), "text": text,
            "chat": {"id": user, "type": "private", "first_name": "Load"},
            "from": {"id": user, "is_bot": False, "first_name": "Load", "language_code": "zh-hans"}}}
        headers = {"Content-Type": "application/json", "X-Telegram-Bot-Api-Secret-Token": self.secret}
        return TELEGRAM_PATH, json.dumps(update, ensure_ascii=False).encode("utf-8"), headers
