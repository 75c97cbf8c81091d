"""Human handoff: one lifecycle for every channel.

    requested (the user asked, or the bot decided) -> active (the bot stays silent
    for that user; their messages go to agents) -> ended (an agent closed it, the
    user ended it, or it timed out)

The user gets a message at each step (the dispatcher's replies and
:meth:`HandoffManager.notify_user`). Agents get the last turns with personal data
masked. How agents are reached is channel-specific: each channel registers an
:class:`AgentRelay` (e.g. a forum topic per user in a Telegram agents'
supergroup); channels without one hand the conversation to the agent console.

State lives in the :class:`~bot.store.Store` (SQLite by default, Redis for several
replicas), so a handoff started on one replica is honoured by every other:
``handoff:<channel>:<user>`` (the session, JSON, expiring after the idle timeout),
``turns:<channel>:<user>`` (the last turns) and ``handoff:index`` (who is in handoff,
for the agent console). With Redis, keep it across a Redis restart with ``appendonly
yes`` (README, "Scaling out"): a Redis that comes back empty has forgotten every
handoff, and the bot answers those users again.

When the store fails, the methods that only read or write it raise
:class:`~bot.store.StoreError` and the dispatcher goes on without them (no transcript,
"not in handoff", an honest "nobody can take the chat right now"); a user's message
already relayed to agents (:meth:`HandoffManager.user_message`) stays relayed, and an
agent's reply (:meth:`HandoffManager.agent_message`) still goes to the user.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

import structlog

from bot.store import MemoryStore, Store, StoreError
from bot.store.health import store_unavailable
from safety.pii import mask_bot_text, mask_pii, pseudonym

log = structlog.get_logger("healthbot.handoff")

#: Turns of conversation kept per user and shown to the agent.
TRANSCRIPT_TURNS = 10
#: An active handoff with no message either way for this long ends by itself, seconds.
IDLE_TIMEOUT_S = 30 * 60


@dataclass
class HandoffSession:
    """One user's handoff.

    Attributes:
        channel / user_id / chat_id: who (chat_id is where replies to the user go).
        state: "active" or "ended".
        reason: why it started: "user_request", "emergency", "no_answer".
        transcript: the last turns, masked, oldest first, as "user: ..." / "bot: ...".
        relay_ref: whatever the channel's relay needs to find the agents' thread
            (a Telegram forum topic id).
        started_at / last_activity: UNIX seconds.
    """

    channel: str
    user_id: str
    chat_id: str
    reason: str
    transcript: list[str]
    state: str = "active"
    relay_ref: object = None
    started_at: float = field(default_factory=time.time)
    last_activity: float = field(default_factory=time.time)


class AgentRelay(Protocol):
    """How a channel reaches its human agents."""

    async def open(self, session: HandoffSession) -> None:
        """Show agents a new handoff with its transcript; may set ``session.relay_ref``."""
        ...

    async def forward(self, session: HandoffSession, text: str) -> None:
        """Pass a user's message (masked) to the agents of ``session``."""
        ...

    async def close(self, session: HandoffSession, by: str) -> None:
        """Tell agents the handoff ended (``by``: "user", "agent", "timeout")."""
        ...


UserNotifier = Callable[[HandoffSession, str], Awaitable[None]]


class PlatformAgentRelay:
    """The relay of a channel whose platform takes a handed-off chat to its own agents
    (WeChat's customer-service system: the passive reply ``transfer_customer_service``
    moves the conversation there), so there is nothing to open, forward or close here."""

    async def open(self, session: HandoffSession) -> None:
        return None

    async def forward(self, session: HandoffSession, text: str) -> None:
        return None

    async def close(self, session: HandoffSession, by: str) -> None:
        return None


class HandoffManager:
    """Keeps handoff sessions and per-user transcripts in the store; talks to channel relays.

    Args:
        store: shared state (default: a private in-memory store).
        idle_timeout_s: an active handoff with no message either way for this long ends.
    """

    def __init__(self, store: Store | None = None, idle_timeout_s: float = IDLE_TIMEOUT_S):
        self.store: Store = store if store is not None else MemoryStore()
        self.idle_timeout_s = idle_timeout_s
        #: True when the agent console is on (adapters/console.py): agents there see every
        #: channel's handoffs and reply through the channel's notifier.
        self.console = False
        self._relays: dict[str, AgentRelay] = {}
        self._notifiers: dict[str, UserNotifier] = {}

    def reachable(self, channel: str) -> bool:
        """Whether a person can take a handoff on ``channel``: the channel has its own way to
        agents (a relay: a Telegram agents' group, WeChat's customer-service system), or the
        agent console is on and can reply on that channel (it has a notifier)."""
        return channel in self._relays or (self.console and channel in self._notifiers)

    def register(self, channel: str, relay: AgentRelay | None = None, notify_user: UserNotifier | None = None) -> None:
        """Register how ``channel`` reaches agents and how it sends an agent's text to a user."""
        if relay is not None:
            self._relays[channel] = relay
        if notify_user is not None:
            self._notifiers[channel] = notify_user

    @staticmethod
    def turns_key(channel: str, user_id: str) -> str:
        """The store key of the user's last turns."""
        return f"turns:{channel}:{user_id}"

    @staticmethod
    def session_key(channel: str, user_id: str) -> str:
        """The store key of the user's handoff."""
        return f"handoff:{channel}:{user_id}"

    def with_turns(self, channel: str, user_id: str, kept: str | None,
                   *turns: tuple[str, str]) -> tuple[str, str, float]:
        """``(key, value, ttl_s)`` that write the turns ``kept`` (as stored, or None) followed by
        ``turns``, each ``(who, text)`` with who ``"user"`` or ``"bot"``, masked, the last
        :data:`TRANSCRIPT_TURNS` of them."""
        lines = (json.loads(kept or "[]") + [f"{who}: {mask_bot_text(text) if who == 'bot' else mask_pii(text)}"
                                             for who, text in turns])[-TRANSCRIPT_TURNS:]
        return self.turns_key(channel, user_id), json.dumps(lines, ensure_ascii=False), self.idle_timeout_s

    def active_in(self, raw: str | None) -> HandoffSession | None:
        """The active handoff stored as ``raw`` (the value at :meth:`session_key`), or None (none,
        ended, or idle past the timeout)."""
        if raw is None:
            return None
        s = HandoffSession(**json.loads(raw))
        if s.state != "active" or time.time() - s.last_activity > self.idle_timeout_s:
            return None
        return s

    async def save(self, s: HandoffSession) -> None:
        """Write ``s`` back (after a relay or adapter changed it)."""
        await self.store.set(self.session_key(s.channel, s.user_id), json.dumps(dataclasses.asdict(s), ensure_ascii=False),
                             ttl_s=self.idle_timeout_s if s.state == "active" else 60.0)

    async def active(self, channel: str, user_id: str) -> HandoffSession | None:
        """The user's active handoff, or None (an idle one past the timeout has expired).

        Raises:
            StoreError: the store failed (whether the user is in handoff is unknown).
        """
        return self.active_in(await self.store.get(self.session_key(channel, user_id)))

    async def _index(self, add: tuple[str, str] | None = None, remove: tuple[str, str] | None = None) -> list:
        index = [tuple(k) for k in json.loads(await self.store.get("handoff:index") or "[]")]
        if add and add not in index:
            index.append(add)
        if remove in index:
            index.remove(remove)
        if add or remove:
            await self.store.set("handoff:index", json.dumps(index))
        return index

    async def sessions(self) -> list[HandoffSession]:
        """Every active handoff, oldest first (for an agent console)."""
        found = [await self.active(c, u) for c, u in await self._index()]
        return sorted((s for s in found if s is not None), key=lambda s: s.started_at)

    async def start(self, channel: str, user_id: str, chat_id: str, reason: str) -> HandoffSession:
        """Start (or return the already active) handoff and open it with the channel's relay."""
        existing = await self.active(channel, user_id)
        if existing:
            return existing
        turns = json.loads(await self.store.get(self.turns_key(channel, user_id)) or "[]")
        s = HandoffSession(channel, user_id, chat_id, reason, turns)
        relay = self._relays.get(channel)
        if relay is not None:
            try:
                await relay.open(s)
            except Exception:  # the handoff stays active: agents can still see it in the console
                log.exception("handoff.relay_open_failed", channel=channel)
        await self.save(s)
        await self._index(add=(channel, user_id))
        log.info("handoff.start", channel=channel, user=pseudonym(user_id), reason=reason)
        return s

    async def user_message(self, s: HandoffSession, text: str) -> None:
        """A message from a user in handoff: to the agents, not to the bot.

        Raises:
            StoreError: the message went to the agents' relay, but the session could not be
                saved (its transcript and idle clock are not updated).
        """
        s.last_activity = time.time()
        masked = mask_pii(text)
        s.transcript.append(f"user: {masked}")
        relay = self._relays.get(s.channel)
        try:
            if relay is not None:
                await relay.forward(s, masked)
        finally:
            await self.save(s)

    async def agent_message(self, s: HandoffSession, text: str) -> None:
        """An agent's reply: sent to the user through the channel's notifier."""
        s.last_activity = time.time()
        s.transcript.append(f"agent: {mask_pii(text)}")
        try:
            await self.save(s)
        except StoreError as exc:  # the reply still goes to the user; only its record is missing
            store_unavailable("handoff_agent_message", exc)
        notify = self._notifiers.get(s.channel)
        if notify is not None:
            await notify(s, text)

    async def end(self, channel: str, user_id: str, by: str) -> HandoffSession | None:
        """End the user's handoff (``by``: "user", "agent", "timeout"); None if none was active."""
        s = await self.active(channel, user_id)
        if s is None:
            return None
        s.state = "ended"
        await self.save(s)
        await self._index(remove=(channel, user_id))
        relay = self._relays.get(channel)
        if relay is not None:
            try:
                await relay.close(s, by)
            except Exception:
                log.exception("handoff.relay_close_failed", channel=channel)
        log.info("handoff.end", channel=channel, user=pseudonym(user_id), by=by)
        return s

    async def forget(self, channel: str, user_id: str) -> None:
        """Drop everything kept about the user (unsubscribe, Telegram /stop)."""
        await self.store.delete(self.session_key(channel, user_id))
        await self.store.delete(self.turns_key(channel, user_id))
        await self._index(remove=(channel, user_id))
