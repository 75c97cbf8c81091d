"""Text normalization for every inbound message, before triage, rules and retrieval.

One cleaned form of the user's text (:class:`Normalized`): Simplified Chinese
(OpenCC ``t2s`` from opencc-python-reimplemented), full-width ASCII folded to
half-width (Unicode NFKC), emoji and decorative symbols removed, repeated
punctuation collapsed, whitespace collapsed, Latin lowercased. Sentence
punctuation, digits, negation words (没有/不/no/not/don't) and units (°C, mg,
140/90) are kept, because triage and the scope rules read them.

The original text and the user's script are kept so that replies can be written
back in Traditional characters (:func:`to_user_script`) when the user wrote
Traditional.

Results are memoized (:data:`MEMO_SIZE` texts of up to :data:`MEMO_MAX_CHARS`
characters, LRU): one message is normalized by admission, the dispatcher, triage
and the scope rules (about six calls), and OpenCC here is the pure-Python one
(``t2s`` of a 260-character reply ≈ 0.4 ms), so every call after the first for a
text is a dictionary lookup. The functions are pure and :class:`Normalized` is
frozen, so a shared result is safe.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, TypeVar

import opencc

__all__ = ["MEMO_MAX_CHARS", "MEMO_SIZE", "Normalized", "memoized", "normalize", "to_user_script", "to_simplified",
           "detect_lang"]

R = TypeVar("R")

MEMO_SIZE = 4096
"""Texts whose normalized form (and, apart, whose OpenCC conversions) are remembered."""
MEMO_MAX_CHARS = 2048
"""Longer texts are converted each time (they are rare and would crowd out the rest)."""

# CJK Unified Ideographs (+ Extension A) and CJK compatibility ideographs.
_CJK = r"\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_HAS_CJK = re.compile(f"[{_CJK}]")

# Symbols (Unicode category "So"/"Sk") that carry meaning in health messages and
# must survive emoji removal: temperatures and arrows on lab reports.
_KEEP_SYMBOLS = frozenset("°℃℉↑↓←→µ")

# Emoji glue: variation selectors, zero-width joiner, keycap, tag characters.
_EMOJI_GLUE = re.compile("[\ufe0e\ufe0f\u200d\u20e3\U000e0020-\U000e007f]")
# WeChat text emoticons as they arrive in message text: "[微笑]", "[Smile]", "/::)".
_WECHAT_EMOTICON = re.compile(r"\[[\u4e00-\u9fff]{1,4}\]|\[[A-Za-z]{2,12}\]|/::?[^\s/]{1,3}")
# Decorative characters removed anywhere; "~" only when not a numeric range (5~10).
_DECORATIVE = re.compile(r"[*#^_|`\\【】「」『』〖〗☆★]|(?<!\d)[~〜～]|[~〜～](?!\d)")
# Runs of punctuation collapse to their first character ("！！！" → "!", "。。。" → "。").
_PUNCT_RUN = re.compile(r"([!?,.;:，。！？、；：…—\-])[!?,.;:，。！？、；：…—\-]+")
# Spaces between two CJK characters are typing artefacts ("胸 口 疼").
_CJK_SPACE = re.compile(f"(?<=[{_CJK}])\\s+(?=[{_CJK}])")
_SPACES = re.compile(r"\s+")
# Curly quotes and apostrophes typed on phones ("don’t").
_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201b": "'", "\u2032": "'",
                         "\u201c": '"', "\u201d": '"'})

# Markers of a Hong Kong / Cantonese or a Taiwan writer, used only to pick the
# OpenCC variant (s2hk / s2tw) for replies.
_HK_MARKERS = re.compile("[嘅唔咗冇喺佢啲嚟睇搵揾嘢咁乜]|香港|係咪")
_TW_MARKERS = re.compile("台灣|臺灣|裡|妳|健保")


@lru_cache(maxsize=None)
def _converter(config: str) -> opencc.OpenCC:
    return opencc.OpenCC(config)


@dataclass(frozen=True)
class Normalized:
    """A user message after :func:`normalize`.

    Attributes:
        text: the cleaned text: Simplified Chinese, half-width, lowercased Latin,
            no emoji, collapsed punctuation and whitespace (characters, not bytes).
        original: the text exactly as received.
        lang: ``"zh"`` if the text contains any CJK ideograph, else ``"en"``.
        script: ``"hant"`` when the user wrote Traditional characters (OpenCC
            ``t2s`` changed the text), else ``"hans"``.
        variant: ``"hk"`` when the writer shows Hong Kong (Cantonese particles such
            as 佢/唔/咗, or 香港), ``"tw"`` when a Traditional writer uses Taiwan
            spellings, else ``""``; picks the OpenCC ``s2hk`` / ``s2tw`` reply
            conversion and, in triage, names 999 before 120.
    """

    text: str
    original: str
    lang: str
    script: str = "hans"
    variant: str = ""


def detect_lang(text: str) -> str:
    """``"zh"`` if ``text`` has at least one CJK ideograph, else ``"en"``."""
    return "zh" if _HAS_CJK.search(text or "") else "en"


def _strip_emoji(text: str) -> str:
    text = _EMOJI_GLUE.sub("", text)
    out = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in _KEEP_SYMBOLS:
            out.append(ch)
        elif cat in ("So", "Cs", "Co") or (cat == "Sk" and ord(ch) >= 0x1F3FB):
            out.append(" ")
        else:
            out.append(ch)
    return "".join(out)


def normalize(text: str) -> Normalized:
    """Clean one user message for matching and retrieval (memoized, module doc).

    Steps, in order: NFKC (full-width ASCII and ``℃``-style compatibility
    characters to their plain forms), curly quotes to ASCII, emoji / WeChat
    emoticons / decorative symbols removed, OpenCC ``t2s`` (Traditional →
    Simplified), repeated punctuation collapsed to one mark, spaces between CJK
    characters dropped, whitespace collapsed, Latin lowercased.

    Args:
        text: the message as received (any length; ``None`` is treated as ``""``).

    Returns:
        :class:`Normalized` with the cleaned text, the original, the language and
        the script the user wrote in.
    """
    return _normalize(text or "")


def memoized(fn: Callable[..., R]) -> Callable[..., R]:
    """``fn`` with its results remembered (:data:`MEMO_SIZE` calls, LRU) when its first argument, a
    text (str or :class:`Normalized`), has at most :data:`MEMO_MAX_CHARS` characters: for the pure
    readers of a message (normalization, the red-flag and scope rules, the intent rules), each asked
    once a message or more and again for every repeat of a popular question. ``fn`` must be pure,
    its arguments hashable and its results immutable (they are shared)."""
    memo = lru_cache(maxsize=MEMO_SIZE)(fn)

    @functools.wraps(fn)
    def call(text: Any, *args: Any) -> R:
        size = len(text.original if isinstance(text, Normalized) else text)
        return memo(text, *args) if size <= MEMO_MAX_CHARS else fn(text, *args)

    call.cache_clear = memo.cache_clear  # type: ignore[attr-defined]
    return call


@memoized
def _normalize(original: str) -> Normalized:
    s = unicodedata.normalize("NFKC", original).translate(_QUOTES)
    s = _WECHAT_EMOTICON.sub(" ", s)
    s = _strip_emoji(s)
    s = _DECORATIVE.sub(" ", s)
    simplified = _convert("t2s", s)
    script = "hant" if simplified != s else "hans"
    # Cantonese particles survive t2s, so a Hong Kong writer is recognised from the
    # normalized text too (the dispatcher may pass that to triage).
    variant = "hk" if _HK_MARKERS.search(original) else ("tw" if script == "hant" and _TW_MARKERS.search(original) else "")
    s = _PUNCT_RUN.sub(r"\1", simplified)
    s = _CJK_SPACE.sub("", s)
    s = _SPACES.sub(" ", s).strip().lower()
    # Punctuation left alone at the very start ("，你好") is noise.
    s = s.lstrip(",.;:，。、；：!?！？ ")
    return Normalized(text=s, original=original, lang=detect_lang(s), script=script, variant=variant)


def _convert(config: str, text: str) -> str:
    changes = _t2s_changes() if config == "t2s" else None
    if changes is not None and changes.isdisjoint(text):
        return text  # nothing OpenCC could change: 95 % of the repository's texts, 7 us against 70 us and more
    return _converted(text, config)


@lru_cache(maxsize=1)
def _t2s_changes() -> frozenset[str] | None:
    """Every character OpenCC ``t2s`` may change, read from its dictionaries: those
    ``TSCharacters.txt`` maps to another character (or to several), and those of the
    ``TSPhrases.txt`` phrases that convert although none of their characters is such a one
    (沈 of 沈默 → 沉默). A text without any of them comes out of ``t2s`` unchanged. None
    when the dictionaries cannot be read (another OpenCC packaging): every text converts."""
    folder = Path(opencc.__file__).parent / "dictionary"
    try:
        tables = [[line.split("\t", 1) for line in (folder / name).read_text(encoding="utf-8").splitlines()
                   if "\t" in line] for name in ("TSCharacters.txt", "TSPhrases.txt")]
    except OSError:
        return None
    chars = {k for k, v in tables[0] if v.split() != [k]}
    chars |= {c for k, v in tables[1] if v.split()[:1] != [k] and chars.isdisjoint(k) for c in k}
    return frozenset(chars) if chars else None


@memoized
def _converted(text: str, config: str) -> str:
    return _converter(config).convert(text)


def to_user_script(text: str, script: str, variant: str = "") -> str:
    """Write a Simplified-Chinese reply in the user's script.

    Args:
        text: reply text in Simplified Chinese (English passes through unchanged).
        script: :attr:`Normalized.script`; only ``"hant"`` converts.
        variant: :attr:`Normalized.variant`: ``"hk"`` → OpenCC ``s2hk``,
            otherwise ``s2tw`` (Taiwan standard: OpenCC's plain ``s2t`` writes archaic forms such as 喫).

    Returns:
        The text, converted when the user wrote Traditional.
    """
    if script != "hant" or not text:
        return text
    config = {"hk": "s2hk"}.get(variant, "s2tw")  # s2t would write 喫 for 吃, which no reader uses
    return _convert(config, text)


def to_simplified(text: str) -> str:
    """OpenCC ``t2s``: Traditional → Simplified Chinese, nothing else changed."""
    return _convert("t2s", text or "")
