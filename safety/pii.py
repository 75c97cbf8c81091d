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
  (…路…号, …街…号, …大道…号, …巷…号, …弄…号, with building/unit/room parts)
  and English "12 Baker Street" forms → ``[ADDRESS]``.

Masking is deliberately simple: it is a safety net for logs, not a guarantee;
nothing here is reversible.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["mask_pii", "PII_PATTERNS"]

PII_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("[ID]", re.compile(r"(?<![0-9A-Za-z])\d{17}[\dXx](?![0-9A-Za-z])")),
    ("[EMAIL]", re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")),
    ("[PHONE]", re.compile(r"(?<![0-9])(?:(?:\+|00)86[\s-]?)?1[3-9]\d(?:[\s-]?\d{4}){2}(?![0-9])")),
    ("[ADDRESS]", re.compile(
        r"[\u4e00-\u9fff]{1,6}(?:路|街|大街|大道|巷|胡同|弄)\s*\d+\s*(?:号|弄|巷)"
        r"(?:\s*[\dA-Za-z]+\s*(?:号楼|栋|幢|座|单元|层|楼|室|号|-))*(?:\s*\d+)?")),
    ("[ADDRESS]", re.compile(
        r"\b\d{1,5}\s+(?:[A-Z][a-z]+\s+){1,3}(?:Street|St|Road|Rd|Avenue|Ave|Lane|Ln|Drive|Dr|Boulevard|Blvd|Way|"
        r"Court|Ct|Place|Pl|Terrace|Close|Crescent)\b\.?")),
)


def mask_pii(text: str) -> str:
    """Replace personal data in ``text`` with placeholders (``[ID]``, ``[EMAIL]``,
    ``[PHONE]``, ``[ADDRESS]``); everything else is unchanged.

    Args:
        text: any text (characters); ``None`` is treated as ``""``.

    Returns:
        The masked text.
    """
    out = text or ""
    for placeholder, pattern in PII_PATTERNS:
        out = pattern.sub(placeholder, out)
    return out


def pseudonym(user_id: str) -> str:
    """A stable, non-reversible stand-in for a channel user id (WeChat OpenID, Telegram id) in logs.

    OpenIDs identify a person to whoever holds the account, so logs carry the first
    12 hex digits of their SHA-256 instead (enough to follow one user's requests).
    """
    return "u_" + hashlib.sha256(user_id.encode("utf-8")).hexdigest()[:12]
