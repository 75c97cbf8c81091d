"""Safety-net lines: the warning signs that fit a message and when to call for help.

When the decision head (bot/decision.py) sees some chance of danger but not enough for
the full emergency reply, the reply still goes out with one line naming the specific
warning signs and the emergency number (clinicians' safety-netting; NICE NG143 uses the
same idea for feverish children). The families, their cues and wording are data:
safety/safety_net.yaml, each with its source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

TABLE = Path(__file__).with_name("safety_net.yaml")
#: At most this many families' lines in one reply.
MAX_FAMILIES = 2


@dataclass(frozen=True)
class Family:
    """One family of warning signs: ``id``, compiled ``cues``, the line per language, and the ids of
    the families whose cues, where they match, keep this one out (``not_with``)."""

    id: str
    cues: re.Pattern
    text: dict[str, str]
    not_with: tuple[str, ...] = ()


def _load() -> tuple[tuple[Family, ...], dict[str, dict[str, str]]]:
    data = yaml.load(TABLE.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    families = tuple(Family(f["id"], re.compile(f["cues"]), {"zh": f["zh"], "en": f["en"]}, tuple(f.get("not_with", ())))
                     for f in data["families"])
    ids = {f.id for f in families}
    for f in families:
        if not ids.issuperset(f.not_with):
            raise ValueError(f"{TABLE}: family {f.id}: not_with names no family: {sorted(set(f.not_with) - ids)}")
    return families, data["after_danger"]


FAMILIES, _AFTER_DANGER = _load()
_BY_ID = {f.id: f for f in FAMILIES}


def safety_net(text: str, lang: str, kind: str, number: str, crisis_line: str) -> tuple[tuple[str, ...], str]:
    """The families and the line(s) to add for a message with uncertain danger.

    Args:
        text: the normalized message (Simplified Chinese, lowercase Latin).
        lang: ``"zh"`` or ``"en"``: the language of the line.
        kind: ``"crisis"`` (self-harm is the likelier danger) or ``"emergency"``.
        number: the emergency number for ``lang`` (120; "112 / 911").
        crisis_line: the crisis line for ``lang`` (12356; 988).

    Returns:
        (family ids, the line text joined by newlines): ``crisis`` alone for a crisis;
        else the first :data:`MAX_FAMILIES` families whose cues match and whose ``not_with`` families'
        cues do not, or ``general``.

    Raises:
        KeyError: ``{number}`` or ``{crisis_line}`` aside, a placeholder the table's line does not fill.
    """
    if kind == "crisis":
        chosen = [_BY_ID["crisis"]]
    else:
        cued = {f.id for f in FAMILIES if f.cues.search(text)}
        chosen = [f for f in FAMILIES if f.id in cued and cued.isdisjoint(f.not_with)][:MAX_FAMILIES] or [_BY_ID["general"]]
    lines = [f.text["zh" if lang == "zh" else "en"].format(number=number, crisis_line=crisis_line) for f in chosen]
    return tuple(f.id for f in chosen), "\n".join(lines)


def after_danger_line(kind: str, lang: str, number: str, crisis_line: str) -> str:
    """The line a thanks or a goodbye gets soon after an emergency (``kind`` ``"emergency"``) or a crisis
    (``"crisis"``) reply: what to do if the danger is still there (safety/safety_net.yaml ``after_danger``).

    Raises:
        KeyError: ``kind`` is neither.
    """
    return _AFTER_DANGER[kind]["zh" if lang == "zh" else "en"].format(number=number, crisis_line=crisis_line)
