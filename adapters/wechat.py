"""WeChat official-account (公众号) adapter: ``GET /wechat`` and ``POST /wechat``.

A thin translator (ARCHITECTURE.md, "One message, end to end"): it checks the
request really comes from WeChat, parses the XML into one :class:`bot.types.Inbound`,
calls ``dispatcher.handle`` and renders the :class:`bot.types.Reply` as a passive
reply. No business logic: which text a follow, a voice note or a menu click gets
is the dispatcher's decision.

Protocol source: WeChat official-account developer documentation
(https://developers.weixin.qq.com/doc/offiaccount/), pages 接入指南 (URL
verification), 接收普通消息, 接收事件推送, 被动回复用户消息 and 消息加解密说明;
limits in :mod:`adapters.wechat_constants`. Signatures, AES and message parsing use
wechatpy; untrusted XML passes defusedxml (no DTD, no entities) before any parser.

Request checks, in order (each answers a short plain-text body, never a trace):

* signature — ``signature`` = sha1 of the sorted [token, timestamp, nonce]; bad or
  missing: 403 ``invalid signature``. Encrypted requests also need ``msg_signature``
  = sha1 of the sorted [token, timestamp, nonce, Encrypt] (403 when wrong).
* timestamp — further than ``wechat.timestamp_window_s`` from now: 403 (replay).
* body — over ``server.max_body_bytes``: 413; not UTF-8, not well-formed, with a
  DOCTYPE or entities, or not a WeChat message: 400.

Modes (``wechat.mode``): ``plaintext``; ``safe`` — every POST is AES-encrypted
(``encrypt_type=aes``), decrypted with ``msg_signature`` and answered encrypted;
``compatible`` — encrypted when the query says ``encrypt_type=aes``, else plaintext.

The deadline (the decision this module is built around):
    WeChat waits :data:`~adapters.wechat_constants.REPLY_DEADLINE_S` (5 s) and then
    re-delivers, :data:`~adapters.wechat_constants.MAX_DELIVERIES` (3) times in all;
    after the last failed one the user sees "该公众号暂时无法提供服务". Answering
    ``success`` (or an empty body) stops the retries, so there is no answer that
    means "retry later" inside the 5 s. Each delivery therefore waits for
    ``dispatcher.handle`` at most ``wechat.reply_budget_s`` (measured from the
    request's arrival) on a *shielded* task, and:

    * ready in time: the passive text reply (To/From swapped);
    * not ready: ``success`` — WeChat stops retrying, the user sees no error, the
      computation keeps running to the end and the dispatcher keeps its Reply
      (a retry that still arrives gets that Reply passively). Delivering it later
      (customer-service API for service accounts, or on the user's next message)
      is the dispatcher's job (ARCHITECTURE.md, "Deadlines").

    Not chosen: holding deliveries 1 and 2 open past 5 s so that WeChat's retry
    picks up a late answer. It needs a per-message delivery counter that a request
    does not carry (process-local state that is wrong behind several replicas),
    misjudging the last delivery shows the user WeChat's error, and the dispatcher
    could not tell whether the passive reply reached the user, so a later
    "deliver on next message" could send it twice. ``success`` keeps one rule: the
    user gets a passive answer only from a response that came in time, once.

Message kinds: text → TEXT; voice → TEXT with ``Recognition`` when WeChat's speech
recognition filled it, else UNSUPPORTED (``raw["type"] = "voice"``); image, video,
shortvideo, location, link, file and any other type → UNSUPPORTED (``raw["type"]``);
event subscribe (also by QR code) → SUBSCRIBE; every other event → EVENT with
``raw["event"]`` (lower case) and ``raw["event_key"]``. Menu CLICK is an EVENT, not
TEXT: its EventKey is an identifier the operator chose in the menu editor
(``V1001_TIPS``), not words a user typed; sent as text it would go through triage
and retrieval. The dispatcher can answer an EVENT with text (and this adapter
sends it); an EVENT reply with empty text, and anything for ``unsubscribe`` (the
user can no longer receive it), answers ``success``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import re
import time
from typing import Any, Protocol
from xml.etree.ElementTree import Element, ParseError

import defusedxml
import defusedxml.ElementTree as safe_et
import structlog
from aiohttp import web
from wechatpy.crypto import PrpCrypto, WeChatCrypto
from wechatpy.exceptions import InvalidAppIdException, InvalidSignatureException
from wechatpy.parser import parse_message
from wechatpy.replies import TextReply
from wechatpy.utils import WeChatSigner

from adapters import wechat_constants as wc
from bot.config import Config, ConfigError
from bot.types import Inbound, MessageKind, Reply

log = structlog.get_logger("healthbot.wechat")

__all__ = [
    "WECHAT_ADAPTER",
    "WechatAdapter",
    "fit_passive_text",
    "parse_inbound",
    "render_text_reply",
    "setup_wechat",
    "strip_invalid_xml_chars",
]

# XML 1.0 (§2.2 Char) forbids C0 controls except TAB, LF, CR, and U+FFFE/U+FFFF;
# WeChat clients send some of them (e.g. \x08 from certain emoji keyboards) inside
# CDATA, which makes every XML parser fail. Lone surrogates cannot survive UTF-8
# decoding but can reach us in reply text.
_INVALID_XML_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff\ud800-\udfff]")
_SENTENCE_ENDS = frozenset("。！？!?；;…\n")
_ELLIPSIS = "…"
_CDATA_END = "]]>"
_CDATA_END_SPLIT = "]]]]><![CDATA[>"  # closes the section after "]]" and reopens it before ">"


class DispatcherLike(Protocol):
    """What the adapter needs from the core: ``handle(Inbound) -> Reply`` (deduplicating)."""

    async def handle(self, inbound: Inbound) -> Reply: ...


class _Reject(Exception):
    """A request refused with ``status`` and a short plain-text ``body`` (no trace)."""

    def __init__(self, status: int, body: str, reason: str):
        super().__init__(reason)
        self.status = status
        self.body = body
        self.reason = reason

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=self.body)


# --------------------------------------------------------------------------- text


def strip_invalid_xml_chars(text: str) -> str:
    """``text`` without the characters XML 1.0 forbids (C0 controls but TAB/LF/CR,
    U+FFFE, U+FFFF, surrogates); every other character is kept as it is."""
    return _INVALID_XML_CHARS.sub("", text)


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


# --------------------------------------------------------------------------- parsing


def _element_to_dict(element: Element) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for child in element:
        out[child.tag] = _element_to_dict(child) if len(child) else (child.text or "")
    return out


def _parse_xml(text: str) -> dict[str, Any]:
    """The children of the ``<xml>`` root as a dict; 400 for anything else.

    defusedxml refuses any DOCTYPE (so entity expansion and external entities
    never reach a parser); the caller has removed XML-invalid characters.
    """
    try:
        root = safe_et.fromstring(text, forbid_dtd=True, forbid_entities=True, forbid_external=True)
    except defusedxml.DefusedXmlException as exc:
        raise _Reject(400, "malformed xml", f"forbidden xml construct: {type(exc).__name__}") from None
    except (ParseError, ValueError) as exc:
        raise _Reject(400, "malformed xml", f"xml parse error: {exc}") from None
    if root.tag != "xml":
        raise _Reject(400, "malformed xml", f"root element is <{root.tag}>, not <xml>")
    return _element_to_dict(root)


def parse_inbound(xml_text: str, received_at: float | None = None) -> Inbound:
    """One WeChat message or event XML → :class:`bot.types.Inbound` (channel ``"wechat"``).

    Args:
        xml_text: the (decrypted) message XML, already free of XML-invalid characters.
        received_at: UNIX seconds when the request arrived (default: now).

    ``message_id`` is the MsgId for messages and
    ``"<FromUserName>:<CreateTime>:<event>"`` for events (接收事件推送 recommends
    FromUserName + CreateTime; the event name keeps two different events of one
    second apart). ``user_id`` = ``chat_id`` = FromUserName (the OpenID). ``raw``
    holds every field of the XML plus ``type`` (MsgType, lower case) and, for
    events, ``event`` and ``event_key``.

    Raises:
        _Reject: (400) the XML is not a WeChat message.
    """
    fields = _parse_xml(xml_text)
    msg_type = str(fields.get("MsgType") or "").strip().lower()
    openid = str(fields.get("FromUserName") or "").strip()
    if not msg_type or not openid or not fields.get("ToUserName"):
        raise _Reject(400, "malformed xml", "MsgType, FromUserName or ToUserName missing "
                      "(an encrypted body while wechat.mode is plaintext looks like this)")
    try:
        message = parse_message(xml_text)  # wechatpy's typed view (same, already vetted, text)
    except Exception as exc:  # noqa: BLE001 — any failure here is a malformed message
        raise _Reject(400, "malformed xml", f"wechatpy could not parse the message: {exc!r}") from None
    create_time = str(fields.get("CreateTime") or "").strip()
    raw: dict[str, Any] = {**fields, "type": msg_type}
    text = ""
    if msg_type == "event":
        event = str(fields.get("Event") or "").strip().lower()
        raw["event"] = event
        raw["event_key"] = fields.get("EventKey") or ""
        message_id = f"{openid}:{create_time}:{event}"
        kind = MessageKind.SUBSCRIBE if event == "subscribe" else MessageKind.EVENT
    else:
        msg_id = str(fields.get("MsgId") or "").strip()
        message_id = msg_id or f"{openid}:{create_time}:{msg_type}"
        if msg_type == "text":
            kind, text = MessageKind.TEXT, message.content or ""
        elif msg_type == "voice" and (getattr(message, "recognition", None) or "").strip():
            kind, text = MessageKind.TEXT, message.recognition.strip()
            raw["voice_recognition"] = True
        else:
            kind = MessageKind.UNSUPPORTED
    return Inbound(channel=wc.CHANNEL, user_id=openid, chat_id=openid, message_id=message_id,
                   kind=kind, text=text, lang=None,
                   received_at=time.time() if received_at is None else received_at, raw=raw)


# --------------------------------------------------------------------------- the adapter


def _signature(*parts: str) -> str:
    signer = WeChatSigner()
    signer.add_data(*parts)
    return signer.signature


def _same(expected: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


def _mask(openid: str) -> str:
    return openid[:6] + "…" if len(openid) > 6 else "…"


class WechatAdapter:
    """Request handlers for one official account; see the module docstring.

    Args:
        cfg: the effective config (``cfg.wechat``, ``cfg.server.max_body_bytes``).
        dispatcher: anything with ``async handle(Inbound) -> Reply`` that
            deduplicates on (channel, message_id).

    Raises:
        ConfigError: ``wechat.reply_budget_s`` not in (0, 5) s, or an
            EncodingAESKey that is not base64 of 32 bytes.
    """

    def __init__(self, cfg: Config, dispatcher: DispatcherLike):
        self.cfg = cfg.wechat
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
        self.pending: set[asyncio.Task[Reply]] = set()
        if not self.cfg.token:
            log.warning("wechat.not_configured", hint="set HEALTHBOT_WECHAT_TOKEN; /wechat answers 503 until then")

    # ---- request checks

    def _check_timestamp(self, query: Any) -> None:
        try:
            ts = int(query.get("timestamp", ""))
        except ValueError:
            raise _Reject(403, "invalid signature", "timestamp missing or not an integer") from None
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
        limit = self.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _Reject(413, "body too large", f"Content-Length {request.content_length} > {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await request.content.read(limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise _Reject(413, "body too large", f"body over {limit} bytes")
        return b"".join(chunks)

    def _decrypt(self, envelope_text: str, query: Any) -> str:
        assert self.crypto is not None
        encrypt = str(_parse_xml(envelope_text).get("Encrypt") or "").strip()
        if not encrypt:
            raise _Reject(400, "malformed xml", "encrypted request without <Encrypt>")
        ts, nonce = query.get("timestamp", ""), query.get("nonce", "")
        given = query.get("msg_signature")
        if not _same(_signature(self.cfg.token, ts, nonce, encrypt), given):
            raise _Reject(403, "invalid signature", "msg_signature missing or wrong")
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

        Answers within ``wechat.reply_budget_s`` seconds of arrival: the passive
        text reply XML (encrypted in safe mode), or ``success`` when the dispatcher
        is not ready, the reply has no text, or the event is ``unsubscribe``.
        403/413/400 as in the module docstring; 500 ``internal error`` (logged,
        never a trace) for a bug here; a dispatcher error is logged and answered
        ``success`` so WeChat shows the user no error.
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

        budget = self.cfg.reply_budget_s - (loop.time() - started)
        reply = await self._answer(inbound, budget)
        try:
            out = self._render(reply, inbound)
            if out == wc.NO_REPLY:
                return web.Response(text=wc.NO_REPLY)
            if encrypted:
                assert self.crypto is not None
                out = self.crypto.encrypt_message(out, query.get("nonce", ""), str(int(time.time())))
            return web.Response(text=out, content_type=wc.XML_CONTENT_TYPE)
        except Exception:  # noqa: BLE001
            log.exception("wechat.error", stage="render", message_id=inbound.message_id)
            return web.Response(text=wc.NO_REPLY)

    async def _answer(self, inbound: Inbound, budget_s: float) -> Reply | None:
        """``dispatcher.handle(inbound)`` if it finishes within ``budget_s`` seconds, else None.

        The computation runs in its own task behind :func:`asyncio.shield`: neither
        this timeout nor a cancelled request handler (client gone) cancels it.
        """
        task = asyncio.ensure_future(self.dispatcher.handle(inbound))
        self.pending.add(task)
        task.add_done_callback(self._finished)
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout=max(budget_s, 0.0))
        except TimeoutError:
            log.warning("wechat.reply_deferred", message_id=inbound.message_id, user=_mask(inbound.user_id),
                        budget_s=round(budget_s, 3), kind=inbound.kind.value)
            return None
        except Exception as exc:  # noqa: BLE001 — logged with its trace in _finished
            log.error("wechat.dispatcher_failed", message_id=inbound.message_id, error=type(exc).__name__)
            return None

    def _finished(self, task: asyncio.Task[Reply]) -> None:
        self.pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("wechat.dispatcher_error", exc_info=task.exception())

    def _render(self, reply: Reply | None, inbound: Inbound) -> str:
        if reply is None or not reply.text.strip() or inbound.raw.get("event") == "unsubscribe":
            return wc.NO_REPLY
        return render_text_reply(reply.text, to_user=inbound.user_id, from_user=str(inbound.raw["ToUserName"]))

    async def drain(self, timeout_s: float | None = None) -> None:
        """Wait up to ``timeout_s`` seconds (default ``reply_budget_s``) for computations
        still running after their webhook answered (graceful shutdown); never cancels them."""
        if self.pending:
            await asyncio.wait(set(self.pending), timeout=self.cfg.reply_budget_s if timeout_s is None else timeout_s)


WECHAT_ADAPTER = web.AppKey("wechat_adapter", WechatAdapter)
"""Where :func:`setup_wechat` stores its :class:`WechatAdapter` in the app."""


def setup_wechat(app: web.Application, cfg: Config, dispatcher: DispatcherLike) -> None:
    """Add ``GET /wechat`` (URL verification) and ``POST /wechat`` (messages) to ``app``.

    Args:
        app: the aiohttp application (not yet started).
        cfg: the effective config; ``cfg.wechat`` and ``cfg.server.max_body_bytes``
            are used. With an empty ``wechat.token`` both routes answer 503 (an
            unsigned webhook is never accepted).
        dispatcher: ``async handle(Inbound) -> Reply``, deduplicating on
            (channel, message_id); called once per WeChat delivery.

    Raises:
        ConfigError: see :class:`WechatAdapter`.
    """
    adapter = WechatAdapter(cfg, dispatcher)
    app[WECHAT_ADAPTER] = adapter
    app.router.add_get("/wechat", adapter.handle_get)
    app.router.add_post("/wechat", adapter.handle_post)

    async def _drain(_app: web.Application) -> None:
        await adapter.drain()

    app.on_shutdown.append(_drain)
