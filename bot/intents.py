"""Rule-based intents: greeting, human handoff, out of scope; and the canned replies.

Runs after emergency triage (``safety.triage``) and next to the scope rules
(``safety.scope``); anything these rules do not claim goes to knowledge retrieval.

* GREETING only when the whole message is a greeting, thanks, "who are you" or
  "help" (with polite filler): "你好" is a greeting, "你好，我失眠怎么办" is not.
* HANDOFF whenever the user asks for a person: "转人工", "人工客服", "talk to a
  person", or the bare word the bot itself suggests ("人工", "human").
* OUT_OF_SCOPE conservatively: a non-health subject (weather, stocks, lottery,
  homework, recipes, jokes, code, sports, travel, ...) AND no health word
  anywhere in the message ("天气热怎么防中暑" is a health question).

The rules and the reply texts are data, bot/intent_rules.yaml (each rule with its source
and an example it must catch), so a clinician or operator can review them without reading
Python; they are matched on :attr:`safety.normalize.Normalized.text` (Simplified,
lowercased). This module only loads and applies them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import yaml

from bot.types import Intent
from safety.normalize import Normalized, memoized

__all__ = ["rule_intent", "intent_reply", "unsupported_reply", "care_team_reply", "is_aftercare", "is_medical_diet",
           "CARE_TEAM_RULES", "MEDICAL_DIET_CONDITIONS", "MEDICAL_DIET_REPLY", "GREETING_TOKENS",
           "HANDOFF_PATTERNS", "END_HANDOFF_PATTERNS", "HANDOFF_ENDED_REPLY", "HANDOFF_UNAVAILABLE_REPLY",
           "is_end_handoff", "HANDOFF_OFFERS", "drop_handoff_offer", "OFF_TOPIC_PATTERNS", "HEALTH_WORDS", "AFTERCARE_PATTERNS", "AFTERCARE_REPLY"]

#: The rule table: patterns, greeting tokens, care-team rules, abuse words, replies.
TABLE = Path(__file__).with_name("intent_rules.yaml")
_DATA = yaml.load(TABLE.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)


def _regex(value: str | list[str] | None) -> str | None:
    """A pattern as written in a rule table: a string, or a list meaning any one of them."""
    return value if value is None or isinstance(value, str) else "|".join(value)


def _patterns(entries: list[dict], key: str = "pattern") -> tuple[str, ...]:
    return tuple(_regex(e[key]) for e in entries)


def _texts(entry: dict) -> dict[str, str]:
    return {"zh": entry["zh"], "en": entry["en"]}


_REPLY_TEXTS: dict[str, dict] = _DATA["replies"]

# A message is a greeting when it is made only of these tokens (and filler, punctuation, spaces).
GREETING_TOKENS: tuple[str, ...] = tuple(_DATA["greeting"]["tokens"])
_GREETING_FILLER: tuple[str, ...] = tuple(_DATA["greeting"]["filler"])
_GREETING_RE = re.compile(
    r"^(?:\s|[,.!?;:~，。！？；：、]|"
    + "|".join(sorted((re.escape(t) for t in GREETING_TOKENS + _GREETING_FILLER), key=len, reverse=True))
    + r")+$")

_THANKS = re.compile(_DATA["thanks"]["pattern"])
_THANKED = re.compile(_DATA["thanks"]["thanked"])
_THANKED_AT_START = re.compile(r"^\W*(?:\w+\W+)?(?:" + _DATA["thanks"]["thanked"] + ")")
_HELPED = re.compile(_DATA["thanks"]["feedback"]["helped"])
_QUESTION = re.compile(_DATA["thanks"]["feedback"]["question"])

# Asking for a person. The bare words match only as the whole message.
HANDOFF_PATTERNS: tuple[str, ...] = _patterns(_DATA["handoff"])
_HANDOFF_RE = tuple(re.compile(p) for p in HANDOFF_PATTERNS)

# Leaving a person for the bot: the whole message only.
END_HANDOFF_PATTERNS: tuple[str, ...] = _patterns(_DATA["end_handoff"])
_END_HANDOFF_RE = tuple(re.compile(p) for p in END_HANDOFF_PATTERNS)

#: The bot takes the chat back (the user ended a handoff, or asked to while in none).
HANDOFF_ENDED_REPLY: dict[str, str] = _texts(_REPLY_TEXTS["handoff_ended"])
#: Nobody can answer a handoff on this channel (no agent console, no agents' group).
HANDOFF_UNAVAILABLE_REPLY: dict[str, str] = _texts(_REPLY_TEXTS["handoff_unavailable"])

#: Every "reply 人工 / human to reach a person" offer in the bot's texts (the replies here,
#: safety/review.py, safety/triage.py), with what replaces it: where nobody can take a
#: handoff the offer is dropped (:func:`drop_handoff_offer`), not made and then refused.
HANDOFF_OFFERS: tuple[tuple[str, str], ...] = tuple((o["offer"], o["replacement"]) for o in _DATA["handoff_offers"])


def drop_handoff_offer(text: str) -> str:
    """``text`` without its offer of a person (:data:`HANDOFF_OFFERS`), trailing space removed."""
    for offer, replacement in HANDOFF_OFFERS:
        text = text.replace(offer, replacement)
    return text.rstrip()


def is_end_handoff(norm: Normalized) -> bool:
    """Whether the whole message asks to leave the person and return to the bot
    ("结束人工", "不用人工了", "回到机器人", "end chat", "/end"; :data:`END_HANDOFF_PATTERNS`)."""
    text = norm.text.strip().strip("!?.,;:~，。！？；：、～ ")
    return any(p.match(text) for p in _END_HANDOFF_RE)


# Subjects that are not about health, and words that keep a message about health.
OFF_TOPIC_PATTERNS: tuple[str, ...] = _patterns(_DATA["off_topic"])
_OFF_TOPIC_RE = tuple(re.compile(p) for p in OFF_TOPIC_PATTERNS)
HEALTH_WORDS: tuple[str, ...] = _patterns(_DATA["health_words"])
_HEALTH_RE = tuple(re.compile(p) for p in HEALTH_WORDS)


def _care_team_matcher(rules: list[dict]) -> Callable[[Normalized], bool]:
    """True when a rule's ``pattern`` matches and its ``also`` (if any) matches too."""
    compiled = tuple((re.compile(_regex(r["pattern"])), re.compile(_regex(r["also"])) if r.get("also") else None)
                     for r in rules)

    def matches(norm: Normalized) -> bool:
        return any(p.search(norm.text) and (also is None or also.search(norm.text)) for p, also in compiled)
    return matches


#: Everyday questions that the person's treating team must answer, not the knowledge base:
#: (rule name, matcher, reply per language), checked in order (aftercare, medical_diet).
CARE_TEAM_RULES: tuple[tuple[str, Callable[[Normalized], bool], dict[str, str]], ...] = tuple(
    (group["name"], _care_team_matcher(group["rules"]), _texts(group["reply"])) for group in _DATA["care_team"])
_CARE_TEAM = {group["name"]: group for group in _DATA["care_team"]}
_CARE_MATCHERS = {name: matches for name, matches, _ in CARE_TEAM_RULES}

# After an operation or a vaccination, or during a treatment ("打完疫苗能洗澡吗"): ask the team.
AFTERCARE_PATTERNS: tuple[str, ...] = _patterns(_CARE_TEAM["aftercare"]["rules"])
AFTERCARE_REPLY: dict[str, str] = _texts(_CARE_TEAM["aftercare"]["reply"])
# Eating with a condition whose diet the treating team sets (kidney disease, cirrhosis, Parkinson's).
MEDICAL_DIET_CONDITIONS: tuple[str, ...] = _patterns(_CARE_TEAM["medical_diet"]["rules"])
MEDICAL_DIET_EATING: tuple[str, ...] = _patterns(_CARE_TEAM["medical_diet"]["rules"], "also")
MEDICAL_DIET_REPLY: dict[str, str] = _texts(_CARE_TEAM["medical_diet"]["reply"])


def is_medical_diet(norm: Normalized) -> bool:
    """True for a question about eating with a condition whose diet the treating team sets
    (:data:`MEDICAL_DIET_CONDITIONS` and an eating word in the same language's pattern)."""
    return _CARE_MATCHERS["medical_diet"](norm)


def is_aftercare(norm: Normalized) -> bool:
    """True for an everyday question after an operation or a vaccination, or during a
    treatment (:data:`AFTERCARE_PATTERNS`). Checked after triage and the scope rules, so an
    emergency or a medicine question keeps its own reply."""
    return _CARE_MATCHERS["aftercare"](norm)


@memoized
def care_team_reply(norm: Normalized, lang: str) -> tuple[str, str] | None:
    """``(rule name, reply in lang)`` of the first :data:`CARE_TEAM_RULES` entry that matches
    (``"zh"``, else English, as :func:`intent_reply`), or None. Checked after triage and the
    scope rules, so an emergency or a medicine question keeps its own reply."""
    for rule, matches, replies in CARE_TEAM_RULES:
        if matches(norm):
            return rule, replies["zh" if lang == "zh" else "en"]
    return None


def _is_greeting(text: str) -> bool:
    """The whole message is greeting tokens (at most 40 characters), or it thanks, says the advice
    helped and asks nothing (``thanks.feedback``, at most 80 characters)."""
    if not text:
        return False
    if len(text) <= 40 and _GREETING_RE.match(text):
        return True
    return (len(text) <= 80 and bool(_THANKED_AT_START.match(text)) and bool(_HELPED.search(text))
            and not _QUESTION.search(text))


@memoized
def rule_intent(norm: Normalized) -> Intent | None:
    """Classify a message by rule, or return ``None`` to let retrieval decide.

    Args:
        norm: the normalized message (:func:`safety.normalize.normalize`). Call
            after ``safety.triage``: an emergency wins over everything here.

    Returns:
        :attr:`Intent.HANDOFF` (asked for a person; checked first, so "你好，转人工"
        is a handoff), :attr:`Intent.GREETING` (the whole message is a greeting,
        thanks, who-are-you or help, at most 40 characters),
        :attr:`Intent.OUT_OF_SCOPE` (a non-health subject and no health word), or
        ``None``.
    """
    text = norm.text.strip()
    if not text:
        return None
    if any(p.search(text) for p in _HANDOFF_RE):
        return Intent.HANDOFF
    if _is_greeting(text):
        return Intent.GREETING
    if any(p.search(text) for p in _OFF_TOPIC_RE) and not any(p.search(text) for p in _HEALTH_RE):
        return Intent.OUT_OF_SCOPE
    return None


_REPLIES: dict[Intent, tuple[str, str]] = {
    Intent(name): (texts["zh"], texts["en"]) for name, texts in _REPLY_TEXTS.items()
    if name in {i.value for i in Intent}}


def intent_reply(intent: Intent, lang: str) -> str:
    """The canned reply for ``intent`` in ``lang`` (``"zh"`` Simplified or ``"en"``).

    Covers GREETING (what the bot does, example questions, not a doctor),
    HANDOFF (connecting to a person), OUT_OF_SCOPE (kind; what it can help
    with), NO_ANSWER (honest: cannot answer reliably, see a doctor, offer a
    person), plus generic REFER_DOCTOR and EMERGENCY texts for callers without a
    :mod:`safety.scope` / :mod:`safety.triage` result (prefer those: they are
    specific). Emergency numbers: 120 / 999 (zh), 112 / 911 / 999 (en).

    Raises:
        ValueError: for :attr:`Intent.ANSWER` and :attr:`Intent.SYSTEM`, which
            have no canned text.
    """
    try:
        zh, en = _REPLIES[Intent(intent)]
    except (KeyError, ValueError):
        raise ValueError(f"no canned reply for intent {intent!r}: answers come from the knowledge base") from None
    return zh if lang == "zh" else en




def greeting_reply(text: str, lang: str) -> str:
    """The reply to a greeting: a warm short one for thanks, goodbyes and festive wishes
    (bot/intent_rules.yaml ``thanks``), else the introduction (:func:`intent_reply`)."""
    if _THANKS.search(text):
        reply = "reply" if _THANKED.search(text) else "wishes_reply"  # "再见" is not thanked for
        return _DATA["thanks"][reply]["zh" if lang == "zh" else "en"]
    return intent_reply(Intent.GREETING, lang)


def unsupported_reply(lang: str) -> str:
    """Reply to images, voice, stickers, video and other non-text messages, in ``lang``."""
    return _REPLY_TEXTS["unsupported"]["zh" if lang == "zh" else "en"]


#: Insults and swearing aimed at the bot (Simplified after normalization; English lowercase).
ABUSE_WORDS = re.compile(_regex(_DATA["abuse"]["pattern"]))
#: Words left after removing the insult that still make a question ("你真笨，我失眠怎么办").
_ABUSE_FILLER = re.compile(_regex(_DATA["abuse"]["filler"]))
_ABUSE_MAX_LEFT: int = _DATA["abuse"]["max_left"]


@memoized
def is_abuse(norm: Normalized) -> bool:
    """True when the message is only an insult (no question left once the insult is removed)."""
    text = norm.text.strip().lower()
    if not ABUSE_WORDS.search(text):
        return False
    rest = _ABUSE_FILLER.sub("", ABUSE_WORDS.sub("", text))
    return len(rest) <= _ABUSE_MAX_LEFT


ABUSE_REPLY: dict[str, str] = _texts(_REPLY_TEXTS["abuse"])


def abuse_reply(lang: str) -> str:
    """A calm reply to an insult: apologise, invite a rephrase, offer a human."""
    return ABUSE_REPLY.get(lang, ABUSE_REPLY["zh"])


#: Replies about the message itself (intent system), used by bot/dispatcher.py.
SLOW_DOWN_REPLY = {
    "zh": "您发消息有点快，请稍等几秒再发，我会一条一条回答您。",
    "en": "You're sending messages a little fast. Please wait a few seconds and send your question again.",
}
BUSY_REPLY = {
    "zh": "现在咨询的人有点多，请稍等几秒再发一次您的问题，谢谢您的耐心。",
    "en": "I'm a little busy right now. Please send your question again in a few seconds.",
}
VOICE_OFF_REPLY = {
    "zh": "本账号暂未开启语音识别，请用文字描述您的问题，例如：“失眠怎么调理”。",
    "en": "Voice recognition is not switched on for this account. Please type your question.",
}
