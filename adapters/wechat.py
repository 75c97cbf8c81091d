"""WeChat official-account (公众号) adapter: ``GET /wechat`` and ``POST /wechat``.

A thin translator (ARCHITECTURE.md, "One message, end to end"): it checks the
request really comes from WeChat, parses the XML into one :class:`bot.types.Inbound`,
calls ``dispatcher.handle`` and renders the :class:`bot.types.Reply` as a passive
reply (or, when late, through the customer-service API or on the user's next
message). No business logic: which text a follow, a voice note or a menu click
gets is the dispatcher's decision.

Protocol source: WeChat official-account developer documentation
(https://developers.weixin.qq.com/doc/offiaccount/), pages 接入指南 (URL
verification), 接收普通消息, 接收事件推送, 被动回复用户消息, 消息加解密说明, 客服消息
and 消息转发到客服; limits in :mod:`adapters.wechat_constants`. Signatures, AES and
message parsing use wechatpy; untrusted XML passes defusedxml (no DTD, no
entities) before any parser. Outbound API calls: :mod:`adapters.wechat_api`.

Request checks, in order (each answers a short plain-text body, never a trace):

* signature — ``signature`` = sha1 of the sorted [token, timestamp, nonce]; bad or
  missing: 403 ``invalid signature``. Encrypted requests also need ``msg_signature``
  = sha1 of the sorted [token, timestamp, nonce, Encrypt] (403 when wrong).
* timestamp — not 1–15 digits, or further than ``wechat.timestamp_window_s`` from
  now: 403 (replay).
* body — over ``server.max_body_bytes``: 413; not UTF-8, not well-formed, with a
  DOCTYPE or entities, nested deeper than
  :data:`~adapters.wechat_parse.MAX_XML_DEPTH`, or not a WeChat message (a text
  field holding elements, a repeated field): 400. Parsing lives in
  :mod:`adapters.wechat_parse`; in the encrypted modes ``<Encrypt>`` is found
  without an XML parser and ``msg_signature`` checked before the envelope is parsed.

Modes (``wechat.mode``): ``plaintext``; ``safe`` — every POST is AES-encrypted
(``encrypt_type=aes``), decrypted with ``msg_signature`` and answered encrypted;
``compatible`` — encrypted when the query says ``encrypt_type=aes``, else plaintext.

The deadline:
    WeChat waits :data:`~adapters.wechat_constants.REPLY_DEADLINE_S` (5 s) and then
    re-delivers, :data:`~adapters.wechat_constants.MAX_DELIVERIES` (3) times in all;
    after the last failed one the user sees "该公众号暂时无法提供服务". Answering
    ``success`` stops the retries. Each delivery waits for ``dispatcher.handle`` (which
    computes a message once, however often it is delivered) at most
    ``wechat.reply_budget_s`` from the request's arrival, on a *shielded* task:

    * ready in time: the passive reply;
    * not ready: ``success`` at once; when the computation ends, the answer goes out
      (``account_type = "service"``) through ``/cgi-bin/message/custom/send``, or
      (``"subscription"``, no such API) into the user's pending-answer queue, from
      which the next passive reply to that user — WeChat's next delivery of the same
      message, or the user's next message — takes it (prefixed with the question it
      answers). A failed customer-service send also falls back to that queue.

    Exactly one path delivers each answer. The store key ``wechat:delivered:<MsgId>``
    (:data:`DELIVERED_KEY`) is claimed with ``set_if_absent`` by whoever delivers:
    a passive reply (the value keeps the reply, so a re-delivery WeChat makes because
    our response did not reach it gets the same reply again), the customer-service
    sender, or the pending queue. The dispatcher's dedup hands a retry the same
    finished Reply; the claim is what stops it from also being queued or sent. Queue
    entries leave only through ``pop_all`` immediately followed by a passive reply.

    Shutdown (:meth:`WechatAdapter.drain`, then :meth:`WechatAdapter.hand_over`): late
    answers still computing at the server's drain deadline are handed to the store
    (``wechat:unfinished``) and the next process to start computes and delivers them;
    pages not yet sent go to the pending queue. Nothing is delivered after the store
    is closed.

    Not chosen: holding deliveries 1 and 2 open past 5 s so that WeChat's retry picks
    up a late answer. A miscounted delivery (one lost on the way) would make us hold
    the last one, and the user would see WeChat's error.

Long answers (:func:`paginate`): split on sentence boundaries into pages of at most
:data:`~adapters.wechat_constants.PASSIVE_TEXT_MAX_BYTES` UTF-8 bytes, the closing
paragraph (the medical disclaimer) repeated on every page. A passive reply carries
page 1; the rest go out through the customer-service API (service accounts, at most
:data:`~adapters.wechat_constants.KF_MESSAGES_PER_USER_MESSAGE` messages) or wait in
``wechat:more:<OpenID>`` with a "回复 1 查看更多" / "Reply 1 for more" line: a
user's "1" gets the next page.

Handoff: a Reply with intent HANDOFF (the user asked for a person, or the
dispatcher relays a message of a user already handed off) is answered with MsgType
``transfer_customer_service`` (with ``<TransInfo><KfAccount>`` when
``wechat.kf_account`` is set); the dispatcher records the handoff itself. A service
account also sends the Reply's text through the customer-service API.

Message kinds: text → TEXT; voice → TEXT with ``Recognition`` when WeChat's speech
recognition filled it, else UNSUPPORTED (``raw["type"] = "voice"``); image, video,
shortvideo, location, link, file and any other type → UNSUPPORTED (``raw["type"]``);
event subscribe (also by QR code) → SUBSCRIBE; every other event → EVENT with
``raw["event"]`` (lower case) and ``raw["event_key"]``. Menu CLICK is an EVENT, not
TEXT: its EventKey is an identifier the operator chose in the menu editor
(``V1001_TIPS``), not words a user typed. An EVENT reply with empty text answers
``success`` (or what is pending for the user). ``unsubscribe`` answers ``success``
and forgets the user: the dispatcher's handoff and session state, the pending
queue and unread pages.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import time
import unicodedata
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from aiohttp import web
from wechatpy.crypto import PrpCrypto, WeChatCrypto
from wechatpy.exceptions import InvalidAppIdException, InvalidSignatureException
from wechatpy.replies import TextReply, TransferCustomerServiceReply
from wechatpy.utils import WeChatSigner

from adapters import wechat_constants as wc
from adapters.body import BodyTooLarge, read_limited
from adapters.wechat_api import SendOutcome, WechatApi
from adapters.wechat_parse import Reject as _Reject
from adapters.wechat_parse import (extract_encrypt, parse_inbound, parse_timestamp, parse_xml,
                                   strip_invalid_xml_chars)
from bot.admission import ADMISSION_KEY, Admission
from bot.config import Config, ConfigError
from bot.handoff import HandoffManager, PlatformAgentRelay
from bot.store import Store, open_store
from bot.types import Inbound, Intent, MessageKind, Reply
from safety.pii import mask_pii

log = structlog.get_logger("healthbot.wechat")

__all__ = [
    "DELIVERED_KEY",
    "MORE_KEY",
    "PENDING_KEY",
    "UNFINISHED_KEY",
    "WECHAT_ADAPTER",
    "Pages",
    "WechatAdapter",
    "fit_passive_text",
    "paginate",
    "parse_inbound",
    "render_text_reply",
    "render_transfer_reply",
    "setup_wechat",
    "split_text",
    "strip_invalid_xml_chars",
]

_SENTENCE_ENDS = frozenset("。！？!?；;…\n")
_CLOSERS = frozenset("\"'”’」』）)】]》")  # kept with the sentence they close
_SOFT_BREAKS = frozenset("，,、：: \t")      # where an over-long sentence is cut, if possible
_GLUE = frozenset("\u200d\ufe0e\ufe0f")     # never start a page with these (ZWJ, variation selectors)
_ELLIPSIS = "…"
_CDATA_END = "]]>"
_CDATA_END_SPLIT = "]]]]><![CDATA[>"  # closes the section after "]]" and reopens it before ">"

DELIVERED_KEY = "wechat:delivered:{msgid}"
"""Store key of one message's delivery state (JSON ``{"via": "passive"|"kf"|"pending"|"composing", ...}``)."""
PENDING_KEY = "wechat:pending:{openid}"
"""Store list of a user's answers computed after their webhook answered (JSON ``{"msgid", "q", "text", "lang"}``;
``q``, the question's first characters, with personal data masked)."""
MORE_KEY = "wechat:more:{openid}"
"""Store key of a user's unread pages (JSON ``{"bodies": [...], "tail", "lang"}``), served one per "1"."""
UNFINISHED_KEY = "wechat:unfinished"
"""Store list of messages whose answer was still being computed when a process shut down
(JSON of the :class:`~bot.types.Inbound`, :func:`_inbound_to_json`); the next process to
start (any replica) computes and delivers them (:meth:`WechatAdapter.recover`)."""
UNFINISHED_TTL_S = 3600.0
"""Seconds a message left unfinished by a shutdown waits for the next process."""
SHUTDOWN_GRACE_S = 0.5
"""Seconds a shutdown waits, after handing unfinished work to the store, for the last store writes."""

DELIVERY_STATE_TTL_S = 3600.0
"""Seconds a delivery claim is kept: past WeChat's retries (~15 s) and the dispatcher's
own dedup window (bot/dedup.py, 3600 s), so no later delivery path can claim it again."""
COMPOSING_TTL_S = 10.0
"""Seconds the "composing" claim lives before the final state replaces it; if the
process dies in between, the message becomes claimable again."""
PENDING_TTL_S = 24 * 3600.0
"""Seconds an undelivered answer waits for the user's next message."""
MORE_TTL_S = 24 * 3600.0
"""Seconds unread pages of a long answer wait for "1"."""
KF_FOLLOW_UP_DELAY_S = 1.0
"""Seconds between a passive page 1 and the customer-service messages with the rest,
so that they reach the user after it."""
COMPOSING_WAIT_S = 1.0
"""Most seconds a retry waits for a concurrent delivery of the same message to finish composing."""

MORE_HINT = {"zh": "回复 1 查看更多", "en": "Reply 1 for more"}
"""The continuation line on a page that has more after it, by language."""
CONTINUE_WORDS = frozenset({"1", "１"})
"""A user's text (stripped) that asks for the next page."""
PENDING_HEADER = {"zh": "您之前问的“{q}”：", "en": 'Your earlier question "{q}":'}
CONTINUED_HEADER = {"zh": "（接上条）", "en": "(continued)"}
SEGMENT_SEPARATOR = "\n\n——————\n\n"
QUESTION_SNIPPET_CHARS = 24


class DispatcherLike(Protocol):
    """What the adapter needs from the core: ``handle(Inbound) -> Reply`` (deduplicating).

    Optional: ``handoff`` and ``sessions`` objects with ``forget(channel, user_id)``
    (bot.dispatcher.Dispatcher has both), called on unsubscribe.
    """

    async def handle(self, inbound: Inbound) -> Reply: ...


# --------------------------------------------------------------------------- text


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def _cut_utf8(text: str, max_bytes: int) -> str:
    """The longest prefix of ``text`` of at most ``max_bytes`` UTF-8 bytes (never half a character)."""
    if max_bytes <= 0:
        return ""
    cut = text.encode("utf-8")[:max_bytes].decode("utf-8", "ignore")
    return cut.rstrip("\u200d")  # a zero-width joiner left at the end would glue nothing


def _back_to_sentence(text: str) -> str:
    """``text`` cut after its last sentence end, if that keeps at least half of it."""
    for i in range(len(text) - 1, len(text) // 2 - 1, -1):
        ch = text[i]
        if ch in _SENTENCE_ENDS or (ch == "." and i + 1 < len(text) and text[i + 1].isspace()):
            return text[: i + 1]
    return text


def fit_passive_text(text: str, max_bytes: int = wc.PASSIVE_TEXT_MAX_BYTES) -> str:
    """``text`` shortened to at most ``max_bytes`` UTF-8 bytes for a passive reply.

    Unchanged when it fits. Otherwise the last paragraph (after the last blank line,
    else the last line — where the dispatcher puts the medical disclaimer) is kept
    whole when it takes at most half of ``max_bytes``; the text before it is cut on
    a character boundary, moved back to the end of a sentence (。！？!?; …) when that
    keeps at least half of it, and marked with "…".

    Args:
        text: the reply text (already free of XML-invalid characters).
        max_bytes: the limit in UTF-8 bytes; default
            :data:`~adapters.wechat_constants.PASSIVE_TEXT_MAX_BYTES` (2048,
            被动回复用户消息).

    Returns:
        A string whose UTF-8 encoding is at most ``max_bytes`` bytes.
    """
    if _nbytes(text) <= max_bytes:
        return text
    mark = _ELLIPSIS if _nbytes(_ELLIPSIS) < max_bytes else ""
    body, tail = text, ""
    for sep in ("\n\n", "\n"):
        at = text.rstrip().rfind(sep)
        if at > 0 and text[at:].strip():
            body, tail = text[:at], text[at:].rstrip()
            break
    if tail and _nbytes(tail) + _nbytes(mark) > max_bytes // 2:
        body, tail = text, ""
    head = _cut_utf8(body, max_bytes - _nbytes(tail) - _nbytes(mark))
    head = _back_to_sentence(head).rstrip()
    return head + mark + tail


def _cdata(text: str) -> str:
    """``text`` made safe inside wechatpy's ``<![CDATA[...]]>`` (it does not escape "]]>")."""
    return text.replace(_CDATA_END, _CDATA_END_SPLIT)


def render_text_reply(text: str, to_user: str, from_user: str, now: float | None = None) -> str:
    """The passive text reply XML (被动回复用户消息, 回复文本消息).

    Args:
        text: the reply; XML-invalid characters are dropped, it is cut to
            :data:`~adapters.wechat_constants.PASSIVE_TEXT_MAX_BYTES` UTF-8 bytes
            (:func:`fit_passive_text`) and "]]>" is split so the CDATA stays intact.
        to_user: the user's OpenID (the message's FromUserName).
        from_user: the account's original id (the message's ToUserName).
        now: CreateTime, UNIX seconds (default: now).
    """
    content = fit_passive_text(strip_invalid_xml_chars(text))
    reply = TextReply(source=_cdata(from_user), target=_cdata(to_user), content=_cdata(content),
                      time=int(time.time() if now is None else now))
    return reply.render()


def _sentences(text: str) -> list[str]:
    """``text`` as consecutive pieces (joined they give ``text``), each ending after a
    sentence end (。！？!?；;…, a newline, or "." before whitespace), the closing quotes
    or brackets after it and the whitespace that follows."""
    out: list[str] = []
    start, i, n = 0, 0, len(text)
    while i < n:
        ch = text[i]
        end = ch in _SENTENCE_ENDS or (ch == "." and i + 1 < n and text[i + 1].isspace())
        i += 1
        if end:
            while i < n and (text[i] in _SENTENCE_ENDS or text[i] in _CLOSERS):
                i += 1
            while i < n and text[i].isspace():
                i += 1
            out.append(text[start:i])
            start = i
    if start < n:
        out.append(text[start:])
    return out


def _cut_long(sentence: str, max_bytes: int) -> str:
    """The head of an over-long ``sentence``: at most ``max_bytes`` UTF-8 bytes, whole
    characters, ending after a comma or space when one is in its second half, never
    leaving a ZWJ, variation selector or combining mark to start the next page."""
    head = sentence.encode("utf-8")[:max_bytes].decode("utf-8", "ignore")
    if not head:
        raise ValueError(f"max_bytes={max_bytes} cannot hold the character {sentence[0]!r}")
    if len(head) < len(sentence):
        for i in range(len(head) - 1, len(head) // 2, -1):
            if head[i] in _SOFT_BREAKS:
                return head[: i + 1]
        k = len(head)
        while k > 1 and (sentence[k] in _GLUE or unicodedata.combining(sentence[k]) or sentence[k - 1] == "\u200d"):
            k -= 1
        head = head[:k]
    return head


def split_text(text: str, max_bytes: int = wc.PASSIVE_TEXT_MAX_BYTES) -> list[str]:
    """``text`` in consecutive parts of at most ``max_bytes`` UTF-8 bytes each.

    Parts end on sentence boundaries (。！？!?；;…, newlines, ". "), packed greedily;
    a single sentence longer than ``max_bytes`` is cut after a comma or space, else
    between two characters (never inside a UTF-8 sequence, never before a joiner).
    Whitespace at the ends of each part is dropped; apart from that, the parts joined
    give ``text`` in order.

    Args:
        text: any text.
        max_bytes: the limit per part, UTF-8 bytes (≥ 4, the longest character).

    Returns:
        The parts (``[]`` for a blank text; ``[text]`` when it fits).

    Raises:
        ValueError: ``max_bytes`` below 4.
    """
    if max_bytes < 4:
        raise ValueError(f"max_bytes must be >= 4 (one UTF-8 character), not {max_bytes}")
    if not text.strip():
        return []
    if _nbytes(text) <= max_bytes:
        return [text]
    parts: list[str] = []
    current = ""
    for sentence in _sentences(text):
        if _nbytes(current + sentence.rstrip()) <= max_bytes:
            current += sentence
            continue
        if current.strip():
            parts.append(current.strip())
        current = sentence
        while _nbytes(current.strip()) > max_bytes:
            stripped = current.strip()
            head = _cut_long(stripped, max_bytes)
            parts.append(head.strip())
            current = stripped[len(head):]
    if current.strip():
        parts.append(current.strip())
    return parts


@dataclass(frozen=True)
class Pages:
    """A text laid out as messages: ``bodies`` in order, ``tail`` (the closing
    paragraph, e.g. the disclaimer) repeated on each page, ``lang`` for the
    continuation line. Every :meth:`page` fits the limit it was built for."""

    bodies: tuple[str, ...]
    tail: str = ""
    lang: str = "zh"

    def page(self, i: int, more: bool = False) -> str:
        """Page ``i`` (0-based): its body, the "回复 1 查看更多" line when ``more``, the tail."""
        pieces = [self.bodies[i], MORE_HINT.get(self.lang, MORE_HINT["en"]) if more else "", self.tail]
        return "\n\n".join(p for p in pieces if p)

    def to_json(self, start: int = 0) -> str:
        return json.dumps({"bodies": list(self.bodies[start:]), "tail": self.tail, "lang": self.lang},
                          ensure_ascii=False)

    @classmethod
    def from_json(cls, raw: str) -> Pages:
        data = json.loads(raw)
        return cls(tuple(data["bodies"]), data.get("tail", ""), data.get("lang", "zh"))


def paginate(text: str, lang: str = "zh", max_bytes: int = wc.PASSIVE_TEXT_MAX_BYTES) -> Pages:
    """``text`` as :class:`Pages` of at most ``max_bytes`` UTF-8 bytes each.

    A text that fits is one page, unchanged. Otherwise its last paragraph (after
    the last blank line — where the dispatcher puts the medical disclaimer) is the
    tail when it takes at most a quarter of ``max_bytes``, and the rest is split by
    :func:`split_text` leaving room on every page for the tail and the continuation
    line (so a user who reads only page 1 still sees the disclaimer).

    Args:
        text: the reply text, free of XML-invalid characters.
        lang: ``"zh"`` or ``"en"`` (the continuation line's language).
        max_bytes: the per-message limit, UTF-8 bytes (2048 for passive replies and
            customer-service text).

    Raises:
        ValueError: ``max_bytes`` below 64 (no room for the continuation line).
    """
    if max_bytes < 64:
        raise ValueError(f"max_bytes must be >= 64 for pages with a continuation line, not {max_bytes}")
    if _nbytes(text) <= max_bytes:
        return Pages((text,), "", lang)
    body, tail = text.strip(), ""
    at = body.rfind("\n\n")
    if at > 0:
        candidate = body[at + 2:].strip()
        if candidate and _nbytes(candidate) <= max_bytes // 4:
            body, tail = body[:at].rstrip(), candidate
    hint = MORE_HINT.get(lang, MORE_HINT["en"])
    reserve = _nbytes("\n\n" + hint) + (_nbytes("\n\n" + tail) if tail else 0)
    return Pages(tuple(split_text(body, max_bytes - reserve)) or ("",), tail, lang)


def render_transfer_reply(to_user: str, from_user: str, kf_account: str = "", now: float | None = None) -> str:
    """The passive reply that hands the message to human agents (消息转发到客服).

    Args:
        to_user: the user's OpenID; from_user: the account's original id.
        kf_account: ``name@wxid`` of one agent (``<TransInfo><KfAccount>``), "" = any agent.
        now: CreateTime, UNIX seconds (default: now).
    """
    reply = TransferCustomerServiceReply(source=_cdata(from_user), target=_cdata(to_user),
                                         time=int(time.time() if now is None else now))
    xml = reply.render()
    if kf_account:
        info = f"<TransInfo><KfAccount><![CDATA[{_cdata(strip_invalid_xml_chars(kf_account))}]]></KfAccount></TransInfo>"
        xml = xml[: xml.rindex("</xml>")] + info + "\n</xml>"
    return xml


# --------------------------------------------------------------------------- the adapter


def _signature(*parts: str) -> str:
    signer = WeChatSigner()
    signer.add_data(*(p.encode("utf-8", "surrogatepass") for p in parts))  # a lone surrogate is no crash
    return signer.signature


def _same(expected: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


def _mask(openid: str) -> str:
    return openid[:6] + "…" if len(openid) > 6 else "…"


@dataclass(frozen=True)
class _Out:
    """What one delivery answers: ``kind`` "text" (``content``), "transfer", or "none" (``success``)."""

    kind: str
    content: str = ""

    def state(self) -> str:
        """The delivery state stored under :data:`DELIVERED_KEY` (replayed to a re-delivery)."""
        return json.dumps({"via": "passive", "type": self.kind, "content": self.content}, ensure_ascii=False)


_NONE = _Out("none")


def _via(how: str) -> str:
    return json.dumps({"via": how})


def _inbound_to_json(inbound: Inbound) -> str:
    raw = {k: v for k, v in inbound.raw.items() if isinstance(v, (str, int, float, bool)) or v is None}
    return json.dumps({"v": 1, "user_id": inbound.user_id, "chat_id": inbound.chat_id,
                       "message_id": inbound.message_id, "kind": inbound.kind.value, "text": inbound.text,
                       "lang": inbound.lang, "received_at": inbound.received_at, "raw": raw}, ensure_ascii=False)


def _inbound_from_json(raw: str) -> Inbound | None:
    try:
        d = json.loads(raw)
        return Inbound(channel=wc.CHANNEL, user_id=str(d["user_id"]), chat_id=str(d.get("chat_id") or d["user_id"]),
                       message_id=str(d["message_id"]), kind=MessageKind(d["kind"]), text=str(d.get("text") or ""),
                       lang=d.get("lang"), received_at=float(d.get("received_at") or time.time()),
                       raw=dict(d.get("raw") or {}))
    except (ValueError, KeyError, TypeError):
        log.error("wechat.unfinished_unreadable")
        return None


def _snippet(text: str) -> str:
    text = " ".join(strip_invalid_xml_chars(text).split())
    return text if len(text) <= QUESTION_SNIPPET_CHARS else text[: QUESTION_SNIPPET_CHARS - 1] + _ELLIPSIS


class WechatAdapter:
    """Request handlers for one official account; see the module docstring.

    Args:
        cfg: the effective config (``cfg.wechat``, ``cfg.server.max_body_bytes``).
        dispatcher: anything with ``async handle(Inbound) -> Reply`` that
            deduplicates on (channel, message_id).
        store: the shared store for delivery claims, pending answers, unread pages
            and the access token; may be given later with :meth:`attach`. Without
            one, replies are passive only (a late answer waits in the dispatcher's
            dedup cache for a re-delivery).
        api: the server-API client (default: one on ``store`` for service accounts).

    Attributes:
        stats: counters for metrics — ``passive``, ``deferred`` (budget missed),
            ``replayed``, ``late_kf``, ``late_pending``, ``pending_delivered``,
            ``kf_pages``, ``kf_fallback_pending``, ``kf_unknown``, ``continuations``,
            ``transfers``, ``unsubscribes``, ``store_errors``. The API client's own
            counters are at ``api.stats``.

    Raises:
        ConfigError: ``wechat.reply_budget_s`` not in (0, 5) s, an EncodingAESKey
            that is not base64 of 32 bytes, or a service account without
            ``wechat.appid`` / ``HEALTHBOT_WECHAT_APPSECRET``.
    """

    def __init__(self, cfg: Config, dispatcher: DispatcherLike, store: Store | None = None,
                 api: WechatApi | None = None, handoff: HandoffManager | None = None):
        self.cfg = cfg.wechat
        handoff = handoff if handoff is not None else getattr(dispatcher, "handoff", None)
        if self.cfg.token and hasattr(handoff, "register"):
            # a handed-off chat goes to WeChat's customer-service system (transfer_customer_service)
            handoff.register(wc.CHANNEL, PlatformAgentRelay())
        self.max_body_bytes = cfg.server.max_body_bytes
        self.dispatcher = dispatcher
        if not 0 < self.cfg.reply_budget_s < wc.REPLY_DEADLINE_S:
            raise ConfigError(f"config key 'wechat.reply_budget_s': {self.cfg.reply_budget_s} s must be > 0 and "
                              f"below WeChat's {wc.REPLY_DEADLINE_S} s deadline (4.0 leaves room for the network)")
        self.crypto: WeChatCrypto | None = None
        if self.cfg.mode != "plaintext":
            try:
                if len(base64.b64decode(self.cfg.aes_key + "=", validate=True)) != 32:
                    raise ValueError("not 32 bytes")
                self.crypto = WeChatCrypto(self.cfg.token, self.cfg.aes_key, self.cfg.appid)
            except (ValueError, binascii.Error, AssertionError) as exc:
                raise ConfigError(f"config key 'wechat.aes_key': not a valid EncodingAESKey ({exc}); copy the "
                                  f"{wc.AES_KEY_CHARS} characters from the console's 服务器配置") from None
        if self.cfg.token and self.cfg.account_type == "service" and not (self.cfg.appid and self.cfg.appsecret):
            raise ConfigError("config key 'wechat.appsecret': account_type 'service' sends late answers through the "
                              "customer-service API, which needs wechat.appid and HEALTHBOT_WECHAT_APPSECRET")
        self.store: Store | None = None
        self.api: WechatApi | None = api
        self.pending: set[asyncio.Task[Any]] = set()
        self.stats: Counter[str] = Counter()
        #: Late messages (answer still computing when their webhook answered): MsgId -> (Inbound, task).
        self._late: dict[str, tuple[Inbound, asyncio.Future[Reply]]] = {}
        #: Tasks waiting on a customer-service API call (cancelled at the shutdown deadline).
        self._in_api: set[asyncio.Task[Any]] = set()
        #: Set by :meth:`hand_over`: from then on, pages go to the pending queue instead of the API.
        self._closing = False
        #: The app's admission control (its shutdown deadline bounds a delivery's wait).
        self.admission: Admission | None = None
        self._user_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        if store is not None:
            self.attach(store)
        if not self.cfg.token:
            log.warning("wechat.not_configured", hint="set HEALTHBOT_WECHAT_TOKEN; /wechat answers 503 until then")

    def attach(self, store: Store) -> None:
        """Use ``store`` from now on (and, for a service account, a :class:`WechatApi` on it)."""
        self.store = store
        if self.api is None and self.cfg.account_type == "service" and self.cfg.appsecret:
            self.api = WechatApi(self.cfg, store)

    @property
    def service(self) -> bool:
        """True when late answers and extra pages go out through the customer-service API."""
        return self.cfg.account_type == "service" and self.api is not None

    # ---- request checks


    def _check_timestamp(self, query: Any) -> None:
        ts = parse_timestamp(query.get("timestamp"))
        skew = abs(time.time() - ts)
        if skew > self.cfg.timestamp_window_s:
            raise _Reject(403, "stale timestamp", f"timestamp {skew:.0f} s from now (window "
                          f"{self.cfg.timestamp_window_s} s): replay or wrong clock")

    def _check_signature(self, query: Any, required: bool) -> None:
        given = query.get("signature")
        if given is None and not required:
            return
        expected = _signature(self.cfg.token, query.get("timestamp", ""), query.get("nonce", ""))
        if not _same(expected, given):
            raise _Reject(403, "invalid signature", "signature missing or wrong")

    def _is_encrypted(self, query: Any) -> bool:
        if self.cfg.mode == "safe":
            return True
        return self.cfg.mode == "compatible" and query.get("encrypt_type", "").lower() == "aes"

    async def _read_body(self, request: web.Request) -> bytes:
        try:
            return await read_limited(request, self.max_body_bytes)
        except BodyTooLarge as exc:
            raise _Reject(413, "body too large", str(exc)) from None

    def _decrypt(self, envelope_text: str, query: Any) -> str:
        assert self.crypto is not None
        # Authenticate before any XML parser sees the body: <Encrypt> is found by one
        # linear search, checked against msg_signature, and only then is the envelope parsed.
        encrypt = extract_encrypt(envelope_text)
        ts, nonce = query.get("timestamp", ""), query.get("nonce", "")
        given = query.get("msg_signature")
        if not _same(_signature(self.cfg.token, ts, nonce, encrypt), given):
            raise _Reject(403, "invalid signature", "msg_signature missing or wrong")
        if str(parse_xml(envelope_text).get("Encrypt") or "").strip() != encrypt:
            raise _Reject(400, "malformed xml", "<Encrypt> is not a field of the <xml> envelope")
        try:
            return self.crypto.decrypt_message({"Encrypt": encrypt}, given, ts, nonce)
        except InvalidSignatureException:
            raise _Reject(403, "invalid signature", "msg_signature wrong") from None
        except InvalidAppIdException:
            raise _Reject(403, "invalid signature", "decrypted message is for another appid") from None
        except Exception as exc:  # noqa: BLE001 — bad base64 / padding / length from a signed sender
            raise _Reject(400, "malformed xml", f"cannot decrypt <Encrypt>: {type(exc).__name__}") from None

    # ---- handlers

    async def handle_get(self, request: web.Request) -> web.Response:
        """``GET /wechat``: URL verification (接入指南).

        Echoes ``echostr`` when ``signature`` = sha1(sorted [token, timestamp, nonce])
        is valid. In compatible/safe mode a request with ``msg_signature`` (=
        sha1(sorted [token, timestamp, nonce, echostr])) gets ``echostr`` decrypted.
        403 ``invalid signature`` otherwise (also outside the timestamp window).
        """
        if not self.cfg.token:
            return web.Response(status=503, text="wechat adapter not configured")
        query = request.query
        try:
            echostr = query.get("echostr")
            if not echostr:
                raise _Reject(400, "missing echostr", "GET without echostr")
            if self.crypto is not None and "msg_signature" in query:
                ts, nonce = query.get("timestamp", ""), query.get("nonce", "")
                if not _same(_signature(self.cfg.token, ts, nonce, echostr), query.get("msg_signature")):
                    raise _Reject(403, "invalid signature", "msg_signature wrong (GET)")
                self._check_timestamp(query)
                try:
                    echo = PrpCrypto(self.crypto.key).decrypt(echostr, self.cfg.appid)
                except Exception as exc:  # noqa: BLE001
                    raise _Reject(403, "invalid signature", f"cannot decrypt echostr: {type(exc).__name__}") from None
            else:
                self._check_signature(query, required=True)
                self._check_timestamp(query)
                echo = echostr
        except _Reject as rej:
            log.warning("wechat.rejected", method="GET", status=rej.status, reason=rej.reason)
            return rej.response()
        log.info("wechat.url_verified")
        return web.Response(text=echo)


    async def handle_post(self, request: web.Request) -> web.Response:
        """``POST /wechat``: one message or event → at most one passive reply.

        Answers within ``wechat.reply_budget_s`` seconds of arrival: a passive text
        reply (page 1 of a long answer, with what was pending for the user before
        it), ``transfer_customer_service`` for a handoff, the same reply again for a
        re-delivery of a message already answered, or ``success`` (not ready — the
        answer follows later —, nothing to say, or ``unsubscribe``); encrypted in
        safe mode. 403/413/400 as in the module docstring; 500 ``internal error``
        (logged, never a trace) for a bug while parsing; a dispatcher or store error
        is logged and answered as well as possible (``success`` at worst).
        """
        if not self.cfg.token:
            return web.Response(status=503, text="wechat adapter not configured")
        loop = asyncio.get_running_loop()
        started = loop.time()
        received_at = time.time()
        query = request.query
        try:
            encrypted = self._is_encrypted(query)
            # `signature` covers only the query, so it is checked before the body is
            # read; encrypted requests are authenticated by msg_signature below.
            self._check_signature(query, required=not encrypted)
            if encrypted and not query.get("msg_signature"):
                raise _Reject(403, "invalid signature", "encrypted request without msg_signature")
            self._check_timestamp(query)
            body = await self._read_body(request)
            try:
                text = strip_invalid_xml_chars(body.decode("utf-8"))
            except UnicodeDecodeError:
                raise _Reject(400, "malformed xml", "body is not UTF-8") from None
            if encrypted:
                text = strip_invalid_xml_chars(self._decrypt(text, query))
            inbound = parse_inbound(text, received_at)
        except _Reject as rej:
            log.warning("wechat.rejected", method="POST", status=rej.status, reason=rej.reason)
            return rej.response()
        except Exception:  # noqa: BLE001 — a bug here must not show WeChat a trace
            log.exception("wechat.error", stage="parse")
            return web.Response(status=500, text="internal error")

        try:
            out = await self._respond(inbound, self.cfg.reply_budget_s - (loop.time() - started))
        except Exception:  # noqa: BLE001
            log.exception("wechat.error", stage="respond", message_id=inbound.message_id)
            out = _NONE
        try:
            xml = self._render(out, inbound)
            if xml == wc.NO_REPLY:
                return web.Response(text=wc.NO_REPLY)
            if encrypted:
                assert self.crypto is not None
                xml = self.crypto.encrypt_message(xml, query.get("nonce", ""), str(int(time.time())))
            return web.Response(text=xml, content_type=wc.XML_CONTENT_TYPE)
        except Exception:  # noqa: BLE001
            log.exception("wechat.error", stage="render", message_id=inbound.message_id)
            return web.Response(text=wc.NO_REPLY)

    # ---- answering one delivery

    async def _respond(self, inbound: Inbound, budget_s: float) -> _Out:
        """What this delivery of ``inbound`` answers (see the module docstring, "The deadline")."""
        if inbound.raw.get("event") == "unsubscribe":
            await self._answer(inbound, budget_s, late=False)  # the core sees it too; nothing can be sent
            await self._forget(inbound.user_id)
            return _NONE
        if self.store is not None and inbound.kind is MessageKind.TEXT and inbound.text.strip() in CONTINUE_WORDS:
            try:
                out = await self._continuation(inbound)
            except Exception:  # noqa: BLE001 — a store failure: let the dispatcher answer "1"
                self.stats["store_errors"] += 1
                log.exception("wechat.store_error", stage="continuation", message_id=inbound.message_id)
                out = None
            if out is not None:
                return out
        reply = await self._answer(inbound, budget_s)
        if reply is None:
            return _NONE
        if self.store is None:
            return self._plain(reply)
        try:
            out = await self._deliver_passive(inbound, reply)
        except Exception:  # noqa: BLE001 — the store failed: answer this reply alone, unrecorded
            self.stats["store_errors"] += 1
            log.exception("wechat.store_error", stage="passive", message_id=inbound.message_id)
            return self._plain(reply)
        if out.kind != "none":
            self.stats["passive"] += 1
        return out

    def _plain(self, reply: Reply) -> _Out:
        """The reply on its own (no store): a handoff, or its text cut to one page."""
        if reply.intent is Intent.HANDOFF:
            return _Out("transfer")
        return _Out("text", reply.text) if reply.text.strip() else _NONE

    async def _answer(self, inbound: Inbound, budget_s: float, late: bool = True) -> Reply | None:
        """``dispatcher.handle(inbound)`` if it finishes within ``budget_s`` seconds, else None.

        The computation runs in its own task behind :func:`asyncio.shield`: neither
        this timeout nor a cancelled request handler (client gone) cancels it. On a
        timeout with ``late``, the answer is delivered when it is ready
        (:meth:`_deliver_late`, once per message in this process).
        """
        task = asyncio.ensure_future(self.dispatcher.handle(inbound))
        self._track(task)
        left = self.admission.seconds_left() if self.admission is not None else None
        if left is not None:  # shutting down: answer before the drain deadline, the rest is handed over
            budget_s = min(budget_s, left - 0.1)
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout=max(budget_s, 0.0))
        except TimeoutError:
            self.stats["deferred"] += 1
            log.warning("wechat.reply_deferred", message_id=inbound.message_id, user=_mask(inbound.user_id),
                        budget_s=round(budget_s, 3), kind=inbound.kind.value,
                        then="customer-service API" if self.service else "pending queue")
            if late and self.store is not None and inbound.message_id not in self._late:
                self._watch_late(inbound, task)
            return None
        except Exception as exc:  # noqa: BLE001 — logged with its trace in _finished
            log.error("wechat.dispatcher_failed", message_id=inbound.message_id, error=type(exc).__name__)
            return None

    def _watch_late(self, inbound: Inbound, task: asyncio.Future[Reply]) -> None:
        """Deliver ``task``'s answer when it is ready (:meth:`_deliver_late`)."""
        self._late[inbound.message_id] = (inbound, task)
        task.add_done_callback(lambda t: self._spawn(self._deliver_late(inbound, t)))

    def _track(self, task: asyncio.Task[Any]) -> None:
        self.pending.add(task)
        task.add_done_callback(self._finished)

    def _spawn(self, coro: Any) -> None:
        self._track(asyncio.ensure_future(coro))

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self.pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("wechat.dispatcher_error", exc_info=task.exception())

    async def _deliver_passive(self, inbound: Inbound, reply: Reply) -> _Out:
        """Claim the delivery of ``inbound``'s answer for this passive reply, or replay / hand over."""
        assert self.store is not None
        key = DELIVERED_KEY.format(msgid=inbound.message_id)
        if await self.store.set_if_absent(key, _via("composing"), COMPOSING_TTL_S):
            out = await self._compose(inbound, reply)
            await self.store.set(key, out.state(), DELIVERY_STATE_TTL_S)
            return out
        state = await self._state(key)
        if state.get("via") == "passive":  # WeChat did not get our earlier response: the same again
            self.stats["replayed"] += 1
            return _Out(str(state.get("type", "none")), str(state.get("content", "")))
        if state.get("via") not in ("kf", "pending"):
            return _NONE  # another delivery is still composing it (or died doing so)
        # Sent through the API or queued: this delivery carries whatever is pending
        # for the user (its own answer, if still queued), and nothing else.
        out = await self._compose(inbound, None)
        if out.kind != "none":
            await self.store.set(key, out.state(), DELIVERY_STATE_TTL_S)
        return out

    async def _state(self, key: str) -> dict[str, Any]:
        """The delivery state at ``key``, waiting up to :data:`COMPOSING_WAIT_S` while it is "composing"."""
        assert self.store is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + COMPOSING_WAIT_S
        while True:
            raw = await self.store.get(key)
            try:
                state = json.loads(raw) if raw else {}
            except ValueError:
                state = {}
            if state.get("via") != "composing" or loop.time() >= deadline:
                return state
            await asyncio.sleep(0.02)

    async def _compose(self, inbound: Inbound, reply: Reply | None) -> _Out:
        """The passive reply: what is pending for the user, then ``reply`` (paged); or a transfer."""
        assert self.store is not None
        openid = inbound.user_id
        if reply is not None and reply.intent is Intent.HANDOFF:
            text = strip_invalid_xml_chars(reply.text).strip()
            if self.service and text:
                self._spawn(self._send_later(openid, paginate(text, reply.lang, wc.KF_TEXT_MAX_BYTES),
                                             0, inbound.message_id, ""))
            self.stats["transfers"] += 1
            log.info("wechat.transfer", message_id=inbound.message_id, user=_mask(openid),
                     kf_account=bool(self.cfg.kf_account))
            return _Out("transfer")
        own = strip_invalid_xml_chars(reply.text).strip() if reply is not None else ""
        lang = reply.lang if reply is not None else "zh"
        queued = await self.store.pop_all(PENDING_KEY.format(openid=openid))
        segments = [self._format_pending(raw, inbound.message_id) for raw in queued]
        segments = [s for s in segments if s] + ([own] if own else [])
        if queued:
            self.stats["pending_delivered"] += len(queued)
            log.info("wechat.pending_delivered", message_id=inbound.message_id, user=_mask(openid), count=len(queued))
        if not segments:
            return _NONE
        pages = paginate(SEGMENT_SEPARATOR.join(segments), lang)
        more_key = MORE_KEY.format(openid=openid)
        if len(pages.bodies) == 1:
            if own:  # a new answer: unread pages of an older one no longer follow on
                await self.store.delete(more_key)
            return _Out("text", pages.page(0))
        if self.service:
            await self.store.delete(more_key)
            self._spawn(self._send_later(openid, pages, 1, inbound.message_id, ""))
            return _Out("text", pages.page(0))
        await self.store.set(more_key, pages.to_json(1), MORE_TTL_S)
        return _Out("text", pages.page(0, more=True))

    @staticmethod
    def _format_pending(raw: str, current_msgid: str) -> str:
        try:
            item = json.loads(raw)
            text, lang = str(item["text"]).strip(), str(item.get("lang") or "zh")
        except (ValueError, KeyError, TypeError):
            log.error("wechat.pending_unreadable")
            return ""
        if item.get("cont"):
            header = CONTINUED_HEADER.get(lang, CONTINUED_HEADER["en"])
        elif item.get("q") and item.get("msgid") != current_msgid:
            header = PENDING_HEADER.get(lang, PENDING_HEADER["en"]).format(q=item["q"])
        else:
            header = ""
        return f"{header}\n{text}" if header else text

    async def _continuation(self, inbound: Inbound) -> _Out | None:
        """The next unread page for a user's "1" (None when there is none: the dispatcher answers "1")."""
        assert self.store is not None
        key = DELIVERED_KEY.format(msgid=inbound.message_id)
        if await self.store.get(key):  # a re-delivery of this "1"
            return await self._deliver_passive(inbound, Reply("", Intent.SYSTEM))
        more_key = MORE_KEY.format(openid=inbound.user_id)
        lock = self._user_locks.get(inbound.user_id)
        if lock is None:
            lock = self._user_locks[inbound.user_id] = asyncio.Lock()
        async with lock:  # two quick "1"s of one user get consecutive pages
            raw = await self.store.get(more_key)
            if not raw:
                return None
            if not await self.store.set_if_absent(key, _via("composing"), COMPOSING_TTL_S):
                return await self._deliver_passive(inbound, Reply("", Intent.SYSTEM))
            pages = Pages.from_json(raw)
            more = len(pages.bodies) > 1
            if more:
                await self.store.set(more_key, pages.to_json(1), MORE_TTL_S)
            else:
                await self.store.delete(more_key)
            out = _Out("text", pages.page(0, more=more))
            await self.store.set(key, out.state(), DELIVERY_STATE_TTL_S)
        self.stats["continuations"] += 1
        return out

    # ---- late answers

    async def _deliver_late(self, inbound: Inbound, task: asyncio.Future[Reply]) -> None:
        """Deliver the answer of a computation that outlived its webhook, unless a passive reply claimed it."""
        try:
            if task.cancelled() or task.exception() is not None:
                return  # not cached by the dispatcher: WeChat's next delivery computes it again
            await self._deliver_late_reply(inbound, task.result())
        except Exception:  # noqa: BLE001
            self.stats["store_errors"] += 1
            log.exception("wechat.error", stage="late", message_id=inbound.message_id)
        finally:
            self._late.pop(inbound.message_id, None)

    async def _deliver_late_reply(self, inbound: Inbound, reply: Reply) -> None:
        assert self.store is not None
        text = strip_invalid_xml_chars(reply.text or "").strip()
        if not text:
            return  # nothing to say (an event, a silent handoff relay)
        key = DELIVERED_KEY.format(msgid=inbound.message_id)
        question = _snippet(mask_pii(inbound.text))  # kept up to 24 h in the store: no personal data
        if self.service:
            if not await self.store.set_if_absent(key, _via("kf"), DELIVERY_STATE_TTL_S):
                return  # a passive reply has it
            self.stats["late_kf"] += 1
            log.info("wechat.late_answer_kf", message_id=inbound.message_id, user=_mask(inbound.user_id))
            await self._send_pages(inbound.user_id, paginate(text, reply.lang, wc.KF_TEXT_MAX_BYTES), 0,
                                   inbound.message_id, question)
            return
        if reply.intent is Intent.HANDOFF:
            # Too late for transfer_customer_service; the dispatcher has started the
            # handoff and the user's next message is transferred. A stale "connecting
            # you" text is not queued.
            log.info("wechat.late_handoff_text_dropped", message_id=inbound.message_id, user=_mask(inbound.user_id))
            return
        if not await self.store.set_if_absent(key, _via("pending"), DELIVERY_STATE_TTL_S):
            return
        item = {"msgid": inbound.message_id, "q": question, "text": text, "lang": reply.lang}
        await self.store.push(PENDING_KEY.format(openid=inbound.user_id), json.dumps(item, ensure_ascii=False),
                              PENDING_TTL_S)
        self.stats["late_pending"] += 1
        log.info("wechat.answer_pending", message_id=inbound.message_id, user=_mask(inbound.user_id))

    async def _send_later(self, openid: str, pages: Pages, start: int, msgid: str, question: str) -> None:
        """:meth:`_send_pages` after :data:`KF_FOLLOW_UP_DELAY_S` (so they follow the passive reply)."""
        try:
            await asyncio.sleep(KF_FOLLOW_UP_DELAY_S)
            await self._send_pages(openid, pages, start, msgid, question)
        except Exception:  # noqa: BLE001
            self.stats["store_errors"] += 1
            log.exception("wechat.error", stage="kf_pages", message_id=msgid)

    async def _send_pages(self, openid: str, pages: Pages, start: int, msgid: str, question: str) -> None:
        """Send ``pages.bodies[start:]`` through the customer-service API, in order.

        At most :data:`~adapters.wechat_constants.KF_MESSAGES_PER_USER_MESSAGE`
        messages; the last one allowed says "回复 1 查看更多" when pages remain, and
        those wait under :data:`MORE_KEY`. A message WeChat refused (45047, 45015,
        45009, …) and everything after it go to the pending queue; a message whose
        fate is unknown (timeout) is not queued again (it may have arrived), the rest is.
        """
        assert self.store is not None and self.api is not None
        n = len(pages.bodies)
        allowed_end = start + wc.KF_MESSAGES_PER_USER_MESSAGE
        me = asyncio.current_task()
        for i in range(start, n):
            if self._closing:  # shutting down: what is left waits for the user's next message
                await self._queue_rest(openid, pages, i, msgid, question)
                return
            last_allowed = i == allowed_end - 1 and n > allowed_end
            if me is not None:
                self._in_api.add(me)
            try:
                outcome = await self.api.send_text(openid, pages.page(i, more=last_allowed))
            except asyncio.CancelledError:
                # The shutdown deadline came during the call: the page may or may not have
                # arrived; queued again (a repeat rather than a loss), with the rest.
                if self._closing:
                    await self._queue_rest(openid, pages, i, msgid, question)
                raise
            finally:
                if me is not None:
                    self._in_api.discard(me)
            if outcome is SendOutcome.SENT:
                self.stats["kf_pages"] += 1
                if last_allowed:
                    await self.store.set(MORE_KEY.format(openid=openid), pages.to_json(i + 1), MORE_TTL_S)
                    return
                continue
            if outcome is SendOutcome.UNKNOWN:
                self.stats["kf_unknown"] += 1
                log.warning("wechat.kf_unknown", message_id=msgid, user=_mask(openid), page=i + 1,
                            hint="no answer from the API: not queued again, it may have reached the user")
            rest = i if outcome is SendOutcome.FAILED else i + 1
            if rest < n:
                await self._queue_rest(openid, pages, rest, msgid, question)
                self.stats["kf_fallback_pending"] += 1
                log.info("wechat.kf_failed_answer_pending", message_id=msgid, user=_mask(openid), from_page=rest + 1)
            return

    async def _queue_rest(self, openid: str, pages: Pages, rest: int, msgid: str, question: str) -> None:
        """Pages ``rest`` on of an answer into the user's pending queue (their next passive reply)."""
        assert self.store is not None
        text = "\n\n".join(pages.bodies[rest:] + ((pages.tail,) if pages.tail else ()))
        item = {"msgid": msgid, "q": question if rest == 0 else "", "cont": rest > 0, "text": text,
                "lang": pages.lang}
        await self.store.push(PENDING_KEY.format(openid=openid), json.dumps(item, ensure_ascii=False),
                              PENDING_TTL_S)
        if self._closing:
            self.stats["shutdown_pages_pending"] += 1
            log.info("wechat.shutdown_answer_pending", message_id=msgid, user=_mask(openid), from_page=rest + 1)

    # ---- unsubscribe

    async def _forget(self, openid: str) -> None:
        """Drop what is kept about a user who unfollowed: the core's handoff and session
        state (``dispatcher.forget_user``), their pending answers and unread pages."""
        forget = getattr(self.dispatcher, "forget_user", None)  # absent on test doubles
        if forget is not None:
            try:
                await forget(wc.CHANNEL, openid)
            except Exception:  # noqa: BLE001 — the rest is still forgotten
                log.exception("wechat.forget_failed")
        if self.store is not None:
            try:
                await self.store.delete(PENDING_KEY.format(openid=openid))
                await self.store.delete(MORE_KEY.format(openid=openid))
            except Exception:  # noqa: BLE001
                self.stats["store_errors"] += 1
                log.exception("wechat.store_error", stage="unsubscribe")
        self.stats["unsubscribes"] += 1
        log.info("wechat.unsubscribed", user=_mask(openid))

    def _render(self, out: _Out, inbound: Inbound) -> str:
        account = str(inbound.raw["ToUserName"])
        if out.kind == "transfer":
            return render_transfer_reply(inbound.user_id, account, self.cfg.kf_account)
        if out.kind == "text" and out.content.strip():
            return render_text_reply(out.content, to_user=inbound.user_id, from_user=account)
        return wc.NO_REPLY

    async def drain(self, timeout_s: float | None = None) -> None:
        """Wait up to ``timeout_s`` seconds (default ``reply_budget_s``) for computations
        and deliveries still running after their webhook answered; never cancels them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.cfg.reply_budget_s if timeout_s is None else max(timeout_s, 0.0))
        while self.pending and loop.time() < deadline:
            await asyncio.wait(set(self.pending), timeout=deadline - loop.time())

    async def hand_over(self) -> None:
        """Graceful shutdown, after :meth:`drain` and before the store closes: nothing
        computed or being delivered is lost.

        Each message whose answer is still being computed goes to :data:`UNFINISHED_KEY`
        (the next process to start answers it; the delivery claim keeps it to one
        delivery) and is no longer delivered from here; a customer-service send still
        waiting on the API is cancelled, and its page with every page not yet sent goes
        to the user's pending queue (as does every page from now on). Then up to
        :data:`SHUTDOWN_GRACE_S` for those store writes.
        """
        if self.store is None:
            return
        self._closing = True
        saved = 0
        for inbound, task in list(self._late.values()):
            if task.done():
                continue
            try:
                await self.store.push(UNFINISHED_KEY, _inbound_to_json(inbound), UNFINISHED_TTL_S)
            except Exception:  # noqa: BLE001 - it may still finish and be delivered before the store closes
                self.stats["store_errors"] += 1
                log.exception("wechat.store_error", stage="shutdown", message_id=inbound.message_id)
                continue
            saved += 1
            task.cancel()  # its delivery is now the next process's (the computation itself goes on)
        for task in list(self._in_api):
            task.cancel()
        if self.pending:
            await asyncio.wait(set(self.pending), timeout=SHUTDOWN_GRACE_S)
        self.stats["shutdown_unfinished_saved"] += saved
        if saved or self.pending:
            log.info("wechat.shutdown_handed_over", unfinished_saved=saved, still_running=len(self.pending))

    async def recover(self) -> int:
        """At start-up: compute and deliver the messages a stopped process left unfinished
        (:data:`UNFINISHED_KEY`); returns how many were taken. Never raises."""
        if self.store is None:
            return 0
        try:
            items = await self.store.pop_all(UNFINISHED_KEY)
        except Exception:  # noqa: BLE001 - the store is down: they wait for a later start
            self.stats["store_errors"] += 1
            log.exception("wechat.store_error", stage="recover")
            return 0
        taken = 0
        for raw in items:
            inbound = _inbound_from_json(raw)
            if inbound is None or inbound.message_id in self._late:
                continue
            task = asyncio.ensure_future(self.dispatcher.handle(inbound))
            self._track(task)
            self._watch_late(inbound, task)
            taken += 1
        if taken:
            self.stats["recovered"] += taken
            log.info("wechat.recovered_unfinished", count=taken)
        return taken

    async def close(self) -> None:
        """Close the API client's HTTP session."""
        if self.api is not None:
            await self.api.close()


WECHAT_ADAPTER = web.AppKey("wechat_adapter", WechatAdapter)
"""Where :func:`setup_wechat` stores its :class:`WechatAdapter` in the app."""


def setup_wechat(app: web.Application, cfg: Config, dispatcher: DispatcherLike, store: Store | None = None,
                 handoff: HandoffManager | None = None) -> None:
    """Add ``GET /wechat`` (URL verification) and ``POST /wechat`` (messages) to ``app``.

    Args:
        app: the aiohttp application (not yet started).
        cfg: the effective config; ``cfg.wechat``, ``cfg.server.max_body_bytes`` and
            ``cfg.effective_store_url`` are used. With an empty ``wechat.token`` both
            routes answer 503 (an unsigned webhook is never accepted) and no store is opened.
        dispatcher: ``async handle(Inbound) -> Reply``, deduplicating on
            (channel, message_id); called once per WeChat delivery.
        store: the shared store to use; None = open ``cfg.effective_store_url`` in
            the app's cleanup context (closed on cleanup).
        handoff: the app's handoff manager: told that WeChat's customer-service system
            takes handed-off chats (default: the dispatcher's, if it has one).

    At start-up, messages a stopped process left unfinished are answered
    (:meth:`WechatAdapter.recover`). On shutdown, computations and deliveries still
    running are waited for until the server's drain deadline (the app's
    :class:`~bot.admission.Admission`; without one, ``reply_budget_s``), and what is
    left is handed to the store (:meth:`WechatAdapter.hand_over`) before it closes.

    Raises:
        ConfigError: see :class:`WechatAdapter`.
        bot.store.StoreError: at start-up, the store cannot be opened.
    """
    adapter = WechatAdapter(cfg, dispatcher, store=store, handoff=handoff)
    adapter.admission = app.get(ADMISSION_KEY)
    app[WECHAT_ADAPTER] = adapter
    app.router.add_get("/wechat", adapter.handle_get)
    app.router.add_post("/wechat", adapter.handle_post)

    async def lifecycle(_app: web.Application):
        opened = None
        if adapter.store is None and cfg.wechat.token:
            opened = await open_store(cfg.effective_store_url)
            adapter.attach(opened)
        if cfg.wechat.token:
            await adapter.recover()  # what a stopped process left unfinished
        try:
            yield
        finally:
            await adapter.close()
            if opened is not None:
                await opened.close()

    async def _drain(_app: web.Application) -> None:
        # Until the server's drain deadline (bot/app.py serve), else one reply budget.
        left = adapter.admission.seconds_left() if adapter.admission is not None else None
        await adapter.drain(left)
        await adapter.hand_over()

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(_drain)
