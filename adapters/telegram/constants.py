"""Telegram Bot API limits and this adapter's own bounds, each with its source.

Code elsewhere says ``constants.MAX_TEXT_LENGTH``, never 4096 (STYLE.md,
"limits and constants in one documented place"). Where python-telegram-bot already
names a protocol limit (:mod:`telegram.constants`, whose docstrings cite the Bot
API) the value is taken from there rather than typed again.

Sources:

* Bot API — https://core.telegram.org/bots/api (sections "Getting updates",
  "setWebhook", "sendMessage", "Formatting options", "createForumTopic",
  "ResponseParameters").
* Bot FAQ — https://core.telegram.org/bots/faq ("My bot is hitting limits, how do
  I avoid this?").
* python-telegram-bot v22 — :mod:`telegram.constants`.

Numbers marked "our choice" are this project's bounds, not Telegram's.
"""

from __future__ import annotations

import re
from typing import Final

from telegram.constants import ForumTopicLimit, InlineKeyboardButtonLimit, MessageLimit, WebhookLimit

CHANNEL: Final = "telegram"
"""Value of :attr:`bot.types.Inbound.channel` for this adapter."""

# --------------------------------------------------------------------------- webhook

WEBHOOK_PATH: Final = "/telegram"
"""Route of the webhook inside the bot's aiohttp server (ARCHITECTURE.md)."""

SECRET_HEADER: Final = "X-Telegram-Bot-Api-Secret-Token"
"""Header carrying the webhook secret. Source: Bot API, setWebhook ``secret_token``:
"A secret token to be sent in a header 'X-Telegram-Bot-Api-Secret-Token' in every
webhook request"."""

SECRET_TOKEN_RE: Final = re.compile(
    rf"^[A-Za-z0-9_-]{{{int(WebhookLimit.MIN_SECRET_TOKEN_LENGTH)},{int(WebhookLimit.MAX_SECRET_TOKEN_LENGTH)}}}$")
"""Valid webhook secrets. Source: Bot API, setWebhook ``secret_token``: "1-256
characters. Only characters A-Z, a-z, 0-9, _ and - are allowed"
(``WebhookLimit.MIN/MAX_SECRET_TOKEN_LENGTH``)."""

WEBHOOK_MAX_CONNECTIONS: Final[int] = 40
"""``max_connections`` sent by ``healthbot telegram set-webhook``: the Bot API
default ("Defaults to 40"; allowed 1-100, ``WebhookLimit.MIN/MAX_CONNECTIONS_LIMIT``)."""

UPDATE_MAX_BYTES: Final[int] = 1024 * 1024
"""Largest webhook body read, bytes (our choice). A real update is a few KiB: a
message is at most 4096 characters, plus the replied-to message and entities; the
server-wide ``server.max_body_bytes`` (64 KiB) is not applied to this route so an
authenticated Telegram delivery is never refused for its size."""

ALLOWED_UPDATES: Final[tuple[str, ...]] = ("message", "edited_message", "callback_query", "my_chat_member")
"""Update types the bot subscribes to (setWebhook / getUpdates ``allowed_updates``):
messages, edits (see the module docstring of :mod:`adapters.telegram`), the /lang
buttons, and block/unblock notifications. Source: Bot API, "Update"."""

POLL_TIMEOUT_S: Final[int] = 30
"""Long-polling timeout of ``getUpdates`` in seconds (``healthbot serve
--telegram-polling``). Source: Bot API, getUpdates ``timeout``: "Should be positive,
short polling should be used for testing purposes only"; 30 s is a common choice."""

SEEN_UPDATES_MAX: Final[int] = 10_000
"""update_ids remembered for deduplication (our choice). Source of the need: Bot
API, Update ``update_id``: "This identifier becomes especially handy if you're using
webhooks, since it allows you to ignore repeated updates". Telegram re-sends an
update whose webhook did not answer 2xx; those retries come within minutes, long
before 10,000 later updates."""

MAX_CONCURRENT_UPDATES: Final[int] = 256
"""Updates processed at once across all chats (python-telegram-bot's
``concurrent_updates(True)`` value); within one chat they run one at a time, in order."""

# --------------------------------------------------------------------------- sending

MAX_TEXT_LENGTH: Final[int] = int(MessageLimit.MAX_TEXT_LENGTH)
"""Most characters in one message, 4096. Source: Bot API, sendMessage ``text``:
"1-4096 characters after entities parsing" (``telegram.constants.MessageLimit``).
This adapter counts UTF-16 code units (how Telegram measures entity offsets), which
is never fewer than characters, so a part it sends is never too long."""

CALLBACK_DATA_MAX_BYTES: Final[int] = int(InlineKeyboardButtonLimit.MAX_CALLBACK_DATA)
"""Most bytes of a button's ``callback_data``, 64. Source: Bot API, InlineKeyboardButton
``callback_data``: "Data to be sent in a callback query to the bot when the button is pressed,
1-64 bytes" (``telegram.constants.InlineKeyboardButtonLimit``)."""

PARSE_MODE: Final = "HTML"
"""Every message is sent with ``parse_mode=HTML`` and its text HTML-escaped
(Bot API, "HTML style": ``<``, ``>`` and ``&`` must be written ``&lt;``, ``&gt;``,
``&amp;``); MarkdownV2 would need 18 characters escaped and fails on any one missed."""

SEND_MAX_ATTEMPTS: Final[int] = 5
"""Attempts per Bot API call before giving up (our choice): flood waits and
transient network errors are retried, nothing else."""

NETWORK_BACKOFF_BASE_S: Final[float] = 0.5
"""First wait after a network error, seconds; doubled each attempt, with jitter (our choice)."""

NETWORK_BACKOFF_MAX_S: Final[float] = 8.0
"""Longest wait between two attempts after a network error, seconds (our choice)."""

RETRY_AFTER_MAX_S: Final[float] = 60.0
"""Longest flood-control wait honoured for one call, seconds (our choice). Source of
the wait: Bot API, ResponseParameters ``retry_after`` ("the number of seconds left
to wait before the request can be repeated"), raised by python-telegram-bot as
``telegram.error.RetryAfter``; an answer delayed further is no longer useful, so
the call fails and is logged. Flood limits: Bot FAQ, about 1 message per second
per chat, 30 per second overall, 20 per minute per group
(``telegram.constants.FloodLimit``)."""

FORUM_TOPIC_NAME_MAX: Final[int] = int(ForumTopicLimit.MAX_NAME_LENGTH)
"""Longest forum topic name, 128 characters. Source: Bot API, createForumTopic
``name``: "Topic name, 1-128 characters" (``telegram.constants.ForumTopicLimit``)."""

TRANSCRIPT_TURN_MAX_CHARS: Final[int] = 600
"""Characters of one transcript turn shown to agents when a topic opens (our
choice: a bot answer with its disclaimer is a few hundred characters; the full
text stays in the bot's logs)."""

STARTUP_RETRY_MAX_S: Final[float] = 300.0
"""Longest wait between two attempts to reach the Bot API at start-up (getMe),
seconds (our choice); /telegram answers 503 until it succeeds, so Telegram keeps
the updates and re-sends them."""

# --------------------------------------------------------------------------- error texts

# The Bot API documents error codes but not the descriptions; these are the
# descriptions it returns (as reported by python-telegram-bot users and matched,
# lower-cased, as substrings of ``TelegramError.message``).
ERR_TOO_LONG: Final = "message is too long"
"""400 for a text over :data:`MAX_TEXT_LENGTH` after entity parsing."""

ERR_PARSE_ENTITIES: Final = "can't parse entities"
"""400 for text that is not valid in its ``parse_mode``."""

ERR_THREAD_NOT_FOUND: Final = "message thread not found"
"""400 when the forum topic was deleted."""

ERR_TOPIC_CLOSED: Final = "topic_closed"
"""400 when posting into a closed forum topic without the right to manage topics."""

ERR_TOPIC_NOT_MODIFIED: Final = "topic_not_modified"
"""400 when closing a closed topic or reopening an open one (harmless)."""

# --------------------------------------------------------------------------- message kinds

UNSUPPORTED_TYPES: Final[tuple[str, ...]] = (
    "sticker", "animation", "photo", "video", "video_note", "voice", "audio", "document",
    "venue", "location", "contact", "poll", "dice", "game", "story", "paid_media", "invoice",
)
"""Message contents answered with the dispatcher's "please type your question" text,
checked in this order (an animation also carries ``document``, a venue also
``location``). Names are Bot API "Message" fields (``telegram.constants.MessageType``);
``raw["type"]`` of the Inbound is the name found. A message with none of these and
no text is a service message (member joined, topic created, ...) and gets no answer."""

GROUP_CHAT_TYPES: Final[frozenset[str]] = frozenset({"group", "supergroup"})
"""Chat types where the bot answers only commands, mentions and replies to it
(Bot API, Chat ``type``; channels post ``channel_post`` updates, which are not
subscribed to)."""
