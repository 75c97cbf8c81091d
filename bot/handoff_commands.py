"""A user's explicit commands about talking to a person, the same on every channel.

A channel with commands (Telegram's /human and /stop) calls these instead of
sending words such as "转人工" through the dispatcher: a command is an unambiguous
request, which must not depend on intent rules recognising a phrase, nor be read
as a question while a handoff is already running. The channel says the result to
the user in its own words.
"""

from __future__ import annotations

from typing import Any, Literal

from bot.handoff import HandoffManager

__all__ = ["request_human", "stop_conversation"]


async def request_human(handoff: HandoffManager, channel: str, user_id: str,
                        chat_id: str) -> Literal["started", "already", "unavailable"]:
    """Hand the user to a person (reason ``user_request``).

    Returns:
        ``"started"``; ``"already"`` when a handoff was active (it goes on); or
        ``"unavailable"`` when nobody can take it on ``channel``
        (:meth:`HandoffManager.reachable`: no agents' group, no console) and none is active.
    """
    already = await handoff.active(channel, user_id) is not None
    if not already and not handoff.reachable(channel):
        return "unavailable"
    await handoff.start(channel, user_id, chat_id, "user_request")
    return "already" if already else "started"


async def stop_conversation(handoff: HandoffManager, dispatcher: Any, channel: str, user_id: str) -> bool:
    """End the user's handoff (``by="user"``) and forget their session: handoff,
    transcript and session state (``dispatcher.forget_user`` when the dispatcher has
    one, else the handoff manager's :meth:`~HandoffManager.forget`).

    Returns:
        True when a handoff was active and has ended.
    """
    ended = await handoff.end(channel, user_id, by="user")
    forget_user = getattr(dispatcher, "forget_user", None)
    await (forget_user(channel, user_id) if forget_user else handoff.forget(channel, user_id))
    return ended is not None
