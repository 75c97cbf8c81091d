"""Splitting a reply into channel-sized messages: the one splitter of every adapter.

:func:`split_text` cuts a text into parts of at most ``limit`` units, counted by
the channel's measure (:func:`utf8_len` for WeChat's byte limits, :func:`utf16_len`
for Telegram's), on the same boundaries for every channel:

* a **sentence end** — 。！？!?；;… or a newline, or "." before whitespace — with
  the further ends and closing quotes or brackets (:data:`CLOSERS`, 】 among them)
  that follow it; parts are packed greedily, as many whole sentences as fit;
* a sentence longer than ``limit`` is cut after a comma, colon or space
  (:data:`SOFT_BREAKS`) in the second half of what fits, else between two
  characters, never leaving a zero-width joiner, variation selector or combining
  mark to start the next part.

What differs by channel is a parameter: ``line_breaks_first`` (Telegram) ends a
part after the last paragraph break, else line break, in the second half of what
fits, before looking for sentence ends (a Telegram message is cheap, so a message
ends where the text has a break); WeChat fills each page (the user asks for the
next one with "1").
"""

from __future__ import annotations

import unicodedata
from typing import Callable

__all__ = ["CLOSERS", "SENTENCE_ENDS", "SOFT_BREAKS", "split_text", "utf16_len", "utf8_len"]

SENTENCE_ENDS = frozenset("。！？!?；;…\n")
"""Characters that end a sentence (and "." before whitespace)."""
CLOSERS = frozenset("\"'”’」』）)】]》")
"""Closing quotes and brackets, kept with the sentence end before them."""
SOFT_BREAKS = frozenset("，,、：: \t")
"""Where an over-long sentence is cut, if one lies in the second half of what fits."""
_GLUE = frozenset("\u200d\ufe0e\ufe0f")  # never start a part with these (ZWJ, variation selectors)


def utf8_len(text: str) -> int:
    """Length of ``text`` in UTF-8 bytes, the unit of WeChat's limits."""
    return len(text.encode("utf-8"))


def utf16_len(text: str) -> int:
    """Length of ``text`` in UTF-16 code units, the unit of Telegram's limits and entity
    offsets (Bot API, MessageEntity: "Offset in UTF-16 code units"); characters outside
    the Basic Multilingual Plane (most emoji) count 2."""
    return len(text.encode("utf-16-le")) // 2


def _utf8_char(ch: str) -> int:
    o = ord(ch)
    return 1 if o < 0x80 else 2 if o < 0x800 else 3 if o < 0x10000 else 4


def _utf16_char(ch: str) -> int:
    return 2 if ord(ch) > 0xFFFF else 1


_CHAR_SIZE: dict[Callable[[str], int], Callable[[str], int]] = {utf8_len: _utf8_char, utf16_len: _utf16_char}


def _boundaries(text: str) -> list[int]:
    """Positions where a sentence ends in ``text``: after the end, the further ends and
    closers that follow it, and the whitespace after them; ``len(text)`` last."""
    out: list[int] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        end = ch in SENTENCE_ENDS or (ch == "." and i + 1 < n and text[i + 1].isspace())
        i += 1
        if end:
            while i < n and (text[i] in SENTENCE_ENDS or text[i] in CLOSERS):
                i += 1
            while i < n and text[i].isspace():
                i += 1
            out.append(i)
    if not out or out[-1] != n:
        out.append(n)
    return out


def _cut_long(sentence: str, fit: int) -> int:
    """Characters of the head of an over-long ``sentence`` whose first ``fit`` characters
    fit: up to a soft break in their second half, else ``fit`` moved back so that no
    joiner, variation selector or combining mark starts the rest (at least one)."""
    for i in range(fit - 1, fit // 2, -1):
        if sentence[i] in SOFT_BREAKS:
            return i + 1
    k = fit
    while k > 1 and (sentence[k] in _GLUE or unicodedata.combining(sentence[k]) or sentence[k - 1] == "\u200d"):
        k -= 1
    return k


def split_text(text: str, limit: int, *, size: Callable[[str], int] = utf8_len,
               line_breaks_first: bool = False) -> list[str]:
    """``text`` in consecutive parts of at most ``limit`` units each (see the module docstring).

    Args:
        text: any text.
        limit: the most units per part, at least one character's worth (a character
            larger than ``limit`` still makes a part of its own).
        size: the measure, :func:`utf8_len` (default) or :func:`utf16_len`.
        line_breaks_first: end a part at the last paragraph, else line, break in the
            second half of what fits, before sentence ends (Telegram).

    Returns:
        The parts in order, each stripped of surrounding whitespace and non-empty
        (``[]`` for a blank text); joined, they give the text back up to whitespace
        at the cuts.
    """
    text = text.strip()
    if not text:
        return []
    if size(text) <= limit:
        return [text]
    char_size = _CHAR_SIZE[size]
    sums = [0]  # sums[i]: size of text[:i]
    for ch in text:
        sums.append(sums[-1] + char_size(ch))
    last = [0] * (len(text) + 1)  # last[i]: length of text[:i].rstrip()
    for i, ch in enumerate(text, 1):
        last[i] = last[i - 1] if ch.isspace() else i
    ends = _boundaries(text)
    parts: list[str] = []
    start, b, n = 0, 0, len(text)

    def fits(a: int, z: int) -> bool:
        return sums[max(last[z], a)] - sums[a] <= limit

    while start < n:
        while ends[b] <= start:
            b += 1
        if line_breaks_first and not fits(start, n):
            while text[start].isspace():
                start += 1
            fit = start
            while fit < n and sums[fit + 1] - sums[start] <= limit:
                fit += 1
            window = text[start:max(fit, start + 1)]
            half = len(window) // 2
            at = window.rfind("\n\n", half)
            cut = at + 2 if at >= 0 else window.rfind("\n", half) + 1
            if cut > 0:
                parts.append(window[:cut].strip())
                start += cut
                while start < n and text[start].isspace():
                    start += 1
                continue
        best = None
        k = b
        while k < len(ends) and fits(start, ends[k]):
            best = ends[k]
            k += 1
        if best is not None:  # as many whole sentences as fit
            parts.append(text[start:best].strip())
            start = best
            continue
        lead = start
        while text[lead].isspace():
            lead += 1
        sentence = text[lead:last[ends[b]]]
        if sums[lead + len(sentence)] - sums[lead] <= limit:  # fits without the whitespace before it
            parts.append(sentence)
            start = ends[b]
            continue
        fit = 0
        while sums[lead + fit + 1] - sums[lead] <= limit:
            fit += 1
        head = _cut_long(sentence, max(fit, 1))
        parts.append(sentence[:head].strip())
        start = lead + head
    return [p for p in parts if p]
