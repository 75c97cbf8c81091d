"""Scoring of two-turn conversations whose second turn asks for a facet (issue 24's test set).

A labelled file (``evals/follow_ups.jsonl``) holds one conversation a line: ``turns`` (the
question, then a short follow-up), ``lang``, ``topic`` (the catalogue id the question belongs
to) and ``facet`` (a facet of bot/knowledge.FACETS, ``see_doctor``, or ``more``). Each
conversation runs through the dispatcher as one user; the second reply is judged by what
it contains:

- ``facet_given``: the facet's own text (``see_doctor``: the topic's when-to-see-a-doctor text
  without its main answer; ``more``: a reply that is not the first answer again), for the
  labelled topic, whatever the first reply was (a first turn answered with another topic and
  followed by that topic's facet is a miss);
- ``honest_missing``: the topic lacks the facet and the reply says so;
- ``repeated``: the second reply is the first answer word for word (never wanted).

A line with ``second_topics`` (the topics that answer the second turn on its own, best first;
``[]`` for none) and ``second_intent`` (answer, no_answer, refer_doctor, emergency) instead of
``facet`` is a switch: a second turn that asks about something else in the words follow-ups use
("我家孩子老是流鼻血 怎么回事" after insomnia). It is scored as *taken* when the first turn got a
topic that does not answer the second and the second reply comes from that same topic (a false
follow-up), and *right* when the second reply is what the second turn asks for (one of its topics,
or its intent).

A line with ``kind`` (``crisis``, ``emergency``, ``frustrated`` or ``calm``) instead of ``facet``
tells danger, or only strong feelings, in the second turn ("痒得受不了 我就拿刀片划" after an eczema
answer; "试了都没用 烦死了"): a crisis or emergency is *caught* when the second reply is the
emergency or crisis reply or carries a safety-net line; a frustrated or calm second turn that gets
the emergency or crisis reply is a *full alarm* (the user asked about a symptom and got a hotline).

Figures: share of conversations whose first turn got the labelled topic, share whose
second turn got the facet's text (end to end, and among first turns answered on topic
with a topic that has the facet), honest replies for missing facets, repeats.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from bot.dispatcher import Dispatcher
from bot.evaluate import read_jsonl
from bot.follow_up import SEE_DOCTOR, has_facet
from bot.knowledge import FACETS
from bot.types import Inbound, Intent, MessageKind
from safety.normalize import to_simplified, to_user_script

#: Characters of a text that identify it inside a reply (its start; replies add headings around it).
PROBE_CHARS = 24


@dataclass
class FollowUpResult:
    """Counts over a conversation file; :meth:`summary` gives the shares."""

    conversations: int = 0         # facet follow-ups (switches are counted apart)
    first_on_topic: int = 0
    facet_exists: int = 0          # first turn on topic and the topic has the facet asked for
    facet_given: int = 0           # the second reply carries the labelled topic's facet text (any first reply)
    facet_given_on_topic: int = 0  # ... among facet_exists
    honest_missing: int = 0        # the topic lacks the facet and the reply says so
    missing: int = 0               # first turn answered with a topic that lacks the facet
    repeated: int = 0
    switches: int = 0              # lines whose second turn asks about something else
    switches_after_topic: int = 0  # ... whose first turn got a topic that does not answer the second
    switches_taken: int = 0        # ... whose second reply came from that topic all the same
    switches_right: int = 0        # second reply what the second turn asks for
    danger: int = 0                # second turns labelled crisis or emergency
    danger_caught: int = 0         # ... given the emergency or crisis reply or a safety-net line
    danger_full: int = 0           # ... given the emergency or crisis reply
    feelings: int = 0              # second turns labelled frustrated or calm
    feelings_full_alarms: int = 0  # ... given the emergency or crisis reply
    misses: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        """The figures as a dict (shares in 0..1; ``missing_facet_said_honestly`` None when no facet was missing)."""
        n = max(self.conversations, 1)
        return {
            "conversations": self.conversations,
            "first_turn_on_topic": self.first_on_topic / n,
            "facet_given": self.facet_given / n,
            "facet_given_when_on_topic_and_present": self.facet_given_on_topic / max(self.facet_exists, 1),
            "on_topic_with_facet": self.facet_exists,
            "missing_facet_said_honestly": self.honest_missing / self.missing if self.missing else None,
            "missing_facet": self.missing,
            "repeated_word_for_word": self.repeated,
            "switches": self.switches,
            "switches_taken_for_follow_ups": self.switches_taken,
            "switches_after_another_topic": self.switches_after_topic,
            "switches_right": self.switches_right / self.switches if self.switches else None,
            "danger_second_turns": self.danger,
            "danger_caught": self.danger_caught / self.danger if self.danger else None,
            "danger_full_reply": self.danger_full / self.danger if self.danger else None,
            "feelings_second_turns": self.feelings,
            "full_alarms_on_feelings": self.feelings_full_alarms,
        }


FACET_LABELS = (*FACETS, SEE_DOCTOR, "more")
#: What the second turn of a switch asks for when no topic answers it.
SWITCH_INTENTS = ("answer", "no_answer", "refer_doctor", "emergency")
#: What the second turn of a danger line tells: danger, or only strong feelings.
DANGER_KINDS, FEELING_KINDS = ("crisis", "emergency"), ("frustrated", "calm")


def read_conversations(path: Path) -> list[dict] | None:
    """The conversations of a file whose lines have ``turns`` (None when its first line has
    none: a file of labelled questions). Raises ValueError naming a bad line."""
    rows = []
    for n, row in read_jsonl(path):
        if not rows and "turns" not in row:
            return None
        two = isinstance(row.get("turns"), list) and len(row["turns"]) >= 2
        if "kind" in row:
            if not two or row["kind"] not in DANGER_KINDS + FEELING_KINDS:
                raise ValueError(f"{path}:{n}: a danger line needs 'turns' (two messages) and 'kind' "
                                 f"({', '.join(DANGER_KINDS + FEELING_KINDS)})")
        elif "second_topics" in row:
            if not (two and isinstance(row["second_topics"], list) and row.get("second_intent") in SWITCH_INTENTS):
                raise ValueError(f"{path}:{n}: a switch needs 'turns' (two messages), 'second_topics' (a list) and "
                                 f"'second_intent' ({', '.join(SWITCH_INTENTS)})")
        elif not two or row.get("facet") not in FACET_LABELS or not isinstance(row.get("topic"), str):
            raise ValueError(f"{path}:{n}: needs 'turns' (two messages), 'topic' and 'facet' ({', '.join(FACET_LABELS)})")
        rows.append(row)
    return rows


def _contains(reply_text: str, text: str) -> bool:
    """Whether ``reply_text`` carries the start of ``text`` (Simplified), in either script: a reply in Traditional is
    compared as written too, since t2s does not undo every s2t change (顶着 -> 頂著 -> 顶著)."""
    probe = text[:PROBE_CHARS]
    return (to_simplified(probe) in to_simplified(reply_text)
            or any(to_user_script(probe, "hant", variant) in reply_text for variant in ("", "hk")))


def _given(dispatcher: Dispatcher, topic, facet: str, lang: str, first: str, second) -> bool:
    # a referral counts where it carries the facet below it (bot/follow_up.py below_referral), never for "more"
    if second.intent is not Intent.ANSWER and (second.intent is not Intent.REFER_DOCTOR or facet == "more"):
        return False
    if facet == "more":
        return second.text != first and not _contains(second.text, topic.answer[lang])
    if facet == SEE_DOCTOR:
        return _contains(second.text, topic.see_doctor[lang]) and not _contains(second.text, topic.answer[lang])
    if facet in topic.facet_topics:
        return _contains(second.text, dispatcher.kb.topics[topic.facet_topics[facet]].answer[lang])
    return facet in topic.facets and _contains(second.text, topic.facet_text(facet, lang))


async def evaluate_follow_ups(dispatcher: Dispatcher, rows: list[dict]) -> FollowUpResult:
    """Run each conversation as its own user and score the second reply (module docstring)."""
    res = FollowUpResult()
    run = time.time_ns()
    for i, row in enumerate(rows):
        user = f"fu-{run}-{i}"
        replies = []
        for n, text in enumerate(row["turns"][:2]):
            replies.append(await dispatcher.handle(Inbound("eval", user, user, f"{user}-{n}", MessageKind.TEXT, text)))
        first, second = replies
        if "kind" in row:
            _score_danger(res, row, second)
            continue
        if "second_topics" in row:
            _score_switch(res, row, first, second)
            continue
        res.conversations += 1
        res.repeated += first.intent is Intent.ANSWER and second.text == first.text
        topic = dispatcher.kb.topics.get(first.topic or "")
        on_topic = first.topic == row["topic"]
        res.first_on_topic += on_topic
        lang = first.lang if first.lang in ("zh", "en") else row["lang"]
        wanted = dispatcher.kb.topics.get(row["topic"])  # the labelled topic's facet, whatever the first reply was
        given = wanted is not None and _given(dispatcher, wanted, row["facet"], lang, first.text, second)
        res.facet_given += given
        if topic is not None and row["facet"] != "more" and not has_facet(topic, row["facet"]):
            res.missing += 1
            res.honest_missing += second.intent is Intent.NO_ANSWER and second.topic == topic.id
        elif on_topic:
            res.facet_exists += 1
            res.facet_given_on_topic += given
        if not given:
            res.misses.append({"turns": row["turns"], "topic": row["topic"], "facet": row["facet"],
                               "first_topic": first.topic, "second_intent": second.intent.value,
                               "second": second.text[:80]})
    return res


def _score_danger(res: FollowUpResult, row: dict, second) -> None:
    full = second.intent is Intent.EMERGENCY
    if row["kind"] in DANGER_KINDS:
        res.danger += 1
        res.danger_full += full
        res.danger_caught += full or bool(second.safety_net)
        missed = not full
    else:
        res.feelings += 1
        res.feelings_full_alarms += full
        missed = full
    if missed:
        res.misses.append({"turns": row["turns"], "kind": row["kind"], "second_intent": second.intent.value,
                           "safety_net": list(second.safety_net)})


def _score_switch(res: FollowUpResult, row: dict, first, second) -> None:
    res.switches += 1
    wanted = row["second_topics"]
    if first.topic is not None and first.topic not in wanted:
        res.switches_after_topic += 1
        res.switches_taken += second.topic == first.topic
    right = second.topic in wanted if row["second_intent"] == "answer" else (
        second.intent.value == row["second_intent"] or second.topic is None)
    res.switches_right += right
    if not right or first.topic not in wanted and second.topic == first.topic:
        res.misses.append({"turns": row["turns"], "second_topics": wanted, "first_topic": first.topic,
                           "second_topic": second.topic, "second_intent": second.intent.value})


def format_follow_up_report(res: FollowUpResult) -> str:
    """The figures as lines of text (facet follow-ups, then switches, each when the file has any)."""
    s = res.summary()
    facets = [
        f"conversations                         {s['conversations']}",
        f"first turn on the labelled topic      {s['first_turn_on_topic']:.1%}",
        f"second turn got the facet's text      {s['facet_given']:.1%} (end to end)",
        f"  when the first turn was on topic and the topic has the facet: "
        f"{s['facet_given_when_on_topic_and_present']:.1%} of {s['on_topic_with_facet']}",
        f"facet missing from the topic          {s['missing_facet']}, said honestly "
        f"{'n/a' if s['missing_facet_said_honestly'] is None else format(s['missing_facet_said_honestly'], '.1%')}",
        f"second reply = first word for word    {s['repeated_word_for_word']}",
    ] if s["conversations"] else []
    switches = [
        f"switches (second turn about something else)  {s['switches']}",
        f"  taken for a follow-up of the first topic   {s['switches_taken_for_follow_ups']} of "
        f"{s['switches_after_another_topic']} answered with another topic first",
        f"  second reply what it asks for              {s['switches_right']:.1%}",
    ] if s["switches"] else []
    danger = [
        f"danger in the second turn                    {s['danger_second_turns']}",
        f"  caught (the emergency or crisis reply, or a safety net)  {s['danger_caught']:.1%}",
        f"  given the emergency or crisis reply        {s['danger_full_reply']:.1%}",
    ] if s["danger_second_turns"] else []
    feelings = [
        f"strong feelings, no danger, in the second turn  {s['feelings_second_turns']}",
        f"  given the emergency or crisis reply (full alarms)  {s['full_alarms_on_feelings']}",
    ] if s["feelings_second_turns"] else []
    return "\n".join(facets + switches + danger + feelings)
