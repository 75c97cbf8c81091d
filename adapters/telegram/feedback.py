"""👍 / 👎 buttons under the bot's answers, and what a press does (bot/feedback.py).

An answer (intent ``answer`` with a topic) is sent with an inline keyboard of two buttons,
labelled in the answer's language. Each button's callback data is
``fb:<h|n>:<chat id>:<message id>`` (h helpful, n not helpful; the ids are those of the
user's question, :attr:`bot.types.Inbound.message_id`): at most 47 bytes, within
:data:`~adapters.telegram.constants.CALLBACK_DATA_MAX_BYTES`. A press records the presser's
vote on that answer (:meth:`bot.feedback.FeedbackBook.vote`: only the user who asked can
vote, once), answers the callback query with a short notice (:data:`bot.feedback.TEXTS`:
"谢谢反馈！" / "Thanks for the feedback!", or why it did not count) and, once the answer has
its vote, removes the keyboard.
"""

from __future__ import annotations

import re
from typing import Callable

import structlog
from telegram import CallbackQuery, InlineKeyboardButton, InlineKeyboardMarkup, Update
from telegram.error import TelegramError
from telegram.ext import ContextTypes

from adapters.telegram import constants as tc
from adapters.telegram.sender import TelegramSender
from bot.feedback import TEXTS, FeedbackBook, Outcome
from bot.store import StoreError
from bot.store.health import store_unavailable
from bot.types import Inbound, Reply

log = structlog.get_logger("healthbot.telegram")

__all__ = ["FEEDBACK_BUTTON_RE", "FeedbackButtons"]

FEEDBACK_BUTTON_RE = re.compile(r"fb:([hn]):(-?[0-9]{1,20}:[0-9]{1,20})\Z")
"""The whole callback data of a feedback button: the vote and the question's ``"<chat>:<message>"``
(``\\Z``: python-telegram-bot matches a handler's pattern from the start, so this is a full match)."""
_VOTE = {"h": "helpful", "n": "not_helpful"}


class FeedbackButtons:
    """The keyboard under answers and the handler of its presses.

    Args:
        feedback: where offers and votes are kept.
        sender: Bot API calls with the adapter's retry rules.
        ui_lang_of: user id → the language of the adapter's own texts (for a notice whose
            answer is unknown).
    """

    def __init__(self, feedback: FeedbackBook, sender: TelegramSender, ui_lang_of: Callable[[str], str]):
        self.feedback = feedback
        self.sender = sender
        self.ui_lang_of = ui_lang_of

    async def keyboard(self, inbound: Inbound, reply: Reply) -> InlineKeyboardMarkup | None:
        """The 👍 / 👎 keyboard for ``reply`` to ``inbound``, once its user may vote on it; None when the
        reply takes no feedback (not an answer) or the offer could not be stored. Never raises."""
        data = {vote: f"fb:{code}:{inbound.message_id}" for code, vote in _VOTE.items()}
        if any(len(d.encode()) > tc.CALLBACK_DATA_MAX_BYTES or not FEEDBACK_BUTTON_RE.match(d) for d in data.values()):
            return None  # an edited message's id ("<chat>:<message>:edit:<date>"): never an answer
        if not await self.feedback.offer(tc.CHANNEL, inbound.user_id, inbound.message_id, reply):
            return None
        lang = reply.lang if reply.lang in ("zh", "en") else "zh"
        return InlineKeyboardMarkup([[InlineKeyboardButton(TEXTS[vote][lang], callback_data=data[vote])
                                      for vote in ("helpful", "not_helpful")]])

    async def on_press(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """A feedback button was pressed: vote, answer the query, remove the keyboard once voted."""
        query: CallbackQuery | None = update.callback_query
        match = FEEDBACK_BUTTON_RE.match(query.data or "") if query is not None else None
        if query is None or query.from_user is None or match is None:
            return
        uid = str(query.from_user.id)
        try:
            result = await self.feedback.vote(tc.CHANNEL, uid, match.group(2), _VOTE[match.group(1)])
        except StoreError as exc:
            store_unavailable("feedback", exc)
            result = None
        lang = (result.lang if result is not None else None) or self.ui_lang_of(uid)
        notice = TEXTS[result.outcome.value if result is not None else "failed"][lang]
        try:  # the button stops spinning and the notice shows
            await self.sender.call("answerCallbackQuery", lambda: query.answer(text=notice))
        except TelegramError as exc:
            log.warning("telegram.callback_answer_failed", error=str(exc))
        if result is None or result.outcome is Outcome.UNKNOWN or query.message is None:
            return  # nothing counted: the buttons stay (for the user who asked, or for a later try)
        try:
            await self.sender.call("editMessageReplyMarkup", lambda: query.edit_message_reply_markup(reply_markup=None))
        except TelegramError as exc:  # e.g. "message is not modified": a second press raced the first
            log.info("telegram.keyboard_not_removed", error=str(exc))
