"""Whether a message tells the danger its red flag names as over: a safety net, not "call 120 now".

"前几天胸口闷了一下 现在好了", "passed out once last week, fine since", "刚才流鼻血流了好多 现在已经止住了":
a red flag matches, but the episode has ended, and for these dangers the guidance is "see a doctor,
call if it comes back" (NHS "Chest pain", "Fainting", "Choking", "Nosebleed"). Such a message is
still caught: the decision layer replies with the safety-net line (the warning signs and when to
call 120), not the full emergency reply. The table and the sources are safety/red_flags/settled.yaml;
where the guidance is emergency care whatever the person feels now (a TIA, anaphylaxis, an overdose,
a swallowed battery, a fit, a head injury, pregnancy, a baby) the full reply stands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from safety.clause_context import mandarin_view
from safety.normalize import memoized
from safety.red_flag_rules import rule_regex

__all__ = ["SETTLED_TABLE", "SettledRules", "load_settled", "settled"]

SETTLED_TABLE = Path(__file__).with_name("red_flags") / "settled.yaml"
_KEYS = {"cues", "rearm", "never", "categories"}
_CATEGORY_KEYS = {"about", "not_with"}


@dataclass(frozen=True)
class SettledRules:
    """safety/red_flags/settled.yaml, compiled: ``categories`` maps a red-flag category to its
    (``about``, ``not_with``) patterns (``not_with`` None when the category has none)."""

    cues: re.Pattern[str]
    rearm: re.Pattern[str]
    never: re.Pattern[str]
    categories: dict[str, tuple[re.Pattern[str], re.Pattern[str] | None]]


def _regex(spec: str | dict) -> re.Pattern[str]:
    """A pattern of the table, read as the red-flag rules read theirs (``any_of`` lists, ``{G4}`` gaps)."""
    return re.compile(rule_regex(spec))


def load_settled(path: Path = SETTLED_TABLE) -> SettledRules:
    """The rules of ``path``.

    Raises:
        ValueError: an unknown or missing key (top level or in a category).
    """
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    if set(data) != _KEYS:
        raise ValueError(f"{path}: keys must be {sorted(_KEYS)}, got {sorted(data)}")
    categories = {}
    for name, entry in data["categories"].items():
        if "about" not in entry or set(entry) - _CATEGORY_KEYS:
            raise ValueError(f"{path}: category {name}: keys must be 'about' and optionally 'not_with'")
        categories[name] = (_regex(entry["about"]), _regex(entry["not_with"]) if entry.get("not_with") else None)
    return SettledRules(_regex(data["cues"]), _regex(data["rearm"]), _regex(data["never"]), categories)


RULES = load_settled()


@memoized
def settled(text: str, categories: tuple[str, ...] = ()) -> str:
    """The words saying the danger is over ("现在好了", "fine since"), or "" when the full reply stands.

    Args:
        text: the normalized message (:func:`safety.normalize.normalize`), read as the red-flag rules
            read it (with Cantonese in Mandarin: :func:`~safety.clause_context.mandarin_view`).
        categories: the red-flag categories that matched (``"heart_attack"``, ...); empty when the
            decision head raised the alarm alone: then the categories whose ``about`` the message
            matches are checked.

    "" whenever a category may not settle, the message tells something of ``never``, a category's
    ``not_with`` matches, or something after the cue brings the danger back.
    """
    view = mandarin_view(text)
    cue = RULES.cues.search(view)
    if cue is None or RULES.rearm.search(view, cue.end()) or RULES.never.search(view):
        return ""
    if any(c not in RULES.categories for c in categories):
        return ""
    checked = ([RULES.categories[c] for c in categories] if categories
               else [pair for pair in RULES.categories.values() if pair[0].search(view)])
    if any(not_with is not None and not_with.search(view) for _about, not_with in checked):
        return ""
    return cue.group()
