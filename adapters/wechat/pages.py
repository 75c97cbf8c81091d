"""Long answers as WeChat pages: parts of at most a byte limit, the closing paragraph
(the medical disclaimer) repeated on every page, "回复 1 查看更多" on a page with more
after it (see the package docstring, "Long answers")."""

from __future__ import annotations

import json
from dataclasses import dataclass

from adapters.text_split import split_text as _split
from adapters.text_split import utf8_len as _nbytes
from adapters.wechat import constants as wc

__all__ = ["CONTINUE_WORDS", "MORE_HINT", "Pages", "paginate", "split_text"]

MORE_HINT = {"zh": "回复 1 查看更多", "en": "Reply 1 for more"}
"""The continuation line on a page that has more after it, by language."""
CONTINUE_WORDS = frozenset({"1", "１"})
"""A user's text (stripped) that asks for the next page."""


def split_text(text: str, max_bytes: int = wc.PASSIVE_TEXT_MAX_BYTES) -> list[str]:
    """``text`` in consecutive parts of at most ``max_bytes`` UTF-8 bytes each, as many
    whole sentences as fit per part (:func:`adapters.text_split.split_text`).

    Args:
        text: any text.
        max_bytes: the limit per part, UTF-8 bytes (≥ 4, the longest character).

    Returns:
        The parts, stripped (``[]`` for a blank text; one part when it fits).

    Raises:
        ValueError: ``max_bytes`` below 4.
    """
    if max_bytes < 4:
        raise ValueError(f"max_bytes must be >= 4 (one UTF-8 character), not {max_bytes}")
    return _split(text, max_bytes)


@dataclass(frozen=True)
class Pages:
    """A text laid out as messages: ``bodies`` in order, ``tail`` (the closing
    paragraph, e.g. the disclaimer) repeated on each page, ``lang`` for the
    continuation line. Every :meth:`page` fits the limit it was built for."""

    bodies: tuple[str, ...]
    tail: str = ""
    lang: str = "zh"

    def page(self, i: int, more: bool = False) -> str:
        """Page ``i`` (0-based): its body, the "回复 1 查看更多" line when ``more``, the tail."""
        pieces = [self.bodies[i], MORE_HINT.get(self.lang, MORE_HINT["en"]) if more else "", self.tail]
        return "\n\n".join(p for p in pieces if p)

    def to_json(self, start: int = 0) -> str:
        return json.dumps({"bodies": list(self.bodies[start:]), "tail": self.tail, "lang": self.lang},
                          ensure_ascii=False)

    @classmethod
    def from_json(cls, raw: str) -> Pages:
        data = json.loads(raw)
        return cls(tuple(data["bodies"]), data.get("tail", ""), data.get("lang", "zh"))


def paginate(text: str, lang: str = "zh", max_bytes: int = wc.PASSIVE_TEXT_MAX_BYTES) -> Pages:
    """``text`` as :class:`Pages` of at most ``max_bytes`` UTF-8 bytes each.

    A text that fits is one page, unchanged. Otherwise its last paragraph (after
    the last blank line — where the dispatcher puts the medical disclaimer) is the
    tail when it takes at most a quarter of ``max_bytes``, and the rest is split by
    :func:`split_text` leaving room on every page for the tail and the continuation
    line (so a user who reads only page 1 still sees the disclaimer).

    Args:
        text: the reply text, free of XML-invalid characters.
        lang: ``"zh"`` or ``"en"`` (the continuation line's language).
        max_bytes: the per-message limit, UTF-8 bytes (2048 for passive replies and
            customer-service text).

    Raises:
        ValueError: ``max_bytes`` below 64 (no room for the continuation line).
    """
    if max_bytes < 64:
        raise ValueError(f"max_bytes must be >= 64 for pages with a continuation line, not {max_bytes}")
    if _nbytes(text) <= max_bytes:
        return Pages((text,), "", lang)
    body, tail = text.strip(), ""
    at = body.rfind("\n\n")
    if at > 0:
        candidate = body[at + 2:].strip()
        if candidate and _nbytes(candidate) <= max_bytes // 4:
            body, tail = body[:at].rstrip(), candidate
    hint = MORE_HINT.get(lang, MORE_HINT["en"])
    reserve = _nbytes("\n\n" + hint) + (_nbytes("\n\n" + tail) if tail else 0)
    return Pages(tuple(split_text(body, max_bytes - reserve)) or ("",), tail, lang)

