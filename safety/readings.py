"""Blood-pressure readings told in a message, and whether they all lie in the range that is not by
itself a reason for the full emergency reply (safety/readings.yaml: the table, the guidelines it
follows and why the decision layer asks).

"血压有点高 高压145 低压95 医生说先观察" -> ``"145/95"``; "血压200 头疼" -> ``""`` (severe: the head and
the red-flag rules decide as before); "血压80/50 头晕" -> ``""`` (below 90: possible shock).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from safety.normalize import memoized

__all__ = ["Reading", "TABLE", "moderate_bp", "readings"]

TABLE = Path(__file__).with_name("readings.yaml")
_DATA = yaml.load(TABLE.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
_NUMBER = _DATA["number"]


def _compile(key: str) -> re.Pattern[str]:
    return re.compile(_DATA[key].replace("{number}", _NUMBER))


_PAIR, _SYSTOLIC, _DIASTOLIC, _SINGLE = (_compile(k) for k in ("pair", "systolic", "diastolic", "single"))
_CONTEXT, _NOT_WITH = re.compile(_DATA["context"]), re.compile(_DATA["not_with"])
_SEVERE_SYS, _SEVERE_DIA = _DATA["severe"]["systolic"], _DATA["severe"]["diastolic"]
_MODERATE_MIN = _DATA["moderate"]["systolic_min"]
_SHAPE = _DATA["pair_shape"]
#: Plausible values (mmHg) of a systolic or diastolic told alone; others are years, ages, counts.
_PLAUSIBLE_SYS, _PLAUSIBLE_DIA = (60, 300), (30, 200)
_DIGITS = {c: i for i, c in enumerate("零一二三四五六七八九")} | {"两": 2}


def chinese_number(text: str) -> int:
    """An integer from Arabic digits or the Chinese numerals of readings (10-299): "一百五" 150,
    "一百五十五" 155, "一百零五" 105, "九十五" 95, "两百" 200.

    Raises:
        ValueError: not such a number.
    """
    if text.isdigit():
        return int(text)
    hundreds, _, rest = text.partition("百") if "百" in text else ("", "", text)
    value = (_DIGITS[hundreds] if hundreds else 1) * 100 if "百" in text else 0
    rest = rest.lstrip("零")
    if not rest:
        return value
    if "十" in rest:
        tens, _, units = rest.partition("十")
        return value + (_DIGITS[tens] if tens else 1) * 10 + (_DIGITS[units] if units else 0)
    if len(rest) == 1 and value and not text.count("零"):  # "一百五": the tens, said short
        return value + _DIGITS[rest] * 10
    return value + _DIGITS[rest]


@dataclass(frozen=True)
class Reading:
    """One reading, in mmHg; a part the message does not tell is None."""

    systolic: int | None
    diastolic: int | None

    def __str__(self) -> str:
        return f"{self.systolic or '?'}/{self.diastolic or '?'}"


def _plausible(value: int, bounds: tuple[int, int]) -> bool:
    return bounds[0] <= value <= bounds[1]


def readings(text: str) -> tuple[Reading, ...]:
    """The blood-pressure readings a normalized message tells (safety/readings.yaml), in order of the
    patterns: pairs, then a systolic or diastolic named alone, then a number after "血压" / "bp".
    Not memoized: its one caller on the message path, :func:`moderate_bp`, is."""
    found: list[Reading] = []
    context = _CONTEXT.search(text) is not None
    for m in _PAIR.finditer(text):
        s, d = chinese_number(m.group(1)), chinese_number(m.group(2))
        shape = (_plausible(s, _SHAPE["systolic"]) and _plausible(d, _SHAPE["diastolic"])
                 and _SHAPE["gap"][0] <= s - d <= _SHAPE["gap"][1])
        if (context and s > d and _plausible(s, _PLAUSIBLE_SYS) and _plausible(d, _PLAUSIBLE_DIA)) or shape:
            found.append(Reading(s, d))
    named = [Reading(chinese_number(m.group(1)), None) for m in _SYSTOLIC.finditer(text)]
    named += [Reading(None, chinese_number(m.group(1))) for m in _DIASTOLIC.finditer(text)]
    found += [r for r in named if _plausible(r.systolic or r.diastolic, _PLAUSIBLE_SYS if r.systolic else _PLAUSIBLE_DIA)]
    if not found:
        found += [Reading(v, None) for v in (chinese_number(m.group(1)) for m in _SINGLE.finditer(text))
                  if _plausible(v, _PLAUSIBLE_SYS)]
    return tuple(found)


@memoized
def moderate_bp(text: str) -> str:
    """The readings ("145/95", "165/?") when a normalized message tells at least one blood-pressure
    reading and every one lies in the moderate range (systolic 90-179, diastolic below 120 mmHg: not by
    itself a reason to call 120), in a message not about pregnancy, a birth or a young child (``not_with``);
    "" otherwise."""
    found = readings(text)
    if not found or _NOT_WITH.search(text):
        return ""
    for r in found:
        if r.systolic is not None and not _MODERATE_MIN <= r.systolic < _SEVERE_SYS:
            return ""
        if r.diastolic is not None and r.diastolic >= _SEVERE_DIA:
            return ""
    return " ".join(map(str, found))
