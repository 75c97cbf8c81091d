"""``healthbot eval``'s figures from a few scored lines (bot/evaluate.py), without the model."""

from __future__ import annotations

from types import SimpleNamespace

from bot.evaluate import EvalResult, format_report, score
from bot.types import Intent


def _reply(intent: Intent, topic: str | None = None):
    return SimpleNamespace(intent=intent, topic=topic, confidence=0.9 if topic else 0.0, safety_net=(), suggested=())


def test_clinician_questions_count_every_reply_without_self_care_and_the_topic_answers():
    res = EvalResult()
    for got in (Intent.REFER_DOCTOR, Intent.NO_ANSWER, Intent.EMERGENCY, Intent.REFER_DOCTOR):
        score(res, {"q": "x", "intent": "refer_doctor"}, _reply(got))
    score(res, {"q": "y", "intent": "refer_doctor"}, _reply(Intent.ANSWER, "sleep.insomnia"))
    score(res, {"q": "z", "intent": "answer", "topics": ["sleep.insomnia"]}, _reply(Intent.ANSWER, "sleep.insomnia"))
    s = res.summary()
    assert (s["recall_refer_doctor"], s["refer_to_clinician"], s["refer_answered"]) == (0.4, 0.8, 1)
    assert "80.0% sent to a clinician" in format_report(res) and "1 answered with a topic" in format_report(res)
