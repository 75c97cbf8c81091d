"""The red-flag rule tables of safety/red_flags/: read, checked and filled at import.

safety/triage.py matches the rules; this module only loads them (it imports nothing of
triage). ``rules.yaml`` holds reusable regex fragments (``blocks``) and the flags;
``replies.yaml`` what to do while waiting for the ambulance, per category. The comment
at the top of rules.yaml describes the same schema for clinicians who review it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

__all__ = ["RedFlag", "RED_FLAG_DIR", "load_red_flags", "load_replies", "gap_zh", "gap_en", "rule_regex"]

RED_FLAG_DIR = Path(__file__).with_name("red_flags")
_PLACEHOLDER = re.compile(r"\{([A-Z][A-Z0-9_]*)\}")
_REQUIRED_KEYS = {"category", "name", "patterns"}
_FLAG_KEYS = _REQUIRED_KEYS | {"example", "source", "not_before", "unless", "unless_mild", "severe_signs"}


@dataclass(frozen=True)
class RedFlag:
    """One red-flag rule (an entry of safety/red_flags/rules.yaml), placeholders filled.

    Attributes:
        category: reply key (``heart_attack``, ``stroke``, ``breathing``,
            ``anaphylaxis``, ``bleeding``, ``poisoning``, ``seizure``,
            ``unconscious``, ``infant_fever``, ``severe_headache``, ``gi_bleed``,
            ``pregnancy``, ``hypoglycemia``, ``abdomen``, ``eye``, ``high_bp``,
            ``fracture``, ``heatstroke``, ``head_injury``, ``bowel``, ``burn``, ``drowning``,
            ``electric``, ``sepsis``, ``dehydration``, ``torsion``, ``groin``, ``hyperglycemia``,
            ``swallowed``, ``crisis``; replies
            also ``choking``, ``gas``, ``nosebleed``, ``mushroom``).
        name: short label, unique within the category.
        patterns: regular expressions over the normalized text; ALL must match
            somewhere in the message (each one not negated) for the flag to fire.
        not_before: regex, anchored at the end, tested on the clause text just
            before the first pattern's match; a hit cancels that match
            ("眼皮" before "抽搐" is an eyelid twitch, not a seizure).
        unless: regex over the whole message; a hit always cancels the flag (context
            that explains the symptom away, e.g. 打鼾 and stopping breathing at night).
        unless_mild: regex over the whole message; a hit cancels the flag only where
            ``severe_signs`` finds nothing (iron tablets explain black stools, but not
            black stools with dizziness).
        severe_signs: regex over the whole message; any hit keeps the flag whatever
            ``unless_mild`` finds. Set exactly when ``unless_mild`` is.
        source: the public guideline the flag follows.
        example: a short message the flag must catch (checked by the tests).
    """

    category: str
    name: str
    patterns: tuple[str, ...]
    not_before: str | None = None
    unless: str | None = None
    unless_mild: str | None = None
    severe_signs: str | None = None
    source: str = ""
    example: str = ""


def gap_zh(n: int) -> str:
    """Up to ``n`` Chinese characters that are not a clause boundary or a negation."""
    return f"[^,.;!?，。；！？\\n不没无未]{{0,{n}}}"


def gap_en(n: int) -> str:
    """Up to ``n`` English characters, no clause boundary, no "not"/"no"/"n't"/"never"."""
    return f"(?:(?!\\bnot\\b|\\bno\\b|n't\\b|\\bnever\\b)[^,.;!?\\n]){{0,{n}}}"


def rule_regex(spec: str | dict, blocks: dict[str, str] | None = None) -> str:
    """One regex from a rule table (rules.yaml; settled.yaml): a string or ``{any_of: [...]}`` (joined by
    ``|``), with its placeholders filled: ``{G4}`` → :func:`gap_zh`, ``{E20}`` → :func:`gap_en`, ``{NAME}`` → one
    of ``blocks`` (none by default).

    Raises:
        ValueError: a ``{NAME}`` that is not a block defined above.
    """
    text = "|".join(spec["any_of"]) if isinstance(spec, dict) else spec
    blocks = blocks or {}

    def fill(m: re.Match[str]) -> str:
        name = m.group(1)
        if re.fullmatch(r"[GE]\d+", name):
            return (gap_zh if name[0] == "G" else gap_en)(int(name[1:]))
        if name not in blocks:
            raise ValueError(f"unknown block {{{name}}} in {text!r}")
        return blocks[name]

    return _PLACEHOLDER.sub(fill, text)


def load_red_flags(path: Path = RED_FLAG_DIR / "rules.yaml") -> tuple[RedFlag, ...]:
    """The red flags of ``path`` (rules.yaml), in file order, placeholders filled.

    Each flag is a mapping with these keys (any other key is an error):

    * ``category``, ``name``, ``patterns`` (required), ``example``, ``source``,
      ``not_before``: as in :class:`RedFlag`;
    * ``unless``: a regex; a hit anywhere in the message cancels the flag;
    * ``unless_mild`` with ``severe_signs`` (both or neither): an exception that holds
      only where nothing severe is told. The flag is cancelled when ``unless_mild``
      hits and ``severe_signs`` does not; a denied sign ("没有头晕", "not dizzy")
      counts as untold only where ``severe_signs`` says so (the ``NOT_NEGATED_ZH`` /
      ``NOT_NEGATED_EN`` blocks before the signs).

    A flag may have both kinds of exception: heavy bleeding told with 牙龈 is not
    flagged whatever else is told; told with 经期, only where no faintness is told.

    Raises:
        ValueError: unknown or missing keys, ``unless_mild`` without ``severe_signs`` (or
            the reverse), an unknown ``{NAME}`` block, or two flags with one label.
    """
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    blocks: dict[str, str] = {}
    for name, spec in data["blocks"].items():
        blocks[name] = rule_regex(spec, blocks)
    flags = []
    for entry in data["flags"]:
        label = f"{entry.get('category')}.{entry.get('name')}"
        if set(entry) - _FLAG_KEYS or not _REQUIRED_KEYS <= set(entry):
            raise ValueError(f"{path}: bad keys in red flag {label}: unknown {sorted(set(entry) - _FLAG_KEYS)}, "
                             f"missing {sorted(_REQUIRED_KEYS - set(entry))}")
        if bool(entry.get("unless_mild")) != bool(entry.get("severe_signs")):
            raise ValueError(f"{path}: red flag {label}: 'unless_mild' and 'severe_signs' go together "
                             "(an exception without severe signs is a plain 'unless')")
        optional = {k: rule_regex(entry[k], blocks) for k in ("not_before", "unless", "unless_mild", "severe_signs")
                    if entry.get(k)}
        flags.append(RedFlag(entry["category"], entry["name"], tuple(rule_regex(p, blocks) for p in entry["patterns"]),
                             source=entry.get("source", ""), example=entry.get("example", ""), **optional))
    labels = [f"{f.category}.{f.name}" for f in flags]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{path}: duplicate red flags {sorted({x for x in labels if labels.count(x) > 1})}")
    return tuple(flags)


def load_replies(path: Path = RED_FLAG_DIR / "replies.yaml") -> tuple[dict[str, tuple[str, str]], ...]:
    """``(while_waiting, lead)`` of replies.yaml: per category, the (zh, en) text of what to do
    while waiting, and of the replies that lead with what to do now."""
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    return tuple({cat: (r["zh"], r["en"]) for cat, r in data[key].items()} for key in ("while_waiting", "lead"))
