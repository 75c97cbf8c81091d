"""safety/regex_screen.py: a relaxed pattern never misses what the exact one finds in a clause."""

from __future__ import annotations

import re

import pytest

from safety import triage
from safety.regex_screen import relax, screen


@pytest.mark.parametrize("pattern, relaxed", [
    (r"\bchest (?:pain|tight)(?! ago)", r"chest (?:pain|tight)"),
    (r"(?<!不)疼[^，。]{0,3}$", r"疼[^，。]{0,3}"),
    (r"^(?:a|b)\b", r"(?:a|b)"),
    (r"[\]^$]x(?=y(?:z))", r"[\]^$]x"),  # ^ and $ inside a class are characters
    (r"[^)(]a(?<=\()b", r"[^)(]ab"),  # parentheses in a class do not open groups
    (r"\\bx", r"\\bx"),  # an escaped backslash then b is not a word boundary
])
def test_relax_removes_only_zero_width_assertions(pattern, relaxed):
    assert relax(pattern) == relaxed


@pytest.mark.parametrize("pattern", [r"a(?=b){2}", r"a\b?", r"x^*", r"(?<!x", r"a(?=b)?"])
def test_a_pattern_that_cannot_be_relaxed_is_searched_exactly(pattern):
    with pytest.raises(ValueError):
        relax(pattern)


def test_screen_is_none_when_no_relaxation_exists():
    assert screen(re.compile(r"a(?=b){2}")) is None
    assert screen(re.compile(r"a(?=b)c")).pattern == "ac"


def test_every_red_flag_screen_finds_what_its_pattern_finds_in_a_clause():
    examples = [f.example for f in triage.RED_FLAGS if f.example]
    assert len(examples) > 100
    checked = 0
    for flag, patterns, _nb, _unless in triage._COMPILED:
        for pattern in patterns:
            relaxed = screen(pattern)
            if relaxed is None:
                continue
            for text in examples:
                view = triage.normalize(text).text.translate(triage._CANTONESE)
                if any(pattern.search(c) for c in triage._clauses(view)):
                    assert relaxed.search(view), (flag.name, pattern.pattern, text)
                    checked += 1
    assert checked > 200
