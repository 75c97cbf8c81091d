"""“Did you mean …?”: offer the nearest topic when the bot is not sure enough to answer.

When the decision policy declines a topic answer only because the topic-fit verifier's
P(fit) is below ``decision.topic_fit`` (bot/decision.py), the honest reply is still "I
can't answer that reliably", but a dead end helps nobody: the nearest topic is right for
about two in three of these questions (blind batches H–K, 2026-12-03). So the reply names
that topic's title and asks; a short yes ("是", "对", "嗯", "好的", "1", "yes", "ok") as the
next message sends the topic's answer. It is the two-stage fallback of dialogue systems
(Rasa's ``TwoStageFallbackPolicy``: "Did you mean …?" before giving up), with the choice left
to the user, so a wrong guess costs one message and is never sent as an answer.

The offer is made only for ``decision.suggest`` <= P(fit) < ``decision.topic_fit`` (below
it, the nearest topic was right less often than wrong on the development batches), never
for an emergency, a crisis, a referral or a question outside a topic's scope, and it keeps
any safety-net line. The yes-words are data (bot/suggestion_rules.yaml).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import yaml

from bot.knowledge import Topic

RULES_PATH = Path(__file__).with_name("suggestion_rules.yaml")


@lru_cache(maxsize=1)
def _answers() -> dict[str, re.Pattern[str]]:
    rules = yaml.load(RULES_PATH.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    return {key: re.compile(f"^(?:{'|'.join(f'(?:{rules[key][lang]})' for lang in ('zh', 'en'))})(?:{rules['tails']})*$")
            for key in ("affirm", "refuse")}


def answer_to_offer(text: str) -> str | None:
    """``"yes"`` when a normalized message (Simplified Chinese, lowercase Latin) is only a yes
    ("是的", "对对", "嗯", "好的呀", "1", "yes please", "ok!"), ``"no"`` when it is only a no
    ("不是", "不对", "算了", "nope"), else ``None`` (a message of its own)."""
    text = text.strip()
    pats = _answers()
    return "yes" if pats["affirm"].match(text) else "no" if pats["refuse"].match(text) else None


def ask_again_reply(lang: str) -> str:
    """After a no to the offer: ask for the question in other words."""
    if lang == "zh":
        return ("好的。请换个说法再问一次，说清楚是谁（自己、老人还是孩子）、哪里不舒服、想知道什么，"
                "比如「老人膝盖疼能做什么锻炼」。")
    return ("All right. Please ask again in other words: who it is for (you, an older person, a child), what the "
            "trouble is and what you want to know, e.g. \u201cwhat exercise helps an older person's sore knees?\u201d")


def suggestion_reply(topic: Topic, lang: str) -> str:
    """The honest decline with the offer of ``topic``: its title and how to accept."""
    if lang == "zh":
        return (f"这个问题我没把握直接回答，怕说错误导您。您是想了解「{topic.title['zh']}」吗？"
                "是的话，回复“是”，我把这方面的建议发给您；不是的话，请换个说法再问，或咨询医生。")
    return (f"I'm not sure I can answer that reliably, and I don't want to mislead you. Did you mean "
            f"\u201c{topic.title['en']}\u201d? Reply \u201cyes\u201d and I'll send that advice; if not, "
            "please ask in other words, or ask a doctor.")
