"""Topic scope: does the chosen topic cover the population or named disease a question names?

The groups and their cues are data (bot/topic_scope.yaml). Which topics cover a group
is read off the knowledge base itself: a topic covers a group when its title or one of
its example questions names it (the authors wrote the answer with that group in mind).
Used by the decision policy (bot/decision.py): an answer goes out only when every group
the question names is covered by the topic; otherwise the bot says it cannot answer
reliably. Cost: about twenty regular-expression searches on a short text (microseconds).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from bot.knowledge import LANGS, KnowledgeBase
from safety.normalize import memoized, normalize

TABLE = Path(__file__).with_name("topic_scope.yaml")


@dataclass(frozen=True)
class Group:
    """A population, named disease, body site or idea: ``id``, ``kind`` ("population", "disease",
    "body_site" or "tcm_concept"), compiled ``cues``; ``topics`` covers it besides those that name it;
    a group with ``rules_out`` is covered by every topic but those (an idea that any topic may
    meet, but that a few topics whose words are close must not answer)."""

    id: str
    kind: str
    cues: re.Pattern
    topics: tuple[str, ...] = ()
    rules_out: tuple[str, ...] = ()


def load_groups(path: Path = TABLE) -> tuple[Group, ...]:
    """The groups of ``path``; raises ValueError (via re.error / KeyError) on a malformed table."""
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    return tuple(Group(g["id"], g["kind"], re.compile(g["cues"]), tuple(g.get("topics", ())),
                       tuple(g.get("rules_out", ()))) for g in data["groups"])


class TopicScope:
    """Which topics cover which groups, for one knowledge base."""

    def __init__(self, kb: KnowledgeBase, groups: tuple[Group, ...] | None = None):
        self.groups = groups if groups is not None else load_groups()
        self.covered: dict[str, frozenset[str]] = {}
        # each title and question normalized once, not once per group (OpenCC is slow: ~40 s on 2 cores)
        texts = {t.id: [normalize(q).text for lang in LANGS for q in (t.title[lang], *t.questions[lang])]
                 for t in kb.topics.values()}
        for g in self.groups:
            self.covered[g.id] = frozenset(texts).difference(g.rules_out) if g.rules_out else frozenset(
                g.topics) | frozenset(tid for tid, qs in texts.items() if any(g.cues.search(q) for q in qs))
        #: :meth:`named`, remembered for repeated texts (one group search each, every message)
        self._named = memoized(lambda text: tuple(g.id for g in self.groups if g.cues.search(text)))

    def named(self, text: str) -> list[str]:
        """Ids of the groups a normalized message names, in table order."""
        return list(self._named(text))

    def uncovered(self, text: str, topic_id: str) -> str | None:
        """The first group ``text`` names that ``topic_id`` does not cover, or None when the topic fits."""
        return next((g for g in self._named(text) if topic_id not in self.covered[g]), None)
