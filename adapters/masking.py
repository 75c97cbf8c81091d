"""How the adapters show a user or chat id in logs: never whole."""

from __future__ import annotations

__all__ = ["mask_id"]


def mask_id(value: object, *, head: int = 0, tail: int = 0) -> str:
    """``value`` for a log line: its first ``head`` and last ``tail`` characters around "…".

    Just "…" when the id is not longer than ``head + tail`` (nothing of it is shown).
    WeChat OpenIDs keep their first 6 characters (``mask_id(openid, head=6)`` →
    ``"oUser1…"``), Telegram ids their last 4 (``mask_id(chat_id, tail=4)`` → ``"…6789"``).
    """
    s = str(value)
    if len(s) <= head + tail:
        return "…"
    return s[:head] + "…" + (s[len(s) - tail:] if tail else "")
