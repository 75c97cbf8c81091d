"""Conversation state (bot/session.py): what a session keeps, and sessions written by other versions."""

from __future__ import annotations

import json

from bot.session import Session, Sessions
from bot.store import MemoryStore


async def test_a_session_round_trips_and_one_from_another_version_keeps_what_this_one_knows():
    sessions = Sessions(MemoryStore())
    await sessions.save("wechat", "u1", Session(last_topic="sleep.insomnia", suggested=["a", "b"]))
    back = await sessions.get("wechat", "u1")
    assert (back.last_topic, back.suggested, back.no_answer_streak) == ("sleep.insomnia", ["a", "b"], 0)
    # an older version also wrote "lang"; a newer one may write fields this one lacks
    await sessions.store.set("session:wechat:u2", json.dumps({"last_topic": "nutri.salt", "lang": "zh",
                                                             "mood": "fine", "no_answer_streak": 2}))
    older = await sessions.get("wechat", "u2")
    assert (older.last_topic, older.no_answer_streak) == ("nutri.salt", 2) and not hasattr(older, "lang")
    fresh = await sessions.get("wechat", "nobody")
    assert (fresh.last_topic, fresh.suggested, fresh.no_answer_streak) == (None, [], 0)
