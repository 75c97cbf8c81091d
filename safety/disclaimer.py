"""The medical disclaimer appended to every health reply.

Short on purpose: WeChat passive replies carry at most 2048 bytes of text
(UTF-8, so about 680 Chinese characters), and the disclaimer must leave room for
the answer. Each disclaimer is at most :data:`DISCLAIMER_MAX_CHARS` characters.
The wording says what the text is (general health information), who made it (AI,
as Chinese rules on AI-generated content require it to be labelled), and that it
does not replace a doctor.
"""

from __future__ import annotations

from functools import lru_cache

from safety.normalize import to_user_script

__all__ = ["DISCLAIMER", "DISCLAIMER_MAX_CHARS", "with_disclaimer"]

DISCLAIMER_MAX_CHARS = 70
"""Upper bound on each disclaimer's length in characters (Python ``len``)."""

DISCLAIMER: dict[str, str] = {
    "zh": "⚕️以上为健康科普，由AI生成，不能替代医生诊断；如有不适请及时就医。",
    "en": "⚕️ General health info, AI-generated; not a substitute for a doctor.",
}
"""Disclaimer text by language (``"zh"`` Simplified Chinese, ``"en"`` English)."""

_SEPARATOR = "\n\n"


def with_disclaimer(text: str, lang: str) -> str:
    """Append the disclaimer for ``lang`` to ``text``, once.

    Idempotent: a text that already ends with (or contains) either language's
    disclaimer, or its Traditional-Chinese form, is returned unchanged, so calling
    this twice never doubles it. Trailing whitespace of ``text`` is trimmed before
    the disclaimer, which follows a blank line. Unknown ``lang`` values use English.

    Args:
        text: the reply body (characters).
        lang: ``"zh"`` or ``"en"``.

    Returns:
        ``text`` followed by a blank line and the disclaimer (``len(DISCLAIMER[lang])``
        ≤ 70 characters).
    """
    body = (text or "").rstrip()
    if _has_disclaimer(body):
        return body
    disclaimer = DISCLAIMER.get(lang, DISCLAIMER["en"])
    return f"{body}{_SEPARATOR}{disclaimer}" if body else disclaimer


def _has_disclaimer(text: str) -> bool:
    # The dispatcher may already have converted a Chinese reply to Traditional (Taiwan or Hong Kong).
    return any(d in text for d in _written_forms())


@lru_cache(maxsize=1)
def _written_forms() -> tuple[str, ...]:
    """Every disclaimer as a reply may carry it: each language's, and the Chinese one in both
    Traditional variants :func:`safety.normalize.to_user_script` writes."""
    zh = DISCLAIMER["zh"]
    return (*DISCLAIMER.values(), to_user_script(zh, "hant"), to_user_script(zh, "hant", "hk"))
