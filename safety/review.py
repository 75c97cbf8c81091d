"""Last check on every outgoing health text: no doses, no medicine changes, no diagnoses.

Knowledge-base answers are reviewed by people, but this check runs on every text
the bot sends about health (answers, follow-ups, anything generated later), so
one bad sentence can never reach a user. It blocks:

* ``dose``: a drug amount or regimen — numbers with mg / 毫克 / 微克 / 片 / 粒 /
  单位 / tablets tied to a medicine or to taking it ("每次两片，一天三次",
  "400 mg twice a day", "布洛芬400毫克");
* ``stop_medicine``: advice to stop, reduce, double or switch a prescribed
  medicine ("可以停药", "you can stop taking your blood pressure pills") —
  warnings against doing so ("不要自行停药", "don't stop taking ... without
  talking to your doctor") pass;
* ``diagnosis``: a definitive diagnosis of the reader ("你得了胃炎", "you have
  diabetes") — conditionals ("如果您有高血压", "if you have diabetes") pass.

Nutrition and activity figures are not drug doses and pass: "盐每天不超过5克"
(《中国居民膳食指南（2022）》), "150 minutes a week" (WHO), "1500-1700毫升水",
"up to 400 mg of caffeine a day" (EFSA/FDA), "每天钙800毫克".

A blocked text is replaced whole by :data:`FALLBACK` in its language, which sends
the reader to a doctor or pharmacist.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = ["ReviewResult", "review", "FALLBACK", "REVIEW_RULES"]

FALLBACK = {
    "zh": "这个问题涉及具体用药或诊断，需要医生结合您的情况来判断，我不方便给出具体建议。请咨询您的医生或药师；如需人工帮助，请回复“人工”。",
    "en": "This touches on specific medicines or a diagnosis, which needs a doctor who knows your situation. "
          'Please ask your doctor or pharmacist; reply "human" to talk to a person.',
}
"""Replacement text for a blocked reply, by language (Simplified Chinese / English)."""


@dataclass(frozen=True)
class ReviewResult:
    """Outcome of :func:`review`.

    Attributes:
        text: the text to send: the input unchanged, or :data:`FALLBACK` when blocked.
        blocked: True when the input was replaced.
        reasons: what was found, each ``"<reason>:<rule>"`` with reason ``dose``,
            ``stop_medicine`` or ``diagnosis``; empty when not blocked.
    """

    text: str
    blocked: bool
    reasons: tuple[str, ...] = ()


_NUM = r"(?<![\d.])(?:\d+(?:\.\d+)?(?:\s*[-~～到至]\s*\d+(?:\.\d+)?)?|[零一二两三四五六七八九十百千半]+(?:[到至][零一二两三四五六七八九十百千半]+)?)"
_NUM_EN = r"(?<![\d.])(?:\d+(?:\.\d+)?(?:\s*(?:-|to)\s*\d+(?:\.\d+)?)?|one|two|three|four|half|a half|1/2)"
_PILL_ZH = "(?:片|粒|丸|胶囊|毫克|mg|微克|μg|µg|mcg|国际单位|单位|iu|滴|支)"
_WEAK_UNIT_ZH = "(?:克|g|毫升|ml)"
# Medicines (not nutrients: 钙, 叶酸, 维生素 amounts are dietary figures).
_MEDICINE_ZH = ("(?:药(?!膳|材)|布洛芬|对乙酰氨基酚|扑热息痛|阿司匹林|他汀|二甲双胍|胰岛素|褪黑素|安眠|头孢|阿莫西林|抗生素|激素|"
                "泼尼松|地塞米松|华法林|硝苯地平|氨氯地平|降压药|降糖药|止痛药|退烧药|感冒药|中成药|冲剂|口服液|糖浆|药片|混悬液|"
                "颗粒剂|胶囊)")
_NAMED_MEDICINE_ZH = ("(?:布洛芬|对乙酰氨基酚|扑热息痛|阿司匹林|他汀|二甲双胍|胰岛素|褪黑素|头孢|阿莫西林|泼尼松|地塞米松|华法林|"
                      "冲剂|口服液|糖浆|混悬液|颗粒剂|中成药|汤药)")
_FOOD_ZH = "(?:面包|姜|西瓜|苹果|柠檬|肉|饼干|吐司|坚果|核桃|红枣|枸杞)"
_MEDICINE_NAMES_EN = (r"medicine|medication|meds|drug|pills?|tablets?|capsules?|insulin|ibuprofen|advil|paracetamol|"
                      r"acetaminophen|tylenol|aspirin|statins?|metformin|amlodipine|lisinopril|warfarin|prednisone|melatonin|"
                      r"antibiotics?|amoxicillin|sleeping pills?")
_MEDICINE_EN = f"(?:{_MEDICINE_NAMES_EN})"
_FREQ_EN = (r"(?:once|twice|three times|four times|\d+ times)\s+(?:a|per|each)\s+day|every\s+\d+(?:\s*-\s*\d+)?\s+hours|"
            r"\b(?:bid|tid|qid)\b")

# (reason, rule name, pattern). Patterns run over lowercased text.
REVIEW_RULES: tuple[tuple[str, str, str], ...] = (
    ("dose", "per_time_zh", f"(?:每次|一次|每回|每顿)(?:吃|服|服用|口服|含服|用|打|注射|喷|滴)?{_NUM}{_PILL_ZH}"),
    ("dose", "regimen_zh", f"{_NUM}(?:片|粒|丸|胶囊)[^。！？\\n]{{0,8}}(?:一天|每天|每日|一日){_NUM}次|"
                           f"(?:一天|每天|每日|一日){_NUM}次[^。！？\\n]{{0,8}}{_NUM}(?:片|粒|丸|胶囊|毫克|mg|单位)"),
    ("dose", "take_amount_zh", f"(?:吃|服|服用|口服|含服|冲服|注射|打)(?:上)?{_NUM}(?:{_PILL_ZH})(?![^。！？，,\\n]{{0,4}}{_FOOD_ZH})"),
    ("dose", "medicine_amount_zh", f"{_MEDICINE_ZH}[^。！？\\n]{{0,8}}?{_NUM}\\s*{_PILL_ZH}|{_NUM}\\s*{_PILL_ZH}(?:的)?{_MEDICINE_ZH}|"
                                   f"{_NAMED_MEDICINE_ZH}[^。！？\\n]{{0,6}}?{_NUM}\\s*{_WEAK_UNIT_ZH}"),
    ("dose", "amount_frequency_en", rf"\b{_NUM_EN}\s*(?:mg|milligrams?|mcg|micrograms?|µg|iu|units?|ml|tablets?|pills?|"
                                    rf"capsules?|tabs|puffs|drops|teaspoons?)\b[^.!?\n]{{0,25}}(?:{_FREQ_EN})"),
    ("dose", "take_amount_en", rf"\b(?:take|taking|took|give|giving|inject|swallow|have)\s+(?:up to\s+|about\s+|around\s+)?"
                               rf"{_NUM_EN}\s*(?:mg|milligrams?|mcg|micrograms?|µg|iu|units?|tablets?|pills?|capsules?|tabs|"
                               rf"puffs|drops)\b"),
    ("dose", "medicine_amount_en", rf"\b{_MEDICINE_EN}\b[^.!?\n]{{0,15}}?\b{_NUM_EN}\s*(?:mg|milligrams?|mcg|µg|iu|units?|ml|"
                                   rf"tablets?|pills?|capsules?)\b|\b{_NUM_EN}\s*(?:mg|milligrams?|mcg|µg|iu|units?|ml|"
                                   rf"tablets?|pills?|capsules?)\s+(?:of\s+)?(?:\w+\s+)?{_MEDICINE_EN}\b"),
    ("stop_medicine", "stop_zh", "停药|减药|断药|换药|停掉[^。！？\\n，,]{0,4}药|停用[^。！？\\n，,]{0,6}(?:药|他汀|胰岛素)|"
                                 "(?:可以|能|就能|就可以|不妨|试着)(?:停|不吃|不用吃|不用再吃|减|减少|换)[^。！？\\n，,]{0,4}(?:药|他汀|胰岛素)|"
                                 "减(?:少)?(?:药量|剂量)|把[^。！？\\n，,]{0,6}药[^。！？\\n，,]{0,2}(?:停|减|换)|"
                                 "换成[^。！？\\n，,]{0,6}(?:药|胰岛素)|加(?:大)?(?:药量|剂量)|"
                                 "药(?:量)?(?:加倍|减半)|(?:不用|不必|无需)再?吃药|可以不吃药"),
    ("stop_medicine", "stop_en", r"\bstop(?:ping)? (?:taking|using)\b|\bstop (?:your|the|all)\s+(?:\w+\s+){0,2}?" + _MEDICINE_EN +
                                 r"|\bcome off (?:your|the)\b|\b(?:reduce|lower|cut|halve|double|increase|change|switch)\s+(?:down\s+)?"
                                 r"(?:on\s+)?your\s+(?:\w+\s+){0,2}?(?:dose|dosage|" + _MEDICINE_NAMES_EN + r")\b|"
                                 r"\byou can stop\b|\bno longer need (?:your|to take)\b|"
                                 r"\bskip (?:your|a) (?:dose|pills?|medication|insulin)\b"),
    ("diagnosis", "you_have_zh", "(?:你|您)(?:可能|应该|肯定|一定|就是|这是|这就是)?(?:得了|患了|患有)|"
                                 "(?:你|您)(?:这|这个)?(?:肯定是|应该是|就是|一定是|这是|属于)[^。！？\\n，,]{0,6}"
                                 "(?:病|症(?!状)|炎|癌|瘤|综合征|梗|中风|结石|感染|溃疡|甲亢|甲减|痛风|抑郁)|"
                                 "(?:你|您)有[^。！？\\n，,]{0,2}(?:高血压|糖尿病|心脏病|冠心病|癌|肿瘤|胃炎|肝炎|抑郁症|痛风|甲亢|甲减)|"
                                 "确诊为|诊断为|可以确诊|初步诊断"),
    ("diagnosis", "you_have_en", r"\byou(?:'ve| have)? (?:definitely |probably |likely |clearly |must |may |might |could )?"
                                 r"(?:have|got|have got|are suffering from|'re suffering from)\s+(?:a |an )?(?:\w+ ){0,2}?"
                                 r"(?:cancer|diabetes|hypertension|high blood pressure|infection|pneumonia|depression|"
                                 r"heart disease|tumou?r|gout|an?a?emia|arthritis|\w+itis|\w+osis|\w+emia|\w+oma|syndrome|"
                                 r"disease|disorder|ulcer|dementia|appendicitis)\b|"
                                 r"\byou(?:'re| are) (?:definitely |probably |clearly )?(?:diabetic|an?a?emic|hypertensive|"
                                 r"pre-?diabetic)\b|\bthis is (?:definitely |clearly |probably |likely )?(?:a |an )?"
                                 r"(?:cancer|tumou?r|stroke|heart attack|infection)\b|\byour diagnosis is\b"),
)
_COMPILED = tuple((reason, name, re.compile(p)) for reason, name, p in REVIEW_RULES)

# Context that turns a match into a warning, a condition or a referral.
_CLAUSE_START = re.compile(r"[。！？!?；;\n，,]|\.\s")
_SENTENCE_START = re.compile(r"[。！？!?；;\n]|\.\s")
# How far back a cancelling word may stand: a clause for warnings about medicines
# ("不要自行停药，..." does not cover the next clause), a sentence for conditions
# ("If feet blister, or you have diabetes and a foot wound, ...").
_WINDOW = {"stop_medicine": _CLAUSE_START, "diagnosis": _SENTENCE_START, "dose": _CLAUSE_START}
_CANCEL_BEFORE = {
    "stop_medicine": re.compile(
        "不要|别|切勿|不可|不能|不宜|请勿|勿|不得|禁止|千万|不应|避免|不建议|严禁|是否|要不要|能否|由医生|遵医嘱|医生指导|"
        r"\b(?:don'?t|do not|never|shouldn'?t|should not|must not|mustn'?t|avoid|not|without|before|whether|if|about|"
        r"ask|talk to|check with)\b"),
    "diagnosis": re.compile(
        "如果|假如|要是|若|万一|一旦|当|对于|已经|已|如|是否|有没有|会不会|担心|怀疑|"
        r"\b(?:if|when|whether|unless|once|in case|who|think|worried|wonder)\b"),
    # A number stays a number, even inside a warning: doses are never cancelled.
    "dose": re.compile("(?!)"),
}
_CANCEL_AFTER = {
    "stop_medicine": re.compile(
        "^[^。！？\\n]{0,6}(?:可能|会|容易)[^。！？\\n]{0,6}(?:导致|引起|反弹|加重|危险|风险)|"
        "^[^。！？\\n]{0,8}(?:要|需|需要|应|应该|必须|请|务必)(?:在|由|听|遵|咨询|问|和)?[^。！？\\n]{0,4}(?:医生|医嘱|遵医|药师)|"
        r"^[^.!?\n]{0,40}\bwithout (?:talking|speaking|checking|asking|consulting|first)"),
    "diagnosis": re.compile("^[^。！？\\n]{0,8}(?:的话|的人|的朋友|的患者|的老人|者|时)|^[^.!?\\n]{0,20}\\b(?:should|may want to|can)\\b"),
    "dose": re.compile("(?!)"),
}


def _clause_before(text: str, start: int, boundary: re.Pattern[str] = _CLAUSE_START) -> str:
    cut = 0
    for m in boundary.finditer(text, 0, start):
        cut = m.end()
    return text[cut:start]


@functools.lru_cache(maxsize=4096)  # replies repeat (a topic's answer, a template): checked once each
def review(text: str, lang: str) -> ReviewResult:
    """Check one outgoing text and replace it when it is unsafe (pure: results are cached).

    Args:
        text: the reply about to be sent (any length, characters).
        lang: ``"zh"`` or ``"en"``: the language of :data:`FALLBACK` if blocked.

    Returns:
        :class:`ReviewResult`; ``text`` is the original when nothing unsafe was
        found, else the fallback, with every finding listed in ``reasons``.
    """
    low = (text or "").lower()
    reasons: list[str] = []
    for reason, name, pattern in _COMPILED:
        for m in pattern.finditer(low):
            before = _clause_before(low, m.start(), _WINDOW[reason])
            after = low[m.end():]
            if _CANCEL_BEFORE[reason].search(before) or _CANCEL_AFTER[reason].search(after):
                continue
            reasons.append(f"{reason}:{name}")
            break
    if reasons:
        return ReviewResult(text=FALLBACK["zh" if lang == "zh" else "en"], blocked=True, reasons=tuple(reasons))
    return ReviewResult(text=text, blocked=False)
