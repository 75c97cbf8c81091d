"""Normalized message types shared by every channel adapter and the dispatcher.

Adapters turn a platform request into one :class:`Inbound` and render one
:class:`Reply` back into the platform's wire format (ARCHITECTURE.md, "One
message, end to end"). Nothing channel-specific lives here.
"""

from __future__ import annotations

import enum
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any


class Intent(str, enum.Enum):
    """What the bot decided a message is (../shared/topics.yaml, "Intents")."""

    ANSWER = "answer"
    EMERGENCY = "emergency"
    REFER_DOCTOR = "refer_doctor"
    OUT_OF_SCOPE = "out_of_scope"
    GREETING = "greeting"
    HANDOFF = "handoff"
    NO_ANSWER = "no_answer"
    # Not a user intent: replies the bot gives about the message itself
    # (unsupported message type, rate limited, busy).
    SYSTEM = "system"


class MessageKind(str, enum.Enum):
    """Kind of inbound message after the adapter has parsed it."""

    TEXT = "text"
    SUBSCRIBE = "subscribe"      # user followed the account / pressed /start
    UNSUPPORTED = "unsupported"  # image, video, sticker, ...: answered with a helpful text
    EVENT = "event"              # other events that need no answer


#: A lone UTF-16 surrogate: only a JSON ``"\ud800"`` escape puts one in a Python str,
#: and such a str cannot be encoded as UTF-8 (the store, the logs, the reply all fail).
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def without_lone_surrogates(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD (the Unicode replacement
    character), so it can be stored, logged and answered; other text is returned as is."""
    return _LONE_SURROGATE.sub("\ufffd", text)


@dataclass(frozen=True)
class Inbound:
    """One user message, channel-independent.

    Attributes:
        channel: ``"wechat"``, ``"telegram"`` or ``"http"``.
        user_id: the channel's stable user id (WeChat OpenID, Telegram user id).
        chat_id: where the reply goes (equals ``user_id`` for WeChat).
        message_id: the channel's message id (WeChat MsgId, or
            FromUserName+CreateTime for events); the dedup key together with
            ``channel``.
        kind: what the adapter parsed (:class:`MessageKind`).
        text: the user's text; ``""`` for non-text messages.
        lang: ``"zh"`` or ``"en"`` if the channel knows it, else ``None``
            (the dispatcher then detects it from the text).
        received_at: UNIX time in seconds when the adapter received it.
        raw: the platform's own fields, for logging and adapter use only.
        replay_record: ``(key, value, ttl_s)`` the store records with the message's claim (bot/dedup.py):
            a key already holding another value refuses the message (:class:`bot.dedup.ReplayRefused`).
            WeChat's plaintext mode records each request's timestamp and nonce with its body's digest
            (adapters/wechat/webhook.py); None elsewhere.

    Lone UTF-16 surrogates in ``user_id``, ``chat_id``, ``message_id`` and ``text``
    become U+FFFD on construction (:func:`without_lone_surrogates`): the message is
    still answered (an emergency in it still triaged), never a 500.
    """

    channel: str
    user_id: str
    chat_id: str
    message_id: str
    kind: MessageKind
    text: str = ""
    lang: str | None = None
    received_at: float = field(default_factory=time.time)
    raw: dict[str, Any] = field(default_factory=dict)
    replay_record: tuple[str, str, float] | None = None

    def __post_init__(self) -> None:
        for name in ("user_id", "chat_id", "message_id", "text"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, without_lone_surrogates(value))


@dataclass(frozen=True)
class Reply:
    """The bot's answer to one :class:`Inbound`.

    Attributes:
        text: the full text to send, disclaimer included, in ``lang``.
        intent: the decided :class:`Intent`.
        lang: ``"zh"`` or ``"en"``.
        topic: knowledge-base topic id for ``answer`` replies, else ``None``.
        confidence: retrieval confidence in [0, 1] (0 when not retrieved).
        engine: name of the inference engine that embedded the question, if any.
        latency_ms: time spent in the dispatcher, milliseconds.
        handoff: True when the bot offers or starts a human handoff.
        safety_net: the warning-sign families (safety/safety_net.yaml) of the safety-net line
            the reply carries when danger was possible but not certain; empty when none.
        suggested: the topics a ``no_answer`` reply offers, best first ("您是想了解「…」吗？",
            bot/suggestion.py); the user's next message may choose one; empty when none.
    """

    text: str
    intent: Intent
    lang: str = "zh"
    topic: str | None = None
    confidence: float = 0.0
    engine: str | None = None
    latency_ms: float = 0.0
    handoff: bool = False
    safety_net: tuple[str, ...] = ()
    suggested: tuple[str, ...] = ()

    def to_json(self) -> str:
        """Every field as JSON (shared between replicas through the store)."""
        return json.dumps({**self.__dict__, "intent": self.intent.value}, ensure_ascii=False)

    @classmethod
    def from_json(cls, raw: str) -> "Reply":
        """The inverse of :meth:`to_json`."""
        data = json.loads(raw)
        return cls(**{**data, "intent": Intent(data["intent"]), "safety_net": tuple(data.get("safety_net", ())),
                      "suggested": tuple(data.get("suggested", ()))})

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape of ``healthbot ask --json`` and ``POST /api/chat``."""
        return {
            "intent": self.intent.value,
            "topic": self.topic,
            "confidence": round(self.confidence, 4),
            "reply": self.text,
            "engine": self.engine,
            "latency_ms": round(self.latency_ms, 2),
            "lang": self.lang,
            "safety_net": list(self.safety_net),
            "suggested_topics": list(self.suggested),
        }
