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

A message with more in it than a facet ("老人便秘怎么办") is not a follow-up here and is
read on its own by retrieval. Facet names: :data:`bot.knowledge.FACETS` plus
``see_doctor`` (every topic's "when to see a doctor").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

from bot.knowledge import FACETS, KnowledgeBase, Topic
from bot.retrieval import Retriever
from inference.batcher import BusyError, DeadlineExceeded
from inference.engines.base import EngineError

RULES_PATH = Path(__file__).with_name("follow_up_rules.yaml")

#: The "when to see a doctor" facet every topic has (its ``see_doctor`` field).
SEE_DOCTOR = "see_doctor"
#: Facets that differ by population: a missing one sends the user to a clinician first.
POPULATION_FACETS = frozenset({"elders", "children", "pregnancy"})
#: Longest message read as a facet follow-up: characters, or words for Latin script
#: (longer ones stand alone).
MAX_CHARS = 40
MAX_WORDS = 16
#: Longest message read as a population follow-up tied to the last answer (:func:`read_tied_follow_up`).
TIED_MAX_CHARS = 60
TIED_MAX_WORDS = 24
#: Longest message read with the topic in context, characters.
FOLLOW_UP_MAX_CHARS = 24


@dataclass(frozen=True)
class FollowUp:
    """What a short follow-up asks for: ``facet`` (a FACETS name or ``see_doctor``), or
    ``None`` for "more on the same topic"."""

    facet: str | None


@dataclass(frozen=True)
class FollowUpPlan:
    """How the dispatcher reads a message in a conversation (:func:`plan_follow_up`).

    Attributes:
        ask_back: a follow-up with no topic in context: ask what the user means.
        facet: a short message that is only a facet cue ("老人呢"): answered from the topic in
            context at once; ``FollowUp(None)`` for "还有呢".
        loose: a short message with a facet cue and no subject of its own ("老人洗要注意啥 我外公快
            九十了"): answered from the topic in context when the decision allows an answer and
            retrieval read with that topic puts no other topic clearly ahead (:func:`follows_topic`).
        with_context: retrieval reads the message together with the topic in context.
    """

    ask_back: bool = False
    facet: FollowUp | None = None
    loose: FollowUp | None = None
    with_context: bool = False


#: How far (hybrid retrieval score, bot/retrieval.py) the best topic may be ahead of the topic
#: in context when a message with a facet cue is read with that topic and still follows it.
#: Chosen on two sets of two-turn conversations and standalone questions put after a random
#: topic (evals/follow_ups.jsonl and a second blind set): at 0.02, 90 % of follow-ups follow
#: and 5 % of standalone questions with a facet cue are taken for follow-ups.
FOLLOW_MARGIN = 0.02


def follows_topic(best_score: float, context_score: float) -> bool:
    """Whether a message with a facet cue, read with the topic in context, asks about that topic:
    no other topic scores more than :data:`FOLLOW_MARGIN` above it."""
    return best_score - context_score <= FOLLOW_MARGIN


#: Retrieval confidence (bot/retrieval.py ``confidence``) at which a message read on its own
#: names a topic of its own, so that it does not follow another one; and the length from which a
#: message, the words for who it is for left out, says enough to be read so (characters, or words
#: for Latin script). Chosen on the follow-up sets and on 902 standalone questions with a facet
#: cue put after an unrelated topic (evals/README.md, "Follow-up conversations").
NAMED_CONFIDENCE = 0.8
NAMING_CHARS = 18
NAMING_WORDS = 9


async def loose_follows(retriever: Retriever, text: str, context: str, topic_id: str, best_score: float,
                        context_score: float) -> bool:
    """Whether a short message with a facet cue (:func:`read_loose_follow_up`) asks about the topic
    in context, given its reading with that topic (``best_score``, ``context_score``). With the
    words for pregnancy, children or elders blanked out (the subject):

    - a subject of :data:`NAMING_CHARS` characters (:data:`NAMING_WORDS` words) or more that, read
      on its own, names another topic with confidence :data:`NAMED_CONFIDENCE` is a question of
      its own ("孩子挑食不爱吃青菜 追着喂都不吃 怎么办" after a stroke answer);
    - else it follows when no topic is more than :data:`FOLLOW_MARGIN` ahead of the topic in
      context;
    - else, when it named who it is for, it follows when the subject does not name another topic
      on its own and, read with the topic, puts none more than :data:`FOLLOW_MARGIN` ahead: the
      words for a population pull toward the topics about it (pregnancy diet, infant feeding),
      which "what if ur pregnant? just found out lol" does not ask about.

    Args:
        text: the normalized message (PII masked).
        context: the title of the topic in context; ``topic_id`` its id.

    Returns False when the encoder cannot serve (busy, past its deadline, no engine): the
    message is then answered from its own reading.
    """
    subject = " ".join(without_population(text).split())
    if not subject:  # nothing but who it is for: "孕妇呢" with more words around the cue
        return True
    naming = (len(subject.split()) >= NAMING_WORDS if subject.isascii()
              else len(subject.replace(" ", "")) >= NAMING_CHARS)
    near = follows_topic(best_score, context_score)
    try:
        if naming or not near:
            alone = (await retriever.search(subject)).matches[0]
            if alone.topic_id != topic_id and alone.confidence >= NAMED_CONFIDENCE:
                return False
        if near:
            return True
        if subject == " ".join(text.split()):
            return False
        found = await retriever.search(subject, context=context, context_topic=topic_id)
    except (BusyError, DeadlineExceeded, EngineError):
        return False
    return follows_topic(found.matches[0].score, found.context_score)


#: How many of its own nearest topics a message with a facet cue may put the topic in context
#: among and still follow it although it names a word that topic never uses (:func:`plan_follow_up`).
OWN_READING_TOP = 3


async def _near_on_its_own(retriever: Retriever, text: str, topic_id: str) -> bool:
    """Whether ``text`` read on its own has ``topic_id`` among its :data:`OWN_READING_TOP` nearest
    topics (False when the encoder cannot serve)."""
    try:
        found = await retriever.search(text)
    except (BusyError, DeadlineExceeded, EngineError):
        return False
    return topic_id in [m.topic_id for m in found.matches[:OWN_READING_TOP]]


async def plan_follow_up(text: str, last: Topic | None, retriever: Retriever) -> FollowUpPlan:
    """How to read ``text`` (normalized, personal data masked) given the topic answered last
    (``None``: none in the last 30 minutes).

    A message with a facet cue that names a subject the topic never mentions ("老人便秘怎么办"
    after insomnia: ``Retriever.new_subject``) is a question of its own, unless, read on its own,
    it still has that topic among its nearest (:data:`OWN_READING_TOP`): "孩子也鼻塞 小朋友能喝姜汤吗"
    after the ginger answer names "鼻塞", which that topic never says, and asks about ginger for
    children all the same; "吃了冰西瓜拉肚子了 怎么调理" after the walk-after-meals topic does not.
    Chosen on follow-up sets 1-5 and the standalone-question guard (evals/README.md).
    """
    strict = read_follow_up(text)
    if last is None:
        return FollowUpPlan(ask_back=strict is not None or is_bare_follow_up(text))
    if strict is not None:
        return FollowUpPlan(facet=strict)
    tied, loose = read_tied_follow_up(text), read_loose_follow_up(text)
    if (tied or loose) and (retriever.new_subject(without_cues(text), last.id, _rules().generic) is None
                            or await _near_on_its_own(retriever, text, last.id)):
        return FollowUpPlan(facet=tied) if tied else FollowUpPlan(loose=loose, with_context=True)
    return FollowUpPlan(with_context=is_follow_up(text))


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
                      for name in data["loose_order"] if name in POPULATION_FACETS))


def _length(text: str) -> int:
    """A message's length as the limits here count it: words for Latin script, else characters."""
    return len(text.split()) if text.isascii() else len(text)


def _remainder(text: str) -> tuple[str, bool]:
    """``text`` without its lead and tail words, and whether a lead word was there."""
    rules = _rules()
    lead = rules.leads.match(text)
    rest = text[lead.end():] if lead else text
    rest = rules.tails.sub("", rest).strip()
    return rest, bool(lead)


def read_follow_up(text: str) -> FollowUp | None:
    """The facet a short follow-up asks for, or ``None`` when ``text`` is not one.

    Args:
        text: the normalized message (Simplified Chinese, lowercase Latin).
    """
    text = text.strip().lower()
    if not text or _length(text) > (MAX_WORDS if text.isascii() else MAX_CHARS):
        return None
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


def read_loose_follow_up(text: str) -> FollowUp | None:
    """The facet a short message in a conversation asks for when a cue appears anywhere in it
    ("老人洗要注意啥 我外公快九十了" -> elders, "should i still hit the gym?" -> activity), or a
    request for more; ``None`` without a cue or for a long message. Whether it asks about the
    topic in context or names a subject of its own is for retrieval to say (bot/dispatcher.py).

    Args:
        text: the normalized message (Simplified Chinese, lowercase Latin).
    """
    text = text.strip().lower()
    if not text or _length(text) > (MAX_WORDS if text.isascii() else MAX_CHARS):
        return None
    found = read_follow_up(text) or read_named_facet(text)
    if found is not None:
        return found
    return FollowUp(None) if _rules().more_loose.search(text) else None


def read_tied_follow_up(text: str) -> FollowUp | None:
    """The population facet a message asks for when it names who it is for and ties itself to the
    answer just given ("我爸76了也这样 老年人要注意啥", "孕妇也脚肿 一样处理吗", "what about my dad, same
    thing?"; the rules' ``same`` words); ``None`` otherwise or past :data:`TIED_MAX_CHARS` characters
    (:data:`TIED_MAX_WORDS` words for Latin script). Whether it names a subject of its own is for
    retrieval to say (:func:`plan_follow_up`).

    Args:
        text: the normalized message (Simplified Chinese, lowercase Latin).
    """
    text = text.strip().lower()
    if not text or _length(text) > (TIED_MAX_WORDS if text.isascii() else TIED_MAX_CHARS):
        return None
    rules = _rules()
    cues = dict(rules.loose)
    return next((FollowUp(name) for name, tie in rules.same if cues[name].search(text) and tie.search(text)), None)


def read_named_facet(text: str) -> FollowUp | None:
    """The first facet (the rules' ``loose_order``) whose cue appears anywhere in ``text``
    (normalized), whatever its length; None without one. Also for a message that retrieval already
    puts on the topic just answered ("what about for kids? my son keeps licking his lips and now
    there's a red ring around his mouth"), so that its facet, not the same answer, goes out."""
    text = text.strip().lower()
    return next((FollowUp(name) for name, pattern in _rules().loose if pattern.search(text)), None)


def _blank(text: str, facets: frozenset[str] | None = None) -> str:
    """``text`` with the loose cues of ``facets`` (None: every facet) blanked out."""
    for name, pattern in _rules().loose:
        if facets is None or name in facets:
            text = pattern.sub(" ", text)
    return text


def without_cues(text: str) -> str:
    """``text`` with every facet and "more" cue blanked out: what is left names the subject, if any."""
    return _rules().more_loose.sub(" ", _blank(text))


def without_population(text: str) -> str:
    """``text`` with the cues of who it is for (pregnancy, children, elders) blanked out."""
    return _blank(text, POPULATION_FACETS)


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
        return _hinted(_see_doctor_reply(topic, lang), topic, lang, hint), True
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
    return f"{body}\n{_menu(topic, lang)}\n{_see_doctor_line(topic, lang)}", False


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
    return f"{head}\n{_menu(topic, lang)}\n{_see_doctor_line(topic, lang)}"


def ask_back_reply(lang: str) -> str:
    """A follow-up with no topic in context: ask what the user means."""
    if lang == "zh":
        return "您是接着问哪个问题呢？我这边没有看到前面的话题。请把问题完整说一下，比如「失眠怎么调理」「高血压饮食要注意什么」。"
    return ("Which question are you following up on? I don't have the earlier topic. Please ask in full, "
            "for example \u201chow can I sleep better?\u201d or \u201cwhat should I eat with high blood pressure?\u201d")


def _menu(topic: Topic, lang: str) -> str:
    """The facets ``topic`` has, worded as the user can ask for them (rules' ``menu``)."""
    menu = _rules().menu[lang]
    asks = [menu[f] for f in FACETS if f in topic.facets] + [menu[SEE_DOCTOR]]
    if lang == "zh":
        return "还可以接着问：" + "、".join(f"「{a}」" for a in asks) + "。"
    return "You can also ask: " + ", ".join(f"\u201c{a}\u201d" for a in asks)


def _hinted(body: str, topic: Topic, lang: str, hint: bool) -> str:
    if not hint:
        return body
    if lang == "zh":
        return f"{body}\n（以上接着「{topic.title['zh']}」回答；想问别的，请把问题说完整。）"
    return f"{body}\n(This follows on from \u201c{topic.title['en']}\u201d; for something else, please ask in full.)"


def _see_doctor_line(topic: Topic, lang: str) -> str:
    return f"【何时就医】{topic.see_doctor['zh']}" if lang == "zh" else f"When to see a doctor: {topic.see_doctor['en']}"


def _see_doctor_reply(topic: Topic, lang: str) -> str:
    names = topic.source_names(lang)
    if lang == "zh":
        return f"【{topic.title['zh']}·何时就医】{topic.see_doctor['zh']}\n【来源】{names}"
    return f"{topic.title['en']}, when to see a doctor: {topic.see_doctor['en']}\nSource: {names}"
