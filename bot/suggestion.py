"""“Did you mean …?”: offer the nearest topics when the bot is not sure enough to answer.

When the decision policy declines a topic answer only because one of its two learned judges
doubts it (bot/decision.py, ``Decision.offer``), the honest reply is still "I can't answer
that reliably", but a dead end helps nobody. Among such questions on the development
batches (A, B, H–M, 2026-12-03) retrieval's best topic was right for 62 %, one of its best
two for 82 % and one of its best three for 90 %. So the reply lists up to
:data:`MAX_OFFERED` topic titles and asks; a number ("1", "第二个", "two"), or a bare yes
for the first ("是", "对", "嗯", "好的", "yes", "ok"), as the next message sends that topic's
answer, and a bare no asks for the question in other words. It is the two-stage fallback
of dialogue systems (Rasa's ``TwoStageFallbackPolicy``: "Did you mean …?" before giving up)
and the "您是不是想问" list of Chinese service bots, with the choice left to the user, so a
wrong guess costs one message and is never sent as an answer.

Topics offered besides the best are retrieval's next best that cover the populations and
diseases the question names (bot/topic_scope.py). Never for an emergency, a crisis, a
referral or a named medicine; a safety-net line stays. The words are data
(bot/suggestion_rules.yaml).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import yaml

from bot.knowledge import FACETS, SEE_DOCTOR, SEE_DOCTOR_HEADING, KnowledgeBase, Topic
from safety.normalize import memoized

RULES_PATH = Path(__file__).with_name("suggestion_rules.yaml")
#: Most topics one offer lists.
MAX_OFFERED = 3
#: :func:`answer_to_offer` for a no.
DECLINED = -1


@lru_cache(maxsize=1)
def _patterns() -> tuple[re.Pattern[str], ...]:
    """Whole-message patterns: a no, then a choice of the first, second and third topic."""
    rules = yaml.load(RULES_PATH.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)

    def whole(words: dict[str, str]) -> re.Pattern[str]:
        return re.compile(f"^(?:{'|'.join(f'(?:{words[lang]})' for lang in ('zh', 'en'))})(?:{rules['tails']})*$")
    return (whole(rules["refuse"]), *(whole(c) for c in rules["choose"]))


@memoized
def answer_to_offer(text: str) -> int | None:
    """What a normalized message (Simplified Chinese, lowercase Latin) says to an offer, if it is
    nothing else: the 0-based index of the topic chosen (a bare yes, "是的", "好的呀", "yes
    please", chooses the first; "2", "第二个", "two" the second), :data:`DECLINED` for a bare no
    ("不是", "算了", "nope"), else ``None`` (a message of its own)."""
    text = text.strip()
    refuse, *choose = _patterns()
    if refuse.match(text):
        return DECLINED
    return next((i for i, pat in enumerate(choose) if pat.match(text)), None)


def offered_topics(kb: KnowledgeBase, suggested: list[str]) -> list[Topic]:
    """The topics of ``suggested`` (the ids the user's last reply offered, best first), those no longer in ``kb`` left out."""
    return [kb.topics[t] for t in suggested if t in kb.topics]


def ask_again_reply(lang: str) -> str:
    """After a no to the offer: ask for the question in other words."""
    if lang == "zh":
        return ("好的。请换个说法再问一次，说清楚是谁（自己、老人还是孩子）、哪里不舒服、想知道什么，"
                "比如「老人膝盖疼能做什么锻炼」。")
    return ("All right. Please ask again in other words: who it is for (you, an older person, a child), what the "
            "trouble is and what you want to know, e.g. \u201cwhat exercise helps an older person's sore knees?\u201d")


def suggestion_reply(topics: list[Topic], lang: str) -> str:
    """The honest decline with the offer of ``topics`` (1 to :data:`MAX_OFFERED`, best first):
    their titles and how to choose."""
    if lang == "zh":
        lead = "这个问题我没把握直接回答，怕说错误导您。"
        if len(topics) == 1:
            return (f"{lead}您是想了解「{topics[0].title['zh']}」吗？"
                    "是的话，回复“是”，我把这方面的建议发给您；不是的话，请换个说法再问，或咨询医生。")
        return f"{lead}您是想了解下面哪一个？请回复数字：\n{_numbered(topics, 'zh')}\n都不是的话，请换个说法再问，或咨询医生。"
    lead = "I'm not sure I can answer that reliably, and I don't want to mislead you."
    if len(topics) == 1:
        return (f"{lead} Did you mean \u201c{topics[0].title['en']}\u201d? Reply \u201cyes\u201d and I'll send "
                "that advice; if not, please ask in other words, or ask a doctor.")
    return (f"{lead} Did you mean one of these? Reply with its number:\n{_numbered(topics, 'en')}\n"
            "If none fits, please ask in other words, or ask a doctor.")


def choose_first_reply(topics: list[Topic], facet: str | None, lang: str) -> str:
    """A follow-up ("那饮食上呢", "what about exercise?") sent while ``topics`` stand offered: which topic
    it follows is the user's to say. The offer again, and that ``facet`` (a FACETS name or
    ``see_doctor``; None for "more") of the topic chosen comes next."""
    what = SEE_DOCTOR_HEADING[lang].lower() if facet == SEE_DOCTOR else (
        FACETS[facet][lang] if facet in FACETS else "")
    if lang == "zh":
        aspect = f"「{what}」方面的建议" if what else "这方面的建议"
        if len(topics) == 1:
            return f"您是想了解「{topics[0].title['zh']}」吗？是的话，回复“是”，我把{aspect}发给您。"
        return f"您问的是下面哪一个？请先回复数字，我再把{aspect}发给您：\n{_numbered(topics, 'zh')}"
    aspect = f"the advice on {what.lower()}" if what else "that advice"
    if len(topics) == 1:
        return f"Did you mean \u201c{topics[0].title['en']}\u201d? Reply \u201cyes\u201d and I'll send {aspect}."
    return f"Which of these are you asking about? Reply with its number and I'll send {aspect}:\n{_numbered(topics, 'en')}"


def _numbered(topics: list[Topic], lang: str) -> str:
    """The titles of ``topics`` in ``lang``, one a line, numbered from 1 as the user chooses them."""
    return "\n".join(f"{i}. {t.title[lang]}" for i, t in enumerate(topics, 1))
