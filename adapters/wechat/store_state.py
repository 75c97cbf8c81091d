"""What the WeChat adapter keeps in the store: the keys, how long each lives, and
the JSON of each value (see the package docstring, "The deadline")."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Protocol

import structlog

from adapters.wechat import constants as wc
from adapters.wechat.parsing import strip_invalid_xml_chars
from adapters.wechat.replies import ELLIPSIS
from bot.types import Inbound, MessageKind, Reply

log = structlog.get_logger("healthbot.wechat")

DELIVERED_KEY = "wechat:delivered:{msgid}"
"""Store key of one message's delivery state (JSON ``{"via": "passive"|"kf"|"pending"|"composing", ...}``)."""
PENDING_KEY = "wechat:pending:{openid}"
"""Store list of a user's answers computed after their webhook answered (JSON ``{"msgid", "q", "text", "lang"}``;
``q``, the question's first characters, with personal data masked)."""
MORE_KEY = "wechat:more:{openid}"
"""Store key of a user's unread pages (JSON ``{"bodies": [...], "tail", "lang"}``), served one per "1"."""
UNFINISHED_KEY = "wechat:unfinished"
"""Store list of messages whose answer was still being computed when a process shut down
(JSON of the :class:`~bot.types.Inbound`, :func:`inbound_to_json`); the next process to
start (any replica) computes and delivers them (:meth:`WechatAdapter.recover`)."""
REPLAY_KEY = "wechat:nonce"
"""Plaintext mode: ``wechat:nonce:<timestamp>:<nonce>`` -> sha256 of the body it first came with
(:meth:`WechatAdapter._check_replay`), kept for twice ``wechat.timestamp_window_s``."""
UNFINISHED_TTL_S = 3600.0
"""Seconds a message left unfinished by a shutdown waits for the next process."""

DELIVERY_STATE_TTL_S = 3600.0
"""Seconds a delivery claim is kept: past WeChat's retries (~15 s) and the dispatcher's
own dedup window (bot/dedup.py, 3600 s), so no later delivery path can claim it again."""
COMPOSING_TTL_S = 10.0
"""Seconds the "composing" claim lives before the final state replaces it; if the
process dies in between, the message becomes claimable again."""
PENDING_TTL_S = 24 * 3600.0
"""Seconds an undelivered answer waits for the user's next message."""
MORE_TTL_S = 24 * 3600.0
"""Seconds unread pages of a long answer wait for "1"."""
COMPOSING_WAIT_S = 1.0
"""Most seconds a retry waits for a concurrent delivery of the same message to finish composing."""

PENDING_HEADER = {"zh": "您之前问的“{q}”：", "en": 'Your earlier question "{q}":'}
CONTINUED_HEADER = {"zh": "（接上条）", "en": "(continued)"}
SEGMENT_SEPARATOR = "\n\n——————\n\n"
QUESTION_SNIPPET_CHARS = 24


class DispatcherLike(Protocol):
    """What the adapter needs from the core: ``handle(Inbound) -> Reply`` (deduplicating).

    Optional: ``handoff`` and ``sessions`` objects with ``forget(channel, user_id)``
    (bot.dispatcher.Dispatcher has both), called on unsubscribe; ``replay_store``, the store in
    which ``handle`` records ``Inbound.replay_record`` with its claim, raising
    :class:`bot.dedup.ReplayRefused` on a conflict (bot.dispatcher.Dispatcher): where it is not the
    adapter's own store, the adapter records every request itself before answering.
    """

    async def handle(self, inbound: Inbound) -> Reply: ...


@dataclass(frozen=True)
class PassiveAnswer:
    """What one delivery answers: ``kind`` "text" (``content``), "transfer", or "none" (``success``)."""

    kind: str
    content: str = ""

    def state(self) -> str:
        """The delivery state stored under :data:`DELIVERED_KEY` (replayed to a re-delivery)."""
        return json.dumps({"via": "passive", "type": self.kind, "content": self.content}, ensure_ascii=False)


NO_ANSWER = PassiveAnswer("none")


def via(how: str) -> str:
    return json.dumps({"via": how})


def inbound_to_json(inbound: Inbound) -> str:
    raw = {k: v for k, v in inbound.raw.items() if isinstance(v, (str, int, float, bool)) or v is None}
    return json.dumps({"v": 1, "user_id": inbound.user_id, "chat_id": inbound.chat_id,
                       "message_id": inbound.message_id, "kind": inbound.kind.value, "text": inbound.text,
                       "lang": inbound.lang, "received_at": inbound.received_at, "raw": raw}, ensure_ascii=False)


def inbound_from_json(raw: str) -> Inbound | None:
    try:
        d = json.loads(raw)
        return Inbound(channel=wc.CHANNEL, user_id=str(d["user_id"]), chat_id=str(d.get("chat_id") or d["user_id"]),
                       message_id=str(d["message_id"]), kind=MessageKind(d["kind"]), text=str(d.get("text") or ""),
                       lang=d.get("lang"), received_at=float(d.get("received_at") or time.time()),
                       raw=dict(d.get("raw") or {}))
    except (ValueError, KeyError, TypeError):
        log.error("wechat.unfinished_unreadable")
        return None


def question_snippet(text: str) -> str:
    text = " ".join(strip_invalid_xml_chars(text).split())
    return text if len(text) <= QUESTION_SNIPPET_CHARS else text[: QUESTION_SNIPPET_CHARS - 1] + ELLIPSIS

