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

:func:`required_literals` is cheaper still: strings of which every match of a pattern contains
at least one ("胸口?(?:疼|痛)" → {"疼", "痛"}, "\\bchest pain" → {"chest pain"}), read from the
pattern's parse tree. A message that contains none of them cannot match. :class:`LiteralIndex`
finds, for a message, the entries of a table (all 161 red flags, about 1,150 strings) whose
strings it contains, by looking up the message's own characters and character pairs, instead
of a test per string.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

try:  # the parser behind re.compile (Python 3.11+); without it no pattern is indexed
    from re import _constants as _sre
    from re import _parser as _sre_parse
except ImportError:  # pragma: no cover - older or other Pythons
    _sre = _sre_parse = None

__all__ = ["LiteralIndex", "all_required_literals", "relax", "required_literals", "screen"]

MAX_REQUIRED = 64
"""Most strings :func:`required_literals` returns; more would cost about as much as a search."""

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


def _better(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    """The more selective requirement: the longer shortest string, then fewer strings."""
    if a is None or b is None:
        return a if b is None else b
    return a if (min(map(len, a)), -len(a)) >= (min(map(len, b)), -len(b)) else b


def _required(items: Sequence) -> frozenset[str] | None:
    """A requirement of a sequence of parsed items: runs of literals, or one item's requirement."""
    best: frozenset[str] | None = None
    run: list[str] = []
    for op, av in items:
        if op is _sre.LITERAL:
            run.append(chr(av))
            continue
        if run:
            best, run = _better(best, frozenset(["".join(run)])), []
        best = _better(best, _required_item(op, av))
    return _better(best, frozenset(["".join(run)])) if run else best


def _required_item(op, av) -> frozenset[str] | None:  # noqa: ANN001 - sre parse-tree items
    if op is _sre.IN:
        if all(kind is _sre.LITERAL for kind, _ in av):
            return frozenset(chr(c) for _, c in av)
        return None  # NEGATE, ranges, categories: too wide
    if op is _sre.BRANCH:
        union: set[str] = set()
        for alternative in av[1]:
            found = _required(alternative)
            if found is None:
                return None
            union |= found
        return frozenset(union)
    if op is _sre.SUBPATTERN:
        _group, add_flags, _del_flags, sub = av
        return None if add_flags & _sre.SRE_FLAG_IGNORECASE else _required(sub)
    if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", None)):
        low, _high, sub = av
        return _required(sub) if low >= 1 else None
    if op is getattr(_sre, "ATOMIC_GROUP", None):
        return _required(av)
    return None  # ANY, NOT_LITERAL, CATEGORY, assertions, group references: nothing required


def required_literals(pattern: re.Pattern[str]) -> frozenset[str] | None:
    """Strings of which every match of ``pattern`` contains at least one, or None when none can
    be named (the pattern may match without any particular text, it ignores case, or it cannot
    be parsed). At most :data:`MAX_REQUIRED` strings.

    Read from the parse tree of :mod:`re` itself: a run of literals requires itself, a class of
    literals any one of them, alternatives the union of theirs, a sequence the most selective of
    its parts' (the longest shortest string), a repeat at least once its body's; anything else
    requires nothing.
    """
    if _sre_parse is None or pattern.flags & re.IGNORECASE:
        return None
    try:
        found = _required(_sre_parse.parse(pattern.pattern, pattern.flags))
    except Exception:  # noqa: BLE001 - an internal parser we only read; no requirement then
        return None
    return found if found and "" not in found and len(found) <= MAX_REQUIRED else None


def all_required_literals(patterns: Iterable[re.Pattern[str]]) -> tuple[str, ...]:
    """For patterns that must all match: the most selective of their :func:`required_literals`
    (sorted), or ``()`` when none names any."""
    best: frozenset[str] | None = None
    for found in map(required_literals, patterns):
        best = _better(best, found)
    return tuple(sorted(best)) if best else ()


class LiteralIndex:
    """Which entries of a table a text contains a required string of.

    Args:
        entries: per entry, the strings of which a text must contain one for the entry to
            match (:func:`required_literals`); an empty entry is a candidate for every text.

    A string of one character is looked up by that character, a longer one by its first two
    (every string a text contains starts with one of the text's characters or pairs), and then
    checked with ``in``.
    """

    def __init__(self, entries: Iterable[Sequence[str]]) -> None:
        self._by_key: dict[str, list[tuple[int, str]]] = {}
        always: list[int] = []
        for i, words in enumerate(entries):
            if not words:
                always.append(i)
            for word in words:
                self._by_key.setdefault(word[:2], []).append((i, word))
        self._always = frozenset(always)

    def candidates(self, text: str) -> list[int]:
        """Indices of the entries ``text`` contains a string of (and the always-candidates), ascending."""
        by_key = self._by_key
        found = set(self._always)
        keys = set(text)
        keys.update(text[i:i + 2] for i in range(len(text) - 1))
        for key in keys:
            hits = by_key.get(key)
            if hits is not None:
                for i, word in hits:
                    if i not in found and (len(word) <= 2 or word in text):
                        found.add(i)
        return sorted(found)
