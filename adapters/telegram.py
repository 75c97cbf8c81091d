"""Telegram adapter (python-telegram-bot v22): ``POST /telegram`` webhook, polling, commands.

A thin translator (ARCHITECTURE.md, "One message, end to end"): a Telegram
``Update`` becomes one :class:`bot.types.Inbound`, ``dispatcher.handle`` decides,
and the :class:`bot.types.Reply` is sent back with sendMessage. What a greeting,
a sticker or an emergency gets is the dispatcher's decision; this module only owns
Telegram's protocol: its webhook, its limits (:mod:`adapters.telegram_constants`),
its commands and its agents' group (:mod:`adapters.telegram_handoff`).

Protocol source: Telegram Bot API, https://core.telegram.org/bots/api; client:
python-telegram-bot v22 (``telegram.ext.Application`` with ``updater(None)``,
``Update.de_json``, ``Bot.send_message``).

Webhook (``POST /telegram``), checks in order, each answered with a short body:

* ``X-Telegram-Bot-Api-Secret-Token`` compared with ``telegram.secret`` by
  :func:`hmac.compare_digest` — missing or wrong: 403. With no secret configured
  the route answers 503: an unauthenticated webhook is never accepted (polling
  still works).
* the adapter not started (Bot API unreachable at start-up) or shutting down: 503,
  so Telegram keeps the update and re-sends it.
* body over :data:`~adapters.telegram_constants.UPDATE_MAX_BYTES`: 413; not JSON,
  not an object or without an integer ``update_id``: 400.
* otherwise 200 at once: the update is queued and processed in the background.
  An update whose fields have the wrong types (:mod:`adapters.telegram_checks`)
  or that python-telegram-bot cannot parse is logged as one warning line and
  dropped; every error while processing is logged; neither reaches the HTTP
  answer — a 5xx would make Telegram re-send it for ever and hold back the
  updates behind it.

Processing: concurrent across chats, one at a time and in arrival order within a
chat (:class:`PerChatUpdateProcessor`), at most
:data:`~adapters.telegram_constants.MAX_CONCURRENT_UPDATES` at once.

Deduplication, two layers: ``update_id`` (a Telegram re-delivery, also of
commands) is remembered for the last
:data:`~adapters.telegram_constants.SEEN_UPDATES_MAX` updates and a repeat is
dropped before any handler; ``Inbound.message_id`` is ``"<chat_id>:<message_id>"``,
the dispatcher's (channel, message_id) key, stable across re-deliveries.

Message kinds: text → TEXT; sticker, photo, voice, video, document, location and
the rest of :data:`~adapters.telegram_constants.UNSUPPORTED_TYPES` → UNSUPPORTED
with ``raw["type"]`` (the dispatcher answers with a helpful text; ``voice`` gets
its "type your question" text); service messages (member joined, topic created)
and channel posts → nothing. A message without a sender or from a bot is ignored.

Edited messages (an explicit choice): an edit is **not answered again**. It is
passed on as an EVENT (``raw["type"] = "edited_message"``, ``raw["content_type"]``,
``raw["edit_date"]``; ``message_id`` ``"<chat>:<message>:edit:<edit_date>"``), for
which the dispatcher stays silent. Telegram shows an edit in place, above the
answer already given; a second answer would arrive out of order, and every
further edit (typo fixes) would add one more. A user who changes the question
sends it again. (An edit of a command is likewise not run again.)

Groups: the bot answers only commands (``/help`` or ``/help@thisbot``), messages
that mention it (``@thisbot``, removed from the question) and replies to its own
messages; its answer replies to the question. /human works only in a private chat
(a health conversation with an agent does not belong in a group).

Commands:

* ``/start`` — an Inbound of kind SUBSCRIBE: the dispatcher's greeting and disclaimer.
* ``/help`` — what the bot does, the commands, the emergency number.
* ``/human`` — an explicit choice: the adapter calls
  :meth:`bot.handoff.HandoffManager.start` itself (reason ``user_request``) and
  confirms, rather than sending the words "转人工" through the dispatcher. A
  command is an unambiguous request; it must not depend on intent rules
  recognising a phrase, nor be read as a question while a handoff is already
  running. Messages after it go to agents through the dispatcher (which relays
  them while a handoff is active).
* ``/stop`` — ends the handoff (``HandoffManager.end(by="user")``), forgets the
  session (``Dispatcher.forget_user``), the /lang choice and the agents' topic link.
* ``/lang`` — ``/lang en`` or ``/lang zh``, or buttons when given no argument (their
  callback data must match :data:`LANG_BUTTON_RE` whole; any other button press
  is answered with a short notice and changes nothing). The
  choice is kept per user in memory and sent as ``Inbound.lang``; without a
  choice ``Inbound.lang`` is None and the dispatcher detects the language from
  the text. The adapter's own texts (help, confirmations) use the choice, else
  the user's Telegram ``language_code`` (zh* → zh, other → en), else zh.

Sending (:class:`TelegramSender`): ``parse_mode=HTML`` with the whole text
HTML-escaped — never MarkdownV2, whose 18 reserved characters fail on any one
missed; answers longer than
:data:`~adapters.telegram_constants.MAX_TEXT_LENGTH` are split on paragraph, line
or sentence boundaries and sent in order (a part that fails stops the rest);
``RetryAfter`` (an ``int`` or a ``timedelta`` in v22) is waited out; ``Forbidden``
(the user blocked the bot, the bot left the group) is recorded in
:attr:`TelegramSender.blocked` and not retried; network errors are retried with
bounded exponential backoff. A read timeout is retried too: rarely the first
attempt did arrive and the user sees the part twice, which beats losing it.
"""

from __future__ import annotations

import asyncio
import datetime as dtm
import hmac
import html
import json
import logging
import random
import re
import time
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol, TypeVar

import structlog
from aiohttp import web
from telegram import (Bot, BotCommand, CallbackQuery, InlineKeyboardButton, InlineKeyboardMarkup,
                      LinkPreviewOptions, Message, MessageEntity, ReplyParameters, Update, User)
from telegram.constants import ChatMemberStatus
from telegram.error import (BadRequest, ChatMigrated, Forbidden, InvalidToken, NetworkError, RetryAfter,
                            TelegramError)
from telegram.ext import (Application, ApplicationBuilder, ApplicationHandlerStop, BaseUpdateProcessor,
                          CallbackQueryHandler, ChatMemberHandler, CommandHandler, ContextTypes, MessageHandler,
                          TypeHandler, filters)
from telegram.warnings import PTBDeprecationWarning

from adapters import telegram_constants as tc
from adapters.body import BodyTooLarge, read_limited
from adapters.telegram_checks import update_problem
from adapters.telegram_handoff import USER_TEXTS, TelegramAgentRelay
from bot import metrics
from bot.config import Config, ConfigError, TelegramConfig
from bot.types import Inbound, MessageKind, Reply

if TYPE_CHECKING:  # pragma: no cover
    from bot.handoff import HandoffManager, HandoffSession

log = structlog.get_logger("healthbot.telegram")

__all__ = [
    "PerChatUpdateProcessor",
    "SendPolicy",
    "TELEGRAM_ADAPTER",
    "TelegramAdapter",
    "TelegramSender",
    "parse_update",
    "redact",
    "render_html",
    "retry_after_seconds",
    "setup_telegram",
    "split_text",
    "use_polling",
    "utf16_len",
    "webhook_admin",
]

T = TypeVar("T")


class DispatcherLike(Protocol):
    """What the adapter needs from the core: ``handle(Inbound) -> Reply`` (deduplicating)."""

    async def handle(self, inbound: Inbound) -> Reply: ...


# --------------------------------------------------------------------------- texts the adapter owns

TEXTS: dict[str, dict[str, str]] = {
    "help": {
        "zh": "我是健康养生小助手，可以回答日常养生问题，例如“手脚冰凉怎么办”“失眠怎么调理”。"
              "内容仅供健康科普参考，不能代替医生的诊断和治疗。\n\n"
              "/start 开始\n/help 帮助\n/human 转人工客服\n/stop 结束人工对话并清除会话记录\n"
              "/lang 选择语言（中文 / English）\n\n"
              "群聊中请 @我 或回复我的消息提问。紧急情况请立即拨打 {emergency}。",
        "en": "I answer everyday health and wellness questions, e.g. \"my hands and feet are always cold\" "
              "or \"how can I sleep better\". This is general health information, not a diagnosis or "
              "treatment by a doctor.\n\n"
              "/start start\n/help this help\n/human talk to a person\n"
              "/stop end a conversation with a person and forget this session\n"
              "/lang choose the language (中文 / English)\n\n"
              "In groups, mention me or reply to my message. In an emergency call {emergency} now.",
    },
    "lang_prompt": {"zh": "请选择语言：", "en": "Choose a language:"},
    "lang_set": {"zh": "好的，之后用中文回答您。", "en": "OK, I will answer in English from now on."},
    "human_started": {"zh": "已为您转接人工客服，请直接发送您的问题，客服会在这里回复您。发送 /stop 可结束。",
                      "en": "You are being connected to a person. Send your question here and an agent "
                            "will reply in this chat. Send /stop to end."},
    "human_already": {"zh": "您已在人工客服对话中，请直接发送消息。发送 /stop 可结束。",
                      "en": "You are already talking to a person; just send your message. Send /stop to end."},
    "human_unavailable": {"zh": "抱歉，现在没有人工客服可以接待您。健康方面的问题可以继续问我；情况紧急请直接拨打120。",
                          "en": "Sorry, no member of our team can chat right now. You can keep asking me health "
                                "questions; in an emergency call your local emergency number now."},
    "human_private_only": {"zh": "为保护您的隐私，请私聊我并发送 /human 转人工客服。",
                           "en": "To protect your privacy, message me privately and send /human there."},
    "stopped_handoff": {"zh": "已结束人工客服对话，并清除了本次会话记录。随时可以继续向我提问。",
                        "en": "The conversation with the agent has ended and this session is forgotten. "
                              "Ask me anything any time."},
    "stopped": {"zh": "已清除您的会话记录。随时可以继续向我提问。",
                "en": "Your session is forgotten. Ask me anything any time."},
    "unknown_command": {"zh": "没有这个命令。发送 /help 查看可用命令，或直接输入您的问题。",
                        "en": "Unknown command. Send /help for the commands, or just type your question."},
    "unknown_button": {"zh": "这个按钮已失效。发送 /lang 可重新选择语言。",
                       "en": "This button no longer works. Send /lang to choose the language again."},
}

COMMANDS: dict[str, list[tuple[str, str]]] = {
    "zh": [("start", "开始"), ("help", "帮助"), ("human", "转人工客服"), ("stop", "结束人工对话并清除会话"),
           ("lang", "选择语言")],
    "en": [("start", "Start"), ("help", "Help"), ("human", "Talk to a person"),
           ("stop", "End the conversation with a person, forget the session"), ("lang", "Choose the language")],
}
"""The command menu registered with setMyCommands at start-up (zh default, en for English clients)."""

LANG_BUTTON_PREFIX = "lang:"
LANG_BUTTON_RE = re.compile(rf"{LANG_BUTTON_PREFIX}(zh|en)")
"""The whole callback data of a /lang button (matched with ``fullmatch``: ``"lang:zh\\n"`` is not one)."""


def _lang_arg(value: str) -> str | None:
    v = value.strip().lower()
    if v.startswith("zh") or v in ("中文", "中", "汉语", "chinese", "cn"):
        return "zh"
    if v.startswith("en") or v in ("english", "英文", "英语"):
        return "en"
    return None


def redact(text: str, token: str) -> str:
    """``text`` with the bot token replaced by ``<token>`` (it is part of every Bot API
    URL, and python-telegram-bot puts it in ``InvalidToken`` messages)."""
    return text.replace(token, "<token>") if token else text


def _quiet_httpx() -> None:
    """httpx logs every request URL at INFO, and a Bot API URL contains the token
    (``https://api.telegram.org/bot<token>/sendMessage``): unless its level was set
    on purpose, the ``httpx`` logger is raised to WARNING."""
    logger = logging.getLogger("httpx")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


def _mask(user_id: object) -> str:
    s = str(user_id)
    return "…" + s[-4:] if len(s) > 4 else "…"


# --------------------------------------------------------------------------- text: length, splitting, HTML


def utf16_len(text: str) -> int:
    """Length of ``text`` in UTF-16 code units, the unit of Telegram's limits and entity
    offsets (Bot API, MessageEntity: "Offset in UTF-16 code units"); characters outside
    the Basic Multilingual Plane (most emoji) count 2."""
    return len(text.encode("utf-16-le")) // 2


def _prefix_within(text: str, limit: int) -> int:
    """Number of characters of the longest prefix of ``text`` with at most ``limit`` UTF-16 units."""
    units = 0
    for i, ch in enumerate(text):
        units += 2 if ord(ch) > 0xFFFF else 1
        if units > limit:
            return i
    return len(text)


_SENTENCE_ENDS = frozenset("。！？!?；;…")
_CLOSERS = frozenset("”’」』）)]》\"'")


def _cut_point(window: str) -> int:
    """Where to cut ``window`` (a prefix that fits): after a paragraph break, else a line
    break, else a sentence end (with its closing quotes), else a space, searched in the
    second half only; else the whole window (a hard cut)."""
    half = len(window) // 2
    at = window.rfind("\n\n", half)
    if at >= 0:
        return at + 2
    at = window.rfind("\n", half)
    if at >= 0:
        return at + 1
    for i in range(len(window) - 1, half - 1, -1):
        ch = window[i]
        if ch in _SENTENCE_ENDS or (ch == "." and (i + 1 == len(window) or window[i + 1].isspace())):
            j = i + 1
            while j < len(window) and window[j] in _CLOSERS:
                j += 1
            return j
    at = window.rfind(" ", half)
    if at > 0:
        return at + 1
    return len(window)


def split_text(text: str, limit: int = tc.MAX_TEXT_LENGTH) -> list[str]:
    """``text`` in parts of at most ``limit`` UTF-16 code units, cut at natural boundaries.

    Args:
        text: the reply (plain text; escaping happens per part, after splitting).
        limit: the most UTF-16 code units per part; default
            :data:`~adapters.telegram_constants.MAX_TEXT_LENGTH` (4096, Bot API
            sendMessage ``text``: "1-4096 characters after entities parsing").

    Returns:
        The parts in order, each stripped of surrounding whitespace (Telegram strips
        it too) and non-empty; ``[]`` for a blank text. Cuts go after a paragraph
        break, a line break, a sentence end (。！？!?；;… or ". "), or a space, in that
        order of preference, within the second half of the allowed length; a text
        with none of these is cut hard. Joining the parts gives the text back up to
        whitespace at the cuts.
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1 UTF-16 code unit, got {limit}")
    parts: list[str] = []
    rest = text.strip()
    while rest:
        if utf16_len(rest) <= limit:
            parts.append(rest)
            break
        fit = max(_prefix_within(rest, limit), 1)
        cut = _cut_point(rest[:fit])
        part = rest[:cut].rstrip()
        if part:
            parts.append(part)
        rest = rest[cut:].lstrip()
    return parts


def render_html(text: str) -> str:
    """``text`` escaped for ``parse_mode=HTML``: ``&``, ``<``, ``>`` become ``&amp;``,
    ``&lt;``, ``&gt;`` (Bot API, "HTML style": "All <, > and & symbols that are not a
    part of a tag or an HTML entity must be replaced with the corresponding HTML
    entities"). Nothing in a reply is markup, so nothing is left unescaped."""
    return html.escape(text, quote=False)


# --------------------------------------------------------------------------- sending with retries


def retry_after_seconds(exc: RetryAfter) -> float:
    """Seconds to wait for a ``RetryAfter`` (flood control, HTTP 429).

    python-telegram-bot v22 gives ``retry_after`` as an ``int`` of seconds, or as a
    :class:`datetime.timedelta` when ``PTB_TIMEDELTA`` is set (the int form is
    deprecated since v22.2 and warns); both are accepted, without the warning.
    Source of the value: Bot API, ResponseParameters ``retry_after``.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PTBDeprecationWarning)
        value: Any = exc.retry_after
    if isinstance(value, dtm.timedelta):
        return max(value.total_seconds(), 0.0)
    return max(float(value), 0.0)


@dataclass(frozen=True)
class SendPolicy:
    """How hard a Bot API call is retried (defaults in :mod:`adapters.telegram_constants`).

    Attributes:
        max_attempts: attempts per call (flood waits and network errors only).
        backoff_base_s / backoff_max_s: wait after the first network error and the
            most between two attempts, seconds; doubled each time, with ±50 % jitter.
        retry_after_max_s: a flood wait longer than this fails the call, seconds.
        sleep: the coroutine that waits (tests record the waits and keep them short).
    """

    max_attempts: int = tc.SEND_MAX_ATTEMPTS
    backoff_base_s: float = tc.NETWORK_BACKOFF_BASE_S
    backoff_max_s: float = tc.NETWORK_BACKOFF_MAX_S
    retry_after_max_s: float = tc.RETRY_AFTER_MAX_S
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep

    def backoff_s(self, attempt: int) -> float:
        """Wait after the ``attempt``-th failed attempt (1-based) for a network error, seconds."""
        base = min(self.backoff_base_s * (2 ** (attempt - 1)), self.backoff_max_s)
        return base * random.uniform(0.5, 1.5)


class TelegramSender:
    """Sends through a python-telegram-bot ``Bot`` with the retry rules of :class:`SendPolicy`.

    Attributes:
        bot: the ``Bot`` (set when the application is built).
        blocked: chat id → UNIX seconds when a ``Forbidden`` was recorded (the user
            blocked the bot, or it was removed from the group). Sends to these chats
            fail at once with ``Forbidden`` until the chat writes again or unblocks.
        stats: counters — ``sent`` parts, ``flood_waits``, ``network_retries``,
            ``forbidden``, ``failed`` calls.
    """

    def __init__(self, policy: SendPolicy | None = None):
        self.policy = policy or SendPolicy()
        self.bot: Bot | None = None
        self.blocked: dict[int, float] = {}
        self.stats: dict[str, int] = {"sent": 0, "flood_waits": 0, "network_retries": 0, "forbidden": 0,
                                      "failed": 0}

    def record_blocked(self, chat_id: int, reason: str) -> None:
        """Remember that ``chat_id`` cannot be written to (no further attempts)."""
        if chat_id not in self.blocked:
            log.warning("telegram.blocked", chat=_mask(chat_id), reason=reason)
        self.blocked[chat_id] = time.time()

    def unblock(self, chat_id: int) -> None:
        """The chat can be written to again (it sent a message, or unblocked the bot)."""
        if self.blocked.pop(chat_id, None) is not None:
            log.info("telegram.unblocked", chat=_mask(chat_id))

    async def call(self, what: str, fn: Callable[[], Awaitable[T]], chat_id: int | None = None) -> T:
        """``await fn()`` (one Bot API call named ``what``), retried per the policy.

        Retried: ``RetryAfter`` — after its ``retry_after`` seconds, unless that is over
        ``retry_after_max_s``; ``NetworkError`` (connection errors, timeouts, 5xx)
        other than ``BadRequest`` — after exponential backoff. At most
        ``max_attempts`` attempts in all.

        Raises:
            telegram.error.Forbidden: at once (recorded in :attr:`blocked` when
                ``chat_id`` is given).
            telegram.error.BadRequest, ChatMigrated, InvalidToken, other
                ``TelegramError``: at once, not retried.
            telegram.error.RetryAfter / NetworkError: the last one, when the attempts
                or the flood-wait bound are used up.
        """
        attempt = 0
        while True:
            attempt += 1
            try:
                return await fn()
            except RetryAfter as exc:
                metrics.TELEGRAM_RETRY_AFTER.labels(method=what).inc()
                wait = retry_after_seconds(exc)
                if attempt >= self.policy.max_attempts or wait > self.policy.retry_after_max_s:
                    self.stats["failed"] += 1
                    log.error("telegram.flood_gave_up", method=what, retry_after_s=wait, attempt=attempt)
                    raise
                self.stats["flood_waits"] += 1
                log.warning("telegram.flood_wait", method=what, retry_after_s=wait, attempt=attempt)
                await self.policy.sleep(wait)
            except Forbidden as exc:
                self.stats["forbidden"] += 1
                if chat_id is not None:
                    self.record_blocked(chat_id, str(exc.message))
                raise
            except BadRequest:
                raise
            except NetworkError as exc:
                if attempt >= self.policy.max_attempts:
                    self.stats["failed"] += 1
                    log.error("telegram.network_gave_up", method=what, error=str(exc), attempt=attempt)
                    raise
                wait = self.policy.backoff_s(attempt)
                self.stats["network_retries"] += 1
                log.warning("telegram.network_retry", method=what, error=str(exc), attempt=attempt,
                            wait_s=round(wait, 3))
                await self.policy.sleep(wait)

    async def send_text(self, chat_id: int, text: str, *, thread_id: int | None = None,
                        reply_to: int | None = None, reply_markup: InlineKeyboardMarkup | None = None
                        ) -> list[Message]:
        """Send ``text`` to ``chat_id`` as one or more HTML messages, in order.

        Args:
            chat_id: the chat (user id for private chats, negative for groups).
            text: plain text; split by :func:`split_text` and escaped by :func:`render_html`.
            thread_id: forum topic (``message_thread_id``), if any.
            reply_to: message the first part replies to (sent even if it was deleted).
            reply_markup: buttons, attached to the last part.

        Returns:
            The sent messages (``[]`` for a blank text).

        A part refused as "message is too long" is split again at half the length
        (twice at most); one refused for its entities ("can't parse entities") is
        sent once more without ``parse_mode``; a group that became a supergroup
        (``ChatMigrated``) is written to at its new id. Any other failure stops the
        remaining parts: they would make no sense without the missing one.

        Raises:
            telegram.error.Forbidden: the chat is (now) recorded as blocked.
            telegram.error.TelegramError: see :meth:`call`.
        """
        if self.bot is None:
            raise RuntimeError("telegram adapter not started: no Bot yet")
        if chat_id in self.blocked:
            raise Forbidden(f"chat {_mask(chat_id)} is recorded as having blocked the bot")
        parts = split_text(text)
        queue: deque[tuple[str, int]] = deque((p, 0) for p in parts)
        sent: list[Message] = []
        migrated = False
        while queue:
            part, depth = queue.popleft()
            last = not queue
            reply = ReplyParameters(message_id=reply_to, allow_sending_without_reply=True) \
                if reply_to is not None and not sent else None
            markup = reply_markup if last else None
            try:
                msg = await self._send_part(chat_id, render_html(part), "HTML", thread_id, reply, markup)
            except ChatMigrated as exc:
                if migrated:
                    raise
                migrated, chat_id = True, int(exc.new_chat_id)
                queue.appendleft((part, depth))
                continue
            except BadRequest as exc:
                error = str(exc.message).lower()
                if tc.ERR_TOO_LONG in error and depth < 2 and len(part) > 1:
                    smaller = split_text(part, max(utf16_len(part) // 2, 1))
                    log.warning("telegram.resplit", parts=len(smaller), units=utf16_len(part))
                    queue.extendleft((p, depth + 1) for p in reversed(smaller))
                    continue
                if tc.ERR_PARSE_ENTITIES in error:
                    log.error("telegram.html_rejected", error=str(exc.message))
                    msg = await self._send_part(chat_id, part, None, thread_id, reply, markup)
                else:
                    raise
            sent.append(msg)
            self.stats["sent"] += 1
        return sent

    async def _send_part(self, chat_id: int, text: str, parse_mode: str | None, thread_id: int | None,
                         reply: ReplyParameters | None, markup: InlineKeyboardMarkup | None) -> Message:
        bot = self.bot
        assert bot is not None
        return await self.call("sendMessage", lambda: bot.send_message(
            chat_id=chat_id, text=text, parse_mode=parse_mode, message_thread_id=thread_id,
            reply_parameters=reply, reply_markup=markup,
            link_preview_options=LinkPreviewOptions(is_disabled=True)), chat_id=chat_id)


# --------------------------------------------------------------------------- parsing


def message_type(message: Message) -> str | None:
    """``"text"``, the first of :data:`~adapters.telegram_constants.UNSUPPORTED_TYPES`
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
        module docstring). ``raw`` also has ``update_id``, ``chat_type``,
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


# --------------------------------------------------------------------------- update processing


def _chat_key(update: object) -> int | None:
    try:
        if isinstance(update, Update) and update.effective_chat is not None:
            return int(update.effective_chat.id)
    except (TypeError, ValueError):  # never the case for a checked update; the update still runs
        pass
    return None


class PerChatUpdateProcessor(BaseUpdateProcessor):
    """Processes updates of different chats concurrently and those of one chat in order.

    python-telegram-bot's ``SimpleUpdateProcessor`` runs concurrent updates in any
    order, so two quick questions of one user could be answered swapped; one
    ``asyncio.Lock`` per chat (FIFO) keeps arrival order. Locks are dropped when
    their chat has nothing queued.

    Args:
        max_concurrent_updates: updates in progress at once across all chats
            (default :data:`~adapters.telegram_constants.MAX_CONCURRENT_UPDATES`).
    """

    def __init__(self, max_concurrent_updates: int = tc.MAX_CONCURRENT_UPDATES):
        super().__init__(max_concurrent_updates)
        self._locks: dict[int, tuple[asyncio.Lock, int]] = {}

    async def do_process_update(self, update: object, coroutine: Awaitable[Any]) -> None:
        """Await ``coroutine`` once every earlier update of the same chat is done."""
        key = _chat_key(update)
        if key is None:
            await coroutine
            return
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                await coroutine
        finally:
            lock, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    async def initialize(self) -> None:
        """Nothing to set up."""

    async def shutdown(self) -> None:
        """Nothing to release."""


# --------------------------------------------------------------------------- the adapter


class TelegramAdapter:
    """The Telegram channel: webhook handler, python-telegram-bot application, commands.

    Args:
        cfg: the effective config (``cfg.telegram``; ``cfg.safety`` for the emergency
            number in /help).
        dispatcher: ``async handle(Inbound) -> Reply``, deduplicating on (channel, message_id).
        handoff: the :class:`bot.handoff.HandoffManager` the dispatcher uses; the
            adapter registers its relay (when ``telegram.agent_chat`` is set) and
            :meth:`notify_user` with it.
        policy: retry rules for Bot API calls (tests shorten the waits).

    Raises:
        ConfigError: no ``telegram.token``, or a ``telegram.secret`` Telegram would
            refuse (1-256 characters of ``A-Z a-z 0-9 _ -``).
    """

    def __init__(self, cfg: Config, dispatcher: DispatcherLike, handoff: HandoffManager,
                 policy: SendPolicy | None = None):
        self.cfg: TelegramConfig = cfg.telegram
        self.safety = cfg.safety
        if not self.cfg.token:
            raise ConfigError("config key 'telegram.token': empty; set HEALTHBOT_TELEGRAM_TOKEN")
        if self.cfg.secret and not tc.SECRET_TOKEN_RE.match(self.cfg.secret):
            raise ConfigError("config key 'telegram.secret': must be 1-256 characters of A-Z a-z 0-9 _ - "
                              "(Bot API setWebhook secret_token); set HEALTHBOT_TELEGRAM_SECRET")
        _quiet_httpx()
        self.dispatcher = dispatcher
        self.handoff = handoff
        self.sender = TelegramSender(policy)
        self.langs: dict[str, str] = {}          # user_id -> /lang choice
        self._client_langs: dict[str, str] = {}  # user_id -> from Telegram's language_code
        self._seen: OrderedDict[int, None] = OrderedDict()
        self.polling = False
        self.application: Application | None = None
        self.accepting = False
        self._starter: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.stats: dict[str, int] = {"updates": 0, "duplicates": 0, "dispatched": 0, "errors": 0}
        self.relay: TelegramAgentRelay | None = None
        if self.cfg.agent_chat:
            self.relay = TelegramAgentRelay(self.cfg.agent_chat, self.sender, handoff, self.ui_lang_of)
        handoff.register(tc.CHANNEL, self.relay, self.notify_user)
        if not self.cfg.secret:
            log.warning("telegram.no_secret", hint="set HEALTHBOT_TELEGRAM_SECRET; POST /telegram answers 503 "
                        "until then (polling works without it)")

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

    # ---- application

    @property
    def bot(self) -> Bot:
        """The running application's bot (raises when not started)."""
        if self.application is None:
            raise RuntimeError("telegram adapter not started")
        return self.application.bot

    def build_application(self) -> Application:
        """A python-telegram-bot ``Application`` for this adapter, handlers added.

        ``updater(None)`` for the webhook (updates come from ``POST /telegram``); the
        default ``Updater`` when :attr:`polling`. ``base_url`` is ``telegram.api_base``.
        """
        builder = (ApplicationBuilder().token(self.cfg.token).base_url(self.cfg.api_base)
                   .concurrent_updates(PerChatUpdateProcessor()))
        if not self.polling:
            builder = builder.updater(None)
        app = builder.build()
        message_only = filters.UpdateType.MESSAGE
        app.add_handler(TypeHandler(Update, self._gate), group=-1)
        if self.relay is not None:
            for handler in self.relay.handlers():
                app.add_handler(handler)
        app.add_handler(CommandHandler("start", self._cmd_start, filters=message_only))
        app.add_handler(CommandHandler("help", self._cmd_help, filters=message_only))
        app.add_handler(CommandHandler("human", self._cmd_human, filters=message_only))
        app.add_handler(CommandHandler("stop", self._cmd_stop, filters=message_only))
        app.add_handler(CommandHandler("lang", self._cmd_lang, filters=message_only))
        app.add_handler(CallbackQueryHandler(self._on_lang_button))  # every button; unknown data answered politely
        app.add_handler(ChatMemberHandler(self._on_my_chat_member, ChatMemberHandler.MY_CHAT_MEMBER))
        app.add_handler(MessageHandler(filters.UpdateType.MESSAGES, self._on_message))
        app.add_error_handler(self._on_error)
        return app

    async def start(self) -> None:
        """Build the application and connect (getMe, then start; polling starts the Updater).

        A Bot API that cannot be reached is retried in the background with backoff
        up to :data:`~adapters.telegram_constants.STARTUP_RETRY_MAX_S` (``/telegram``
        answers 503 meanwhile); a token Telegram rejects is logged and not retried.
        The rest of the server starts either way.
        """
        self.application = self.build_application()
        self.sender.bot = self.application.bot
        try:
            await self._connect()
        except InvalidToken as exc:
            log.error("telegram.invalid_token", error=self._redact(exc), hint="check HEALTHBOT_TELEGRAM_TOKEN")
        except (TelegramError, OSError) as exc:
            log.error("telegram.start_failed", error=self._redact(exc), api_base=_api_host(self.cfg.api_base))
            self._starter = asyncio.create_task(self._connect_later(), name="telegram-connect")

    async def _connect(self) -> None:
        app = self.application
        assert app is not None
        await app.initialize()  # getMe; a no-op once it succeeded (safe to retry)
        if not app.running:
            await app.start()
        if self.polling and app.updater is not None and not app.updater.running:
            await app.updater.start_polling(timeout=tc.POLL_TIMEOUT_S, allowed_updates=list(tc.ALLOWED_UPDATES),
                                            drop_pending_updates=False)
        self.accepting = True
        self._spawn(self._register_commands())
        log.info("telegram.started", bot=app.bot.username, mode="polling" if self.polling else "webhook",
                 agent_chat=bool(self.relay))

    async def _connect_later(self) -> None:
        wait = 1.0
        while True:
            await self.sender.policy.sleep(wait)
            try:
                await self._connect()
                return
            except InvalidToken as exc:
                log.error("telegram.invalid_token", error=self._redact(exc), hint="check HEALTHBOT_TELEGRAM_TOKEN")
                return
            except (TelegramError, OSError) as exc:
                wait = min(wait * 2, tc.STARTUP_RETRY_MAX_S)
                log.warning("telegram.start_retry", error=self._redact(exc), next_in_s=wait)

    def _redact(self, exc: BaseException) -> str:
        return redact(str(exc), self.cfg.token)

    async def _register_commands(self) -> None:
        """The command menu (setMyCommands), zh by default and en for English clients; best effort."""
        bot = self.bot
        try:
            for lang, code in (("zh", None), ("en", "en")):
                commands = [BotCommand(c, d) for c, d in COMMANDS[lang]]
                await self.sender.call("setMyCommands",
                                       lambda commands=commands, code=code: bot.set_my_commands(commands,
                                                                                                 language_code=code))
        except TelegramError as exc:
            log.warning("telegram.commands_not_registered", error=str(exc))

    async def stop(self) -> None:
        """Stop taking updates, finish the queued ones, disconnect (graceful shutdown)."""
        self.accepting = False
        if self._starter is not None:
            self._starter.cancel()
            await asyncio.gather(self._starter, return_exceptions=True)
            self._starter = None
        app = self.application
        if app is None:
            return
        try:
            if app.updater is not None and app.updater.running:
                await app.updater.stop()
            if app.running:
                await app.stop()
        finally:
            for task in list(self._background):
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            await app.shutdown()
            log.info("telegram.stopped", **self.sender.stats, **self.stats)

    async def idle(self) -> None:
        """Return once every update received so far has been processed (tests, shutdown)."""
        if self.application is not None and self.application.running:
            await self.application.update_queue.join()

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- webhook

    async def handle_webhook(self, request: web.Request) -> web.Response:
        """``POST /telegram``: authenticate, parse, queue, answer 200 at once.

        Answers (short plain-text bodies, never a trace): 503 without a configured
        secret, or while not connected / shutting down; 403 when
        ``X-Telegram-Bot-Api-Secret-Token`` is missing or wrong (constant-time
        comparison); 413 over :data:`~adapters.telegram_constants.UPDATE_MAX_BYTES`;
        400 for a body that is not a JSON object with an integer ``update_id``; 200
        otherwise — including an update python-telegram-bot cannot parse, or an
        error in this handler (logged and dropped, so Telegram does not re-send it
        for ever).
        """
        if not self.cfg.secret:
            return web.Response(status=503, text="telegram webhook secret not configured")
        given = request.headers.get(tc.SECRET_HEADER)
        if given is None or not hmac.compare_digest(given.encode("utf-8", "replace"), self.cfg.secret.encode()):
            log.warning("telegram.rejected", status=403, reason="secret token missing or wrong",
                        remote=request.remote)
            return web.Response(status=403, text="forbidden")
        app = self.application
        if app is None or not app.running or not self.accepting:
            return web.Response(status=503, text="telegram adapter not ready")
        try:
            return await self._accept(request, app)
        except Exception:  # noqa: BLE001 — a bug here must not turn into a 5xx that Telegram re-sends
            log.exception("telegram.webhook_error")
            return web.Response(text="ok")

    async def _accept(self, request: web.Request, app: Application) -> web.Response:
        """Read, check and queue one authenticated delivery (see :meth:`handle_webhook`)."""
        try:
            body = await read_limited(request, tc.UPDATE_MAX_BYTES)
        except BodyTooLarge:
            log.warning("telegram.rejected", status=413, reason="body too large")
            return web.Response(status=413, text="body too large")
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, ValueError, RecursionError):
            log.warning("telegram.rejected", status=400, reason="body is not JSON")
            return web.Response(status=400, text="malformed update")
        update_id = data.get("update_id") if isinstance(data, dict) else None
        if not isinstance(update_id, int) or isinstance(update_id, bool):
            log.warning("telegram.rejected", status=400, reason="not an object with an integer update_id")
            return web.Response(status=400, text="malformed update")
        problem = update_problem(data)  # fields of the wrong type would fail later, in a handler
        if problem is not None:
            log.warning("telegram.malformed_update", update_id=update_id, reason=problem)
            return web.Response(text="ok")  # dropped: a 4xx/5xx would make Telegram re-send it for ever
        try:
            update = Update.de_json(data, app.bot)
        except Exception as exc:  # noqa: BLE001 — a 4xx/5xx here would make Telegram re-send it for ever
            log.warning("telegram.unparsable_update", update_id=update_id,
                        error=f"{type(exc).__name__}: {str(exc)[:200]}")
            return web.Response(text="ok")
        await app.update_queue.put(update)
        return web.Response(text="ok")

    # ---- handlers

    async def _gate(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """Group -1, before every handler: drop a repeated ``update_id``; note the user."""
        self.stats["updates"] += 1
        if update.update_id in self._seen:
            self.stats["duplicates"] += 1
            log.info("telegram.duplicate_update", update_id=update.update_id)
            raise ApplicationHandlerStop
        self._seen[update.update_id] = None
        while len(self._seen) > tc.SEEN_UPDATES_MAX:
            self._seen.popitem(last=False)
        self._note_user(update.effective_user)
        if update.message is not None and update.effective_chat is not None:
            self.sender.unblock(int(update.effective_chat.id))

    async def _on_error(self, update: object, context: ContextTypes.DEFAULT_TYPE) -> None:
        self.stats["errors"] += 1
        update_id = update.update_id if isinstance(update, Update) else None
        log.error("telegram.handler_error", update_id=update_id, exc_info=context.error)

    async def _reply(self, message: Message, text: str, reply_markup: InlineKeyboardMarkup | None = None) -> None:
        """Send ``text`` to the message's chat (as a reply in groups, in its forum topic); never raises."""
        group = message.chat.type in tc.GROUP_CHAT_TYPES
        thread = message.message_thread_id if message.is_topic_message else None
        try:
            await self.sender.send_text(int(message.chat.id), text, thread_id=thread,
                                        reply_to=message.message_id if group else None, reply_markup=reply_markup)
        except Forbidden:
            pass  # recorded by the sender
        except TelegramError as exc:
            log.error("telegram.reply_failed", chat=_mask(message.chat.id), error=str(exc))

    async def _dispatch(self, inbound: Inbound, message: Message) -> None:
        try:
            reply = await self.dispatcher.handle(inbound)
        except Exception:  # noqa: BLE001 — logged; the user gets no answer rather than a crash
            log.exception("telegram.dispatcher_failed", message_id=inbound.message_id)
            return
        self.stats["dispatched"] += 1
        if reply.text.strip():
            await self._reply(message, reply.text)

    def _text(self, key: str, user_id: str) -> str:
        return TEXTS[key][self.ui_lang_of(user_id)]

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
        lang = self.ui_lang_of(str(user.id))
        number = self.safety.emergency_number_zh if lang == "zh" else self.safety.emergency_number_en
        await self._reply(message, TEXTS["help"][lang].format(emergency=number))

    async def _cmd_human(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        who = self._who(update)
        if who is None:
            return
        message, user = who
        uid = str(user.id)
        if message.chat.type != "private":
            await self._reply(message, self._text("human_private_only", uid))
            return
        already = await self.handoff.active(tc.CHANNEL, uid) is not None
        if not already and not self.handoff.reachable(tc.CHANNEL):  # no agents' group, no console
            await self._reply(message, self._text("human_unavailable", uid))
            return
        await self.handoff.start(tc.CHANNEL, uid, str(message.chat.id), "user_request")
        await self._reply(message, self._text("human_already" if already else "human_started", uid))

    async def _cmd_stop(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        who = self._who(update)
        if who is None:
            return
        message, user = who
        uid = str(user.id)
        ended = await self.handoff.end(tc.CHANNEL, uid, by="user")
        text = self._text("stopped_handoff" if ended else "stopped", uid)
        forget_user = getattr(self.dispatcher, "forget_user", None)  # handoff, transcript and session
        await (forget_user(tc.CHANNEL, uid) if forget_user else self.handoff.forget(tc.CHANNEL, uid))
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
        choice = _lang_arg(context.args[0]) if context.args else None
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




def _api_host(api_base: str) -> str:
    """The Bot API base URL without the token part, for logs."""
    return api_base.split("/bot")[0]


# --------------------------------------------------------------------------- wiring


TELEGRAM_ADAPTER = web.AppKey("telegram_adapter", TelegramAdapter)
"""Where :func:`setup_telegram` stores its :class:`TelegramAdapter` in the app."""


def setup_telegram(app: web.Application, cfg: Config, dispatcher: DispatcherLike, handoff: HandoffManager,
                   *, policy: SendPolicy | None = None) -> TelegramAdapter:
    """Add ``POST /telegram`` to ``app`` and run the Telegram application in its lifecycle.

    Args:
        app: the aiohttp application (not yet started). The adapter starts in a
            ``cleanup_ctx`` appended here — after the core's, so the dispatcher is
            ready — and stops (finishing queued updates) before the core does.
        cfg: the effective config; ``cfg.telegram`` must have a token.
        dispatcher: ``async handle(Inbound) -> Reply``, deduplicating on (channel, message_id).
        handoff: the HandoffManager shared with the dispatcher.
        policy: retry rules (tests shorten the waits).

    Returns:
        The adapter (also at ``app[TELEGRAM_ADAPTER]``). Call :func:`use_polling`
        before the app starts for ``getUpdates`` instead of the webhook.

    Raises:
        ConfigError: see :class:`TelegramAdapter`.
    """
    adapter = TelegramAdapter(cfg, dispatcher, handoff, policy=policy)
    app[TELEGRAM_ADAPTER] = adapter
    app.router.add_post(tc.WEBHOOK_PATH, adapter.handle_webhook)

    async def lifecycle(_app: web.Application):
        await adapter.start()
        try:
            yield
        finally:
            await adapter.stop()

    app.cleanup_ctx.append(lifecycle)
    return adapter


def use_polling(app: web.Application) -> TelegramAdapter:
    """Make the app's Telegram adapter poll ``getUpdates`` (local development) instead of
    taking webhook deliveries; call before the app starts. Polling deletes the
    registered webhook (python-telegram-bot's ``Updater.start_polling``).

    Raises:
        ConfigError: the app has no Telegram adapter (no ``HEALTHBOT_TELEGRAM_TOKEN``).
    """
    adapter = app.get(TELEGRAM_ADAPTER)
    if adapter is None:
        raise ConfigError("--telegram-polling: no Telegram adapter; set HEALTHBOT_TELEGRAM_TOKEN")
    adapter.polling = True
    return adapter


async def webhook_admin(cfg: TelegramConfig, action: str) -> dict[str, Any]:
    """Run ``healthbot telegram ACTION``: ``set-webhook``, ``delete-webhook`` or ``webhook-info``.

    ``set-webhook`` registers ``telegram.webhook_url`` with ``secret_token`` =
    ``telegram.secret``, ``allowed_updates`` =
    :data:`~adapters.telegram_constants.ALLOWED_UPDATES` and ``max_connections`` =
    :data:`~adapters.telegram_constants.WEBHOOK_MAX_CONNECTIONS`, keeping pending
    updates. Every action returns getWebhookInfo as a dict.

    Raises:
        ConfigError: no token; for ``set-webhook``: a webhook URL that is not
            ``https://`` (Bot API setWebhook: "HTTPS URL to send updates to"), or no
            valid secret (the webhook refuses unauthenticated deliveries).
        telegram.error.TelegramError: the Bot API refused.
    """
    if not cfg.token:
        raise ConfigError("config key 'telegram.token': empty; set HEALTHBOT_TELEGRAM_TOKEN")
    if action not in ("set-webhook", "delete-webhook", "webhook-info"):
        raise ConfigError(f"unknown telegram action {action!r}: set-webhook | delete-webhook | webhook-info")
    if action == "set-webhook":
        if not cfg.webhook_url.startswith("https://"):
            raise ConfigError("config key 'telegram.webhook_url': must be an https:// URL ending in "
                              f"{tc.WEBHOOK_PATH} (set HEALTHBOT_TELEGRAM_WEBHOOK_URL)")
        if not tc.SECRET_TOKEN_RE.match(cfg.secret):
            raise ConfigError("config key 'telegram.secret': set HEALTHBOT_TELEGRAM_SECRET (1-256 characters of "
                              "A-Z a-z 0-9 _ -); POST /telegram refuses deliveries without it")
        if not cfg.webhook_url.rstrip("/").endswith(tc.WEBHOOK_PATH):
            log.warning("telegram.webhook_path", url=cfg.webhook_url, expected_suffix=tc.WEBHOOK_PATH)
    _quiet_httpx()
    async with Bot(cfg.token, base_url=cfg.api_base) as bot:
        if action == "set-webhook":
            await bot.set_webhook(url=cfg.webhook_url, secret_token=cfg.secret,
                                  allowed_updates=list(tc.ALLOWED_UPDATES),
                                  max_connections=tc.WEBHOOK_MAX_CONNECTIONS, drop_pending_updates=False)
        elif action == "delete-webhook":
            await bot.delete_webhook(drop_pending_updates=False)
        info = await bot.get_webhook_info()
        return info.to_dict()
