"""A Telegram ``message`` or ``edited_message`` update → one :class:`bot.types.Inbound`
(see the package docstring: message kinds, edited messages, groups)."""

from __future__ import annotations

import datetime as dtm
import time
from typing import Any

from telegram import Message, MessageEntity, Update

from adapters.telegram import constants as tc
from bot.types import Inbound, MessageKind

__all__ = ["addressed_to_bot", "message_type", "parse_update"]


def message_type(message: Message) -> str | None:
    """``"text"``, the first of :data:`~adapters.telegram.constants.UNSUPPORTED_TYPES`
    the message carries, or None for a service message."""
    if message.text is not None:
        return "text"
    for name in tc.UNSUPPORTED_TYPES:
        if getattr(message, name, None):
            return name
    return None


def _mentions(message: Message, bot_username: str, bot_id: int) -> bool:
    target = "@" + bot_username.lower() if bot_username else None
    for parse in (message.parse_entities, message.parse_caption_entities):
        for entity, value in parse([MessageEntity.MENTION, MessageEntity.TEXT_MENTION]).items():
            if entity.type == MessageEntity.MENTION and target and value.lower() == target:
                return True
            if entity.type == MessageEntity.TEXT_MENTION and entity.user is not None and entity.user.id == bot_id:
                return True
    return False


def _replies_to_bot(message: Message, bot_id: int) -> bool:
    replied = message.reply_to_message
    if replied is None or replied.from_user is None or replied.from_user.id != bot_id:
        return False
    # In a forum, a message in a topic "replies" to the topic's creation message.
    return not (message.is_topic_message and replied.message_id == message.message_thread_id)


def addressed_to_bot(message: Message, bot_username: str, bot_id: int) -> bool:
    """True when a group message is for the bot: it mentions ``@bot_username`` (or the
    bot by a text mention) or replies to one of the bot's messages."""
    return _mentions(message, bot_username, bot_id) or _replies_to_bot(message, bot_id)


def _strip_mention(text: str, bot_username: str) -> str:
    if not bot_username:
        return text
    target = "@" + bot_username.lower()
    out, i, low = [], 0, text.lower()
    while True:
        at = low.find(target, i)
        if at < 0:
            out.append(text[i:])
            break
        out.append(text[i:at])
        i = at + len(target)
    return " ".join("".join(out).split(" ")).strip()


def _epoch(value: dtm.datetime | None) -> int:
    return int(value.timestamp()) if value is not None else 0


def parse_update(update: Update, *, bot_username: str, bot_id: int, lang: str | None = None,
                 received_at: float | None = None) -> Inbound | None:
    """One Telegram ``message`` or ``edited_message`` update → :class:`bot.types.Inbound`, or None.

    Args:
        update: the parsed update (``update.message`` may be None: edits, callback
            queries, member updates — never an error).
        bot_username / bot_id: this bot (from getMe), to recognise mentions and replies.
        lang: the user's /lang choice, passed as ``Inbound.lang``.
        received_at: UNIX seconds when the update arrived (default: now).

    Returns:
        None for updates without a message, service messages, messages without a
        sender or from bots, chats other than private/group/supergroup, and group
        messages not addressed to the bot. Otherwise an Inbound (channel
        ``"telegram"``, ``user_id`` the sender's id, ``chat_id`` the chat's id,
        ``message_id`` ``"<chat_id>:<message_id>"``): TEXT (in groups without the
        ``@bot`` mention), UNSUPPORTED with ``raw["type"]`` for media, or — for an
        edited message — EVENT with ``raw["type"] = "edited_message"`` (see the
        package docstring). ``raw`` also has ``update_id``, ``chat_type``,
        ``telegram_message_id``, ``thread_id`` and ``caption`` where present.
    """
    edited = update.message is None and update.edited_message is not None
    message = update.message if update.message is not None else update.edited_message
    if message is None or message.chat is None:
        return None
    user = message.from_user
    if user is None or user.is_bot:
        return None
    chat = message.chat
    group = chat.type in tc.GROUP_CHAT_TYPES
    if chat.type != "private" and not group:
        return None
    mtype = message_type(message)
    if mtype is None:
        return None
    if group and not addressed_to_bot(message, bot_username, bot_id):
        return None
    text = message.text or ""
    if group:
        text = _strip_mention(text, bot_username)
    raw: dict[str, Any] = {"type": mtype, "update_id": update.update_id, "chat_type": chat.type,
                           "telegram_message_id": message.message_id,
                           "thread_id": message.message_thread_id if message.is_topic_message else None}
    if message.caption:
        raw["caption"] = message.caption
    key = f"{chat.id}:{message.message_id}"
    at = time.time() if received_at is None else received_at
    common = {"channel": tc.CHANNEL, "user_id": str(user.id), "chat_id": str(chat.id), "lang": lang,
              "received_at": at}
    if edited:
        edit_date = _epoch(message.edit_date)
        raw.update({"type": "edited_message", "content_type": mtype, "edit_date": edit_date})
        return Inbound(message_id=f"{key}:edit:{edit_date}", kind=MessageKind.EVENT, raw=raw, **common)
    if mtype == "text":
        return Inbound(message_id=key, kind=MessageKind.TEXT, text=text, raw=raw, **common)
    return Inbound(message_id=key, kind=MessageKind.UNSUPPORTED, raw=raw, **common)

