"""A question's cost and the window on long questions (issue 21, "long messages truncated or
windowed to a bounded cost with the user told").

A request's cost is mostly the encoder's work, which grows with the question's length
(a 2,000-character question took 1.4-1.8 s of encoder time on the 2-core machine, a
short one 26 ms). :func:`estimate_tokens` prices a text without the tokenizer;
:func:`window_text` cuts a long one to its beginning and its end, and :data:`LONG_NOTE`
tells the user so.
"""

from __future__ import annotations

import math

__all__ = ["ELISION", "LONG_NOTE", "estimate_tokens", "window_text"]

LONG_NOTE = {
    "zh": "（您的消息比较长，我先读了开头和结尾的部分来回答。如果没有答到您想问的，请用一两句话把最想问的问题再发给我。）",
    "en": "(Your message was long, so I read its beginning and its end to answer. If I missed your question, "
          "please send it again in a sentence or two.)",
}
"""Put before the reply to a question that was read as a window (:func:`window_text`)."""

ELISION = " …… "
"""Joins the beginning and the end of a windowed question."""

_SPACES = b" \t\r\n\x0b\x0c"
_LETTERS = bytes(range(65, 91)) + bytes(range(97, 123))


def _char_cost(ch: str) -> float:
    if ord(ch) >= 0x80:
        return 1.0  # Chinese, full-width forms, emoji, accented letters: at most about a token each
    if ch.isascii() and ch.isalpha():
        return 1.0 / 3.0  # English words: 1.2-1.4 tokens for 4-5 letters
    return 0.0 if ch in " \t\r\n\x0b\x0c" else 1.0  # digits and punctuation: up to a token each


def estimate_tokens(text: str) -> int:
    """An upper estimate of the encoder's tokens for ``text``, without the tokenizer.

    Each non-ASCII character (Chinese, full-width forms, emoji, accented letters),
    digit and punctuation mark counts one, each ASCII letter a third (English words
    come to 1.2-1.4 tokens; the e5 tokenizer gave 0.69 tokens per Chinese character
    and 0.24 per English character on the project's sample questions), spaces
    nothing; plus 2 for the ``query:`` prefix.
    """
    ascii_ = text.encode("ascii", "ignore")
    letters = len(ascii_) - len(ascii_.translate(None, _LETTERS))
    others = len(ascii_.translate(None, _LETTERS + _SPACES))
    return 2 + (len(text) - len(ascii_)) + others + math.ceil(letters / 3)


def _cut_index(text: str, budget: int, from_end: bool = False) -> int:
    """How many characters from the start (or the end) of ``text`` fit ``budget`` estimated tokens."""
    used = 0.0
    n = 0
    for ch in (reversed(text) if from_end else iter(text)):
        cost = _char_cost(ch)
        if used + cost > budget:
            break
        used += cost
        n += 1
    return n


_ENDS = "。！？!?；;…\n."
_SOFT = "，,、：:"


def _snap(piece: str, backwards: bool) -> str:
    """``piece`` cut at a sentence end (else a comma) in its outer half: after the last one for a
    beginning (``backwards``), after the first one for an end."""
    n = len(piece)
    for marks in (_ENDS, _SOFT):
        span = range(n - 1, n // 2, -1) if backwards else range(0, n // 2)
        for i in span:
            if piece[i] in marks:
                return piece[: i + 1] if backwards else piece[i + 1:]
    return piece


def window_text(text: str, budget: int) -> tuple[str, bool]:
    """``text`` cut to at most ``budget`` estimated tokens: its beginning and its end (half the
    budget each), joined by :data:`ELISION`; ``(text, False)`` when it fits.

    The beginning ends after a sentence end (else a comma) in its second half; the end
    starts after one in its first half. The end matters: a consultation message usually
    ends with the question itself.
    """
    if estimate_tokens(text) <= budget:
        return text, False
    room = max(budget - 2 - estimate_tokens(ELISION.strip()), 8)
    head = _snap(text[: _cut_index(text, room // 2)], backwards=True).strip()
    tail_n = _cut_index(text, room - (estimate_tokens(head) - 2), from_end=True)
    tail = _snap(text[len(text) - tail_n:], backwards=False).strip() if tail_n else ""
    return head + ELISION + tail, True
