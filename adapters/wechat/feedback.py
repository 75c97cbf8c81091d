"""👍 / 👎 on WeChat: a customer-service menu message after an answer, and its clicks (bot/feedback.py).

Service accounts only, with ``wechat.feedback_menu`` on (off by default; a subscription account
has no customer-service API). An answer (intent ``answer`` with a topic) that went out through
the customer-service API — a late answer, or the pages after a passive page 1 — is followed by
one ``msgmenu`` message (客服接口-发消息, 发送菜单消息): "这个回答对您有帮助吗？" and two clickable
lines, "👍 有帮助" and "👎 没帮助" (English for English answers), when the answer left room in the
user's customer-service quota (:data:`~adapters.wechat.constants.KF_MESSAGES_PER_USER_MESSAGE`).
A passive reply (the XML answer to the webhook) cannot carry a menu, so an answer delivered
passively alone gets none.

A click arrives as a text message whose ``bizmsgmenuid`` is the line's id: ``1<MsgId>``
(helpful) or ``2<MsgId>`` (not helpful), where ``MsgId`` is the answered question's (10-20
digits; WeChat's own example ids are digits, so nothing else is used). It is not a question:
it records the user's vote on that answer (the first one counts) and is answered passively
with "谢谢反馈！" / "Thanks for the feedback!" — also for a repeated click, which changes nothing.
"""

from __future__ import annotations

import re

import structlog

from adapters.masking import mask_id
from adapters.wechat import constants as wc
from adapters.wechat.api import SendOutcome, WechatApi
from bot.feedback import TEXTS, FeedbackBook, Outcome
from bot.store import StoreError
from bot.store.health import store_unavailable
from bot.types import Inbound, MessageKind, Reply

log = structlog.get_logger("healthbot.wechat")

__all__ = ["MENU_ID_RE", "click_reply", "send_feedback_menu"]

_MSGID = "[0-9]{10,20}"
MENU_ID_RE = re.compile(f"([12])({_MSGID})")
"""A feedback line's id, whole: the vote digit (1 helpful, 2 not helpful) and the question's MsgId."""
_VOTE = {"1": "helpful", "2": "not_helpful"}


async def send_feedback_menu(api: WechatApi, feedback: FeedbackBook, openid: str, msgid: str, reply: Reply) -> bool:
    """Offer ``reply`` (the answer to message ``msgid`` of ``openid``) for a vote and send the menu.

    Returns True when the menu was sent; False when the reply takes no feedback, ``msgid`` is not
    a MsgId, the offer could not be stored, or WeChat did not take the message (logged). Never raises.
    """
    if not re.fullmatch(_MSGID, msgid) or not await feedback.offer(wc.CHANNEL, openid, msgid, reply):
        return False
    lang = reply.lang if reply.lang in ("zh", "en") else "zh"
    outcome = await api.send_menu(openid, TEXTS["question"][lang],
                                  [(f"{digit}{msgid}", TEXTS[vote][lang]) for digit, vote in _VOTE.items()],
                                  TEXTS["tail"][lang])
    if outcome is not SendOutcome.SENT:
        log.info("wechat.feedback_menu_not_sent", message_id=msgid, user=mask_id(openid, head=6),
                 outcome=outcome.value)
    return outcome is SendOutcome.SENT


async def click_reply(feedback: FeedbackBook, inbound: Inbound) -> str | None:
    """The passive reply to a click on a feedback menu line (its vote recorded), or None when
    ``inbound`` is not one (it is then an ordinary message). Never raises."""
    menu_id = inbound.raw.get("bizmsgmenuid")
    match = MENU_ID_RE.fullmatch(menu_id.strip()) if isinstance(menu_id, str) else None
    if inbound.kind is not MessageKind.TEXT or match is None:
        return None
    clicked_en = inbound.text in (TEXTS["helpful"]["en"], TEXTS["not_helpful"]["en"])
    try:
        result = await feedback.vote(wc.CHANNEL, inbound.user_id, match.group(2), _VOTE[match.group(1)])
    except StoreError as exc:
        store_unavailable("feedback", exc)
        return TEXTS["failed"]["en" if clicked_en else "zh"]
    lang = result.lang or ("en" if clicked_en else "zh")
    return TEXTS["unknown" if result.outcome is Outcome.UNKNOWN else "recorded"][lang]
