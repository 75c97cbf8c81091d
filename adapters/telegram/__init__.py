"""Telegram adapter (python-telegram-bot v22): ``POST /telegram`` webhook, polling, commands.

A thin translator (ARCHITECTURE.md, "One message, end to end"): a Telegram
``Update`` becomes one :class:`bot.types.Inbound`, ``dispatcher.handle`` decides,
and the :class:`bot.types.Reply` is sent back with sendMessage. What a greeting,
a sticker or an emergency gets is the dispatcher's decision; this module only owns
Telegram's protocol: its webhook, its limits (:mod:`adapters.telegram.constants`),
its commands and its agents' group (:mod:`adapters.telegram.handoff`).

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
* body over :data:`~adapters.telegram.constants.UPDATE_MAX_BYTES`: 413; not JSON,
  not an object or without an integer ``update_id``: 400.
* otherwise 200 at once: the update is queued and processed in the background.
  An update whose fields have the wrong types (:mod:`adapters.telegram.update_checks`)
  or that python-telegram-bot cannot parse is logged as one warning line and
  dropped; every error while processing is logged; neither reaches the HTTP
  answer — a 5xx would make Telegram re-send it for ever and hold back the
  updates behind it.

Processing: concurrent across chats, one at a time and in arrival order within a
chat (:class:`PerChatUpdateProcessor`), at most
:data:`~adapters.telegram.constants.MAX_CONCURRENT_UPDATES` at once.

Deduplication, two layers: ``update_id`` (a Telegram re-delivery, also of
commands) is remembered for the last
:data:`~adapters.telegram.constants.SEEN_UPDATES_MAX` updates and a repeat is
dropped before any handler; ``Inbound.message_id`` is ``"<chat_id>:<message_id>"``,
the dispatcher's (channel, message_id) key, stable across re-deliveries.

Message kinds: text → TEXT; sticker, photo, voice, video, document, location and
the rest of :data:`~adapters.telegram.constants.UNSUPPORTED_TYPES` → UNSUPPORTED
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
  :func:`bot.handoff_commands.request_human` (``HandoffManager.start``, reason
  ``user_request``) and confirms, rather than sending the words "转人工" through
  the dispatcher. A command is an unambiguous request; it must not depend on intent rules
  recognising a phrase, nor be read as a question while a handoff is already
  running. Messages after it go to agents through the dispatcher (which relays
  them while a handoff is active).
* ``/stop`` — :func:`bot.handoff_commands.stop_conversation` ends the handoff
  (``HandoffManager.end(by="user")``) and forgets the session
  (``Dispatcher.forget_user``); the adapter forgets the /lang choice and the
  agents' topic link.
* ``/lang`` — ``/lang en`` or ``/lang zh``, or buttons when given no argument (their
  callback data must match :data:`~adapters.telegram.texts.LANG_BUTTON_RE` whole; a press of
  any button that is neither a language nor a feedback button is answered with a short notice
  and changes nothing). The
  choice is kept per user in memory and sent as ``Inbound.lang``; without a
  choice ``Inbound.lang`` is None and the dispatcher detects the language from
  the text. The adapter's own texts (help, confirmations) use the choice, else
  the user's Telegram ``language_code`` (zh* → zh, other → en), else zh.

Feedback: an answer (intent ``answer`` with a topic) carries 👍 / 👎 buttons when the adapter
has a :class:`bot.feedback.FeedbackBook`; a press by the user who asked records their vote
(the first one counts), is answered "谢谢反馈！" / "Thanks for the feedback!" and removes the
buttons (:mod:`~adapters.telegram.feedback`). A reply that offers topics ("您是想了解「…」吗？",
``Reply.suggested``, :mod:`bot.suggestion`) takes none: in a private chat it carries a one-time reply
keyboard instead, "是" / "不是" ("Yes" / "No" in English) for one topic, "1" "2" "3" / "不是" for a
list, whose tap sends that text as an ordinary message, the dispatcher's answer to the offer (in a group
such a message would not be addressed to the bot).

Sending (:class:`TelegramSender`): ``parse_mode=HTML`` with the whole text
HTML-escaped — never MarkdownV2, whose 18 reserved characters fail on any one
missed; answers longer than
:data:`~adapters.telegram.constants.MAX_TEXT_LENGTH` are split on paragraph, line
or sentence boundaries and sent in order (a part that fails stops the rest);
``RetryAfter`` (an ``int`` or a ``timedelta`` in v22) is waited out; ``Forbidden``
(the user blocked the bot, the bot left the group) is recorded in
:attr:`TelegramSender.blocked` and not retried; network errors are retried with
bounded exponential backoff. A read timeout is retried too: rarely the first
attempt did arrive and the user sees the part twice, which beats losing it.

Where each part lives (this package; the names below are re-exported for callers):

* :mod:`~adapters.telegram.adapter` — :class:`TelegramAdapter`: the application's
  lifecycle, the webhook, deduplication; :func:`setup_telegram`, :func:`use_polling`.
* :mod:`~adapters.telegram.commands` — the command and message handlers
  (/start, /help, /human, /stop, /lang, buttons, questions) and the agent → user notifier.
* :mod:`~adapters.telegram.parsing` — an ``Update`` → :class:`bot.types.Inbound`;
  :mod:`~adapters.telegram.update_checks` — field types checked before parsing.
* :mod:`~adapters.telegram.sender` — sendMessage with retries, splitting, HTML escaping.
* :mod:`~adapters.telegram.feedback` — the 👍 / 👎 buttons under answers and their presses
  (votes kept by :mod:`bot.feedback`).
* :mod:`~adapters.telegram.updates` — per-chat ordering of update processing.
* :mod:`~adapters.telegram.handoff` — the agents' forum group (one topic per user).
* :mod:`~adapters.telegram.texts` — the texts and command menu the adapter owns;
  :mod:`~adapters.telegram.admin` — ``healthbot telegram set-webhook`` and friends;
  :mod:`~adapters.telegram.constants` — the Bot API's limits with their sources.

Shared with the WeChat adapter: :mod:`adapters.text_split` (the one splitter of
long texts) and :mod:`adapters.masking` (ids in logs). /human and /stop run
:mod:`bot.handoff_commands`, the same on every channel.
"""

from adapters.telegram.adapter import TELEGRAM_ADAPTER, TelegramAdapter, setup_telegram, use_polling
from adapters.telegram.admin import redact, webhook_admin
from adapters.telegram.parsing import parse_update
from adapters.telegram.sender import (SendPolicy, TelegramSender, render_html, retry_after_seconds, split_text,
                                      utf16_len)
from adapters.telegram.updates import PerChatUpdateProcessor

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
