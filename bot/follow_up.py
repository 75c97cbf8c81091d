"""Short follow-ups that ask for one facet of the topic in context.

"失眠怎么调理" then "那饮食上呢" asks for the insomnia topic's diet facet; "老人呢" for what
differs for older people; "还有呢" for more on the same topic. :func:`read_follow_up`
reads such a message with the rules of ``bot/follow_up_rules.yaml`` (leads and tails
stripped, then a facet cue inside a frame must make up the whole rest), and
:func:`facet_reply` / :func:`more_reply` / :func:`ask_back_reply` write the answer:

- the topic has the facet: its text under a heading, then "when to see a doctor" and the
  sources (``Topic.render(lang, facet)``), never the main answer again;
- the topic lacks it: an honest "no specific advice on this here", what it does have, and
  for elders, children and pregnancy a doctor or pharmacist first;
- no topic in context: ask what the user means instead of guessing.

A message with more in it than a facet but a facet cue somewhere ("我外公快九十了 老人洗要注意啥",
"老人便秘怎么办"): :func:`read_cue` says what it would ask of the topic in context, and the follow-up
judge (bot/follow_up_judge.py) whether it asks that or something of its own. Facet names: :data:`bot.knowledge.FACETS` plus
``see_doctor`` (every topic's "when to see a doctor").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from bot.knowledge import FACETS, SEE_DOCTOR, KnowledgeBase, Topic
from bot.retrieval import Retriever
from bot.search_cache import SearchResult
from safety.normalize import memoized

RULES_PATH = Path(__file__).with_name("follow_up_rules.yaml")

#: Facets that differ by population: a missing one sends the user to a clinician first.
POPULATION_FACETS = frozenset({"elders", "children", "pregnancy"})
#: Longest message read as a facet follow-up: characters, or words for Latin script
#: (longer ones stand alone).
MAX_CHARS = 40
MAX_WORDS = 16
#: Longest message with a facet cue that may follow the topic in context (:func:`read_cue`):
#: characters, or words for Latin script.
CUE_MAX_CHARS = 60
CUE_MAX_WORDS = 24
#: Longest message read with the topic in context, characters.
FOLLOW_UP_MAX_CHARS = 24
#: Referral reasons (safety/scope_rules.yaml) below which what the topic in context says for the facet asked
#: may follow (:func:`below_referral`): which medicine may be taken, and what it is. Never below a dose or a
#: stop-or-change-your-medicine question: that referral stands alone.
FACET_AFTER_REFERRAL = frozenset({"prescription", "diagnosis"})


@dataclass(frozen=True)
class FollowUp:
    """What a short follow-up asks for: ``facet`` (a FACETS name or ``see_doctor``), or
    ``None`` for "more on the same topic"."""

    facet: str | None


@dataclass(frozen=True)
class FollowUpPlan:
    """How the dispatcher reads a message in a conversation (bot/follow_up_judge.py ``plan_follow_up``).

    Attributes:
        ask_back: a follow-up with no topic in context: ask what the user means.
        facet: a short message that is only a facet cue ("老人呢"): answered from the topic in
            context at once; ``FollowUp(None)`` for "还有呢".
        loose: a message with a facet cue that the follow-up judge read as asking about the topic
            in context ("老人洗要注意啥 我外公快九十了"): answered from that topic when the decision
            allows an answer.
        with_context: retrieval reads the message together with the topic in context.
        cue: the facet cue of a message the judge did not read as a follow-up: answered from the topic
            in context only when, read on its own, the message finds a topic about that facet in
            general (:func:`asks_in_general`) and names no subject of its own.
        searched: the judge's readings of the message, by (text, context), for the dispatcher's own
            search of this message to reuse (the retriever's caches do the same across messages,
            unless ``inference.embedding_cache_size`` is 0).
    """

    ask_back: bool = False
    facet: FollowUp | None = None
    loose: FollowUp | None = None
    with_context: bool = False
    cue: FollowUp | None = None
    searched: dict[tuple[str, str | None], SearchResult] = field(default_factory=dict, compare=False)


def new_subject_of(retriever: Retriever, text: str, topic_id: str) -> str | None:
    """A word of ``text`` (normalized) that names a subject topic ``topic_id`` never mentions
    ("便秘" in "老人便秘怎么办" after insomnia; :meth:`~bot.retrieval.Retriever.new_subject`), its
    facet cues and the rules' generic words left out; None when there is none."""
    return retriever.new_subject(without_cues(text), topic_id, _rules().generic)


@dataclass(frozen=True)
class _Rules:
    leads: re.Pattern
    tails: re.Pattern
    facets: tuple[tuple[str, re.Pattern], ...]  # (facet, whole-remainder pattern), zh and en merged
    more: re.Pattern
    menu: dict[str, dict[str, str]]  # lang -> facet -> how the user can ask for it
    loose: tuple[tuple[str, re.Pattern], ...]  # (facet, cue anywhere), in the rules' loose_order
    more_loose: re.Pattern
    generic: frozenset[str]  # title words that name no subject (Retriever.new_subject)
    same: tuple[tuple[str, re.Pattern], ...]  # (population facet, its cue with a word tying it to the last answer)
    refers_back: dict[str, re.Pattern]  # script ("zh" for any non-Latin text, "en") -> words pointing back
    facet_subjects: dict[str, frozenset[str]]  # facet -> topics whose subject is that facet in general


@lru_cache(maxsize=1)
def _rules(path: Path = RULES_PATH) -> _Rules:
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    facets = []
    for name, cues in data["facets"].items():
        if name != SEE_DOCTOR and name not in FACETS:
            raise ValueError(f"{path.name}: facets.{name}: not a facet of bot.knowledge.FACETS")
        frames = [frame.replace("{cue}", f"(?:{cues[lang]})") for lang in ("zh", "en")
                  for frame in data["frames"][lang]]
        facets.append((name, re.compile("(?:" + "|".join(frames) + ")")))
    more = "|".join(f"(?:{data['more'][lang]})" for lang in ("zh", "en"))
    return _Rules(leads=re.compile(data["leads"]), tails=re.compile(data["tails"]), facets=tuple(facets),
                  more=re.compile(f"(?:{more})"), menu=data["menu"],
                  loose=tuple((name, re.compile("|".join(f"(?:{data['loose'][name][lang]})" for lang in ("zh", "en"))))
                              for name in data["loose_order"]),
                  more_loose=re.compile("|".join(f"(?:{data['more_loose'][lang]})" for lang in ("zh", "en"))),
                  generic=frozenset(data["generic_words"]),
                  same=tuple((name, re.compile("|".join(
                      f"(?:{data['same'][lang].replace('{who}', '(?:' + data['loose'][name][lang] + ')')})"
                      for lang in ("zh", "en"))))
                      for name in data["loose_order"] if name in POPULATION_FACETS),
                  refers_back={lang: re.compile(data["refers_back"][lang]) for lang in ("zh", "en")},
                  facet_subjects={name: frozenset(ids) for name, ids in data["facet_subjects"].items()})


def _length(text: str) -> int:
    """A message's length as the limits here count it: words for Latin script, else characters."""
    return len(text.split()) if text.isascii() else len(text)


def cue_length(text: str) -> float:
    """``text``'s length as a share of the longest message with a cue that may follow the topic in
    context (:data:`CUE_MAX_CHARS` characters, :data:`CUE_MAX_WORDS` words for Latin script): over 1
    stands alone."""
    return _length(text) / (CUE_MAX_WORDS if text.isascii() else CUE_MAX_CHARS)


def _remainder(text: str) -> tuple[str, bool]:
    """``text`` without its lead and tail words, and whether a lead word was there."""
    rules = _rules()
    lead = rules.leads.match(text)
    rest = text[lead.end():] if lead else text
    rest = rules.tails.sub("", rest).strip()
    return rest, bool(lead)


@memoized
def read_follow_up(text: str) -> FollowUp | None:
    """The facet a short follow-up asks for, or ``None`` when ``text`` is not one.

    Args:
        text: the normalized message (Simplified Chinese, lowercase Latin).
    """
    text = text.strip().lower()
    if not text or _length(text) > (MAX_WORDS if text.isascii() else MAX_CHARS):
        return None
    if (whole := _read_one(text)) is not None or text.isascii():
        return whole
    # "要去医院看吗 挂什么科": Chinese parts, each asking for the same facet on its own
    parts = [p for p in _PARTS.split(text) if p]
    read = {_read_one(p) for p in parts}
    return read.pop() if len(parts) > 1 and len(read) == 1 and None not in read else None


#: Where a Chinese message splits into parts that may each be a follow-up: punctuation, and after a
#: sentence-final particle (normalizing drops the space of "要去医院吗 看哪个科").
_PARTS = re.compile(r"[\s，,。？?！!~～]+|(?<=[吗呢嘛啊呀吧])")


def _read_one(text: str) -> FollowUp | None:
    rest, led = _remainder(text)
    rules = _rules()
    if not rest:
        return FollowUp(None) if led or text != rest else None
    for name, pattern in rules.facets:
        if pattern.fullmatch(rest):
            return FollowUp(name)
    if rules.more.fullmatch(rest):
        return FollowUp(None)
    return None


@memoized
def read_cue(text: str) -> tuple[FollowUp, bool] | None:
    """What a message with a facet cue anywhere in it would ask of the topic in context, and
    whether it ties itself to the last answer; ``None`` without a cue or past :data:`CUE_MAX_CHARS`
    characters (:data:`CUE_MAX_WORDS` words for Latin script). Whether it asks about that topic or
    about something of its own is for the follow-up judge (bot/follow_up_judge.py).

    - tied to the last answer, with who it is for: that group's facet ("我爸76了也这样 老年人要注意啥");
    - else the first facet cue found ("老人洗要注意啥 我外公快九十了" -> elders, "should i still hit the
      gym?" -> activity: :func:`read_named_facet`);
    - else a request for more ("还有别的办法吗" -> ``FollowUp(None)``).

    Args:
        text: the normalized message (Simplified Chinese, lowercase Latin).
    """
    text = text.strip().lower()
    if not text or cue_length(text) > 1:
        return None
    if (tied := read_tied_follow_up(text)) is not None:
        return tied, True
    if (named := read_named_facet(text)) is not None:
        return named, False
    return (FollowUp(None), False) if _rules().more_loose.search(text) else None


@memoized
def read_tied_follow_up(text: str) -> FollowUp | None:
    """The population facet a message asks for when it names who it is for and ties itself to the
    answer just given ("我爸76了也这样 老年人要注意啥", "孕妇也脚肿 一样处理吗", "what about my dad, same
    thing?"; the rules' ``same`` words); ``None`` otherwise or past :data:`CUE_MAX_CHARS` characters
    (:data:`CUE_MAX_WORDS` words for Latin script).

    Args:
        text: the normalized message (Simplified Chinese, lowercase Latin).
    """
    text = text.strip().lower()
    if not text or cue_length(text) > 1:
        return None
    rules = _rules()
    cues = dict(rules.loose)
    return next((FollowUp(name) for name, tie in rules.same if cues[name].search(text) and tie.search(text)), None)


@memoized
def read_named_facet(text: str) -> FollowUp | None:
    """The first facet (the rules' ``loose_order``) whose cue appears anywhere in ``text``
    (normalized), whatever its length; None without one. Also for a message that retrieval already
    puts on the topic just answered ("what about for kids? my son keeps licking his lips and now
    there's a red ring around his mouth"), so that its facet, not the same answer, goes out."""
    text = text.strip().lower()
    return next((FollowUp(name) for name, pattern in _rules().loose if pattern.search(text)), None)


def asks_in_general(facet: str | None, topic_id: str) -> bool:
    """True when ``topic_id`` is about ``facet`` in general (the rules' ``facet_subjects``: exercise for
    ``activity``, a balanced diet for ``diet``): a message with that facet's cue that finds it on its own
    ("would exercise help?") asks, after another topic's answer, for that topic's facet."""
    return facet is not None and topic_id in _rules().facet_subjects.get(facet, ())


def has_facet(topic: Topic, facet: str) -> bool:
    """Whether ``topic`` answers ``facet`` (a FACETS name or ``see_doctor``): its own text, or another
    topic all about it (``facet_topics``)."""
    return facet == SEE_DOCTOR or facet in topic.facets or facet in topic.facet_topics


def without_cues(text: str) -> str:
    """``text`` with every facet and "more" cue blanked out: what is left names the subject, if any."""
    rules = _rules()
    for _, pattern in rules.loose:
        text = pattern.sub(" ", text)
    return rules.more_loose.sub(" ", text)


@memoized
def refers_back(text: str) -> bool:
    """True when ``text`` (normalized) points back at what was just said without naming it: a
    demonstrative or pronoun ("这个要紧吗", "will it go away?") or a verb whose object is left out
    ("喂奶期间能吃吗"); the rules' ``refers_back`` words, English ones for a message in Latin script."""
    text = text.strip().lower()
    return bool(_rules().refers_back["en" if text.isascii() else "zh"].search(text))


def is_follow_up(text: str) -> bool:
    """True for a short message that starts as a continuation ("那夏天呢", "what about at night?"):
    retrieval reads it together with the topic in context."""
    text = text.strip().lower()
    return len(text) <= FOLLOW_UP_MAX_CHARS and bool(_rules().leads.match(text))


def is_bare_follow_up(text: str) -> bool:
    """True for a lead word and a few words of context only ("那夏天呢", "what about at night?"):
    with no topic in context there is nothing to read it against."""
    text = text.strip().lower()
    rest, led = _remainder(text)
    if not led or len(text) > MAX_CHARS:
        return False
    words = rest.split()
    return len(words) <= 2 if rest.isascii() else len(rest) <= 4


def facet_reply(topic: Topic, facet: str, lang: str, hint: bool = False) -> tuple[str, bool]:
    """The reply body for ``facet`` of ``topic`` and whether the topic has it; ``hint`` adds
    that it answers the earlier topic (for a follow-up read from a cue inside a longer message).

    Returns:
        (body without disclaimer, True) when the topic has the facet (``see_doctor`` always);
        (an honest "nothing specific here" with the facets it does have, False) otherwise.
    """
    if facet == SEE_DOCTOR:
        return _hinted(topic.render(lang, SEE_DOCTOR), topic, lang, hint), True
    if facet in topic.facets:
        return _hinted(topic.render(lang, facet), topic, lang, hint), True
    label = FACETS[facet][lang]
    title = topic.title[lang]
    if lang == "zh":
        body = f"关于「{title}」，这里没有专门针对「{label}」的建议，我不想随便说。"
        if facet in POPULATION_FACETS:
            body += f"{label}的情况可能和一般成人不同，用任何方法前请先问医生或药师。"
    else:
        body = f"On \u201c{title}\u201d I have no specific advice for {label.lower()}, and I'd rather not guess."
        if facet in POPULATION_FACETS:
            body += f" Things can be different for {label.lower()}: ask a doctor or pharmacist before trying anything."
    return f"{body}\n{_menu(topic, lang)}\n{topic.see_doctor_line(lang)}", False


def follow_up_reply(kb: KnowledgeBase, topic: Topic, facet: str | None, lang: str, hint: bool = False
                    ) -> tuple[Topic, str | None, str, bool]:
    """(topic answered, facet shown, reply body, whether the topic had it) for ``facet`` of
    ``topic``: its text, the whole answer of the topic a facet points to (``facet_topics``),
    an honest "nothing specific here", or for ``None`` ("还有呢") what else can be asked."""
    if facet in topic.facet_topics:  # another topic is all about it
        other = kb.topics[topic.facet_topics[facet]]
        return other, None, other.render(lang), True
    if facet is None:
        return topic, None, more_reply(topic, lang), True
    body, found = facet_reply(topic, facet, lang, hint)
    return topic, facet, body, found


def more_reply(topic: Topic, lang: str) -> str:
    """What else the user can ask about ``topic`` (its facets), instead of the same answer again."""
    if lang == "zh":
        head = f"关于「{topic.title['zh']}」，上面是主要的建议。"
    else:
        head = f"That was the main advice on \u201c{topic.title['en']}\u201d."
    return f"{head}\n{_what_else(topic, lang)}"


def _what_else(topic: Topic, lang: str) -> str:
    """The facets ``topic`` has, as the user can ask for them, and its when-to-see-a-doctor line."""
    return f"{_menu(topic, lang)}\n{topic.see_doctor_line(lang)}"


def after_crisis_reply(kb: KnowledgeBase, topic: Topic, text: str, lang: str) -> str:
    """What goes below a crisis reply the head was not sure of when ``topic`` was just answered
    (bot/decision.py ``crisis_sure``): the facet of ``topic`` that ``text`` names, else what else can be
    asked, after a line that ties it to the earlier question. Never instead of the crisis reply."""
    named = read_named_facet(text)
    return _tied(topic, lang, follow_up_reply(kb, topic, named.facet, lang, hint=True)[2] if named
                 else _what_else(topic, lang))  # the main answer went out before


def below_referral(topic: Topic | None, asked: FollowUp | None, lang: str) -> str | None:
    """What goes below the referral of a medicine or diagnosis question that the follow-up judge read as
    asking about ``topic``, the topic just answered ("我在喂奶 能吃感冒药吗" after a cold answer): that topic's
    own text for the facet asked (``asked``: breastfeeding, children, elders, causes, when to see a doctor...),
    after a line that ties it to the earlier question. ``None`` without a topic or a facet, or where the topic
    has no text of its own for it. Never instead of the referral."""
    if topic is None or asked is None or asked.facet is None or (
            asked.facet != SEE_DOCTOR and asked.facet not in topic.facets):
        return None
    return _tied(topic, lang, facet_reply(topic, asked.facet, lang)[0])


def _tied(topic: Topic, lang: str, body: str) -> str:
    """``body`` (``topic``'s text) below another reply, after a line that ties it to the earlier question."""
    if lang == "zh":
        return f"另外，关于你前面问的「{topic.title['zh']}」：\n{body}"
    return f"And on what you asked about \u201c{topic.title['en']}\u201d earlier:\n{body}"


def ask_back_reply(lang: str) -> str:
    """A follow-up with no topic in context: ask what the user means."""
    if lang == "zh":
        return "您是接着问哪个问题呢？我这边没有看到前面的话题。请把问题完整说一下，比如「失眠怎么调理」「高血压饮食要注意什么」。"
    return ("Which question are you following up on? I don't have the earlier topic. Please ask in full, "
            "for example \u201chow can I sleep better?\u201d or \u201cwhat should I eat with high blood pressure?\u201d")


def _menu(topic: Topic, lang: str) -> str:
    """The facets ``topic`` answers (its own text or another topic's, :func:`has_facet`), worded as
    the user can ask for them (rules' ``menu``); "when to see a doctor" last."""
    menu = _rules().menu[lang]
    asks = [menu[f] for f in FACETS if has_facet(topic, f)] + [menu[SEE_DOCTOR]]
    if lang == "zh":
        return "还可以接着问：" + "、".join(f"「{a}」" for a in asks) + "。"
    return "You can also ask: " + ", ".join(f"\u201c{a}\u201d" for a in asks)


def _hinted(body: str, topic: Topic, lang: str, hint: bool) -> str:
    if not hint:
        return body
    if lang == "zh":
        return f"{body}\n（以上接着「{topic.title['zh']}」回答；想问别的，请把问题说完整。）"
    return f"{body}\n(This follows on from \u201c{topic.title['en']}\u201d; for something else, please ask in full.)"


