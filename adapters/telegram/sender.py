"""Sending through the Bot API: ``parse_mode=HTML`` with the text escaped, long texts
split into parts, flood waits and network errors retried (see the package docstring, "Sending")."""

from __future__ import annotations

import asyncio
import datetime as dtm
import html
import random
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import structlog
from telegram import Bot, InlineKeyboardMarkup, LinkPreviewOptions, Message, ReplyKeyboardMarkup, ReplyParameters
from telegram.error import BadRequest, ChatMigrated, Forbidden, NetworkError, RetryAfter
from telegram.warnings import PTBDeprecationWarning

from adapters.masking import mask_id
from adapters.telegram import constants as tc
from adapters.text_split import split_text as _split
from adapters.text_split import utf16_len
from bot import metrics

log = structlog.get_logger("healthbot.telegram")

__all__ = ["SendPolicy", "TelegramSender", "render_html", "retry_after_seconds", "split_text", "utf16_len"]

T = TypeVar("T")


def split_text(text: str, limit: int = tc.MAX_TEXT_LENGTH) -> list[str]:
    """``text`` in parts of at most ``limit`` UTF-16 code units, cut at natural boundaries.

    Args:
        text: the reply (plain text; escaping happens per part, after splitting).
        limit: the most UTF-16 code units per part; default
            :data:`~adapters.telegram.constants.MAX_TEXT_LENGTH` (4096, Bot API
            sendMessage ``text``: "1-4096 characters after entities parsing").

    Returns:
        The parts in order, each stripped of surrounding whitespace (Telegram strips
        it too) and non-empty; ``[]`` for a blank text. A part ends after the last
        paragraph break, else line break, in the second half of the allowed length;
        else after as many whole sentences as fit, else inside an over-long sentence
        (:func:`adapters.text_split.split_text`). Joining the parts gives the text
        back up to whitespace at the cuts.

    Raises:
        ValueError: ``limit`` below 1.
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1 UTF-16 code unit, got {limit}")
    return _split(text, limit, size=utf16_len, line_breaks_first=True)


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
    """How hard a Bot API call is retried (defaults in :mod:`adapters.telegram.constants`).

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
            log.warning("telegram.blocked", chat=mask_id(chat_id, tail=4), reason=reason)
        self.blocked[chat_id] = time.time()

    def unblock(self, chat_id: int) -> None:
        """The chat can be written to again (it sent a message, or unblocked the bot)."""
        if self.blocked.pop(chat_id, None) is not None:
            log.info("telegram.unblocked", chat=mask_id(chat_id, tail=4))

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
                        reply_to: int | None = None,
                        reply_markup: InlineKeyboardMarkup | ReplyKeyboardMarkup | None = None
                        ) -> list[Message]:
        """Send ``text`` to ``chat_id`` as one or more HTML messages, in order.

        Args:
            chat_id: the chat (user id for private chats, negative for groups).
            text: plain text; split by :func:`split_text` and escaped by :func:`render_html`.
            thread_id: forum topic (``message_thread_id``), if any.
            reply_to: message the first part replies to (sent even if it was deleted).
            reply_markup: buttons (under the message, or a reply keyboard), attached to the last part only.

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
            raise Forbidden(f"chat {mask_id(chat_id, tail=4)} is recorded as having blocked the bot")
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
                         reply: ReplyParameters | None, markup: InlineKeyboardMarkup | ReplyKeyboardMarkup | None
                         ) -> Message:
        bot = self.bot
        assert bot is not None
        return await self.call("sendMessage", lambda: bot.send_message(
            chat_id=chat_id, text=text, parse_mode=parse_mode, message_thread_id=thread_id,
            reply_parameters=reply, reply_markup=markup,
            link_preview_options=LinkPreviewOptions(is_disabled=True)), chat_id=chat_id)

