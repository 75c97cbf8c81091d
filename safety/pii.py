"""Mask personal data in text before it is logged or stored (ARCHITECTURE.md,
"Operations": logs with personal data masked; sessions in the Store).

Masked, in this order (longest first, so an ID number is never half-masked as a
phone number):

* mainland resident ID numbers: 18 characters, 17 digits plus a digit or X check
  character (GB 11643-1999) → ``[ID]``;
* e-mail addresses → ``[EMAIL]``;
* mainland mobile numbers: 11 digits ``1[3-9]XXXXXXXXX`` (MIIT numbering plan),
  optionally with +86/0086 and spaces or dashes (``138 1234 5678``) → ``[PHONE]``;
* obvious street addresses: a Chinese road/street name with a house number
  (…路…号, …街…号, …大道…号, …巷…号, …弄…号, with building/unit/room parts),
  a residential compound with a building (…小区5栋302, …花园3号楼2单元501室),
  building/unit/room numbers on their own (5栋302, 3单元502室) and English
  "12 Baker Street" forms → ``[ADDRESS]``.

The patterns are matched on a *folded* copy of the text (:func:`fold`), one
character for one character, and the matching spans are replaced in the original:
full-width forms (``１３６…``, ``＠``, ``Ｘ``, the ideographic space) count as their
ASCII forms, and Chinese numerals written digit by digit (``一三八…``, ``〇``/``零``,
``幺``, 壹贰叁…) as digits — so a phone or ID number typed in any of these is
masked, while the rest of the text keeps its own characters.

Masking is deliberately simple: it is a safety net for logs, not a guarantee;
nothing here is reversible.
"""

from __future__ import annotations

import functools
import hashlib
import re

from safety.normalize import memoized

__all__ = ["mask_pii", "mask_bot_text", "fold", "PII_PATTERNS"]

#: Characters folded for matching, each to one ASCII character (same length, so spans align).
_FOLD: dict[int, int] = {cp: cp - 0xFEE0 for cp in range(0xFF01, 0xFF5F)}  # full-width ASCII variants
_FOLD[0x3000] = 0x20  # ideographic space
_FOLD.update({ord(c): ord(str(d)) for d, chars in enumerate(
    ("〇零０", "一幺壹", "二贰", "三叁", "四肆", "五伍", "六陆", "七柒", "八捌", "九玖")) for c in chars})
_FOLD.update({ord(c): ord("-") for c in "－—–‐‑"})  # dashes between digit groups

_UNIT = r"(?:号楼|栋|幢|座|单元|层|楼|室|号|户)"
_BUILDING = r"(?:号楼|栋|幢|座|号院)"
_COMPOUND = r"(?:小区|花园|家园|公寓|新村|社区|大厦|苑|村|园|府|庭|城|湾|院|里)"

PII_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("[ID]", re.compile(r"(?<![0-9A-Za-z])\d{17}[\dXx](?![0-9A-Za-z])")),
    ("[EMAIL]", re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")),
    ("[PHONE]", re.compile(r"(?<![0-9])(?:(?:\+|00)86[\s-]?)?1[3-9]\d(?:[\s-]?\d{4}){2}(?![0-9])")),
    ("[ADDRESS]", re.compile(
        r"[\u4e00-\u9fff]{1,6}(?:路|街|大街|大道|巷|胡同|弄)\s*\d+\s*(?:号|弄|巷)"
        r"(?:\s*[\dA-Za-z]+\s*(?:号楼|栋|幢|座|单元|层|楼|室|号|-))*(?:\s*\d+)?")),
    # a residential compound with a building: 天河北小区5栋302, 阳光花园3号楼2单元501室
    ("[ADDRESS]", re.compile(
        rf"[\u4e00-\u9fff]{{1,6}}{_COMPOUND}\s*\d{{1,5}}\s*{_BUILDING}(?:\s*\d{{1,5}}\s*{_UNIT})*"
        r"(?:\s*-?\s*\d{1,5}(?:室|房|号)?)?")),
    # building / unit / room numbers without the compound's name: 5栋302, 5号楼2单元301室, 3单元502
    ("[ADDRESS]", re.compile(
        rf"(?<![0-9])(?:\d{{1,5}}\s*{_BUILDING}\s*(?:\d{{1,3}}\s*单元\s*)?|\d{{1,3}}\s*单元\s*)"
        r"\d{1,5}\s*(?:室|房|号)?(?![0-9])")),
    ("[ADDRESS]", re.compile(
        r"\b\d{1,5}\s+(?:[A-Z][a-z]+\s+){1,3}(?:Street|St|Road|Rd|Avenue|Ave|Lane|Ln|Drive|Dr|Boulevard|Blvd|Way|"
        r"Court|Ct|Place|Pl|Terrace|Close|Crescent)\b\.?")),
)


_MAY_HOLD_PII = re.compile(r"[\d@]")  # \d as in the patterns: any Unicode digit


def fold(text: str) -> str:
    """``text`` with full-width forms, digit-by-digit Chinese numerals and dashes as ASCII,
    one character for one character (``len(fold(t)) == len(t)``): what the patterns see."""
    return text if text.isascii() else text.translate(_FOLD)


def mask_pii(text: str) -> str:
    """Replace personal data in ``text`` with placeholders (``[ID]``, ``[EMAIL]``,
    ``[PHONE]``, ``[ADDRESS]``); everything else is unchanged.

    Args:
        text: any text (characters); ``None`` is treated as ``""``.

    Returns:
        The masked text.
    """
    out = text or ""
    folded = fold(out)
    if not _MAY_HOLD_PII.search(folded):  # every pattern needs a digit or an @: most log values have none
        return out
    for placeholder, pattern in PII_PATTERNS:
        spans = [m.span() for m in pattern.finditer(folded)]
        if not spans:
            continue
        pieces, at = [], 0
        for start, end in spans:
            pieces += [out[at:start], placeholder]
            at = end
        out = "".join(pieces) + out[at:]
        folded = fold(out)
    return out


@functools.lru_cache(maxsize=1024)
def mask_bot_text(text: str) -> str:
    """:func:`mask_pii` for the bot's own replies, remembered (the same knowledge-base answers
    come back again and again; their digits and sources make every pattern run). Not for users'
    texts: those are not kept in memory longer than their message needs."""
    return mask_pii(text)


@memoized
def pseudonym(user_id: str) -> str:
    """A stable, non-reversible stand-in for a channel user id (WeChat OpenID, Telegram id) in logs.

    OpenIDs identify a person to whoever holds the account, so logs carry the first
    12 hex digits of their SHA-256 instead (enough to follow one user's requests).
    """
    return "u_" + hashlib.sha256(user_id.encode("utf-8")).hexdigest()[:12]
