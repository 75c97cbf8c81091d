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
in its context and builds the reply. Numbers: 120 (mainland China emergency medical service), 999 (Hong Kong,
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
  drooping"): the patterns never require "我" / "I".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from safety.config import SafetyConfig
from safety.normalize import normalize, to_user_script
from safety.red_flag_rules import RedFlag, gap_zh, load_red_flags, load_replies
from safety.regex_screen import LiteralIndex, all_required_literals, screen

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
    """

    kind: Literal["emergency", "crisis"]
    rule: str
    reply: str


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

# --------------------------------------------------------------------------------------
# Context that cancels a match: negation, distant past, prevention framing
# --------------------------------------------------------------------------------------

# Words allowed between a negation and the symptom ("没[什么]胸痛", "不[觉得]胸口疼").
_FILLER_ZH = "(?:什么|啥|任何|觉得|感觉|感到|出现|发生|有|过|明显|的|都|也|太|特别|我|他|她|还|再|一点|有点|啊|呀|了|一直|经常|想过|想|说|发现)"
_NEG_BEFORE_ZH = re.compile(
    "(?:(?<!有)没有?|无|(?<!是)不是|并非|未|从没有?|从来没有?|否认|(?<![受忍止挡说吃睡看听喘透站走记想对会])不|别|"
    "差点|差一点|险些|并没有?)" + _FILLER_ZH + "*$")
_NEG_AFTER_ZH = re.compile("^(?:倒是|倒|是|也|都|就|并|倒也)?(?:没有|没|无|不会|不)(?:呢|啊|的|了|过)?\\s*$")
_FILLER_EN = (r"(?:any|a|an|the|real|really|actually|been|had|having|have|has|got|get|getting|felt|feel|feeling|"
              r"experienced|experiencing|experience|signs?|of|symptoms?|my|his|her|their|much|more|significant|obvious|"
              r"other|current|currently|suffer|suffering|from|think|it|is|was|bit|kind|like|show|showing|notice|noticed|"
              r"complain|complaining|about|seem|seems|to|be|want|wanting|she|he|i|i'm|im|that|this|even|ever)")
_NEG_BEFORE_EN = re.compile(
    r"\b(?:no|not|never|without|denies|deny|don'?t|do not|doesn'?t|does not|didn'?t|did not|isn'?t|is not|aren'?t|"
    r"wasn'?t|haven'?t|have not|hasn'?t|has not|nor|neither|almost|nearly|free of|ruled out|none)"
    r"(?:\s+" + _FILLER_EN + r")*\s*$")

# Distant past: a year or more ago. Anything current between it and the match wins.
_PAST_BEFORE_ZH = re.compile(
    "(?:去年|前年|几年前|多年前|好几年前|(?:\\d+|[一二两三四五六七八九十几多]+)年前|(?<![饭觉床班学点天])以前|曾经|小时候|年轻(?:时|的时候)|"
    "之前(?:有过|得过))(?P<between>.*)$")
_PAST_MONTHS_ZH = re.compile("(?:上个?月|几个月前|(?:\\d+|[一二两三四五六七八九十几]+)个月前|上周|上礼拜|上星期)(?P<between>.*)$")
_RESOLVED_ZH = re.compile("好了|没事了|康复|痊愈|恢复了|治好|出院|没再|没有再")
_PAST_AFTER_ZH = re.compile("^(?:了|过|后)?(?:已经|有)?(?:\\d+|[一二两三四五六七八九十几多好]+)(?:多)?年(?:了|多了|前)?")
_CURRENT_ZH = re.compile("又|再次|现在|今天|今早|今晚|刚才|刚刚|突然|这会儿|此刻|目前|最近|这两天|昨天|昨晚|今儿")
_PAST_BEFORE_EN = re.compile(
    r"\b(?:last year|years? ago|in the past|used to|history of|previously|as a child|when i was young|once had|"
    r"in (?:19|20)\d\d)\b(?P<between>.*)$")
_PAST_MONTHS_EN = re.compile(r"\b(?:last month|months? ago|last week)\b(?P<between>.*)$")
_RESOLVED_EN = re.compile(r"\b(?:now fine|fine now|better now|recovered|all good now|ok now|okay now|healed|no longer)\b")
_PAST_AFTER_EN = re.compile(r"^\W*(?:\w+\s+){0,3}?(?:(?:\d+|a|one|two|three|four|five|six|seven|eight|nine|ten|a few|"
                            r"several|many)\s+years?\s+ago|last year|in (?:19|20)\d\d)\b")
_CURRENT_EN = re.compile(r"\b(?:again|now|today|tonight|this morning|just now|right now|suddenly|currently|yesterday)\b")

_PREVENT_ZH = re.compile("(?:预防|防止|避免|防范|怎么防|如何防|怎样防|远离|降低|(?:怎么|怎样|如何)(?:判断|识别|区分|分辨|知道|看出))"
                         + gap_zh(6) + "$")
_PREVENT_EN = re.compile(r"\b(?:prevent|preventing|prevention of|avoid|avoiding|risk of|reduce the risk of|"
                         r"worried about|afraid of|scared of|fear of|chance of|"
                         r"how (?:do|can|would) (?:i|you|we) (?:tell|know|recogni[sz]e|spot))\b(?:\s+[\w'-]+){0,3}\s*$")
# "心梗发作前有啥信号", "中风的前兆": asking about a condition, not describing one.
_ABOUT_AFTER = re.compile("^(?:前|之前|以前)?(?:会)?(?:有|会有)?(?:什么|啥|哪些)?(?:的)?(?:前兆|信号|征兆|先兆|症状|表现|早期)|"
                          r"^\s*(?:signs|symptoms|warning signs)\b")
# "空调对着头吹会面瘫吗": asking whether something causes it.
_RISK_BEFORE = re.compile("(?:会|容易|能|可能会|导致|引起|造成|引发)$")
# "can anxiety cause chest pain": asking what causes it.
_CAUSE_BEFORE_EN = re.compile(r"\b(?:cause|causes|causing|caused by|lead to|trigger)\s+(?:a\s+|an\s+)?$")
_QUESTION_AFTER = re.compile("^(?:了)?(?:吗|么|嘛|呢)")
# A symptom that has lasted months or years is not an emergency (it still needs a
# doctor), unless something new or sudden is said in its clause. Only the symptom's
# own clause counts ("说话不清楚好几年了", "胸口疼，好几年了"), not a background
# condition ("高血压十多年了，今天胸口疼出冷汗").
_CHRONIC = re.compile("(?:好多|很多|好几|几|多|\\d+|[一二两三四五六七八九十]+)(?:年|个多月|个月)了|多年了|很多年|"
                      r"\bfor (?:years|months|(?:\d+|two|three|four|five|six|several|many) (?:years|months))\b")
_CHRONIC_BEFORE = re.compile("(?:这几年|近几年|这些年|多年来|常年|长期|这几个月|几个月来)" + gap_zh(8) + "$|"
                             r"\bfor (?:years|months)\b")
_SHORT_CLAUSE = 12  # characters: a following clause this short only qualifies the symptom ("好多年了")
_NEW_OR_SUDDEN = re.compile("又|突然|忽然|突发|今天|刚才|刚刚|加重|越来越|现在|最近|这两天|昨天|"
                            r"\b(?:again|suddenly|today|now|worse|this morning|just now)\b")

# A full stop between digits is a decimal point ("血糖2.8", "38.5度"), not a clause boundary.
_CLAUSE_SPLIT = re.compile(r"(?:[,;!?，。；！？\n]|(?<!\d)\.|\.(?!\d))+|但是|可是|但|然而|"
                           r"\b(?:but|however|although|though|except)\b")

# Cantonese → Mandarin words that change a red flag's meaning (透唔到氣 = 透不到气).
_CANTONESE = str.maketrans({"唔": "不", "冇": "没", "咗": "了", "佢": "他", "係": "是", "喺": "在", "嘅": "的", "啲": "些"})


def _clauses(text: str) -> list[str]:
    return [c for c in _CLAUSE_SPLIT.split(text) if c and c.strip()]


def _cancelled(clause: str, start: int, end: int, not_before: re.Pattern[str] | None, rest: str,
               next_clause: str, chronic_cancels: bool) -> bool:
    """True when the context around ``clause[start:end]`` cancels the match; ``rest``
    is the message from this clause on (where "现在好了" may come later)."""
    before, after = clause[:start], clause[end:]
    if chronic_cancels and not _NEW_OR_SUDDEN.search(clause) and (
            _CHRONIC.search(after) or _CHRONIC_BEFORE.search(before)
            or (len(next_clause) <= _SHORT_CLAUSE and _CHRONIC.search(next_clause))):
        return True
    if not_before is not None and not_before.search(before):
        return True
    if _NEG_BEFORE_ZH.search(before) or _NEG_BEFORE_EN.search(before) or _NEG_AFTER_ZH.match(after):
        return True
    if _PREVENT_ZH.search(before) or _PREVENT_EN.search(before) or _ABOUT_AFTER.match(after):
        return True
    if (_RISK_BEFORE.search(before) and _QUESTION_AFTER.match(after)) or _CAUSE_BEFORE_EN.search(before):
        return True
    for past, current in ((_PAST_BEFORE_ZH, _CURRENT_ZH), (_PAST_BEFORE_EN, _CURRENT_EN)):
        m = past.search(before)
        if m and not current.search(m.group("between")):
            return True
    for past, current, resolved in ((_PAST_MONTHS_ZH, _CURRENT_ZH, _RESOLVED_ZH),
                                    (_PAST_MONTHS_EN, _CURRENT_EN, _RESOLVED_EN)):
        m = past.search(before)
        if m and not current.search(m.group("between")) and resolved.search(rest):
            return True
    return bool(_PAST_AFTER_ZH.match(after) or _PAST_AFTER_EN.match(after))


def _find(pattern: re.Pattern[str], clauses: list[str], not_before: re.Pattern[str] | None,
          chronic_cancels: bool) -> bool:
    for i, clause in enumerate(clauses):
        next_clause = clauses[i + 1] if i + 1 < len(clauses) else ""
        for m in pattern.finditer(clause):
            if not _cancelled(clause, m.start(), m.end(), not_before, " ".join(clauses[i:]), next_clause,
                              chronic_cancels):
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
    view = normalize(text).text.translate(_CANTONESE)
    clauses = _clauses(view)
    hits = []
    for i in _LITERALS.candidates(view):  # the others lack a string every match contains
        (flag, patterns, not_before, exceptions), screens = _COMPILED[i], _SCREENS[i]
        if any(s is not None and s.search(view) is None for s in screens):
            continue  # some pattern matches no clause (safety/regex_screen.py)
        if _explained(view, *exceptions):
            continue
        # Suicidal thoughts are never "chronic"; a baby's age in months is not a duration.
        # Days of diarrhoea, of no bowel movement or of an infection are the point of these flags.
        chronic_cancels = flag.category not in ("crisis", "infant_fever", "pregnancy", "dehydration", "bowel", "sepsis")
        if all(_find(p, clauses, not_before if i == 0 else None, chronic_cancels) for i, p in enumerate(patterns)):
            hits.append(f"{flag.category}.{flag.name}")
    return hits


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
_FIRST_AID_WINS = (("breathing.chok", "choking"), ("pregnancy.", "pregnancy"), ("heatstroke.", "heatstroke"),
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
        Traditional.
    """
    cfg = cfg or SafetyConfig()
    hits = match_red_flags(text)
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
    return TriageResult(kind=kind, rule=rule, reply=reply)
