"""Emergency and crisis triage: the first check on every text message.

Rule-based and high-recall by design: when a message describes a red-flag
symptom it is treated as an emergency, even if it is phrased as a question
("胸口疼是怎么回事"). The bot then gives emergency guidance only — call the
emergency number, what to do while waiting where a first-aid guideline says so,
no knowledge-base advice, no medicine — and offers a human agent.

Where the red flags come from:

* Stroke: BE-FAST (Balance, Eyes, Face, Arm, Speech, Time; stroke associations
  and the NHS "FAST" campaign) and its Chinese counterpart 中风120 (1 看一张脸是否
  口角歪斜, 2 查两只胳膊是否一侧无力, 0 聆听语言是否清晰).
* Heart attack, breathing difficulty, choking, anaphylaxis, heavy bleeding,
  poisoning, seizures, unconsciousness, vomiting blood / black stools, sudden
  worst-ever headache: NHS "When to call 999" and the conditions pages.
* Infant fever: NICE guideline NG143 (age under 3 months with a temperature of
  38 °C or higher is a "red" feature); we also count babies of exactly 3 months.
* Pregnancy warning signs (severe headache, blurred vision, bleeding, waters
  breaking, baby moving less), low blood sugar, appendicitis signs, new floaters
  with flashes (detached retina), nosebleed first aid: NHS "Pre-eclampsia",
  "Urgent advice in pregnancy", "Low blood sugar (hypoglycaemia)", "Appendicitis",
  "Detached retina", "Nosebleed"; choking: NHS / Red Cross back blows and
  abdominal thrusts; sudden severe pain in the groin or genitals: NHS
  "Testicular torsion", "Ectopic pregnancy", "Inguinal hernia repair" (a hernia
  that becomes painful and can't be pushed back is an emergency).
* Numbers: 120 (mainland China emergency medical service), 999 (Hong Kong, UK),
  112 / 911 (EU / North America) from :class:`bot.config.SafetyConfig`; crisis
  lines 12356 (China's 24-hour national psychological assistance hotline) and
  988 (US Suicide & Crisis Lifeline), also from ``SafetyConfig``.

How a match is judged (all in data below, not in if-chains):

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
* third parties count the same as the user ("我爸胸口疼出冷汗", "my mum's face is
  drooping"): the patterns never require "我" / "I".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from bot.config import SafetyConfig
from safety.normalize import normalize, to_user_script

__all__ = ["TriageResult", "RedFlag", "RED_FLAGS", "triage", "match_red_flags", "emergency_reply", "crisis_reply",
           "HONG_KONG_EMERGENCY", "UK_HK_EMERGENCY_EN"]

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


@dataclass(frozen=True)
class RedFlag:
    """One red-flag rule.

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
        unless: regex over the whole message; a hit cancels the flag (context
            that explains the symptom away, e.g. iron tablets and black stools).
    """

    category: str
    name: str
    patterns: tuple[str, ...]
    not_before: str | None = None
    unless: str | None = None


# --------------------------------------------------------------------------------------
# Pattern building blocks
# --------------------------------------------------------------------------------------

def _g(n: int) -> str:
    """Up to ``n`` Chinese characters that are not a clause boundary or a negation."""
    return f"[^,.;!?，。；！？\\n不没无未]{{0,{n}}}"


def _eg(n: int) -> str:
    """Up to ``n`` English characters, no clause boundary, no "not"/"no"/"n't"/"never"."""
    return f"(?:(?!\\bnot\\b|\\bno\\b|n't\\b|\\bnever\\b)[^,.;!?\\n]){{0,{n}}}"


G2, G3, G4, G6, G8, G10 = _g(2), _g(3), _g(4), _g(6), _g(8), _g(10)
E6, E10, E15, E20, E25 = _eg(6), _eg(10), _eg(15), _eg(20), _eg(25)
SUDDEN_ZH = "(?:突然|忽然|突发|一下子|猛地|猛然)"
PREGNANT_ZH = "(?:怀孕|孕(?:妇|期|晚期|中期|早期|[0-9一二三四五六七八九十]+周|[0-9一二三四五六七八九十]+个月)|妊娠|怀着|怀了|产检)"
SUDDEN_EN = r"\bsudden(?:ly)?\b"
#: Words that put a pain or bleeding in a period (the flags below they cancel add their own).
PERIOD_ZH = "经期|月经|例假|大姨妈|生理期"
# A hernia or lump that is trapped: will not go back, hard, discoloured.
STUCK_ZH = "推不回去|推不进去|回不去|卡住|发紫|发黑|变硬|很硬|硬邦邦"
PERSON_EN = r"(?:my|his|her|their|the|your)"
BABY_ZH = "(?:宝宝|婴儿|孩子|小孩|娃|小宝|宝贝|儿子|女儿|闺女|小家伙|新生儿|bb)"
# Ages under (and, for recall, exactly) 3 months.
INFANT_AGE_ZH = (
    "(?:新生儿|刚出生|未满月|没满月|满月|小月龄|百天|"
    "(?:不到|没到|未满|不满|才|刚|刚满|只有|出生)?(?<![\\d一二三四五六七八九十])"
    "(?:(?:[一二两俩12]|一个半|两个半)个?(?:多|半)?月|[三3]个?月(?![零又多半])|"
    "(?:[1-9]|1[0-3]|[一二三四五六七八九十]|十[一二三])(?:周(?!岁)|个?星期|个?礼拜)|"
    "(?:\\d{1,2}|[一二三四五六七八九十]{1,3})天))"
)
_WEEKS_EN = r"(?:[1-9]|1[0-3]|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve)"
INFANT_EN = (
    r"\b(?:newborn|new-born|neonate|" + _WEEKS_EN + r"[- ]weeks?[- ]old|\d{1,2}[- ]days?[- ]old|"
    r"(?:[1-3]|one|two|three)[- ]months?[- ]old|(?:under|less than|younger than) (?:3|three) months)|"
    r"\b(?:baby|infant|son|daughter|newborn)\b[^.?!\n]{0,15}?(?<!for )(?<!for the past )\b(?:" + _WEEKS_EN +
    r"\s+weeks?|\d{1,2}\s+days?|(?:[1-3]|one|two|three)\s+months?)\b(?!\s+ago)"
)
FEVER_ZH = "(?:发烧|发热|高烧|低烧|烧到|烧了|体温|3[89](?:\\.\\d)?度?|40度|烫手|摸着烫)"
FEVER_EN = r"(?:fever|temperature|\btemp\b|feverish|burning up|hot to the touch|38(?:\.\d)?\s?°?c\b|100\.4|10[0-4](?:\.\d)?\s?°?f\b)"
CHEMICAL_ZH = ("(?:农药|敌敌畏|百草枯|除草剂|杀虫剂|老鼠药|鼠药|耗子药|毒鼠强|消毒液|消毒水|84|漂白|洁厕|洗洁精|洗衣液|"
               "洗衣凝珠|汽油|煤油|医用酒精|消毒酒精|工业酒精|防冻液|甲醇|假酒|干燥剂|电池|纽扣电池|水银|磁铁)")
DISEASE_EVENT_CUE_ZH = "(?:是不是|会不会|好像|可能|疑似|怀疑|像是|像|怕是|应该是|估计)是?"
# "血" as bleeding, not 血压/血糖/验血/贫血 and the like.
BLOOD_ZH = "(?<![验抽查献测采输贫])血(?![压糖脂管型常小液检清栓红氧])"
# English phrases that ask whether something is happening now ("is this a heart attack").
SUSPECT_EN = (r"\b(?:i think|think (?:i'?m|he'?s|she'?s|it'?s|i am|he is|she is|they'?re)|maybe|might be|"
              r"could (?:this|it|that) be|is (?:this|it|that|he|she)|am i|are they|worried (?:i'?m|he'?s|she'?s|it'?s)|"
              r"scared (?:i'?m|he'?s|she'?s|it'?s)|afraid (?:i'?m|he'?s|she'?s|it'?s))\b(?:(?!risk|prevent|chance)[^.?!\n]){0,20}")

RED_FLAGS: tuple[RedFlag, ...] = (
    # ---- crisis: suicidal thoughts and self-harm -------------------------------------
    RedFlag("crisis", "suicidal_zh", (
        "想死(?![你他她它人])|不想活|活着(?:真)?没(?:意思|意义|劲|盼头)|活不下去|不如死(?:了|掉)|"
        "死了(?:算了|好了|就好了|一了百了)|一死了之|一了百了|自杀|轻生|寻死|想不开|生无可恋|活腻了|"
        "(?:想|准备|打算)(?:去)?(?:跳楼|跳河|跳江|上吊|喝农药|卧轨|死(?![你他她它人]))|要(?:去)?(?:跳楼|跳河|跳江|上吊|卧轨)|(?:想|要|准备|打算)" + G6 + "跳下去|"
        "活够了|(?:想|要)?(?:结束|了结)(?:这一切|一切)|结束(?:自己的?)?生命|了结(?:自己|生命|此生)|"
        "不想(?:再)?醒(?:来|过来)|没有活下去|撑不下去了|想(?:要)?解脱|遗书|遗言|活着(?:还)?有什么(?:意思|意义|用)|"
        "(?:想|要)离开这个世界|没有我" + G4 + "(?:更好|轻松)|不想(?:再)?拖累(?:家里|家人|你们|孩子|大家|儿女)",)),
    RedFlag("crisis", "bereaved_zh", (
        "(?:走了|去世|过世|没了|不在了|离开我|死了)",
        "(?:跟|和|随)(?:他|她|老伴|老头|孩子)?(?:一起|一块)?(?:去|走)(?:了|算了|吧)?$|去(?:陪|找)(?:他|她|老伴)|随(?:他|她)(?:而)?去"),),
    RedFlag("crisis", "bereaved_one_clause_zh", (
        "(?:走了|去世|过世|没了|不在了|离开我|死了)" + G10 + "(?:去(?:陪|找)(?:他|她|老伴)|随(?:他|她)(?:而)?去|"
        "(?:跟|和|随)(?:他|她|老伴|老头|孩子)(?:一起|一块)?(?:去|走)(?:了|算了|吧)?$)",),),
    RedFlag("crisis", "bereaved_en", (
        r"\b(?:died|passed away|passed on|lost my|is gone|was gone)\b",
        r"\b(?:(?:go|be) (?:and be )?with (?:him|her|them)|join (?:him|her|them)|follow (?:him|her|them))\b"),),
    RedFlag("crisis", "plan_zh", (
        "(?:准备|攒|存|买)(?:好|了)?" + G4 + "(?:药|安眠药|绳子|木炭|炭|刀片)|(?:药|安眠药)" + G3 + "(?:攒|存|准备)(?:好|够)",
        "结束|了结|死|不想活|离开这个世界|拖累|解脱|不想再|活着没")),
    RedFlag("crisis", "self_harm_zh", ("割腕|自残|自伤|伤害自己(?!的?(?:身体|健康|胃|肝))",)),
    RedFlag("crisis", "cut_self_zh", ("(?:割|划|烫)(?:伤|破)?(?:了)?(?:自己|手腕)(?!的?(?:身体|健康))",),
            not_before="(?:小心|切菜|做饭|削|刮)" + G3 + "$"),
    RedFlag("crisis", "suicidal_en", (
        r"\bkill(?:ing)? (?:my|him|her|them)sel(?:f|ves)|\bend(?:ing)? (?:my|his|her) (?:own )?life|\bend(?:ing)? it all\b|"
        r"\bsuicid\w*|\b(?:wants?|wanna|wanted|ready) (?:to )?die\b|\bdon'?t want to (?:live|be alive|be here|wake up|exist)|"
        r"\bno (?:reason|point) (?:to|in) (?:live|living|go on|going on)|\bbetter off dead|\btake my (?:own )?life|"
        r"\bnot worth living|\bcan'?t go on\b|\bwish i (?:was|were) dead|\bwish i (?:wasn'?t|weren'?t) (?:alive|here|born)|"
        r"\bjump off (?:a|the) (?:bridge|building|roof)|\bend(?:ing)? it (?:all|tonight|today|now|soon)\b|"
        r"\b(?:saved up|stockpil\w*|hoard\w*|collect\w*)\b" + E15 + r"\b(?:pills|tablets|meds)|\bbetter off without me|"
        r"\bif i (?:was|were) dead|\bif i (?:died|wasn'?t here)|\b(?:want|wish|wanna) (?:to )?(?:just )?disappear|"
        r"\bdisappear forever|\b(?:don'?t|do not|can'?t) see (?:the|any) point (?:in|of) (?:living|life|going on|being alive)|"
        r"\bwhat'?s the point (?:of|in) (?:living|life|going on)",)),
    RedFlag("crisis", "self_harm_en", (
        r"\bself[- ]?harm\w*|\b(?:hurt|hurting|harm|harming|cut|cutting|burn|burning) myself\b",)),

    # ---- heart attack -----------------------------------------------------------------
    RedFlag("heart_attack", "chest_pain_zh", (
        "(?:胸(?!肌|罩|围|怀|襟|有成竹|针)|心口|心窝|心前区|前胸)(?:口|部|前|膛|腔|里|这)?" + G4 +
        "(?:痛|疼|闷|压(?!力)|紧|憋|堵|绞|攥|揪|勒|难受|不舒服|石头|大石|重物|透不过|喘不)",),
        unless=PERIOD_ZH + "|乳房|乳腺|哺乳|喂奶|涨奶|胀奶|咳(?:嗽|得|的时候|时)"),
    RedFlag("heart_attack", "worst_ever_zh", ("(?:胸|心口)" + G4 + "从(?:来)?没(?:有)?(?:这么|那么|如此)" + G2 + "(?:疼|痛|难受|闷)",)),
    RedFlag("heart_attack", "heart_pain_zh", ("心脏" + G3 + "(?:疼|痛|难受|不舒服|揪|绞|压(?!力))|心绞痛",)),
    RedFlag("heart_attack", "event_zh", (
        DISEASE_EVENT_CUE_ZH + "(?:心梗|心肌梗[死塞]|心绞痛)|(?:心梗|心肌梗[死塞])(?:又|突然)?(?:犯了|发作|复发|了)|"
        "(?:心脏病|心绞痛)(?:又|突然)?(?:犯了|发作|复发)",)),
    RedFlag("heart_attack", "arm_jaw_sweat_zh", (
        "(?:左(?:肩膀?|手臂|胳膊|臂)|下巴|下颌|牙)" + G4 + "(?:疼|痛|麻|酸)",
        "冷汗|大汗|虚汗|出汗|一身汗|满头汗")),
    RedFlag("heart_attack", "discomfort_sweat_zh", (
        "(?:心里|心头|心口|胸|心里头)" + G4 + "(?:堵|闷|难受|不舒服|慌|疼|痛)", "冷汗|大汗|虚汗|一身汗|满头汗|直冒汗")),
    RedFlag("heart_attack", "palpitations_sweat_zh", (
        "心慌|心悸|心跳(?:很快|特别快|得厉害|加速|乱)|心跳得(?:特别|很|非常)?快|心脏乱跳",
        "冷汗|大汗|虚汗|要晕|快晕|眼前发黑|晕倒"), unless="更年期|潮热|绝经|烘热"),
    RedFlag("heart_attack", "chest_pain_en", (
        r"\bchest\b" + E20 + r"\b(?:pain|pains|hurts?|hurting|ache|aching|pressure|tight|tightness|heavy|heaviness|"
        r"squeez\w*|crush\w*|discomfort|sore)\b|\b(?:pain|pains|pressure|tightness|ache|discomfort|heaviness|squeezing|"
        r"crushing)\s+(?:in|on|across|around)\s+" + PERSON_EN + r"?\s*chest|\b(?:clutch\w*|holding|grabbing|grabbed)\s+"
        r"(?:at\s+)?(?:his|her|my|their) chest|\b(?:elephant|weight|brick)\b" + E25 + r"\bchest",),
        unless=r"\bbreast|\bperiod\b|menstrua|\bcough"),
    RedFlag("heart_attack", "radiating_en", (
        r"\b(?:pain|ache|numbness|tightness)\b" + E25 + r"\b(?:spread\w*|radiat\w*|going|moving|shoot\w*|travel\w*)"
        r"\s+(?:down|to|into|up)\s+" + PERSON_EN + r"?\s*(?:left\s+)?(?:arm|jaw|neck|back|shoulder)",)),
    RedFlag("heart_attack", "event_en", (
        r"\b(?:having|had|has|have|suffered|suffering)\s+(?:a|another)\s+heart attack|" +
        SUSPECT_EN + r"\bheart attack|"
        r"\bcardiac arrest|\bmy heart (?:hurts|is hurting)",)),
    RedFlag("heart_attack", "palpitations_sweat_en", (
        r"\b(?:racing heart|heart (?:is )?racing|palpitations|heart (?:is )?pounding)",
        r"\b(?:sweat\w*|faint\w*|dizz\w*|passing out|pass out)")),

    # ---- stroke (BE-FAST / 中风120) ----------------------------------------------------
    RedFlag("stroke", "face_zh", (
        "(?:口角|嘴角|嘴巴?|口眼)" + G2 + "(?:歪|斜|下垂|耷拉)|脸(?:突然|一下子)?(?:歪|斜)|面瘫|口角流涎|嘴角(?:漏水|流口水)|喝水(?:从嘴角)?漏|"
        "(?:半边|一侧|一边|左边|右边|左半边|右半边)(?:的)?(?:脸|面部?)" + G3 + "(?:麻|木|没知觉|动不了|歪|下垂|僵)",)),
    RedFlag("stroke", "limb_zh", (
        "(?:一侧|半边|半身|一边|单侧|左边|右边|左侧|右侧|左半边|右半边|半个)(?:的)?(?:身子|身体|手脚|肢体|手|脚|腿|胳膊|手臂|身)?"
        + G3 + "(?:无力|没劲|没力气?|麻|木|不听使唤|动不了|不能动|抬不起|使不上劲|不灵|没知觉|瘫|郁不到|郁不了|动不到)",)),
    RedFlag("stroke", "sudden_limb_zh", (
        SUDDEN_ZH + G4 + "(?:手|脚|腿|胳膊|手臂|胳臂|身子|身体|半边|手脚)" + G4 +
        "(?:无力|没劲|没力气?|麻|软|不听使唤|动不了|不能动|抬不起|使不上劲|拿不住|瘫)|"
        "(?:手|脚|腿|胳膊|手臂|胳臂|半边|手脚)" + G4 + SUDDEN_ZH + G2 + "(?:无力|没劲|没力气?|麻|软|不听使唤|动不了|不能动|"
        "抬不起|使不上劲|拿不住|瘫)|(?:拿不住|握不住|端不住)" + G2 + "(?:筷子|碗|杯子|勺)|(?:筷子|碗|杯子)(?:突然)?(?:掉了|掉地上|拿不住)",)),
    RedFlag("stroke", "speech_zh", (
        "(?:说话|讲话|口齿|吐字|舌头|言语)" + G3 + "(?:不清|含糊|含混|不利索|不利落|费劲|打结|大舌头|僵|发硬|不灵)|"
        "说不出话|大舌头|答非所问|话都说不(?:出|清)|不会说话了|" + SUDDEN_ZH + G4 + "听不懂|舌头" + G3 +
        "(?:捋不直|不听使唤|转不过来|打卷)|讲不(?:到|出|清)(?:嘢|话)|"
        "听不懂(?:人|别人|我们|我|家人|大家)(?:说话|讲话|说的话|的话)|讲嘢" + G3 + "(?:不清|含糊|口齿)",),
        unless="(?:嗓子|喉咙|咽|声音)" + G3 + "(?:哑|沙哑|疼|痛|发炎)|哑了|失声|^(?!.*突然).*(?:孩子|宝宝|小孩|儿童|娃|幼儿|[1-6一二两三四五六]岁)"),
    RedFlag("stroke", "confusion_zh", (
        SUDDEN_ZH + G4 + "(?:不认人|认不出人|认不得人|糊涂|说胡话|胡言乱语|神志不清|意识模糊|颠三倒四|答非所问|迷糊)",)),
    RedFlag("stroke", "vision_zh", (
        SUDDEN_ZH + G4 + "(?:看不见|看不清|看不到|失明|瞎了|重影|看东西(?:模糊|重影|成双|有两个)|视力(?:下降|模糊|丧失)|视线模糊)|"
        "一(?:只|侧|边)眼(?:睛)?" + G4 + "(?:看不见|看不清|看不到|失明|黑了|瞎)|看东西" + G2 + SUDDEN_ZH + G4 +
        "(?:看不见|看不清|模糊|重影|黑)|(?:一半|半边)(?:黑了|看不见|看不清)|半边(?:视野|看不见)|视野(?:缺|少)了一(?:块|半)",)),
    RedFlag("stroke", "vision_dark_zh", (SUDDEN_ZH + G4 + "眼前(?:一黑|发黑)",),
            unless="站起|蹲|起床|起身|坐起|低血糖|饿"),
    RedFlag("stroke", "balance_zh", (
        SUDDEN_ZH + G4 + "(?:站不稳|站不住|走不稳|走路不稳|走不了路|不会走路|走路歪|往一边倒|天旋地转|摔倒|跌倒|倒地|瘫倒|瘫软|瘫在地|栽倒|"
        "一头栽|扑倒)|(?:走路|走着|站着)" + G2 + SUDDEN_ZH + G2 + "(?:不稳|站不住|歪|倒)|(?:往|向)(?:左|右|一)边?(?:倒|偏|歪)",),
        unless="站起|蹲|起床|起身|坐起"),
    RedFlag("stroke", "event_zh", (
        DISEASE_EVENT_CUE_ZH + "(?:小中风|中风|脑梗[死塞]?|脑卒中|脑溢血|脑出血)|"
        "(?:中风|脑梗[死塞]?|脑卒中|脑溢血|脑出血)(?:又|突然)?(?:了|发作|犯了)",),
        # "中风了能吃吗", "万一中风了怎么办": a question about what to do if, not a stroke now.
        not_before="(?:万一|如果|要是|假如|备着|家里要不要)" + G8 + "$",
        unless="(?:中风|脑梗)了?(?:能|可以|能不能|该|要不要)(?:吃|用|服)|要不要备|家里备"),
    RedFlag("stroke", "face_en", (
        r"\b(?:face|mouth|smile|lip|eyelid)\b" + E15 + r"\b(?:droop\w*|sag\w*|lopsided|crooked|uneven|twisted|slack)\b|"
        r"\bone side of " + PERSON_EN + r" (?:face|mouth|body)\b|\b(?:drooping|droopy|crooked|lopsided)\s+(?:face|mouth|smile)|"
        r"\bfacial (?:droop|weakness|paralysis)|\bbell'?s palsy|\bdrool\w* (?:on|from|out of) one side|"
        r"\bface (?:went|has gone|is|feels|suddenly went) numb",)),
    RedFlag("stroke", "arm_en", (
        SUDDEN_EN + E25 + r"\b(?:weak\w*|numb\w*|paraly\w*|limp|can'?t (?:lift|move|raise|feel))|"
        r"\b(?:can'?t|cannot|unable to) (?:lift|raise|move)\b" + E10 + r"\b(?:arm|arms|leg|hand|side)\b|"
        r"\b(?:weakness|numbness|paralysis)\b" + E15 + r"\bone side|\bone (?:arm|leg|side)\b" + E15 +
        r"\b(?:weak|numb|limp|dead|heavy|won'?t move)",)),
    RedFlag("stroke", "speech_en", (
        r"\bslurr\w*|\b(?:garbled|jumbled|confused)\s+(?:speech|words)|"
        r"\b(?:can'?t|cannot|unable to|trouble|difficulty|struggling to|struggles to)\s+(?:speak|speaking|talk|talking|"
        r"get (?:the|his|her|my) words out|find (?:the|his|her|my) words)\b|"
        r"\bspeech\b" + E10 + r"\b(?:slurred|strange|garbled|weird|funny|gone)|\bwords\b" + E20 +
        r"\b(?:jumbled|garbled|slurred|muddled|mixed up|all wrong|coming out wrong)|\btalking (?:funny|strange|gibberish|nonsense)",),
        unless=r"\b(?:lost (?:my|his|her) voice|laryngitis|hoarse)"),
    RedFlag("stroke", "vision_en", (
        SUDDEN_EN + E20 + r"\b(?:vision|blind\w*|can'?t see|double vision|blurr\w*)|" + SUDDEN_EN + E10 + r"\bconfus\w*|"
        r"\blost (?:the )?(?:vision|sight) in one eye|\bcan'?t see (?:out of|with) (?:one|his|her|my|the) (?:left |right )?eye|"
        r"\bblind in one eye",)),
    RedFlag("stroke", "balance_en", (
        SUDDEN_EN + E20 + r"\b(?:dizz\w*|lost (?:his|her|my|their) balance|loss of balance|can'?t (?:walk|stand)|"
        r"unable to (?:walk|stand)|unsteady|fell over|collapsed|room (?:is )?spinning|vertigo)",),
        unless=r"\b(?:stand(?:ing)? up|get(?:ting)? up|got up)\b"),
    RedFlag("stroke", "event_en", (
        r"\b(?:having|had|has|is having|suffered|suffering)\s+(?:a|another)\s+(?:mini[- ]?)?stroke\b|"
        + SUSPECT_EN + r"\b(?:stroke|tia)\b|"
        r"\bmini[- ]?stroke\b",)),

    # ---- breathing difficulty, blue lips, choking ---------------------------------------
    RedFlag("breathing", "breathless_zh", (
        "(?:喘不(?:上|过|动|来)|透不(?:过|上|到)|上不来|接不上)气|呼吸(?:困难|不(?:上来|过来|了)|急促|费力|很费劲|衰竭)|"
        "不能呼吸|没法呼吸|无法呼吸|憋得(?:喘|透|上不来|脸)|气(?:都)?喘不|喘得(?:厉害|说不出|不行|要命|躺不下)|"
        "喘不过来|哮喘(?:发作|犯了|急性发作)",), unless="鼻子堵|鼻塞|鼻子不通"),
    RedFlag("breathing", "orthopnea_zh", (
        "(?:躺(?:平|下|着)|平躺|枕头)", "喘(?!息)|憋气|憋得|上不来气|透不过气|喘不上气|只能坐着睡"),),
    RedFlag("breathing", "cyanosis_zh", ("(?:嘴唇|嘴|脸|脸色|指甲|手指)" + G2 + "(?:发)?(?:紫|青紫|乌青|发青|青了|发绀|黑紫|发乌)",)),
    RedFlag("breathing", "choking_zh", (
        "(?:噎住|噎着|哽住|卡住|卡在)" + G4 + "(?:喉咙|嗓子|气管|喘|说不出|脸|呼吸)|"
        "(?:喉咙|嗓子|气管)(?:里|眼)?" + G2 + "(?:卡|噎|堵)(?:住|了)?" + G4 + "(?:喘|说不出|呼吸|脸)|噎(?:住|着)了",),
        not_before="(?:容易|经常|老是|总是|常常|有时|偶尔|爱)" + G3 + "$", unless="(?:现在|已经)(?:好了|没事)"),
    RedFlag("breathing", "choked_struggling_zh", (
        "(?:噎|呛|卡)(?:住|到|着)", "喘|憋|脸(?:色)?(?:发)?(?:红|紫|青)|说不出|咳不出|发紫|发青|翻白眼"),
        unless="(?:现在|已经)(?:好了|没事)"),
    RedFlag("breathing", "breathless_en", (
        r"\b(?:can'?t|cannot|can not|unable to|struggling to|struggles to|hard to|difficult to|trouble|difficulty|problems?)\s+"
        r"(?:breath\w*\b|catch (?:my|his|her|their) breath|get (?:air|a breath|his breath|her breath|my breath))"
        r"(?!\s+(?:through|out of|with) " + PERSON_EN + r" nose)|"
        r"\b(?:gasping|not getting (?:enough )?air|struggling for (?:air|breath)|fighting for air)|"
        r"\bwheez\w* (?:badly|heavily|a lot)|\basthma attack",)),
    RedFlag("breathing", "short_of_breath_en", (r"\b(?:short(?:ness)? of breath|breathless\w*|out of breath)",),
            unless=r"\b(?:climb\w*|stairs|walk\w*|exercis\w*|run\w*|jog\w*|hills?|workouts?|gym|fitness|effort|exertion|"
                   r"easily)\b"),
    RedFlag("breathing", "cyanosis_en", (
        r"\b(?:lips?|face|fingers?|fingertips|nails?|skin)\b" + E10 + r"\b(?:blue|bluish|purple|grey|gray)\b|"
        r"\b(?:turning|turned|gone|going|is)\s+(?:blue|purple)\b",),
        # Marks that gua sha, cupping or a knock leave on the skin are expected, not cyanosis.
        unless=r"\bgua ?sha\b|\bcupping\b|\bscraping\b|\bbruis"),
    RedFlag("breathing", "choking_en", (
        r"\bchok(?:ing|ed|es)\b(?!\s+hazard)|\b(?:something|food|it|a \w+)\s+(?:is\s+|got\s+)?stuck in " + PERSON_EN +
        r" (?:throat|windpipe|airway)",),
        not_before=r"\b(?:easily|often|always|sometimes|prevent|avoid)\b" + E10 + "$",
        unless=r"\b(?:fine|okay|ok|better|all right|alright) now\b|\bnow (?:fine|okay|ok|better)\b"),

    # ---- anaphylaxis ------------------------------------------------------------------
    RedFlag("anaphylaxis", "throat_tight_zh", (
        "(?:喉咙|嗓子|喉头)" + G3 + "(?:发紧|紧得|锁住|被掐|缩紧|水肿)|过敏性休克|严重过敏反应",)),
    RedFlag("anaphylaxis", "swelling_after_trigger_zh", (
        "(?:喉咙|嗓子|舌头|嘴唇|眼皮|脸|面部|全身|浑身)" + G4 + "(?:肿|水肿|胀|风团|疹子|起包|荨麻疹)",
        "过敏|蛰|蜇|叮|咬|打针|输液|吃药后|吃了药|花生|海鲜|芒果|坚果|虾|蟹|菠萝|青霉素|头孢|突然")),
    RedFlag("anaphylaxis", "hives_and_breathing_zh", (
        "(?:全身|浑身|身上|脸上|皮肤|满身)" + G4 + "(?:起疙瘩|起包|风团|疹子|红疹|荨麻疹|起红点|红点|痒|肿)",
        "喘|呼吸困难|透不过气|喘不上气|憋气|憋得慌|胸闷|嗓子(?:发)?紧|喉咙(?:发)?紧|喉咙肿|舌头肿|嘴唇肿|头晕|发晕")),
    RedFlag("anaphylaxis", "throat_en", (
        r"\bthroat\b" + _eg(40) + r"\b(?:closing|tight\w*|clos\w* up|swell\w* shut)|\btongue\b" + E10 + r"\b(?:swell\w*|swollen)|"
        r"\bswollen tongue|\banaphyla\w*|\bepi-?pen|\badrenaline (?:pen|auto)",)),
    RedFlag("anaphylaxis", "throat_swelling_en", (r"\bthroat\b" + E15 + r"\b(?:swell\w*|swollen)|\bswollen throat",),
            unless=r"\bsore throat|\btonsil|\bstrep\b|\bcold\b|\bflu\b"),
    RedFlag("anaphylaxis", "swelling_after_trigger_en", (
        r"\b(?:lips?|face|eyes?|mouth)\b" + E10 + r"\b(?:swell\w*|swollen|puff\w* up|blow\w* up)|\bswollen (?:lips?|face|eyes?)",
        r"\b(?:after (?:eating|a sting|being stung)|stung|sting|bee|wasp|ate|eating|peanuts?|nuts?|shellfish|allerg\w*|"
        r"injection)")),

    # ---- heavy bleeding ---------------------------------------------------------------
    RedFlag("bleeding", "uncontrolled_zh", (
        "(?:" + BLOOD_ZH + "|出血|流血)" + G10 + "(?:止不住|止不了|不止|停不下来)|"
        "(?:" + BLOOD_ZH + "|出血|流血)" + G4 + "(?:一直流|流个不停|哗哗|喷|涌)|一直(?:在)?(?:流|出|冒)血|止不住(?:的)?(?:血|流血|出血)|"
        "大出血|大量出血|血流不止|血流如注|喷血|(?:伤口|口子)" + G6 + "(?:很深|好深|见骨|止不住|一直(?:流|出)血)|割到(?:动脉|血管)",)),
    RedFlag("bleeding", "a_lot_zh", ("(?:" + BLOOD_ZH + "|出血|流血)" + G2 + "(?:很多|好多|特别多|一大滩|一地)|(?:流|出)了?" + G2 +
                                     "(?:很多|好多|一大滩|一地|一大摊)(?:的)?血",),
            unless=PERIOD_ZH + "|牙龈|刷牙"),
    RedFlag("bleeding", "uncontrolled_en", (
        r"\bbleed\w*\b" + E20 + r"\b(?:won'?t|will not|wont|doesn'?t|does not|can'?t|isn'?t) stop|"
        r"\b(?:won'?t|can'?t|cannot|couldn'?t) stop (?:the )?bleed\w*|\bblood\b" + E10 + r"\b(?:spurt\w*|pour\w*|gush\w*|everywhere)|"
        r"\b(?:deep|bad) (?:cut|wound|gash)\b",)),
    RedFlag("bleeding", "nosebleed_en", (
        r"\bnose ?bleed\w*\b|\bnose\b" + E10 + r"\bbleed\w*",
        r"\b(?:won'?t stop|hasn'?t stopped|not stopping|keeps? going|(?:\d+|twenty|thirty|forty) minutes|an hour)\b"),),
    RedFlag("bleeding", "heavy_en", (
        r"\b(?:heavy|heavily|severe|severely|profuse\w*|a lot of|lots of|so much|massive)\s+(?:bleed\w*|blood)|"
        r"\bbleeding (?:heavily|a lot|badly|profusely|everywhere)",),
        unless=r"\bperiods?\b|menstrua|\bgums?\b|\bstool|\bpoo|\bvomit"),

    # ---- poisoning / overdose ---------------------------------------------------------
    RedFlag("poisoning", "overdose_zh", (
        "(?:吃|吞|服)(?:了|下|掉)?" + G4 + "(?:一|整|半|几|两|好几|大)(?:整)?(?:瓶|盒|板|把|大把|排)" + G3 +
        "(?:药|片|胶囊)|(?:药|片|胶囊)" + G4 + "(?:吃|吞|服)(?:了|下|掉)" + G2 + "(?:一|整|半|几|两|好几)(?:整)?(?:瓶|盒|板|把)|"
        "(?:吃|服|吞)(?:了|下|掉)" + G2 + "(?:\\d{2,}|十几|几十|二十|三十|四十|五十|一百|一大把|一把|一堆|过量|大量)(?:多)?(?:片|粒|颗)?|"
        "药(?:吃|服)(?:多|过量|重复|错|重)了|(?:吃|服)(?:多|错|重)了?药|吃药吃(?:多|错|重)了|(?:服|用)药过量|过量服(?:用|药)|"
        "误服|误食|误吃|误喝|误饮|吃错了?药|吞(?:了|下)" + G4 + "(?:很多|好多|一大把|一把|一堆)?" + G2 + "(?:药|片|胶囊)|"
        "(?:吃|服)(?:了|下)" + G2 + "(?:很多|好多|一大把|一把|一堆)(?:的)?(?:安眠药|镇静药|降糖药|降压药|止痛药|退烧药|抗抑郁药)|"
        "把" + G8 + "(?:药|片|胶囊)" + G3 + "(?:都|全|全部)?(?:吃|吞|喝)(?:了|掉|下)",)),
    RedFlag("poisoning", "chemical_zh", (
        "(?:喝|吃|服|吞|咽)(?:了|下|掉)?" + G4 + CHEMICAL_ZH + "|" +
        CHEMICAL_ZH + G4 + "(?:喝|吃|吞|咽)(?:了|下|掉)|咬破了?体温计|(?<![物会能])中毒(?![吗么嘛])|"
        "(?:被|让)?(?:毒)?蛇咬|蛇咬伤",)),
    RedFlag("poisoning", "gas_zh", (
        "(?:煤气|一氧化碳|燃气|天然气|炭火|烧炭|煤炉|炉子|炭盆)",
        "中毒|头晕|头疼|头痛|恶心|晕倒|叫不醒|昏|站不起|泄漏|泄露|漏气|味道?很大")),
    RedFlag("poisoning", "mushroom_zh", (
        "(?:吃|误食)(?:了|完|过)?" + G8 + "(?:(?:野|毒|山上|采的|路边|捡的)" + G4 + "蘑菇|野生菌|菌子|见手青)",
        "吐|晕|拉肚子|又拉|腹泻|幻觉|小人|不舒服|恶心|肚子疼|腹痛")),
    RedFlag("poisoning", "overdose_en", (
        r"\boverdos\w*|\b(?:took|swallowed|ate|taken|has taken|downed)\b" + E20 +
        r"\b(?:whole|entire|full|all (?:of )?(?:the|my|his|her))\b" + E10 + r"\b(?:bottle|pack\w*|box|strip|blister|pills|"
        r"tablets|meds|medication)|\btoo many\b" + E10 + r"\b(?:pills|tablets|capsules|meds|sleeping)|"
        r"\b(?:ate|eaten|got into|swallowed)\s+(?:some|a few|several|a handful|a bunch|all|lots)\s+(?:of\s+)?"
        r"(?:my|his|her|the|our|their|\w+'s)\s+(?:\w+\s+)?(?:pills|tablets|medicine|medication|meds|capsules)|"
        r"\b(?:took|taken|swallowed|ate|downed)\s+(?:\d{2,}|a handful of|handfuls of|twenty|thirty|forty|fifty)\s+"
        r"(?:\w+\s+)?(?:pills|tablets|capsules|paracetamol|acetaminophen|tylenol|ibuprofen|aspirin|painkillers|"
        r"sleeping pills)|\b(?:took|taken|swallowed|ate|downed|had)\s+(?:a bunch of|a lot of|lots of|loads of|a load of|"
        r"heaps of|a pile of|all (?:of )?(?:the|his|her|my|their))\s+(?:\w+\s+)?(?:pills|tablets|capsules|meds|"
        r"medication|painkillers|sleeping pills)",)),
    RedFlag("poisoning", "pills_and_unresponsive_en", (
        r"\b(?:pills|tablets|capsules|meds|medication|painkillers|sleeping pills|overdos\w*|drank|drinking|alcohol)\b",
        r"\b(?:won'?t|will not|doesn'?t|can'?t|cannot|couldn'?t) (?:wake|waking|be woken)|\bnot waking|\bunresponsive|"
        r"\bpassed out|\bunconscious|\bwon'?t respond|\bnot responding")),
    RedFlag("poisoning", "chemical_en", (
        r"\b(?:swallowed|drank|ate|drinking|ingested|has eaten|has drunk)\b" + E15 +
        r"\b(?:bleach|poison\w*|pesticide|weed ?killer|antifreeze|detergent|laundry pod|dishwasher (?:tablet|pod)|"
        r"batter(?:y|ies)|rat poison|cleaning (?:product|fluid)|paint thinner|petrol|gasoline|kerosene|methanol|mercury|"
        r"silica gel|magnets?)|\bcarbon monoxide (?:poison\w*|leak)|"
        r"\b(?:co|carbon monoxide|gas) alarm (?:is )?(?:going off|went off|beeping)|\bgas leak|(?<!food )\bpoison(?:ed|ing)\b|"
        r"\bsnake ?bite|\bbitten by a snake|\b(?:wild|poisonous) mushroom",)),

    # ---- seizure and unconsciousness --------------------------------------------------
    RedFlag("seizure", "seizure_zh", (
        "抽搐|抽风|痉挛发作|癫痫(?:发作|犯了|又犯)|羊(?:癫|角)疯|口吐白沫|翻白眼|惊厥|抽了过去",),
        not_before="(?:眼皮|眼睑|眼角|嘴角|面肌|脸部?|面部|肌肉|小腿|腿肚子|腿|脚|脚趾|手指|胃|肚子|眼睛)" + G3 + "$"),
    RedFlag("unconscious", "unresponsive_zh", (
        "昏迷|不省人事|人事不省|叫不醒|喊不醒|叫不应|喊不应|拍不醒|摇不醒|(?:叫|喊|拍|摇)" + G4 + "(?:不醒|不应|没有?反应)|叫(?:他|她|人)?(?:都)?没(?:有)?反应|"
        "没(?:有)?(?:了)?(?:意识|心跳|脉搏)|失去(?:意识|知觉)|意识(?:不清|模糊|丧失)|神志不清|"
        "昏倒|晕倒|晕过去|昏过去|倒地不起|倒在地上|休克(?![吗么])|心跳骤停|心脏骤停|心跳停了",)),
    RedFlag("unconscious", "not_breathing_zh", ("没(?:有)?(?:了)?呼吸(?!暂停|困难|急促|不畅|问题|道)|呼吸(?:停了|停止了)",),
            unless="打鼾|打呼|呼噜|鼾|睡眠呼吸暂停"),
    RedFlag("seizure", "seizure_en", (
        r"\bseiz(?:ure|ures|ing|ed)\b|\bconvuls\w*|\bfitting\b|\b(?:having|had) (?:a|another) fit\b|\bepileptic (?:fit|attack)|"
        r"\bfoaming at the mouth|\beyes rolled? back",)),
    RedFlag("unconscious", "unresponsive_en", (
        r"\bunconscious|\bunresponsive|\bnot responding\b|\bstill (?:not|isn'?t) (?:awake|conscious|responding)|"
        r"\b(?:he|she|they|baby|dad|mum|mom|grandma|grandpa|granny|father|mother|husband|wife|son|daughter|friend|"
        r"brother|sister|partner|boyfriend|girlfriend|child|kid|someone|somebody|roommate|neighbou?r)\b" + E15 +
        r"\b(?:won'?t|will not|isn'?t|is not|doesn'?t|can'?t) (?:wake|waking)|\b(?:won'?t|can'?t|cannot|couldn'?t) wake "
        r"(?:him|her|them|my \w+|the baby)\b|\bpassed out|\bblack(?:ed)? out\b(?!\s*curtain)|\bfaint(?:ed|ing)\b|"
        r"\bcollaps(?:ed|ing)\b|\bno (?:pulse|heartbeat)\b|"
        r"\bcardiac arrest|\bkeeled over",)),
    RedFlag("unconscious", "not_breathing_en", (r"\b(?:not|isn'?t|stopped|stops) breathing\b",),
            unless=r"\bsnor\w*|\bsleep apn\w*"),

    # ---- infant under 3 months with fever (NICE NG143) --------------------------------
    RedFlag("infant_fever", "infant_fever_zh", (
        BABY_ZH + "(?:才|刚|刚满|只有|还不到|不到|啱啱|啱)?" + INFANT_AGE_ZH + "|" + INFANT_AGE_ZH + "(?:大)?(?:的)?" + BABY_ZH +
        "|新生儿|刚出生|" + INFANT_AGE_ZH + "大(?!了?(?:以后|之后|后))",
        FEVER_ZH), not_before="(?:烧|热|咳|病|吐|拉)(?:了)?$"),
    RedFlag("infant_fever", "infant_fever_en", (INFANT_EN, FEVER_EN)),

    # ---- sudden worst-ever headache; meningitis signs -------------------------------------
    RedFlag("severe_headache", "thunderclap_zh", (
        "雷击样|霹雳样|" + SUDDEN_ZH + G4 + "(?:剧烈|剧|爆炸|炸裂|撕裂)" + G3 + "(?:的)?头(?:痛|疼)|" +
        SUDDEN_ZH + G4 + "头(?:痛|疼)" + G4 + "(?:欲裂|炸|爆|剧烈|厉害得|受不了|难忍|要命)|"
        "(?:这辈子|一辈子|有生以来|从来没有?|从没|前所未有|史上)" + G6 + "(?:厉害|严重|剧烈|疼|痛)" + G2 + "(?:的)?头(?:痛|疼)|"
        "最(?:厉害|严重|剧烈|疼|痛)的一次头(?:痛|疼)|头" + SUDDEN_ZH + G8 + "(?:疼|痛)|头" + G10 + "(?:砸|劈|炸开|炸裂|裂开)|"
        "头(?:痛|疼)" + G4 + "(?:从来没有?这么|从没这么|前所未有|这辈子最)",)),
    RedFlag("severe_headache", "stiff_neck_fever_zh", (
        "(?:脖子|颈部|颈|后颈)" + G3 + "(?:发硬|硬|僵|转不动|不能弯|低不下)", "发烧|发热|高烧")),
    RedFlag("severe_headache", "thunderclap_en", (
        r"\bworst headache|\bthunderclap|" + SUDDEN_EN + E15 + r"\b(?:severe|excruciating|explosive|terrible|intense|"
        r"blinding|splitting|agonizing|agonising|violent)\s+headache|\bheadache\b" + E20 + r"\b(?:out of nowhere|"
        r"like (?:a|being) (?:hit|struck|kicked)|exploded|explosive|worst)|\bhead (?:feels like it(?:'s| is) )?"
        r"(?:exploding|going to explode)",)),
    RedFlag("severe_headache", "stiff_neck_fever_en", (r"\bstiff neck|\bneck (?:is )?(?:stiff|rigid)", r"\b(?:fever|high temperature)")),

    # ---- vomiting blood, black tarry stools ------------------------------------------
    RedFlag("gi_bleed", "vomit_blood_zh", (
        "(?:吐|呕)(?:了|出)?" + G6 + BLOOD_ZH + "|呕血|咯血|咳(?:了|出)?" + G3 + BLOOD_ZH + "|咖啡(?:渣|色)样?" + G4 + "(?:呕吐|吐|东西)|"
        "(?:呕吐物|吐的东西)" + G4 + "(?:血|咖啡|黑)|(?:吐|呕)" + G8 + "咖啡(?:渣|色)|(?:大便|便)" + G4 + "(?:很多|大量|全是|都是|一大滩|一马桶)" + G2 + "血|"
        "拉(?:了)?" + G3 + "(?:很多|好多|大量|一马桶|全是)(?:的)?血|便血" + G4 + "(?:很多|不止|止不住|大量)|柏油(?:样|色|便)",),
        not_before="(?:气|急|累|笑|贵|坑|亏)(?:得|到|的)" + G2 + "$"),
    RedFlag("gi_bleed", "bleed_event_zh", ("(?:胃|消化道|肠道?)(?:大)?出血",)),
    RedFlag("gi_bleed", "black_stool_zh", (
        "黑便|(?:大便|便便|屎|拉的|粪便)" + G4 + "(?:黑|发黑|是黑)|拉" + G3 + "黑(?:色)?(?:的)?(?:大便|便|屎)",),
        unless="补铁|铁剂|硫酸亚铁|琥珀酸亚铁|铁片|猪血|鸭血|血豆腐|动物血|铋|黑芝麻|桑葚|蓝莓|墨鱼"),
    RedFlag("gi_bleed", "vomit_blood_en", (
        r"\b(?:vomit\w*|throw\w* up|threw up|puk\w*|cough\w* up|spitting up|spit up|bringing up)\b" + E10 + r"\bblood|"
        r"\bblood\b" + E10 + r"\b(?:in|from)\b" + E6 + r"\b(?:vomit|sick|puke)|\bha?ematemesis|\bcoffee[- ]grounds?|"
        r"\b(?:lots of|a lot of|large amount of)\b" + E10 + r"\bblood\b" + E20 + r"\b(?:stool|poo|poop|toilet)|\btarry\b",)),
    RedFlag("gi_bleed", "black_stool_en", (
        r"\bblack\b" + E10 + r"\b(?:stool|stools|poo|poop|bowel movements?)|\b(?:stool|stools|poo|poop)\b" + E10 +
        r"\b(?:black|like tar)\b",),
        unless=r"\biron\b|\bbismuth|pepto|\bblueberr|\bliquorice|\blicorice"),

    # ---- very high blood pressure with symptoms -----------------------------------------
    RedFlag("high_bp", "high_bp_zh", (
        "(?:血压|高压|收缩压)" + G6 + "(?:(?<![\\d.])(?:1[89]\\d|2\\d\\d)(?![\\d.])|两百|二百|一百八|一百九)",
        "头(?:痛|疼)|头晕|吐|呕|恶心|胸(?:闷|痛|疼)|看不清|眼花|视物模糊|说话不清|手脚(?:麻|无力)|喘不上气"),),
    RedFlag("high_bp", "high_bp_en", (
        r"\b(?:blood pressure|bp)\b" + E15 + r"(?<![\d.])(?:1[89]\d|2\d\d)(?![\d.])",
        r"\b(?:headache|vomit\w*|throwing up|chest pain|blurr\w*|confus\w*|short of breath|numb\w*)"),),

    # ---- a fall with hip or thigh pain and unable to stand (hip fracture) ---------------
    RedFlag("fracture", "hip_zh", (
        "摔|跌|滑倒|绊倒", "(?:胯|髋|大腿根|屁股|腿)" + G4 + "(?:疼|痛)",
        "站不起|起不来|不能走|走不了|动不了|不能动|腿变短|腿往外撇"),),
    RedFlag("fracture", "hip_en", (
        r"\b(?:fell|fall|fallen|slipped|tripped)\b", r"\b(?:hip|thigh|groin)\b",
        r"\b(?:can'?t|cannot|unable to) (?:stand|get up|walk|put weight)"),),

    # ---- heat stroke ----------------------------------------------------------------------
    RedFlag("heatstroke", "heatstroke_zh", (
        "中暑|大热天|高温|太阳底下|烈日|地里干活|闷热|晒晕|晒昏|暴晒|工地", "不出汗|滚烫|体温(?:很高|四十|40)|迷糊|糊涂|叫不醒|"
        "说胡话|神志不清|抽搐|晕倒|昏倒|不(?:太)?答应|没(?:有)?反应"),),
    RedFlag("heatstroke", "heatstroke_en", (
        r"\bheat ?stroke|\b(?:in the heat|hot day|heatwave|in the sun)\b",
        r"\b(?:confus\w*|stopped sweating|not sweating|collaps\w*|unresponsive|fainted|seizure|very hot to the touch)"),),

    # ---- head injury on blood thinners ----------------------------------------------------
    RedFlag("head_injury", "anticoagulant_zh", (
        "(?:摔|磕|撞|碰)" + G6 + "(?:头|脑袋|后脑|额头)|(?:头|脑袋|后脑|额头)" + G3 + "(?:磕|撞|碰|摔)",
        "抗凝|华法林|阿司匹林|氯吡格雷|波立维|利伐沙班|达比加群|阿哌沙班|稀释血液的药"),),
    RedFlag("head_injury", "anticoagulant_en", (
        r"\b(?:hit|bumped|banged|knocked) (?:his|her|my|their) head|\b(?:fell|fall)\b" + E20 + r"\bhead\b",
        r"\b(?:blood thinners?|anticoagulants?|warfarin|apixaban|eliquis|rivaroxaban|xarelto|clopidogrel|aspirin)\b"),),

    # ---- vomiting with days of no bowel movement (bowel obstruction) ----------------------
    RedFlag("bowel", "obstruction_zh", (
        "(?:几|好几|\\d+|[三四五六七八九十]+)天(?:都|了)?没(?:有)?(?:大便|拉屎|解大便|排便|拉|放屁)", "吐|呕"),),
    RedFlag("bowel", "obstruction_en", (
        r"\b(?:hasn'?t|haven'?t|not|no) (?:pooped|had a (?:poo|bowel movement)|been to the toilet|passed (?:stool|wind))",
        r"\b(?:vomit\w*|throwing up|threw up|being sick)\b"),),

    # ---- wild mushrooms with symptoms (poisoning) -----------------------------------------
    RedFlag("poisoning", "mushroom_zh", (
        "菌子|蘑菇|野生菌|见手青|毒菌|鹅膏", "小人|幻觉|看见|胡话|吐|呕|拉肚子|腹泻|肚子疼|头晕|迷糊|抽|心慌"),
        unless="怎么(?:做|炒|吃)|能不能吃|怎么分辨|怎么辨别"),
    RedFlag("poisoning", "mushroom_en", (r"\b(?:wild )?mushrooms?\b", r"\b(?:hallucinat\w*|vomit\w*|throwing up|diarrh\w*|"
                                                                      r"cramps|confus\w*)"),),

    # ---- fourth probe round ----------------------------------------------------------------
    RedFlag("poisoning", "methanol_zh", ("散装酒|假酒|来路不明的酒|自酿的?酒|工业酒精|甲醇", "看不清|模糊|眼花|头(?:疼|痛)|吐|迷糊|瞎"),),
    RedFlag("poisoning", "household_en", (
        r"\b(?:dishwasher|detergent|laundry|washing|cleaning)\b" + E15 + r"\b(?:tablets?|pods?|capsules?|liquid|powder)\b|\bbleach\b",
        r"\b(?:swallow\w*|ate|eaten|drank|drunk|got into|foam\w*|chew\w*)\b"),),
    RedFlag("poisoning", "co_en", (
        r"\b(?:gas heater|heater|boiler|stove|charcoal|generator|gas fire)\b", r"\b(?:headaches?|dizz\w*|feel\w* sick|nause\w*|drowsy)\b",
        r"\b(?:whole family|all of us|everyone|both of us|we all|all night|the kids)\b"),),
    # Large burns and scalds (NHS "Burns and scalds": cool with running water, cover, A&E).
    RedFlag("burn", "large_zh", (
        "烧伤|烫伤|烫了|烧着|被开水|被热油|着火",
        "大片|一大片|半个身子|半身|全身|整个(?:胸口|肚子|后背|背|腿|胳膊)|胸口|肚子|脸上|脸都|皮(?:都)?(?:黑|焦|白)|焦了|起了一大片"),
        unless="晒伤|防晒|怎么预防"),
    RedFlag("burn", "large_en", (
        r"\b(?:burn\w*|scald\w*)\b|\bboiling (?:water|oil|soup)|\bhot (?:oil|water|soup)\b",
        r"\b(?:large|big|huge|whole|most of|all over|from (?:his|her|my) neck|chest|face|charred|black(?:ened)?|white and leathery)\b"),
        unless=r"\bsunburn|\bheartburn|\bcalories|\bburning up\b"),
    # Obvious fractures.
    RedFlag("fracture", "deformed_zh", (
        "骨头" + G4 + "(?:露|戳|刺|穿)(?:出|了出)|(?:腿|胳膊|手臂|手腕|脚踝|小腿|大腿)" + G4 +
        "(?:弯成|歪成|变形|折了|断了|反着|往外拐|不对劲地弯)|(?:脚|手|腿)(?:发紫|冰凉|发凉)" + G4 + "(?:压|碾|轧)|(?:压|碾|轧)" + G6 + "(?:发紫|冰凉|冰冷)",),),
    RedFlag("fracture", "crushed_zh", ("(?:压|碾|轧|砸)(?:了|伤|到|住)", "冰凉|冰冷|发紫|发黑|没知觉|肿得"),),
    RedFlag("fracture", "deformed_en", (
        r"\bbone\b" + E15 + r"\b(?:sticking|poking) (?:out|through)|\b(?:bent|twisted) at (?:a|an) (?:weird|odd|funny|strange|wrong) angle|"
        r"\bopen fracture|\bbroken (?:leg|arm|wrist|ankle|hip)\b",),),
    # Head injury with warning signs (NICE NG232 / NHS "Head injury": A&E).
    RedFlag("head_injury", "warning_zh", (
        "(?:磕|撞|摔|碰|砸)" + G6 + "(?:头|脑袋|后脑|额头)|(?:头|脑袋|后脑|额头)" + G3 + "(?:磕|撞|摔|碰|砸)",
        "吐|呕|想睡|老想睡|嗜睡|叫不醒|迷糊|糊涂|记不(?:起|得|清)|忘了刚才|耳朵(?:里)?流|鼻子(?:里)?流(?:清)?水|抽|昏过去|晕过去"),),
    RedFlag("head_injury", "warning_en", (
        r"\b(?:hit|bumped|banged|knocked|hurt)\b" + E15 + r"\bhead\b|\bhead (?:injury|injured)\b|\bfell\b" + E20 + r"\bhead\b",
        r"\b(?:vomit\w*|threw up|throwing up|sleepy|drowsy|confus\w*|can'?t remember|won'?t wake|clear fluid|fit|seizure)\b"),),
    # Near-drowning and electric shock: hospital even if they seem fine.
    RedFlag("drowning", "drowning_zh", ("溺水|落水|呛水" + G8 + "捞|(?:河|水|池塘|水缸|水库|湖)里" + G6 + "捞(?:上来|起来|出来)|掉(?:进|到)?(?:了)?" + G3 + "(?:河|水缸|水里|池塘|水塘|水库|泳池|湖)|从(?:水|河|池)" + G4 + "(?:捞|拉|救)",),),
    RedFlag("drowning", "drowning_en", (r"\bdrown\w*|\bpulled\b" + E20 + r"\b(?:out of|from) (?:the )?(?:water|river|pool|lake|pond|sea|bath)",),),
    RedFlag("electric", "electric_zh", ("触电|电击|被电(?:到|打|击|了)|电(?:到|打)了|摸到(?:电线|插座|电门)|插座" + G4 + "电",),
            unless="静电"),
    RedFlag("electric", "electric_en", (r"\belectric(?:al)? shock|\belectrocut\w*|\b(?:touched|grabbed)\b" + E15 + r"\b(?:power ?line|live wire|cable)|"
                                        r"\bshocked by (?:a|the) (?:socket|outlet|wire)",), unless=r"\bstatic"),
    # Severe infection (sepsis) and meningitis signs (NHS "Sepsis", "Meningitis").
    RedFlag("sepsis", "sepsis_zh", (
        "发烧|发热|高烧|烧到|3[89]度|40度|体温", "(?:手脚|手|脚)(?:冰凉|冰冷|发凉|发紫|花花的)|皮肤发花|尿(?:很少|没有|不出)|一天没尿|寒战|打摆子",
        "迷糊|糊涂|说胡话|反应" + G2 + "慢|叫不醒|不太答应|呼吸(?:很|特别)?快|喘"),),
    RedFlag("sepsis", "sepsis_en", (
        FEVER_EN, r"\b(?:cold|blue|mottled|blotchy) (?:hands|feet|skin)|\b(?:hands|feet)\b" + E10 + r"\b(?:ice[- ]cold|cold|blue|mottled)\b|"
        r"\bno (?:wee|pee|urine)|\bhasn'?t (?:peed|weed)",
        r"\b(?:confus\w*|not making sense|drowsy|breathing (?:fast|quickly)|fast breathing|slurr\w*)"),),
    RedFlag("sepsis", "wound_zh", ("伤口|口子|疮", "发黑|发臭|化脓|流脓|红肿|烂", "发烧|发热|高烧|说胡话|迷糊|糊涂|寒战"),),
    RedFlag("sepsis", "purple_rash_zh", (
        "(?:紫|红|暗红)(?:色)?(?:的)?(?:小)?(?:点|斑|疹|点点)", "按(?:了|着|一下)?(?:也)?(?:不(?:褪|消|退|变)|还在)|压(?:了)?(?:也)?不(?:褪|消)"),),
    RedFlag("sepsis", "purple_rash_en", (r"\b(?:rash|spots)\b", r"\b(?:doesn'?t|does not|won'?t|didn'?t) fade|\bglass test"),),
    RedFlag("severe_headache", "neck_fever_more_zh", (
        "(?:脖子|颈部|颈|后颈)" + G3 + "(?:发硬|硬|僵|梗|转不动|不能弯|低不下)", "烧到|3[89]度|40度|体温|发烧|发热|高烧"),),
    # Dehydration in the very old and the very young.
    RedFlag("dehydration", "dehydration_zh", (
        "拉|吐|腹泻|泻", "不喝水|喝不进|喝不下|没(?:有)?尿|尿很少|尿不湿" + G6 + "(?:干|没湿)|没眼泪|哭没(?:有)?眼泪|囟门(?:凹|塌)",
        "迷糊|糊涂|没精神|蔫|软|叫不醒|嗜睡|说胡话|反应慢|不认人"),),
    RedFlag("dehydration", "dehydration_en", (
        r"\b(?:diarrh\w*|vomit\w*|throwing up|being sick|the runs|loose (?:stools|poo))\b",
        r"\b(?:not drinking|barely drinking|hardly drinking|won'?t drink|no (?:wet )?nappies|dry nappies|no tears|no wee)\b",
        r"\b(?:confus\w*|drowsy|floppy|limp|disoriented|not responding)\b|\b(?:doesn'?t|does not) know where (?:she|he) is"),),
    # Sudden testicular pain (torsion): surgery within hours.
    RedFlag("torsion", "torsion_zh", ("睾丸|蛋蛋|阴囊|下面的蛋|春袋|卵袋",
                                      "突然|忽然|剧痛|疼得(?:厉害|受不了|直哭)|痛得(?:厉害|受不了)|痛到(?:喊|哭|叫)|吐|肿",
                                      "疼|痛|肿"),),
    RedFlag("torsion", "torsion_en", (r"\b(?:testic\w*|testes|scrotum|balls?)\b",
                                      r"\b(?:sudden\w*|severe|agony|vomit\w*|swollen|threw up|throwing up|being sick|"
                                      r"one side|really bad(?:ly)?|screaming)\b",
                                      r"\b(?:pain\w*|hurts?|hurting|ache|aching|agony|swollen|swelling)\b"),),
    # Sudden severe pain in the groin or genitals, said without naming the organ ("down below").
    RedFlag("groin", "groin_zh", ("下身|私处|阴部|腹股沟|大腿根|裆(?:部|里)?", "突然",
                                  "剧痛|疼得(?:厉害|受不了|直哭|打滚|直冒汗)|痛得(?:厉害|受不了|打滚)"),
            unless=PERIOD_ZH + "|痛经|拉伤|扭伤|抻|运动|跑步|踢球|打球|健身|劈叉"),
    RedFlag("groin", "hernia_zh", ("疝", STUCK_ZH + "|卡在外面|剧痛|疼得厉害|痛得厉害"),),
    RedFlag("groin", "lump_zh", ("腹股沟|大腿根|肚脐|阴囊", "鼓包|包块|肿块|鼓起|疙瘩",
                                 STUCK_ZH),),
    RedFlag("groin", "ovary_zh", ("卵巢", "突然|忽然", "疼|痛"),),
    RedFlag("groin", "hernia_en", (r"\bhernia\w*|\b(?:groin|belly button|navel|scrotum)\b",
                                   r"\b(?:won'?t|wont|will not|can'?t|cannot|doesn'?t) (?:go|push|pop|be pushed) (?:back|in)\b|"
                                   r"\bstuck(?: out)?\b|\bhard and (?:red|painful|purple|tender)\b|\b(?:gone|turned) (?:red|purple|dark)\b"),),
    RedFlag("groin", "lump_en", (r"\b(?:groin|scrotum)\b", r"\b(?:hard|swollen|tender)\b", r"\b(?:lump|swelling|bulge)\b",
                                 r"\b(?:crying|screaming|vomit\w*|being sick|threw up|painful|hurts?|agony)\b"),),
    RedFlag("groin", "ovary_en", (r"\bovar\w*", SUDDEN_EN + r"|\bsevere\b|\bsharp\b", r"\bpain\w*|\bhurts?\b"),),
    RedFlag("groin", "groin_en", (r"\b(?:down below|down there|privates|private parts|groin|crotch|genitals?)\b",
                                  r"\bsudden(?:ly)?\b",
                                  r"\b(?:terrible|severe|agonising|agonizing|excruciating|unbearable|awful|worst)\b|\bin agony\b",
                                  r"\b(?:pain|painful|hurts?|hurting|agony)\b"),
            unless=r"\bperiods?\b|\bmenstrua\w*|\b(?:pulled|strain\w*|sprain\w*|workout|football|soccer|running|gym|kicking)\b"),
    # Severe abdominal pain; tearing pain into the back.
    RedFlag("abdomen", "severe_zh", (
        "(?:疼|痛)得" + G4 + "(?:打滚|冒冷汗|出冷汗|直冒汗|直不起腰)|(?:肚子|肚皮|腹部)" + G4 + "(?:硬得像|硬邦邦|像木板|板一样硬)|撕(?:裂|开)(?:样|一样|般|似的)?(?:的)?(?:疼|痛)|"
        "像撕(?:裂|开)" + G4 + "(?:疼|痛)|刀割(?:样|一样)(?:的)?(?:疼|痛)",),
        unless=PERIOD_ZH + "|痛经|来事"),
    RedFlag("abdomen", "severe_en", (r"\b(?:rolling around|doubled over) in (?:pain|agony)|\bbelly\b" + E15 + r"\bhard as (?:a )?board|"
                                     r"\btearing pain|\bripping pain",),),
    # High blood sugar with symptoms (diabetic ketoacidosis signs).
    RedFlag("hyperglycemia", "high_zh", (
        "血糖" + G6 + "(?:hi|测不出|爆表|(?<![\\d.])(?:2\\d|3\\d)(?![\\d.])|二十多|三十)",
        "迷糊|嗜睡|叫不醒|烂苹果|呼吸(?:很|特别)?(?:深|快)|吐|口渴得厉害"),),
    RedFlag("hyperglycemia", "high_en", (r"\b(?:blood sugar|glucose|meter)\b" + E15 + r"\b(?:hi|high|2\d|3\d)\b",
                                         r"\b(?:drowsy|confus\w*|fruity|pear drops|vomit\w*|breathing (?:deep|fast))"),),
    # Swallowed button batteries or magnets.
    RedFlag("swallowed", "battery_magnet_zh", ("(?:吞|吃|咽)" + G6 + "(?:纽扣电池|电池|磁珠|磁铁|吸铁石|磁力珠)",),),
    RedFlag("swallowed", "battery_magnet_en", (r"\bswallow\w*\b" + E20 + r"\b(?:button )?batter(?:y|ies)|\bswallow\w*\b" + E20 + r"\bmagnet\w*",),),
    # Choking without a sound.
    RedFlag("breathing", "choking_silent_zh", ("卡|噎|呛|果冻|糖|花生", "(?:抓|捂|掐)着?(?:脖子|喉咙|嗓子)|不出声|发不出声|说不出话"),),

    # ---- pregnancy warning signs (pre-eclampsia, bleeding, waters, baby moving less) -------
    # NHS "Pre-eclampsia" and "Urgent advice in pregnancy"; 国家卫健委孕产期保健: go now.
    RedFlag("pregnancy", "warning_zh", (
        PREGNANT_ZH,
        "头(?:痛|疼)" + G3 + "(?:厉害|剧烈|要命|受不了|欲裂|难忍)|(?:剧烈|很严重的)头(?:痛|疼)|眼花|眼前(?:发黑|冒金星|闪光|有闪光)|"
        "看东西" + G3 + "(?:模糊|不清|看不清|重影)|视物模糊|视力模糊|(?:阴道|下面)" + G3 + "(?:出血|流血)|"
        "(?:出|流)了?(?:好多|很多|一大摊|不少)(?:的)?血|见红|破水|"
        "羊水(?:破|流)|(?:一直|不停)(?:往下)?流水|湿了一大片|流出" + G3 + "水|(?:下面|阴道)" + G4 + "(?:流水|出水)|胎动" + G3 + "(?:少了|减少|变少|没了|消失|不动|感觉不到)|"
        "(?:没(?:怎么)?|不太|很少)(?:感觉到)?(?:宝宝|孩子|胎儿)(?:在)?动|(?:宝宝|胎儿)(?:不怎么|没怎么|很少)动|(?:肚子|腹部|上腹|下腹|小腹|胃)" + G6 +
        "(?:剧痛|疼得(?:厉害|受不了|冒冷汗)|痛得(?:厉害|受不了|冒冷汗))|(?:一侧|一边|左边|右边|左侧|右侧)" + G4 +
        "(?:小肚子|肚子|下腹|小腹)" + G6 + "(?:剧痛|疼得|痛得|很痛|好痛|很疼|好疼)|抽搐"),
        not_before="(?:预防|怎么避免|如何预防)" + G4 + "$"),
    RedFlag("pregnancy", "warning_en", (
        r"\bpregnan\w*|\bweeks? pregnant|\bexpecting a baby|\bmy (?:wife|daughter|partner) is expecting",
        r"\b(?:severe|bad|terrible|pounding|splitting) headache|\bblurr\w* vision|\bvision\b" + E10 +
        r"\b(?:blurr\w*|spots|flash\w*)|\bseeing (?:spots|flashing lights|stars)|\bflashing lights|\bvaginal bleeding|"
        r"\bbleeding\b|\bwaters?\b" + E20 + r"\b(?:broke|broken|breaking)\b|\bbaby\b" + E15 +
        r"\b(?:moving less|not moving|stopped moving|isn'?t moving|hasn'?t moved)|\b(?:fewer|less|reduced) (?:baby )?"
        r"movements|\bsevere (?:tummy|stomach|belly|abdominal) pain|\bfit\b|\bseizure|"
        r"\b(?:sharp|severe|sudden|intense|terrible|bad)\b" + E20 + r"\bpain\b" + E25 +
        r"\b(?:one side|left side|right side|lower (?:belly|tummy|abdomen|stomach))"),
        not_before=r"\b(?:prevent|avoid)\b" + E10 + "$"),

    RedFlag("pregnancy", "waters_en", (r"\b(?:my|her) waters?\b" + E20 + r"\b(?:broke|broken|breaking)\b",),),
    RedFlag("pregnancy", "waters_zh", ("破水|羊水破了",),),

    # ---- low blood sugar now (hypoglycaemia) -----------------------------------------
    RedFlag("hypoglycemia", "low_reading_zh", (
        "血糖" + G6 + r"(?<![\d.])(?:[0-2](?:\.\d+)?|3(?:\.[0-8]\d*)?)(?![\d.])(?!\s*(?:年|个月|天|岁|小时|周|次|点多))",),
        unless="餐后|饭后|糖化"),
    RedFlag("hypoglycemia", "low_symptoms_zh", (
        "低血糖|血糖" + G3 + "(?:很低|太低|偏低|特别低|低了|掉得|降得)",
        "手抖|发抖|出汗|冒汗|冷汗|心慌|头晕|没力气|迷糊|糊涂|叫不醒|晕倒|眼前发黑"),
        not_before="(?:预防|怎么避免|如何预防|怎么防)" + G4 + "$"),
    RedFlag("hypoglycemia", "insulin_symptoms_zh", (
        "胰岛素|降糖药|降糖针", "冒汗|出汗|冷汗|虚汗|发抖|手抖|心慌|迷糊|糊涂|晕", "现在|突然|刚才|没吃饭|没吃东西|空腹|饿|还没吃"),
        not_before="(?:预防|怎么避免|如何预防|怎么防)" + G4 + "$"),
    RedFlag("hypoglycemia", "diabetic_symptoms_zh", (
        "糖尿病|打胰岛素|降糖", "冒汗|出汗|冷汗|虚汗|发抖|手抖", "迷糊|糊涂|说胡话|叫不醒|不认人|答非所问"),),
    RedFlag("hypoglycemia", "diabetic_symptoms_en", (
        r"\bdiabet\w*|\binsulin\b", r"\b(?:sweat\w*|shak\w*|trembl\w*|clammy)\b",
        r"\b(?:confus\w*|nonsense|drowsy|not making sense|acting (?:strange\w*|odd\w*|weird\w*)|slurr\w*)\b"),),
    RedFlag("hypoglycemia", "low_en", (
        r"\b(?:blood sugar|glucose|bg)\b" + E15 + r"(?<![\d.])(?:[0-2]\.\d|3\.[0-8])(?![\d.])|\bhypo(?:glyc\w*)?\b(?!\s*thyroid)|"
        r"\blow blood sugar",
        r"\b(?:shak\w*|trembl\w*|sweat\w*|confus\w*|dizz\w*|faint\w*|drows\w*|pale|clammy|mmol)"),
        not_before=r"\b(?:prevent|avoid)\b" + E10 + "$"),

    # ---- a child's fit with fever ------------------------------------------------------
    RedFlag("seizure", "febrile_zh", (
        "抽筋|抽过去|抽起来|眼睛?" + G2 + "(?:往上|向上)翻|两眼上翻", FEVER_ZH),
        not_before="(?:腿|脚|小腿|腿肚子|手|手指|脚趾|胃)" + G3 + "$"),

    RedFlag("seizure", "febrile_en", (
        r"\b(?:jerk\w*|twitch\w*|shaking all over|stiffen\w*|eyes rolled|won'?t respond|not responding|floppy)\b",
        FEVER_EN + r"|\bburning up\b"),),

    # ---- appendicitis signs ------------------------------------------------------------
    RedFlag("abdomen", "right_lower_zh", (
        "右下(?:腹|肚子|边肚子|侧肚子|方|边|侧)",
        "越来越(?:疼|痛|厉害)|发烧|发热|疼得(?:厉害|受不了|走不了|直不起)|痛得(?:厉害|受不了)|按(?:着|一下)?" + G2 + "(?:疼|痛)|"
        "剧烈|剧痛|吐了|呕吐|还吐"),
        unless="经期|月经期|来月经的时候|例假的时候|大姨妈的时候|生理期"),
    RedFlag("abdomen", "right_lower_en", (
        r"\b(?:lower right|right lower|bottom right|right side of (?:my|his|her|the) (?:lower )?(?:belly|abdomen|tummy|stomach))",
        r"\b(?:getting worse|worse and worse|fever|temperature|vomit\w*|severe|can'?t walk|excruciating)"),
        unless=r"\bperiods?\b|menstrua"),

    # ---- sudden floaters and flashes, a curtain over the sight (retinal detachment) -------
    RedFlag("eye", "flashes_floaters_zh", (
        "(?:黑影|黑点|飞蚊|蚊子|漂浮物|小黑点)", "(?:闪光|闪电|亮光|光点|闪来闪去|帘子|黑帘|幕布|挡住)"),
        not_before="(?:一直|好多年|多年|从小)" + G3 + "$"),
    RedFlag("eye", "curtain_zh", ("(?:帘子|黑帘|幕布|黑布|一块黑|阴影)" + G4 + "(?:挡|遮|盖)", "眼|视线|视野|看东西")),
    RedFlag("eye", "flashes_floaters_en", (
        r"\bfloaters?\b|\bspots in (?:my|his|her) vision", r"\bflash\w*|\bcurtain|\bshadow over"),),
    RedFlag("eye", "curtain_en", (r"\b(?:curtain|shadow|veil)\b" + E15 + r"\b(?:over|across|coming down over)\b" + E15 +
                                  r"\b(?:vision|eye|sight)",)),
)

_COMPILED: tuple[tuple[RedFlag, tuple[re.Pattern[str], ...], re.Pattern[str] | None, re.Pattern[str] | None], ...] = tuple(
    (f, tuple(re.compile(p) for p in f.patterns),
     re.compile(f.not_before) if f.not_before else None,
     re.compile(f.unless) if f.unless else None)
    for f in RED_FLAGS
)

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
                         + _g(6) + "$")
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
_CHRONIC_BEFORE = re.compile("(?:这几年|近几年|这些年|多年来|常年|长期|这几个月|几个月来)" + _g(8) + "$|"
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


def match_red_flags(text: str) -> list[str]:
    """Every red flag in ``text``, as ``"<category>.<name>"`` strings, in table order.

    ``text`` may be the original message or its normalized form (characters,
    any length). For tests and logs; :func:`triage` builds the reply.
    """
    view = normalize(text).text.translate(_CANTONESE)
    clauses = _clauses(view)
    hits = []
    for flag, patterns, not_before, unless in _COMPILED:
        if unless is not None and unless.search(view):
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

# What to do while waiting for the ambulance, only where a first-aid guideline says so
# (NHS conditions pages, British/Chinese Red Cross first aid, 中风120, China CDC on
# carbon monoxide). No medicine and no doses, ever.
_WHILE_WAITING = {
    "heart_attack": (
        "等待时：马上停止活动，坐下或半躺休息，不要走动，也不要自己开车去医院；把门锁打开，方便急救人员进门；请身边的人陪着。",
        "While you wait: stop what you are doing, sit down and rest; don't walk about or drive yourself to hospital. "
        "Unlock the door for the ambulance crew and ask someone to stay with you."),
    "stroke": (
        "等待时：记下症状开始的时间（或最后一次看到他正常的时间），告诉急救人员；不要给他吃东西、喝水或吃药；让他躺下或半躺，身边不要离人。",
        "While you wait: note the time the symptoms started (or when the person was last seen well) and tell the crew; "
        "don't give food, drink or medicines; let them lie or sit supported and stay with them."),
    "breathing": (
        "等待时：让他坐直或靠坐，松开衣领和腰带，开窗通风；有医生开的急救喷雾（如哮喘吸入剂）可以按医生教的方法用，不要让他走动。",
        "While you wait: help them sit upright, loosen tight clothing and let fresh air in; if they have a reliever "
        "inhaler prescribed for them, they can use it as they were shown; don't let them walk about."),
    "anaphylaxis": (
        "等待时：远离可能的过敏原；如果医生给他开过肾上腺素自动注射笔，按医生教过的方法马上使用。让他躺下并抬高双腿，呼吸困难就坐着，不要突然站起或走动。",
        "While you wait: keep away from the trigger; if they have an adrenaline auto-injector prescribed for them, use "
        "it as they were shown. Lie them down with legs raised, or sit them up if breathing is hard; don't let them "
        "stand up suddenly or walk."),
    "bleeding": (
        "等待时：用干净的毛巾或纱布直接用力按压伤口，一直按住，不要松开查看；能做到的话把受伤部位抬高。",
        "While you wait: press firmly on the wound with a clean cloth or pad and keep pressing without lifting it "
        "to look; raise the injured part if you can."),
    "poisoning": (
        "等待时：不要自行催吐，也不要喂水喂东西；把药瓶、药盒或农药等包装带给医生看；如果人叫不醒但有呼吸，让他侧躺。",
        "While you wait: don't make them vomit and don't give food or drink unless the emergency service tells you "
        "to; keep the bottle, packet or container to show the doctors; if they are drowsy but breathing, lay them "
        "on their side."),
    "gas": (
        "等待时：立即打开门窗通风，把人转移到空气新鲜的地方；不要开关电灯电器、不要点火打电话（到室外再打）；如果叫不醒但有呼吸，让他侧躺。",
        "While you wait: open doors and windows and get everyone into fresh air; don't switch anything electrical on "
        "or off or light a flame (make the call from outside); if they are unresponsive but breathing, lay them on "
        "their side."),
    "seizure": (
        "等待时：移开他身边的硬物，不要按住他的手脚，不要往嘴里塞任何东西；记下抽搐开始的时间；抽搐停止后让他侧躺，保持呼吸通畅。",
        "While you wait: move hard objects away, don't hold them down and put nothing in their mouth; note the time "
        "it started; once it stops, roll them onto their side to keep the airway clear."),
    "unconscious": (
        "等待时：如果他叫不醒但有正常呼吸，让他侧躺，保持呼吸道通畅；如果没有呼吸或只是偶尔喘一下，按急救电话里调度员的指导做胸外按压。",
        "While you wait: if they are unresponsive but breathing normally, put them on their side to keep the airway "
        "clear; if they are not breathing normally, start chest compressions as the emergency call handler tells you."),
    "infant_fever": (
        "3个月以下的宝宝发烧（体温38℃或以上）需要立即看急诊：请马上带宝宝去医院儿科急诊，或拨打急救电话。不要给宝宝捂得太厚。",
        "A baby under 3 months with a temperature of 38°C (100.4°F) or more needs to be seen urgently: go to the "
        "emergency department now or call the emergency number. Don't over-wrap the baby."),
    "severe_headache": (
        "等待时：让他躺下休息，记下头痛开始的时间，不要自己开车去医院。",
        "While you wait: let them lie down, note the time the headache started, and don't drive to hospital yourself."),
    "gi_bleed": (
        "等待时：让他躺下休息，先不要吃东西、喝水；如果还在吐，让他侧躺以免呛到；记下吐出物或大便的颜色和量，告诉医生。",
        "While you wait: let them lie down and don't give food or drink; if they are still vomiting, turn them on "
        "their side so they don't choke; note the colour and amount to tell the doctors."),
    "pregnancy": (
        "等待时：左侧躺下休息，带上产检资料（母子健康手册），不要自己开车去医院。孕期突然头痛得厉害、眼花或看东西模糊、"
        "脸和手突然肿起来，可能是子痫前期；阴道出血、破水或胎动明显减少，也都需要马上看产科急诊。",
        "While you wait: lie on your left side, take your maternity notes, and don't drive yourself. A severe "
        "headache, blurred vision or flashing lights, or sudden swelling of the face and hands in pregnancy can be "
        "pre-eclampsia; bleeding, waters breaking or the baby moving less also need the maternity unit now."),
    "choking": (
        "如果他咳不出、说不出话、喘不上气：站到他身后一侧，让他上身前倾，用掌根在两块肩胛骨之间用力拍背5次；还不行就做5次"
        "腹部冲击（海姆立克法），交替进行，直到东西出来或急救人员到达；如果他失去意识，开始心肺复苏。1岁以下的婴儿不做腹部冲击，改为胸部按压。",
        "If they can't cough, speak or breathe: stand behind and to one side, lean them forward and give up to 5 "
        "firm back blows between the shoulder blades with the heel of your hand; if that doesn't clear it, give up "
        "to 5 abdominal thrusts (the Heimlich manoeuvre); keep alternating until it clears or help arrives; if they "
        "become unresponsive, start CPR. For a baby under 1, use chest thrusts, not abdominal thrusts."),
    "high_bp": (
        "等待时：让他安静地坐着或半躺休息，不要走动；不要自己加吃降压药，也不要吃别人的药；记下量到的血压和时间，告诉医生。",
        "While you wait: let them sit or lie back quietly and not walk about; don't take extra blood pressure "
        "tablets or anyone else's medicine; note the readings and times for the doctors."),
    "fracture": (
        "等待时：不要硬扶他起来走路，也不要揉、拉或热敷疼的地方；让他保持最舒服的姿势躺着，盖好保暖，等急救人员来搬运。",
        "While you wait: don't try to get them up or walking, and don't rub, pull or heat the painful area; let "
        "them lie in the most comfortable position, keep them warm, and wait for the ambulance crew to move them."),
    "heatstroke": (
        "等待时：马上把他移到阴凉通风的地方，解开衣服，用凉水擦身或浇在皮肤上并扇风降温；清醒、能吞咽的可以小口喝凉水；叫不醒的不要喂水，让他侧躺。",
        "While you wait: move them somewhere cool and shaded, loosen clothing, wet the skin with cool water and fan "
        "them; if they are alert and can swallow, give small sips of cool water; if not, give nothing and lay them "
        "on their side."),
    "head_injury": (
        "头部受伤后呕吐、老想睡、迷糊、记不起事、耳朵或鼻子流血或流清水，或者在吃抗凝等“稀释血液”的药（即使现在看着没事），"
        "都可能有颅内出血，需要马上去急诊；不要让他一个人待着，不要给他吃止痛药或安眠药，留意头痛加重、呕吐、嗜睡或说话不清。",
        "After a head injury, vomiting, drowsiness, confusion, memory loss, blood or clear fluid from the ears or "
        "nose, or taking blood thinners (even if they seem fine) can mean bleeding inside the skull: they need A&E "
        "now. Don't leave them alone, give no painkillers or sleeping pills, and watch for a worsening headache, "
        "vomiting, drowsiness or confusion."),
    "burn": (
        "等待时：马上用凉的流动自来水冲洗烧烫伤处约20分钟（不要用冰或冰水），取下附近的戒指手表（粘在皮肤上的衣物不要硬撕）；"
        "不要抹牙膏、酱油、香油或偏方，不要挑破水泡；冲完用干净的保鲜膜或湿布松松盖住，注意给身体其他部位保暖。",
        "While you wait: cool the burn under cool running water for about 20 minutes (no ice), take off nearby "
        "rings or watches but not clothing stuck to the skin; put nothing on it (no toothpaste, butter or creams) "
        "and don't burst blisters; then cover it loosely with cling film or a clean damp cloth and keep the person warm."),
    "drowning": (
        "等待时：如果他没有正常呼吸，马上按急救电话里调度员的指导做心肺复苏；有呼吸的脱掉湿衣服、保暖，让他侧躺。"
        "从水里救上来的人即使现在看着没事，也要去医院检查，几个小时后才可能出现呼吸问题。",
        "While you wait: if they are not breathing normally, start CPR as the call handler tells you; if they are "
        "breathing, remove wet clothes, keep them warm and lay them on their side. Anyone pulled from the water "
        "needs a hospital check even if they seem fine: breathing problems can come hours later."),
    "electric": (
        "先切断电源（拉闸、拔插头），在断电前不要直接用手碰他；如果他没有正常呼吸，按急救电话里调度员的指导做心肺复苏。"
        "触电的人即使现在醒着、看着没事，也要去医院检查心脏和烧伤。",
        "First switch off the power at the mains or unplug it, and don't touch them until it is off; if they are "
        "not breathing normally, start CPR as the call handler tells you. Anyone who had an electric shock needs "
        "a hospital check of the heart and burns even if they seem fine."),
    "sepsis": (
        "这可能是严重感染（败血症/脓毒症）或脑膜炎，需要马上去急诊，不要等到明天；路上注意保暖，记下体温、开始的时间和最后一次小便的时间，告诉医生。",
        "This may be a serious infection (sepsis) or meningitis and needs A&E now, not tomorrow; keep them warm and "
        "note their temperature, when it started and when they last passed urine, to tell the doctors."),
    "dehydration": (
        "这可能是严重脱水，需要马上去医院输液。能喝的话先小口多次喂口服补液盐或温水，婴儿继续喂奶；不要喂果汁、饮料，也不要自行用止泻药。",
        "This may be severe dehydration and needs hospital fluids now. If they can drink, give small frequent sips of "
        "oral rehydration solution or water on the way (keep feeding a baby); no juice or fizzy drinks, and no "
        "anti-diarrhoea medicine without a doctor."),
    "torsion": (
        "睾丸突然剧痛可能是睾丸扭转，要在几个小时内手术才能保住，请马上去医院急诊（外科或泌尿外科），不要等它自己好；先不要吃东西喝水。",
        "Sudden severe testicle pain can be a twisted testicle, which needs surgery within hours: go to A&E now, "
        "don't wait for it to ease, and don't eat or drink in the meantime."),
    "groin": (
        "下身或大腿根突然剧痛，可能是睾丸或卵巢扭转、疝气卡住，女性也可能是宫外孕，有的要在几个小时内手术，请马上去医院急诊，"
        "不要等它自己好；先不要吃东西喝水。",
        "Sudden severe pain in the groin or genitals can be a twisted testicle or ovary, a trapped hernia or, in a "
        "woman, an ectopic pregnancy, some of which need surgery within hours: go to A&E now, don't wait for it to "
        "ease, and don't eat or drink in the meantime."),
    "hyperglycemia": (
        "血糖很高又迷糊、呕吐、呼吸深快或有烂苹果味，可能是糖尿病酮症酸中毒，需要马上去急诊；能喝水的小口喝白开水，不要自己加打胰岛素，把血糖仪读数告诉医生。",
        "Very high blood sugar with drowsiness, vomiting, deep fast breathing or fruity breath can be diabetic "
        "ketoacidosis and needs A&E now; sip water if they can, don't take extra insulin on your own, and tell the "
        "doctors the meter readings."),
    "swallowed": (
        "等待时：不要催吐，也不要给吃喝；把同样的电池或磁珠（或包装）带给医生看。纽扣电池和两颗以上的磁珠在体内几个小时就可能造成严重损伤，即使现在没有不舒服也要马上去急诊。",
        "While you wait: don't make them sick and don't give food or drink; take a matching battery or magnet (or the "
        "packaging) to show the doctors. Button batteries and two or more magnets can cause serious harm within "
        "hours, so go to A&E now even if the child seems fine."),
    "bowel": (
        "等待时：先不要吃东西、喝水，不要吃泻药、止痛药，也不要灌肠；好几天没排便、肚子胀还呕吐，可能是肠梗阻，需要马上去医院急诊。",
        "While you wait: don't eat or drink, and don't take laxatives or painkillers; days without a bowel movement "
        "with a swollen tummy and vomiting can be a bowel obstruction, which needs A&E now."),
    "mushroom": (
        "等待时：不要自行催吐，也不要等症状自己好；把剩下的菌子（或拍的照片）带给医生看；同桌吃过的人即使没有不舒服，也要一起去医院。",
        "While you wait: don't make them vomit and don't wait for it to pass; take any leftover mushrooms (or a "
        "photo) to show the doctors; everyone who ate them should go too, even without symptoms."),
    "abdomen": (
        "等待时：先不要吃东西、喝水，不要吃止痛药，也不要热敷肚子；右下腹越来越疼或伴发烧、呕吐，可能是阑尾炎，需要尽快去医院急诊看外科。",
        "While you wait: don't eat or drink, don't take painkillers and don't put heat on the tummy; pain in the "
        "lower right that keeps getting worse, or comes with fever or vomiting, can be appendicitis and needs A&E."),
}

#: Categories whose reply leads with what to do now instead of "call the emergency number
#: now" (NHS "Low blood sugar", "Detached retina", "Nosebleed"): the call comes when it
#: does not work or when stated signs appear.
_LEAD = {
    "hypoglycemia": (
        "⚠️这可能是低血糖，要马上处理：如果他清醒、能吞咽，马上吃或喝含糖的东西（半杯果汁或含糖饮料、几块糖，"
        "或一勺白糖兑水），15分钟后再测血糖，还低就再吃一次，好转后再吃点主食。\n"
        "如果叫不醒、不能吞咽、抽搐，或吃糖后还不见好，不要喂任何东西，让他侧躺，立即拨打{zh}。",
        "⚠️ This may be low blood sugar and needs treating now: if they are awake and can swallow, give a sugary "
        "drink or snack straight away (a small glass of fruit juice or a non-diet fizzy drink, a few sweets, or a "
        "spoonful of sugar in water); check again after 15 minutes and repeat if still low, then have something "
        "starchy.\nIf they are drowsy or can't swallow, have a fit, or don't get better, give nothing by mouth, lay "
        "them on their side and call {en} now."),
    "eye": (
        "⚠️眼前突然出现很多黑影或闪光，或者像有帘子、阴影挡住视线，可能是视网膜脱离，请今天就去医院眼科急诊"
        "（夜里就去有眼科的医院急诊），不要等到第二天；路上不要自己开车。",
        "⚠️ New floaters with flashes of light, or a shadow or curtain over your sight, can be a detached retina: go "
        "to an eye emergency department or A&E today, don't wait until tomorrow, and don't drive yourself."),
    "nosebleed": (
        "⚠️流鼻血止不住时请这样做：坐下，身体稍向前倾（不要仰头，以免血流进喉咙），用拇指和食指捏住鼻子下方软的部分，"
        "持续按压10到15分钟，用嘴呼吸，不要往鼻子里塞纸。\n"
        "按压15分钟后还在流、出血很多、是头部受撞击后流的，或者正在吃抗凝药，请马上去医院急诊或拨打{zh}。",
        "⚠️ For a nosebleed that won't stop: sit down and lean forward (don't tip your head back, the blood runs into "
        "the throat), pinch the soft part of the nose just above the nostrils for 10 to 15 minutes and breathe "
        "through your mouth.\nIf it is still bleeding after 15 minutes of pressure, is heavy, started after a blow to "
        "the head, or you take blood thinners, go to A&E now or call {en}."),
}

# Diabetes medicines: an overdose of them is treated as low blood sugar.
_GLUCOSE_LOWERING = re.compile(r"降糖|胰岛素|二甲双胍|格列|糖尿病的药|\binsulin|\bmetformin|\bgli\w+|\bdiabet\w* (?:pills?|tablets?|meds?|medication)")

# Not breathing: the unconscious reply (chest compressions as the call handler says).
_NOT_BREATHING = re.compile(r"(?:没|不)(?:有)?(?:呼吸|喘气)|没气了|没了呼吸|\bnot breathing|\bno breath|\bstopped breathing")

# A nose in a bleeding message: nosebleed first aid instead of pressing on a wound.
_NOSE = re.compile(r"鼻|\bnose|\bnosebleed")

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
    category, with gas, mushroom, diabetes-medicine and nosebleed first aid."""
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
