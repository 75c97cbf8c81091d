"""Conversation state (bot/session.py): what a session keeps, and sessions written by other versions."""

from __future__ import annotations

import json

from bot.session import Session, Sessions
from bot.store import MemoryStore


async def test_a_session_round_trips_and_one_from_another_version_keeps_what_this_one_knows():
    sessions = Sessions(MemoryStore())

    async def get(user):
        return sessions.parse(await sessions.store.get(sessions.key("wechat", user)))

    await sessions.store.set(*sessions.dump("wechat", "u1", Session(last_topic="sleep.insomnia", suggested=["a", "b"])))
    back = await get("u1")
    assert (back.last_topic, back.suggested, back.no_answer_streak) == ("sleep.insomnia", ["a", "b"], 0)
    # an older version also wrote "lang"; a newer one may write fields this one lacks
    await sessions.store.set("session:wechat:u2", json.dumps({"last_topic": "nutri.salt", "lang": "zh",
                                                             "mood": "fine", "no_answer_streak": 2}))
    older = await get("u2")
    assert (older.last_topic, older.no_answer_streak) == ("nutri.salt", 2) and not hasattr(older, "lang")
    fresh = await get("nobody")
    assert (fresh.last_topic, fresh.suggested, fresh.no_answer_streak) == (None, [], 0)
