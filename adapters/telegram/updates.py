"""Update processing order: concurrent across chats, in arrival order within one chat."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from telegram import Update
from telegram.ext import BaseUpdateProcessor

from adapters.telegram import constants as tc

__all__ = ["PerChatUpdateProcessor"]


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
            (default :data:`~adapters.telegram.constants.MAX_CONCURRENT_UPDATES`).
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
