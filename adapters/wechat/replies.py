"""The passive reply XML (被动回复用户消息): a text reply cut to WeChat's byte limit,
and the reply that hands a message to human agents (消息转发到客服)."""

from __future__ import annotations

import time

from wechatpy.replies import TextReply, TransferCustomerServiceReply

from adapters.text_split import SENTENCE_ENDS
from adapters.text_split import utf8_len as _nbytes
from adapters.wechat import constants as wc
from adapters.wechat.parsing import strip_invalid_xml_chars

__all__ = ["ELLIPSIS", "fit_passive_text", "render_text_reply", "render_transfer_reply"]

ELLIPSIS = "…"
_CDATA_END = "]]>"
_CDATA_END_SPLIT = "]]]]><![CDATA[>"  # closes the section after "]]" and reopens it before ">"


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
        if ch in SENTENCE_ENDS or (ch == "." and i + 1 < len(text) and text[i + 1].isspace()):
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
            :data:`~adapters.wechat.constants.PASSIVE_TEXT_MAX_BYTES` (2048,
            被动回复用户消息).

    Returns:
        A string whose UTF-8 encoding is at most ``max_bytes`` bytes.
    """
    if _nbytes(text) <= max_bytes:
        return text
    mark = ELLIPSIS if _nbytes(ELLIPSIS) < max_bytes else ""
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
            :data:`~adapters.wechat.constants.PASSIVE_TEXT_MAX_BYTES` UTF-8 bytes
            (:func:`fit_passive_text`) and "]]>" is split so the CDATA stays intact.
        to_user: the user's OpenID (the message's FromUserName).
        from_user: the account's original id (the message's ToUserName).
        now: CreateTime, UNIX seconds (default: now).
    """
    content = fit_passive_text(strip_invalid_xml_chars(text))
    reply = TextReply(source=_cdata(from_user), target=_cdata(to_user), content=_cdata(content),
                      time=int(time.time() if now is None else now))
    return reply.render()



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

