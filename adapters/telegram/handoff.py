"""Human handoff for Telegram: an agents' forum supergroup, one topic per user.

The :class:`bot.handoff.AgentRelay` of the ``telegram`` channel (registered by
:func:`adapters.telegram.adapter.setup_telegram` when ``telegram.agent_chat`` is set). The
agents' group must be a supergroup with topics enabled and the bot an
administrator with the "Manage topics" right (Bot API, createForumTopic: "The bot
must be an administrator in the chat for this to work and must have the
can_manage_topics administrator rights").

Lifecycle, as agents see it:

* **open** — :meth:`TelegramAgentRelay.open`: the user's topic is created
  (createForumTopic, named ``TG …1234 · 用户请求``) or, when this user had one
  before, reopened (reopenForumTopic); the first post carries the reason, the
  user's language and the last turns of the transcript (masked by
  :class:`bot.handoff.HandoffManager`, each turn cut to
  :data:`~adapters.telegram.constants.TRANSCRIPT_TURN_MAX_CHARS`).
* **user → agents** — :meth:`forward` posts the user's (masked) text into the
  topic as a new message. Not forwardMessage: a forward would carry the
  unmasked original and the user's profile into the agents' group.
* **agents → user** — a text an agent writes in the topic goes through
  :meth:`HandoffManager.agent_message` (transcript, idle timer) to the user;
  media (a photo, a document) is copied to the user with copyMessage.
* **end** — ``/done`` in the topic, or an agent closing the topic (the
  ``forum_topic_closed`` service message), ends the handoff with
  ``HandoffManager.end(..., by="agent")`` and tells the user; an end by the user
  (/stop) or by timeout posts a note and closes the topic.
* **deleted topic** — a post that fails with "message thread not found" creates a
  new topic, posts the transcript again and carries on; a post into a topic
  closed by hand ("TOPIC_CLOSED") reopens it first.

State (which topic belongs to which user) is in process memory like the handoff
sessions themselves (bot/handoff.py; several replicas need the shared store, issue
10). A topic the bot does not know (after a restart) gets a short note when an
agent writes in it.

Ordering: the adapter processes one chat's updates one at a time
(:class:`adapters.telegram.updates.PerChatUpdateProcessor`), so a user's /human (which
opens the topic) is finished before their next message is forwarded.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import structlog
from telegram import Message, Update
from telegram.error import BadRequest, Forbidden, TelegramError
from telegram.ext import BaseHandler, CommandHandler, ContextTypes, MessageHandler, filters

from adapters.telegram import constants as tc

if TYPE_CHECKING:  # pragma: no cover
    from adapters.telegram.sender import TelegramSender
    from bot.handoff import HandoffManager, HandoffSession

log = structlog.get_logger("healthbot.telegram.handoff")

__all__ = ["TelegramAgentRelay", "opening_text", "topic_name"]

_REASONS = {"user_request": "用户请求 user request", "emergency": "紧急 emergency", "no_answer": "未答出 no answer"}
_SHORT_REASONS = {"user_request": "用户请求", "emergency": "紧急", "no_answer": "未答出"}
_ENDED_BY = {"user": "用户结束了对话 / ended by the user", "agent": "客服结束了对话 / ended by an agent",
             "timeout": "长时间无消息，对话已结束 / ended after inactivity"}

# Texts the user sees (their language: /lang choice, else Telegram's language_code).
USER_TEXTS: dict[str, dict[str, str]] = {
    "agent_label": {"zh": "人工客服：", "en": "Agent:"},
    "ended_by_agent": {"zh": "人工客服已结束本次对话。您可以继续向我提问；需要人工时发送 /human。",
                       "en": "The agent has ended this conversation. You can keep asking me questions; "
                             "send /human to reach a person again."},
}
# Texts agents see in their group (Chinese first, English after the slash).
AGENT_TEXTS: dict[str, str] = {
    "instructions": "在本话题中回复即发送给用户；发送 /done 或关闭话题即结束对话。\n"
                    "Reply in this topic to answer the user; /done or closing the topic ends the conversation.",
    "recreated": "（原话题已被删除，已新建 / the previous topic was deleted; this one replaces it）",
    "not_active": "此对话已结束，消息未发送给用户。/ This conversation has ended; the message was not delivered.",
    "unknown_topic": "此话题未关联进行中的对话（机器人可能已重启）。/ This topic is not linked to an active "
                     "conversation (the bot may have restarted).",
    "blocked": "用户已屏蔽机器人，消息未送达。/ The user has blocked the bot; the message was not delivered.",
    "failed": "消息发送失败，请稍后再试。/ Delivery failed; please try again.",
    "already_ended": "此对话已结束。/ This conversation has already ended.",
}


def _short_user(user_id: str) -> str:
    return f"TG …{user_id[-4:]}" if len(user_id) > 4 else f"TG {user_id}"


def topic_name(session: HandoffSession) -> str:
    """The forum topic name for ``session``: ``"TG …1234 · 用户请求"``.

    Only the last 4 digits of the Telegram user id (agents tell users apart, nothing
    more identifies them); cut to
    :data:`~adapters.telegram.constants.FORUM_TOPIC_NAME_MAX` (128) characters
    (Bot API, createForumTopic ``name``).
    """
    name = f"{_short_user(session.user_id)} · {_SHORT_REASONS.get(session.reason, session.reason)}"
    return name[: tc.FORUM_TOPIC_NAME_MAX]


def opening_text(session: HandoffSession, lang: str, recreated: bool = False) -> str:
    """The first post of a topic: who, why, the user's language, the last turns, how to answer.

    Args:
        session: the handoff; its ``transcript`` is already masked by the manager.
        lang: ``"zh"`` or ``"en"``, the user's language (agents answer in it).
        recreated: say that the previous topic was deleted.

    Each turn is cut to :data:`~adapters.telegram.constants.TRANSCRIPT_TURN_MAX_CHARS`
    characters; the sender splits the whole post at 4096 characters if needed.
    """
    lines = [f"新的人工咨询 / New handoff — {_short_user(session.user_id)}",
             f"原因 / reason: {_REASONS.get(session.reason, session.reason)} · 语言 / language: {lang}"]
    if recreated:
        lines.append(AGENT_TEXTS["recreated"])
    if session.transcript:
        lines.append("")
        lines.append("最近对话 / last turns:")
        for turn in session.transcript:
            cut = turn if len(turn) <= tc.TRANSCRIPT_TURN_MAX_CHARS else turn[: tc.TRANSCRIPT_TURN_MAX_CHARS] + "…"
            lines.append(cut)
    lines.append("")
    lines.append(AGENT_TEXTS["instructions"])
    return "\n".join(lines)


def _error_text(exc: TelegramError) -> str:
    return str(exc.message).lower()


class TelegramAgentRelay:
    """The ``telegram`` channel's :class:`bot.handoff.AgentRelay`: see the module docstring.

    Args:
        agent_chat: the agents' forum supergroup id (``telegram.agent_chat``, negative).
        sender: the adapter's :class:`adapters.telegram.sender.TelegramSender` (retries,
            flood waits, 4096-character parts, HTML escaping).
        handoff: the :class:`bot.handoff.HandoffManager` the dispatcher uses.
        lang_of: ``user_id -> "zh" | "en"``, the language to talk to a user in.
    """

    def __init__(self, agent_chat: int, sender: TelegramSender, handoff: HandoffManager,
                 lang_of: Callable[[str], str]):
        self.agent_chat = int(agent_chat)
        self.sender = sender
        self.handoff = handoff
        self.lang_of = lang_of
        self._topic_of: dict[str, int] = {}            # user_id -> message_thread_id
        self._user_of: dict[int, tuple[str, str]] = {}  # message_thread_id -> (channel, user_id)
        self._closed_by_agent: set[int] = set()
        self.topics_created = 0

    # ------------------------------------------------------------------ AgentRelay

    async def open(self, session: HandoffSession) -> None:
        """Create (or reopen) the user's topic and post the transcript; sets ``session.relay_ref``.

        Raises:
            telegram.error.TelegramError: the topic could not be created (the
                manager logs it; the handoff stays active for the agent console).
        """
        thread = self._topic_of.get(session.user_id)
        if thread is not None and not await self._reopen(thread):
            self._drop(thread)
            thread = None
        if thread is None:
            thread = await self._create(session)
        session.relay_ref = thread
        await self._post(session, opening_text(session, self.lang_of(session.user_id)), in_transcript=True)

    async def forward(self, session: HandoffSession, text: str) -> None:
        """Post the user's masked ``text`` into their topic; never raises (failures are logged).

        A deleted topic is recreated with the transcript (which already ends with
        this message, so it is not posted twice).
        """
        try:
            await self._post(session, f"用户 / user: {text}", in_transcript=True)
        except Exception:  # noqa: BLE001 — the dispatcher must not fail because agents are unreachable
            log.exception("telegram.handoff.forward_failed", thread=session.relay_ref)

    async def close(self, session: HandoffSession, by: str) -> None:
        """Post who ended the handoff and close the topic (unless an agent already closed it)."""
        thread = session.relay_ref
        if thread is None:
            return
        if thread in self._closed_by_agent:  # an agent closed it by hand: nothing to add, nothing to close
            self._closed_by_agent.discard(thread)
            return
        try:
            await self.sender.send_text(self.agent_chat, _ENDED_BY.get(by, by), thread_id=thread)
        except TelegramError as exc:
            log.warning("telegram.handoff.close_note_failed", thread=thread, error=str(exc))
        try:
            await self.sender.call("closeForumTopic",
                                   lambda: self.sender.bot.close_forum_topic(self.agent_chat, thread))
        except BadRequest as exc:
            if tc.ERR_TOPIC_NOT_MODIFIED not in _error_text(exc) and tc.ERR_THREAD_NOT_FOUND not in _error_text(exc):
                log.warning("telegram.handoff.close_failed", thread=thread, error=str(exc))
        except TelegramError as exc:
            log.warning("telegram.handoff.close_failed", thread=thread, error=str(exc))

    # ------------------------------------------------------------------ topics

    def forget(self, user_id: str) -> None:
        """Drop the user's topic mapping (Telegram /stop); a later handoff gets a new topic."""
        thread = self._topic_of.pop(user_id, None)
        if thread is not None:
            self._user_of.pop(thread, None)

    def user_of(self, thread_id: int) -> tuple[str, str] | None:
        """(channel, user_id) of the topic ``thread_id``, or None if it is not one of ours."""
        return self._user_of.get(thread_id)

    def _drop(self, thread: int) -> None:
        key = self._user_of.pop(thread, None)
        if key is not None and self._topic_of.get(key[1]) == thread:
            del self._topic_of[key[1]]

    async def _create(self, session: HandoffSession) -> int:
        topic = await self.sender.call(
            "createForumTopic", lambda: self.sender.bot.create_forum_topic(self.agent_chat, topic_name(session)))
        thread = int(topic.message_thread_id)
        self._topic_of[session.user_id] = thread
        self._user_of[thread] = (session.channel, session.user_id)
        self.topics_created += 1
        log.info("telegram.handoff.topic_created", thread=thread, reason=session.reason)
        return thread

    async def _reopen(self, thread: int) -> bool:
        """Reopen a closed topic; False when it is gone (deleted) or cannot be reopened."""
        try:
            await self.sender.call("reopenForumTopic",
                                   lambda: self.sender.bot.reopen_forum_topic(self.agent_chat, thread))
        except BadRequest as exc:
            if tc.ERR_TOPIC_NOT_MODIFIED in _error_text(exc):
                return True  # already open
            log.info("telegram.handoff.reopen_failed", thread=thread, error=str(exc))
            return False
        return True

    async def _post(self, session: HandoffSession, text: str, *, recreate: bool = True,
                    in_transcript: bool = False) -> None:
        """Post ``text`` into the session's topic, recreating a deleted topic once.

        Args:
            in_transcript: ``text`` is already the transcript's last turn (or the
                opening itself), so a recreated topic's opening post replaces it.
        """
        thread = session.relay_ref
        if thread is None:
            thread = session.relay_ref = await self._create(session)
        try:
            await self.sender.send_text(self.agent_chat, text, thread_id=thread)
            return
        except BadRequest as exc:
            error = _error_text(exc)
            if tc.ERR_TOPIC_CLOSED in error and await self._reopen(thread):
                await self.sender.send_text(self.agent_chat, text, thread_id=thread)
                return
            if not recreate or tc.ERR_THREAD_NOT_FOUND not in error:
                raise
        log.warning("telegram.handoff.topic_deleted", thread=thread)
        self._drop(thread)
        thread = session.relay_ref = await self._create(session)
        await self.sender.send_text(
            self.agent_chat, opening_text(session, self.lang_of(session.user_id), recreated=True), thread_id=thread)
        if not in_transcript:
            await self.sender.send_text(self.agent_chat, text, thread_id=thread)

    # ------------------------------------------------------------------ agents' side (PTB handlers)

    def handlers(self) -> list[BaseHandler[Any, Any, Any]]:
        """python-telegram-bot handlers for the agents' group, to add before the adapter's own.

        The last one takes every other update from that group, so nothing an agent
        writes is ever answered as a user question.
        """
        chat = filters.Chat(chat_id=self.agent_chat)
        return [
            MessageHandler(chat & filters.StatusUpdate.FORUM_TOPIC_CLOSED, self._on_topic_closed),
            CommandHandler("done", self._on_done, filters=chat & filters.UpdateType.MESSAGE),
            MessageHandler(chat & filters.UpdateType.MESSAGE, self._on_agent_message),
            MessageHandler(chat, self._ignore),
        ]

    async def _ignore(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """Edits and anything else from the agents' group: not relayed (an agent's edit
        does not change what the user already received)."""

    def _thread_of(self, message: Message | None) -> int | None:
        if message is None or not message.is_topic_message or message.message_thread_id is None:
            return None
        return int(message.message_thread_id)

    async def _note(self, thread: int, key: str) -> None:
        try:
            await self.sender.send_text(self.agent_chat, AGENT_TEXTS[key], thread_id=thread)
        except TelegramError as exc:
            log.warning("telegram.handoff.note_failed", thread=thread, error=str(exc))

    async def _session(self, thread: int) -> tuple[tuple[str, str] | None, HandoffSession | None]:
        key = self._user_of.get(thread)
        return key, (await self.handoff.active(*key) if key else None)

    async def _on_agent_message(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        message = update.message
        thread = self._thread_of(message)
        if message is None or thread is None or message.from_user is None or message.from_user.is_bot:
            return  # the General topic, the bot's own posts, anonymous admins
        has_content = bool(message.text) or any(getattr(message, t, None) for t in tc.UNSUPPORTED_TYPES)
        if not has_content or (message.text or "").startswith("/"):
            return  # service messages; other commands
        key, session = await self._session(thread)
        if key is None:
            await self._note(thread, "unknown_topic")
            return
        if session is None:
            await self._note(thread, "not_active")
            return
        try:
            if message.text:
                await self.handoff.agent_message(session, message.text)
            else:
                chat_id = int(session.chat_id)
                await self.sender.call("copyMessage", lambda: self.sender.bot.copy_message(
                    chat_id=chat_id, from_chat_id=self.agent_chat, message_id=message.message_id), chat_id=chat_id)
                session.last_activity = time.time()
                await self.handoff.save(session)
        except Forbidden:
            await self._note(thread, "blocked")
        except TelegramError as exc:
            log.warning("telegram.handoff.agent_delivery_failed", thread=thread, error=str(exc))
            await self._note(thread, "failed")

    async def _on_done(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        thread = self._thread_of(update.message)
        if thread is not None:
            await self._end_by_agent(thread)

    async def _on_topic_closed(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        message = update.message
        thread = self._thread_of(message)
        if thread is None or message is None or (message.from_user is not None and message.from_user.is_bot):
            return  # our own closeForumTopic
        self._closed_by_agent.add(thread)
        await self._end_by_agent(thread, quiet=True)

    async def _end_by_agent(self, thread: int, quiet: bool = False) -> None:
        key = self._user_of.get(thread)
        if key is None:
            if not quiet:
                await self._note(thread, "unknown_topic")
            return
        session = await self.handoff.end(key[0], key[1], by="agent")
        self._closed_by_agent.discard(thread)
        if session is None:
            if not quiet:
                await self._note(thread, "already_ended")
            return
        lang = self.lang_of(session.user_id)
        try:
            await self.sender.send_text(int(session.chat_id), USER_TEXTS["ended_by_agent"][lang])
        except TelegramError as exc:
            log.warning("telegram.handoff.user_not_told", thread=thread, error=str(exc))
