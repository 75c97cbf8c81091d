"""Emergency and crisis triage: the first check on every text message.

Rule-based and high-recall by design: when a message describes a red-flag
symptom it is treated as an emergency, even if it is phrased as a question
("胸口疼是怎么回事"). The bot then gives emergency guidance only — call the
emergency number, what to do while waiting where a first-aid guideline says so,
no knowledge-base advice, no medicine — and offers a human agent.

The rules and replies are data, for clinicians to review without reading Python:

* safety/red_flags/rules.yaml: every red flag with its patterns, the public guideline
  it follows (NHS, NICE NG143, 中国卒中学会 中风120, 中国红十字会《救护》 ...) and an
  example message it must catch (tests/test_safety.py checks each one);
* safety/red_flags/replies.yaml: what to do while waiting, per category, with sources.

:mod:`safety.red_flag_rules` loads them; this module compiles them, judges each match
in its context (:mod:`safety.clause_context`) and builds the reply. Numbers: 120 (mainland China emergency medical service), 999 (Hong Kong,
UK), 112 / 911 (EU / North America) from :class:`safety.config.SafetyConfig`; crisis
lines 12356 (China's 24-hour national psychological assistance hotline) and 988 (US
Suicide & Crisis Lifeline), also from ``SafetyConfig``.

How a match is judged:

* the message is normalized (:func:`safety.normalize.normalize`: Traditional →
  Simplified, lowercase, half-width) and split into clauses at punctuation (a
  full stop between digits is a decimal point) and at contrast words (但是 /
  but), because a negation never reaches across them;
* a match is dropped when a negation stands right before it in its clause
  ("没有胸痛", "不是胸痛", "no chest pain", "I don't have chest pain"), allowing
  only filler words in between ("没什么胸痛", "don't really have any chest pain");
* a match is dropped when the clause puts it in the distant past and nothing
  current comes between ("去年有过胸痛现在好了", "had a stroke two years ago"),
  or frames it as prevention ("怎么预防煤气中毒", "prevent carbon monoxide
  poisoning");
* a flag is dropped when the whole message explains the symptom away: its ``unless``
  hits, or its ``unless_mild`` hits and none of its ``severe_signs`` ("吃补铁的药
  大便黑" but not "吃补铁的药 大便黑 头晕心慌");
* third parties count the same as the user ("我爸胸口疼出冷汗", "my mum's face is
  drooping"): the patterns never require "我" / "I";
* a message about fiction being written or one's own work in health or rescue, naming
  nobody of one's own and nothing now, keeps only its crisis flags
  (:func:`safety.clause_context.fiction_or_work`);
* a flag whose danger the message tells as over ("前几天胸口闷了一下 现在好了") is still
  returned, with ``settled`` set (:mod:`safety.settled`): the dispatcher then replies with
  the decision layer's reply and the safety-net line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from safety.config import SafetyConfig
from safety.normalize import memoized, normalize, to_user_script
from safety.clause_context import cancelled, fiction_or_work, mandarin_view, split_sentence_clauses
from safety.red_flag_rules import RedFlag, load_red_flags, load_replies
from safety.regex_screen import LiteralIndex, all_required_literals, screen
from safety.settled import settled

__all__ = ["TriageResult", "RedFlag", "RED_FLAGS", "load_red_flags", "triage", "match_red_flags", "emergency_reply",
           "crisis_reply", "HONG_KONG_EMERGENCY", "UK_HK_EMERGENCY_EN"]

HONG_KONG_EMERGENCY = "999"
"""Hong Kong's emergency number (Hong Kong Police / Fire Services Department)."""
UK_HK_EMERGENCY_EN = "999 in the UK and Hong Kong"
"""Mentioned next to ``SafetyConfig.emergency_number_en`` in English replies."""


@dataclass(frozen=True)
class TriageResult:
    """An emergency or crisis found in a message.

    Attributes:
        kind: ``"emergency"`` (red-flag symptoms) or ``"crisis"`` (suicidal
            thoughts or self-harm).
        rule: which red flag matched, ``"<category>.<name>"`` (e.g.
            ``"stroke.face_zh"``); for logs and metrics, never shown to users.
        reply: the full reply text in the requested language, emergency numbers
            included, with an offer of a human agent.
        settled: the words telling the danger as over ("现在好了", "fine since";
            :mod:`safety.settled`), "" when they don't: with them the message gets a
            safety net under the decision layer's reply, not ``reply``.
    """

    kind: Literal["emergency", "crisis"]
    rule: str
    reply: str
    settled: str = ""


RED_FLAGS: tuple[RedFlag, ...] = load_red_flags()

_Exceptions = tuple[re.Pattern[str] | None, re.Pattern[str] | None, re.Pattern[str] | None]
# Per flag: the flag, its patterns, not_before, and (unless, unless_mild, severe_signs).
_COMPILED: tuple[tuple[RedFlag, tuple[re.Pattern[str], ...], re.Pattern[str] | None, _Exceptions], ...] = tuple(
    (f, tuple(re.compile(p) for p in f.patterns),
     re.compile(f.not_before) if f.not_before else None,
     tuple(re.compile(p) if p else None for p in (f.unless, f.unless_mild, f.severe_signs)))
    for f in RED_FLAGS
)
# Per pattern, a relaxed pattern that must match the whole message for the pattern to match a clause.
_SCREENS = tuple(tuple(screen(p) for p in patterns) for _flag, patterns, _nb, _exceptions in _COMPILED)


# Per flag, the cheapest test that rules it out: none of these strings in the message.
_LITERALS = LiteralIndex(all_required_literals(patterns) for _flag, patterns, _nb, _exceptions in _COMPILED)

def _find(pattern: re.Pattern[str], clauses: list[str], not_before: re.Pattern[str] | None,
          chronic_cancels: bool, ends: list[int], about_cancels: bool) -> bool:
    for i, clause in enumerate(clauses):
        next_clause = clauses[i + 1] if i + 1 < len(clauses) else ""
        for m in pattern.finditer(clause):
            if not cancelled(clause, m.start(), m.end(), not_before, " ".join(clauses[i:]), next_clause,
                              chronic_cancels, " ".join(clauses[i:ends[i]]), about_cancels):
                return True
    return False


def _explained(view: str, unless: re.Pattern[str] | None, unless_mild: re.Pattern[str] | None,
               severe_signs: re.Pattern[str] | None) -> bool:
    """True when the message ``view`` explains a flag's symptom away: ``unless`` hits, or
    ``unless_mild`` hits and no ``severe_signs`` do (safety/red_flag_rules.py)."""
    if unless is not None and unless.search(view):
        return True
    return (unless_mild is not None and unless_mild.search(view) is not None
            and (severe_signs is None or severe_signs.search(view) is None))


def match_red_flags(text: str) -> list[str]:
    """Every red flag in ``text``, as ``"<category>.<name>"`` strings, in table order.

    ``text`` may be the original message or its normalized form (characters,
    any length). For tests and logs; :func:`triage` builds the reply.
    """
    return list(_red_flags(text))


@memoized
def _red_flags(text: str) -> tuple[str, ...]:
    """:func:`match_red_flags`, remembered for repeated texts (:func:`~safety.normalize.memoized`)."""
    view = mandarin_view(normalize(text).text)
    clauses, ends = split_sentence_clauses(view)
    hits = []
    candidates = _LITERALS.candidates(view)  # the others lack a string every match contains
    story = bool(candidates) and fiction_or_work(view)  # a character's or a patient's danger: only a crisis flag counts
    for i in candidates:
        (flag, patterns, not_before, exceptions), screens = _COMPILED[i], _SCREENS[i]
        if story and flag.category != "crisis":
            continue
        if any(s is not None and s.search(view) is None for s in screens):
            continue  # some pattern matches no clause (safety/regex_screen.py)
        if _explained(view, *exceptions):
            continue
        # Suicidal thoughts are never "chronic"; a baby's age in months is not a duration.
        # Days of diarrhoea, of no bowel movement or of an infection are the point of these flags.
        chronic_cancels = flag.category not in ("crisis", "infant_fever", "pregnancy", "dehydration", "bowel", "sepsis")
        if all(_find(p, clauses, not_before if i == 0 else None, chronic_cancels, ends, flag.category != "crisis")
               for i, p in enumerate(patterns)):
            hits.append(f"{flag.category}.{flag.name}")
    return tuple(hits)


# --------------------------------------------------------------------------------------
# Replies
# --------------------------------------------------------------------------------------

#: What to do while waiting for the ambulance, per category, as (zh, en); and the
#: categories whose reply leads with what to do now instead of "call the emergency number
#: now" (NHS "Low blood sugar", "Detached retina", "Nosebleed"). safety/red_flags/replies.yaml.
_WHILE_WAITING, _LEAD = load_replies()


# Diabetes medicines: an overdose of them is treated as low blood sugar.
_GLUCOSE_LOWERING = re.compile(r"降糖|胰岛素|二甲双胍|格列|糖尿病的药|\binsulin|\bmetformin|\bgli\w+|\bdiabet\w* (?:pills?|tablets?|meds?|medication)")

# Not breathing: the unconscious reply (chest compressions as the call handler says).
_NOT_BREATHING = re.compile(r"(?:没|不)(?:有)?(?:呼吸|喘气)|没气了|没了呼吸|\bnot breathing|\bno breath|\bstopped breathing")

# A nose in a bleeding message: nosebleed first aid instead of pressing on a wound.
_NOSE = re.compile(r"鼻|\bnose|\bnosebleed")

# A period (or its pads) in a bleeding message: lie down with the legs raised instead of pressing on a wound.
_PERIOD = re.compile(r"经期|月经|例假|大姨妈|生理期|卫生巾|\bperiods?\b|menstrua|\btampons?\b")

# Gas and carbon monoxide get their own first aid (China CDC: ventilate, leave the room).
_GAS = re.compile(r"煤气|一氧化碳|燃气|天然气|炭火|烧炭|煤炉|炭盆|\bcarbon monoxide|\bgas\b|\bco alarm")

_HUMAN_OFFER = ("如需人工帮助，请回复“人工”。", 'Reply "human" to talk to a person.')


def emergency_reply(category: str, lang: str, cfg: SafetyConfig, variant: str = "") -> str:
    """The emergency reply for a red-flag ``category`` in ``lang`` (``"zh"``/``"en"``).

    Numbers come from ``cfg`` (120 mainland China; 112 / 911 abroad) plus 999 for
    Hong Kong and the UK; with ``variant == "hk"`` the Chinese reply names 999
    first. ``hypoglycemia``, ``eye`` and ``nosebleed`` lead with what to do now and
    when to call (:data:`_LEAD`). Length: under 600 characters, and under 600 bytes in
    Chinese (well below WeChat's 2048-byte passive reply limit in UTF-8).
    """
    zh = lang == "zh"
    if category in _LEAD:
        number_zh = HONG_KONG_EMERGENCY if variant == "hk" else cfg.emergency_number_zh
        lead = _LEAD[category][0 if zh else 1].format(zh=number_zh, en=cfg.emergency_number_en)
        return "\n".join((lead, _HUMAN_OFFER[0 if zh else 1]))
    waiting = _WHILE_WAITING.get(category, ("", ""))[0 if zh else 1]
    if zh:
        if variant == "hk":
            call = f"⚠️这可能是危急情况，请立即拨打{HONG_KONG_EMERGENCY}急救电话（内地请拨{cfg.emergency_number_zh}）。"
        else:
            call = f"⚠️这可能是危急情况，请立即拨打{cfg.emergency_number_zh}急救电话（香港请拨{HONG_KONG_EMERGENCY}），不要等待观察。"
        return "\n".join(x for x in (call, waiting, _HUMAN_OFFER[0]) if x)
    call = (f"⚠️ This may be an emergency. Call {cfg.emergency_number_en} now (your local emergency number; "
            f"{UK_HK_EMERGENCY_EN}). Don't wait to see if it gets better.")
    return "\n".join(x for x in (call, waiting, _HUMAN_OFFER[1]) if x)


def crisis_reply(lang: str, cfg: SafetyConfig) -> str:
    """The reply to suicidal thoughts or self-harm, in ``lang``.

    Names the crisis line (``cfg.crisis_line_zh`` — 12356, China's 24-hour
    psychological assistance hotline; ``cfg.crisis_line_en`` — 988 in the US),
    suggests telling and staying with someone nearby, says the emergency number is
    right when there is immediate danger, and tells a relative writing about someone
    else how to help (stay with them, remove means, call together).
    """
    if lang == "zh":
        return (
            "听到你这么说，我很担心你。你愿意说出来很重要，你不需要一个人扛着。\n"
            f"请现在就拨打心理援助热线{cfg.crisis_line_zh}（24小时），和专业的人聊一聊。\n"
            "也请告诉身边信任的人你现在的感受，请他陪着你，先不要一个人待着。\n"
            f"如果你已经伤害了自己，或觉得马上会有危险，请立即拨打{cfg.emergency_number_zh}。\n"
            "如果是家人或朋友这样说：请认真对待，陪着他、别让他一个人待着，收好药物和利器，陪他一起打热线或去医院。\n"
            + _HUMAN_OFFER[0])
    return (
        "I'm really sorry you're going through this, and I'm glad you told me. You don't have to carry it alone.\n"
        f"Please call or text a crisis line now: {cfg.crisis_line_en}.\n"
        "Tell someone near you how you feel and ask them to stay with you; try not to be alone right now.\n"
        f"If you have hurt yourself or are in immediate danger, call {cfg.emergency_number_en} now.\n"
        "If it is a relative or friend saying this: take it seriously, stay with them, put medicines and sharp "
        "things away, and call the line or go to A&E with them.\n"
        + _HUMAN_OFFER[1])


#: Flags whose own first aid wins over whatever else matched, in order, as (hit prefix, reply):
#: "说不出话" while choking is also a stroke sign, a pregnant woman's headache also a
#: headache, confusion in the heat, from low blood sugar, after drowning, an electric
#: shock or a swallowed battery is what those cause, and a burn bleeds.
_FIRST_AID_WINS = (("poisoning.fumes", "gas"), ("breathing.chok", "choking"), ("pregnancy.", "pregnancy"), ("heatstroke.", "heatstroke"),
                   ("hypoglycemia.", "hypoglycemia"), ("drowning.", "drowning"), ("electric.", "electric"),
                   ("swallowed.", "swallowed"), ("burn.", "burn"))


def _reply_category(emergencies: list[str], text: str) -> str:
    """Which reply the medical red flags get: the first of :data:`_FIRST_AID_WINS` that
    matched; CPR instructions whenever someone is not breathing; else the first flag's
    category, with gas, mushroom, diabetes-medicine, nosebleed and heavy-period first aid."""
    for prefix, category in _FIRST_AID_WINS:
        if any(h.startswith(prefix) for h in emergencies):
            return category
    if any(h.startswith("unconscious.") for h in emergencies) and _NOT_BREATHING.search(text):
        return "unconscious"
    category = emergencies[0].split(".")[0]
    if category == "poisoning" and _GAS.search(text):
        return "gas"
    if category == "poisoning" and any(h.startswith("poisoning.mushroom") for h in emergencies):
        return "mushroom"
    if category == "poisoning" and _GLUCOSE_LOWERING.search(text):
        return "hypoglycemia"  # too much of a diabetes medicine: sugar first, not "nothing by mouth"
    if category == "bleeding" and _NOSE.search(text):
        return "nosebleed"
    if category == "bleeding" and _PERIOD.search(text):
        return "period_bleeding"
    return category


def triage(text: str, lang: str, cfg: SafetyConfig | None = None) -> TriageResult | None:
    """Check one message for an emergency or a crisis.

    Args:
        text: the user's message, original or normalized (characters; Simplified,
            Traditional, Cantonese-flavoured or English).
        lang: reply language, ``"zh"`` or ``"en"``.
        cfg: emergency numbers and crisis lines (default :class:`SafetyConfig`).

    Returns:
        ``None`` when no red flag is found. Otherwise a :class:`TriageResult`:
        ``kind="emergency"`` if any medical red flag matched (a crisis line is
        added when suicidal words are present too, e.g. an overdose), else
        ``kind="crisis"``. The reply is in the user's script when ``text`` was
        Traditional. ``settled`` is set when every flag's danger is told as over.
    """
    cfg = cfg or SafetyConfig()
    hits = _red_flags(text)
    if not hits:
        return None
    norm = normalize(text)
    emergencies = [h for h in hits if not h.startswith("crisis.")]
    crisis = [h for h in hits if h.startswith("crisis.")]
    if emergencies:
        rule = emergencies[0]
        reply = emergency_reply(_reply_category(emergencies, norm.text), lang, cfg, norm.variant)
        if crisis:
            line = (f"心里很难受的话，也可以拨打心理援助热线{cfg.crisis_line_zh}。" if lang == "zh"
                    else f"If you are struggling, you can also call {cfg.crisis_line_en}.")
            head, _, offer = reply.rpartition("\n")
            reply = f"{head}\n{line}\n{offer}"
        kind = "emergency"
    else:
        rule, kind = crisis[0], "crisis"
        reply = crisis_reply(lang, cfg)
    if lang == "zh":
        reply = to_user_script(reply, norm.script, norm.variant)
    over = "" if crisis else settled(norm.text, tuple(dict.fromkeys(h.split(".")[0] for h in emergencies)))
    return TriageResult(kind=kind, rule=rule, reply=reply, settled=over)
