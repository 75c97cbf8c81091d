"""A cheap necessary condition for a regex that is searched clause by clause.

The red-flag rules (safety/triage.py) search every pattern in every clause of a message and
then judge each match in its context. Most patterns match nowhere in a given message, and
proving that clause by clause, with the Python loop around it, costs most of triage's time
(about 1 ms a message on 2 cores for 257 patterns).

:func:`screen` derives from a pattern a *relaxed* pattern: the same regex with its zero-width
assertions removed (anchors ``^`` ``$`` ``\\A`` ``\\Z``, word boundaries ``\\b`` ``\\B``, and
lookahead / lookbehind groups). Removing an assertion only ever lets more strings match, and a
clause is a substring of the message, so: if the relaxed pattern finds nothing in the whole
message, the original finds nothing in any clause. One ``search`` over the message then rules
a pattern out; only when it finds something is the exact clause-by-clause search run.
"""

from __future__ import annotations

import re

__all__ = ["relax", "screen"]

_ESCAPED_ASSERTIONS = ("\\b", "\\B", "\\A", "\\Z")


def _group_end(pattern: str, start: int) -> int:
    """The index just past the group opened at ``pattern[start] == "("``."""
    depth, i, in_class = 0, start, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "^":
                i += 1
            if pattern[i + 1:i + 2] == "]":  # "[]...]" and "[^]...]": a literal ] first
                i += 1
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced group at {start} in {pattern!r}")


def _unquantified(pattern: str, end: int) -> int:
    """``end``, after checking that no quantifier follows the assertion that ends there.

    Raises:
        ValueError: a quantified assertion: removing it would hand the quantifier to the atom
            before it ("a(?=b){2}" is not relaxed by "a{2}").
    """
    if pattern[end:end + 1] in ("*", "+", "?", "{"):
        raise ValueError(f"a quantified assertion at {end} in {pattern!r}")
    return end


def relax(pattern: str) -> str:
    """``pattern`` without its zero-width assertions (the module docstring); matches a superset.

    Raises:
        ValueError: unbalanced parentheses, or a quantified assertion.
    """
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            pair = pattern[i:i + 2]
            if in_class or pair not in _ESCAPED_ASSERTIONS:
                out.append(pair)
                i += 2
            else:
                i = _unquantified(pattern, i + 2)
            continue
        if in_class:
            out.append(c)
            in_class = c != "]"
            i += 1
            continue
        if c == "[":
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"
            out.append(pattern[i:j])
            in_class, i = True, j
            continue
        if c == "(" and pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            i = _unquantified(pattern, _group_end(pattern, i))
            continue
        if c in "^$":
            i = _unquantified(pattern, i + 1)
            continue
        out.append(c)
        i += 1
    return "".join(out)


def screen(pattern: re.Pattern[str]) -> re.Pattern[str] | None:
    """The relaxed pattern of ``pattern`` (same flags), or None when it cannot be built
    (then every clause must be searched)."""
    try:
        return re.compile(relax(pattern.pattern), pattern.flags)
    except (ValueError, re.error):
        return None
