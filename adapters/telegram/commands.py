"""The Telegram adapter's handlers for what users send: commands (/start, /help,
/human, /stop, /lang), the /lang buttons, block notices and questions; and the
notifier that brings an agent's text to the user (see the package docstring, "Commands").

:class:`TelegramCommands` is the base of :class:`adapters.telegram.adapter.TelegramAdapter`,
which sets the state declared on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import structlog
from telegram import (Bot, CallbackQuery, InlineKeyboardButton, InlineKeyboardMarkup, Message, MessageEntity,
                      ReplyKeyboardMarkup, Update, User)
from telegram.constants import ChatMemberStatus
from telegram.error import Forbidden, TelegramError
from telegram.ext import ContextTypes

from adapters.masking import mask_id
from adapters.telegram import constants as tc
from adapters.telegram.feedback import FeedbackButtons
from adapters.telegram.handoff import USER_TEXTS, TelegramAgentRelay
from adapters.telegram.parsing import parse_update
from adapters.telegram.sender import TelegramSender
from adapters.telegram.texts import LANG_BUTTON_PREFIX, LANG_BUTTON_RE, OFFER_BUTTONS, TEXTS, lang_arg
from safety.config import SafetyConfig
from bot.handoff_commands import request_human, stop_conversation
from bot.types import Inbound, MessageKind, Reply

if TYPE_CHECKING:  # pragma: no cover
    from bot.handoff import HandoffManager, HandoffSession

log = structlog.get_logger("healthbot.telegram")

__all__ = ["DispatcherLike", "TelegramCommands"]


class DispatcherLike(Protocol):
    """What the adapter needs from the core: ``handle(Inbound) -> Reply`` (deduplicating)."""

    async def handle(self, inbound: Inbound) -> Reply: ...


class TelegramCommands:
    """Handlers of :class:`adapters.telegram.adapter.TelegramAdapter` for users' updates."""

    dispatcher: DispatcherLike
    handoff: HandoffManager
    sender: TelegramSender
    safety: SafetyConfig
    relay: TelegramAgentRelay | None
    feedback_buttons: FeedbackButtons | None  # 👍 / 👎 under answers (adapters/telegram/feedback.py)
    langs: dict[str, str]          # user_id -> /lang choice
    _client_langs: dict[str, str]  # user_id -> from Telegram's language_code
    stats: dict[str, int]
    bot: Bot

    # ---- languages

    def ui_lang_of(self, user_id: str) -> str:
        """The language of the adapter's own texts for ``user_id``: the /lang choice,
        else from Telegram's ``language_code``, else ``"zh"``."""
        for lang in (self.langs.get(user_id), self._client_langs.get(user_id)):
            if lang in ("zh", "en"):
                return lang
        return "zh"

    def _note_user(self, user: User | None) -> None:
        if user is not None and user.language_code:
            self._client_langs[str(user.id)] = "zh" if user.language_code.lower().startswith("zh") else "en"

    # ---- replies and commands

    async def _reply(self, message: Message, text: str,
                     reply_markup: InlineKeyboardMarkup | ReplyKeyboardMarkup | None = None) -> None:
        """Send ``text`` to the message's chat (as a reply in groups, in its forum topic); never raises."""
        group = message.chat.type in tc.GROUP_CHAT_TYPES
        thread = message.message_thread_id if message.is_topic_message else None
        try:
            await self.sender.send_text(int(message.chat.id), text, thread_id=thread,
                                        reply_to=message.message_id if group else None, reply_markup=reply_markup)
        except Forbidden:
            pass  # recorded by the sender
        except TelegramError as exc:
            log.error("telegram.reply_failed", chat=mask_id(message.chat.id, tail=4), error=str(exc))

    async def _dispatch(self, inbound: Inbound, message: Message) -> None:
        try:
            reply = await self.dispatcher.handle(inbound)
        except Exception:  # noqa: BLE001 — logged; the user gets no answer rather than a crash
            log.exception("telegram.dispatcher_failed", message_id=inbound.message_id)
            return
        self.stats["dispatched"] += 1
        if reply.text.strip():
            await self._reply(message, reply.text, await self._buttons(inbound, reply, message))

    async def _buttons(self, inbound: Inbound, reply: Reply, message: Message
                       ) -> InlineKeyboardMarkup | ReplyKeyboardMarkup | None:
        """The keyboard under ``reply``: an offer's yes / no, or its numbers and no, for a list (:data:`OFFER_BUTTONS`;
        a tap sends the label) in a private chat — in a group a tap is neither a mention nor a reply, so the bot
        would not hear it; an answer's 👍 / 👎; else none."""
        if reply.suggested:
            if message.chat.type in tc.GROUP_CHAT_TYPES:
                return None
            yes, no = OFFER_BUTTONS["en" if reply.lang == "en" else "zh"]
            labels = [yes] if len(reply.suggested) == 1 else [str(i) for i in range(1, len(reply.suggested) + 1)]
            return ReplyKeyboardMarkup([labels + [no]], one_time_keyboard=True, resize_keyboard=True)
        buttons = self.feedback_buttons
        return await buttons.keyboard(inbound, reply) if buttons is not None else None

    def _text(self, key: str, user_id: str) -> str:
        lang = self.ui_lang_of(user_id)
        return TEXTS[key][lang].format(emergency=self._emergency_number(lang))

    def _emergency_number(self, lang: str) -> str:
        """The configured emergency number (``safety.emergency_number_zh`` / ``_en``)."""
        return self.safety.emergency_number_zh if lang == "zh" else self.safety.emergency_number_en

    @staticmethod
    def _who(update: Update) -> tuple[Message, User] | None:
        message, user = update.message, update.effective_user
        if message is None or user is None or user.is_bot:
            return None
        return message, user

    async def _cmd_start(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        who = self._who(update)
        if who is None:
            return
        message, user = who
        uid = str(user.id)
        inbound = Inbound(channel=tc.CHANNEL, user_id=uid, chat_id=str(message.chat.id),
                          message_id=f"{message.chat.id}:{message.message_id}", kind=MessageKind.SUBSCRIBE,
                          lang=self.ui_lang_of(uid),
                          raw={"type": "command", "command": "start", "args": list(context.args or []),
                               "update_id": update.update_id, "chat_type": message.chat.type})
        await self._dispatch(inbound, message)

    async def _cmd_help(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        who = self._who(update)
        if who is None:
            return
        message, user = who
        await self._reply(message, self._text("help", str(user.id)))

    async def _cmd_human(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        who = self._who(update)
        if who is None:
            return
        message, user = who
        uid = str(user.id)
        if message.chat.type != "private":
            await self._reply(message, self._text("human_private_only", uid))
            return
        outcome = await request_human(self.handoff, tc.CHANNEL, uid, str(message.chat.id))
        await self._reply(message, self._text(f"human_{outcome}", uid))

    async def _cmd_stop(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        who = self._who(update)
        if who is None:
            return
        message, user = who
        uid = str(user.id)
        ended = await stop_conversation(self.handoff, self.dispatcher, tc.CHANNEL, uid)
        text = self._text("stopped_handoff" if ended else "stopped", uid)
        self.langs.pop(uid, None)
        if self.relay is not None:
            self.relay.forget(uid)
        await self._reply(message, text)

    async def _cmd_lang(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        who = self._who(update)
        if who is None:
            return
        message, user = who
        uid = str(user.id)
        choice = lang_arg(context.args[0]) if context.args else None
        if choice is None:
            buttons = InlineKeyboardMarkup([[InlineKeyboardButton("中文", callback_data=f"{LANG_BUTTON_PREFIX}zh"),
                                             InlineKeyboardButton("English", callback_data=f"{LANG_BUTTON_PREFIX}en")]])
            await self._reply(message, self._text("lang_prompt", uid), reply_markup=buttons)
            return
        self.langs[uid] = choice
        await self._reply(message, TEXTS["lang_set"][choice])

    async def _on_lang_button(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        query: CallbackQuery | None = update.callback_query
        if query is None or query.from_user is None:
            return
        uid = str(query.from_user.id)
        match = LANG_BUTTON_RE.fullmatch(query.data or "")
        notice = None if match else self._text("unknown_button", uid)
        try:  # the button stops spinning; an unknown one shows a short notice
            await self.sender.call("answerCallbackQuery", lambda: query.answer(text=notice))
        except TelegramError as exc:
            log.warning("telegram.callback_answer_failed", error=str(exc))
        if match is None:
            log.warning("telegram.unknown_callback", update_id=update.update_id, chars=len(query.data or ""))
            return
        choice = match.group(1)
        self.langs[uid] = choice
        if isinstance(query.message, Message):
            await self._reply(query.message, TEXTS["lang_set"][choice])

    async def _on_my_chat_member(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        change = update.my_chat_member
        if change is None:
            return
        status = change.new_chat_member.status
        chat_id = int(change.chat.id)
        if status in (ChatMemberStatus.BANNED, ChatMemberStatus.LEFT):
            self.sender.record_blocked(chat_id, f"my_chat_member: {status}")
        elif status in (ChatMemberStatus.MEMBER, ChatMemberStatus.ADMINISTRATOR):
            self.sender.unblock(chat_id)

    async def _on_message(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        message, user = update.message, update.effective_user
        command = self._unhandled_command(message) if message is not None else None
        if command is not None:
            if command == "answer" and message is not None and user is not None and not user.is_bot:
                await self._reply(message, self._text("unknown_command", str(user.id)))
            return
        lang = self.langs.get(str(user.id)) if user is not None else None
        bot = self.bot
        inbound = parse_update(update, bot_username=bot.username or "", bot_id=bot.id, lang=lang)
        if inbound is None:
            return
        target = update.message if update.message is not None else update.edited_message
        assert target is not None
        await self._dispatch(inbound, target)

    def _unhandled_command(self, message: Message) -> str | None:
        """For a /command no handler took: ``"answer"`` (a hint, in private chats and for
        ``/x@thisbot`` in groups) or ``"ignore"`` (a group command for another bot, or
        for every bot); None when the message is not a command. A command is never
        passed on as a question."""
        entities = message.entities
        if not (message.text and entities and entities[0].type == MessageEntity.BOT_COMMAND
                and entities[0].offset == 0):
            return None
        if message.chat.type in tc.GROUP_CHAT_TYPES:
            target = message.text[1:entities[0].length].partition("@")[2].lower()
            if not target or target != (self.bot.username or "").lower():
                return "ignore"
        return "answer"

    # ---- handoff: agent -> user

    async def notify_user(self, session: HandoffSession, text: str) -> None:
        """Send an agent's ``text`` to the user of ``session`` (``HandoffManager``'s notifier).

        Raises:
            telegram.error.Forbidden: the user blocked the bot (the relay tells agents).
            telegram.error.TelegramError: delivery failed after retries.
        """
        label = USER_TEXTS["agent_label"][self.ui_lang_of(session.user_id)]
        await self.sender.send_text(int(session.chat_id), f"{label}\n{text}")


