"""safety/regex_screen.py: a relaxed pattern, or a required string, never misses what the exact
pattern finds in a clause."""

from __future__ import annotations

import re

import pytest

from safety import triage
from safety.clause_context import mandarin_view, split_clauses
from safety.regex_screen import LiteralIndex, relax, required_literals, screen


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
                view = mandarin_view(triage.normalize(text).text)
                if any(pattern.search(c) for c in split_clauses(view)):
                    assert relaxed.search(view), (flag.name, pattern.pattern, text)
                    checked += 1
    assert checked > 200


@pytest.mark.parametrize("pattern, words", [
    (r"胸口?(?:疼|痛)", {"胸"}),  # re merges 胸口|胸 into 胸 then an optional 口
    (r"\bchest pain\b", {"chest pain"}),  # the longest run of literals wins
    (r"(?:ab|cd)+x?", {"ab", "cd"}),  # alternatives: the union; a repeat of at least one: its body's
    (r"[疼痛]得厉害", {"得厉害"}),
    (r"(?=x)y", {"y"}),  # a lookahead requires nothing of its own
    (r"a?b*", None), (r"[^a]+", None), (r"(?i)abc", None), (r"(?:x|)", None), (r"\d{2}", None),
])
def test_required_literals(pattern, words):
    found = required_literals(re.compile(pattern))
    assert (None if found is None else set(found)) == words


def test_literal_index_finds_entries_by_their_strings():
    index = LiteralIndex([("胸",), ("chest pain", "heart attack"), (), ("出冷汗",)])
    assert index.candidates("胸口疼") == [0, 2]
    assert index.candidates("crushing chest pain") == [1, 2]
    assert index.candidates("chest hurts") == [2]  # "ch" is there, "chest pain" is not
    assert index.candidates("一直出冷汗，胸闷") == [0, 2, 3]


def test_the_literal_index_rules_out_only_flags_that_cannot_match():
    """Every red flag's literals appear in every text where the flag's patterns match a clause."""
    examples = [f.example for f in triage.RED_FLAGS if f.example]
    for text in examples:
        view = mandarin_view(triage.normalize(text).text)
        candidates = set(triage._LITERALS.candidates(view))
        for i, (flag, patterns, _nb, _unless) in enumerate(triage._COMPILED):
            if all(any(p.search(c) for c in split_clauses(view)) for p in patterns):
                assert i in candidates, (flag.name, text)


def test_the_literal_index_keeps_every_scope_rule_that_matches_its_example():
    from safety import scope
    for i, (rule, pattern, _unless, also) in enumerate(scope._COMPILED):
        view = scope.without_non_drug(scope.normalize(rule.example).text)
        if pattern.search(view) and (also is None or also.search(view)):
            assert i in scope._LITERALS.candidates(view), rule.name
