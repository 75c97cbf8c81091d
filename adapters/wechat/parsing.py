"""Parsing what WeChat sends to ``/wechat``: bounded, total, and authenticated first.

Used by :mod:`adapters.wechat`; every function here either returns a value or
raises :class:`Reject` (a 4xx with a short plain-text body), never anything else
for any input (issue 21: "no 5xx from any input").

* :func:`parse_timestamp` — the ``timestamp`` query parameter, 1–15 digits (a
  10-digit UNIX time in practice); anything else is a 403 before any arithmetic
  (a 400-digit value used to overflow the float conversion).
* :func:`extract_encrypt` — the ``<Encrypt>`` value of a safe-mode envelope, found
  with one linear regular-expression search and **no XML parser**, so that
  ``msg_signature`` (which covers it) is checked before anything expensive runs
  on an unauthenticated body.
* :func:`parse_xml` — the ``<xml>`` root's children as a dict, through defusedxml
  (no DTD, no entities) with the element depth bounded by :data:`MAX_XML_DEPTH`
  while expat reads (a 1,000-deep body used to exhaust the recursion limit);
  a repeated top-level field is refused.
* :func:`parse_inbound` — one message or event → :class:`bot.types.Inbound`; the
  fields the adapter reads as text (``ToUserName``, ``Content``, ``MsgId`` …) must
  be text, not elements, and IDs are bounded in length. A voice message whose
  ``Recognition`` holds elements counts as one without recognition (the user is
  asked to type).
"""

from __future__ import annotations

import re
import time
from typing import Any
from xml.etree.ElementTree import Element, ParseError, TreeBuilder

import defusedxml
from aiohttp import web
from defusedxml.ElementTree import DefusedXMLParser

from adapters.wechat import constants as wc
from bot.types import Inbound, MessageKind

__all__ = ["MAX_XML_DEPTH", "MAX_ID_CHARS", "Reject", "extract_encrypt", "parse_inbound", "parse_timestamp",
           "parse_xml", "strip_invalid_xml_chars"]

MAX_XML_DEPTH = 6
"""Deepest element nesting accepted, ``<xml>`` counting 1. WeChat's deepest documented
push (接收事件推送, ``pic_weixin``: xml > SendPicsInfo > PicList > item > PicMd5Sum) has 5."""

MAX_ID_CHARS = 128
"""Longest ``ToUserName`` / ``FromUserName`` / ``MsgId`` / ``CreateTime`` / ``Event`` accepted,
characters (an OpenID has 28, a MsgId at most 20 digits); longer is a 400."""

TEXT_FIELDS = ("ToUserName", "FromUserName", "CreateTime", "MsgType", "MsgId", "Content", "Event", "EventKey")
"""Top-level fields read as text: an element inside one of them is a 400."""

_ID_FIELDS = ("ToUserName", "FromUserName", "CreateTime", "MsgType", "MsgId", "Event")
_TIMESTAMP = re.compile(r"[0-9]{1,15}")
_ENCRYPT = re.compile(r"<Encrypt>\s*(?:<!\[CDATA\[\s*([A-Za-z0-9+/=]+)\s*\]\]>|([A-Za-z0-9+/=]+))\s*</Encrypt>")

# XML 1.0 (§2.2 Char) forbids C0 controls except TAB, LF, CR, and U+FFFE/U+FFFF;
# WeChat clients send some of them (e.g. \x08 from certain emoji keyboards) inside
# CDATA, which makes every XML parser fail. Lone surrogates cannot survive UTF-8
# decoding but can reach us in reply text.
_INVALID_XML_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff\ud800-\udfff]")


class Reject(Exception):
    """A request refused with ``status`` and a short plain-text ``body`` (no trace)."""

    def __init__(self, status: int, body: str, reason: str):
        super().__init__(reason)
        self.status = status
        self.body = body
        self.reason = reason

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=self.body)


def _malformed(reason: str) -> Reject:
    return Reject(400, "malformed xml", reason)


def strip_invalid_xml_chars(text: str) -> str:
    """``text`` without the characters XML 1.0 forbids (C0 controls but TAB/LF/CR,
    U+FFFE, U+FFFF, surrogates); every other character is kept as it is."""
    return _INVALID_XML_CHARS.sub("", text)


def parse_timestamp(value: str | None) -> int:
    """The ``timestamp`` query parameter as an int; 403 unless it is 1–15 ASCII digits."""
    if value is None or not _TIMESTAMP.fullmatch(value):
        raise Reject(403, "invalid signature", "timestamp missing or not a plain integer of at most 15 digits")
    return int(value)


def extract_encrypt(envelope: str) -> str:
    """The base64 ``<Encrypt>`` value of a safe-mode envelope, without parsing the XML.

    Raises:
        Reject: (400) no ``<Encrypt>`` of base64 characters, or more than one.
    """
    found = [a or b for a, b in _ENCRYPT.findall(envelope)]
    if len(found) != 1:
        raise _malformed("encrypted request without exactly one <Encrypt> of base64 text")
    return found[0]


class _DepthBoundedBuilder(TreeBuilder):
    """A TreeBuilder that refuses to go deeper than :data:`MAX_XML_DEPTH` (raised inside expat's callback)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0

    def start(self, tag: Any, attrs: Any) -> Element:
        self.depth += 1
        if self.depth > MAX_XML_DEPTH:
            raise _malformed(f"elements nested deeper than {MAX_XML_DEPTH}")
        return super().start(tag, attrs)

    def end(self, tag: Any) -> Element:
        self.depth -= 1
        return super().end(tag)


def _element_to_dict(element: Element) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for child in element:
        if child.tag in out and element.tag == "xml":
            raise _malformed(f"field <{child.tag}> given twice")
        out[child.tag] = _element_to_dict(child) if len(child) else (child.text or "")
    return out


def parse_xml(text: str) -> dict[str, Any]:
    """The children of the ``<xml>`` root as a dict (elements with children as nested dicts).

    defusedxml refuses any DOCTYPE (so entity expansion and external entities
    never reach a parser); the depth is bounded while expat reads; the caller has
    removed XML-invalid characters.

    Raises:
        Reject: (400) not well-formed, a DOCTYPE or entity, deeper than
            :data:`MAX_XML_DEPTH`, a root other than ``<xml>``, or a repeated field.
    """
    parser = DefusedXMLParser(target=_DepthBoundedBuilder(), forbid_dtd=True, forbid_entities=True,
                              forbid_external=True)
    try:
        parser.feed(text)
        root = parser.close()
    except Reject:
        raise
    except defusedxml.DefusedXmlException as exc:
        raise _malformed(f"forbidden xml construct: {type(exc).__name__}") from None
    except (ParseError, ValueError, RecursionError) as exc:
        raise _malformed(f"xml parse error: {exc}") from None
    if root.tag != "xml":
        raise _malformed(f"root element is <{str(root.tag)[:40]}>, not <xml>")
    return _element_to_dict(root)


def _check_fields(fields: dict[str, Any]) -> None:
    for name in TEXT_FIELDS:
        if isinstance(fields.get(name), dict):
            raise _malformed(f"<{name}> holds elements, not text")
    for name in _ID_FIELDS:
        if len(str(fields.get(name) or "")) > MAX_ID_CHARS:
            raise _malformed(f"<{name}> longer than {MAX_ID_CHARS} characters")


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
        Reject: (400) the XML is not a WeChat message (see :func:`parse_xml`; a text
            field holding elements; an ID over :data:`MAX_ID_CHARS`).
    """
    fields = parse_xml(xml_text)
    _check_fields(fields)
    msg_type = str(fields.get("MsgType") or "").strip().lower()
    openid = str(fields.get("FromUserName") or "").strip()
    if not msg_type or not openid or not str(fields.get("ToUserName") or "").strip():
        raise _malformed("MsgType, FromUserName or ToUserName missing "
                         "(an encrypted body while wechat.mode is plaintext looks like this)")
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
        recognition = fields.get("Recognition")
        if msg_type == "text":
            kind, text = MessageKind.TEXT, str(fields.get("Content") or "").strip()  # stripped, as wechatpy.parse_message gives it
        elif msg_type == "voice" and isinstance(recognition, str) and recognition.strip():
            kind, text = MessageKind.TEXT, recognition.strip()
            raw["voice_recognition"] = True
        else:
            kind = MessageKind.UNSUPPORTED
    return Inbound(channel=wc.CHANNEL, user_id=openid, chat_id=openid, message_id=message_id,
                   kind=kind, text=text, lang=None,
                   received_at=time.time() if received_at is None else received_at, raw=raw)
