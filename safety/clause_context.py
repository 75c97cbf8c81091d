"""Whether the words around a red flag's match cancel it (safety/triage.py judges every match here).

A match is cancelled, in its clause, by a negation before or after it ("没有胸痛", "no chest
pain"), the distant past or months ago and over ("去年有过胸痛现在好了"), prevention or a question
about a condition ("怎么预防煤气中毒", "中风的前兆", "过敏性休克是什么样子的", "whats anaphylaxis"), a dream, a question of cause ("can anxiety cause
chest pain"), a symptom that has lasted months or years with nothing new, a doctor's diagnosis
of something now over ("去医院说是热性惊厥，现在好好的"), an event that care has since reached
("突然昏倒 送到医院查出来是癫痫": see ``_CARE_REACHED``), a danger told as
a news or media story ("看新闻说有小孩吞了纽扣电池"), or a question of what to do should it
happen ("what's the right way to do back blows for a choking baby"). Clauses end at
punctuation and contrast words (但是 / but): a negation never reaches across them.
"""

from __future__ import annotations

import re

from safety.red_flag_rules import gap_zh

__all__ = ["cancelled", "fiction_or_work", "mandarin_view", "split_clauses", "split_sentence_clauses"]


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
# "潜水得过减压病 多久以后可以坐飞机": a disease one has had (得过, 患过), told right before its name.
_HAD_BEFORE_ZH = re.compile("(?:得过|患过|得了?过)$")
_PAST_MONTHS_ZH = re.compile("(?:上个?月|几个月前|(?:\\d+|[一二两三四五六七八九十几]+)个月前|上周|上礼拜|上星期)(?P<between>.*)$")
_RESOLVED_ZH = re.compile("好了|没事了|康复|痊愈|恢复了|治好|出院|没再|没有再|好好的|一切正常|都正常|(?:一直|都)挺好|"
                          "没(?:什么|啥)?大(?:事|碍|问题)")
_PAST_AFTER_ZH = re.compile("^(?:了|过|后)?(?:已经|有)?(?:\\d+|[一二两三四五六七八九十几多好]+)(?:多)?年(?:了|多了|前)?")
# (又 in a story about others is not now: "看新闻说云南又有人吃菌子中毒")
_NOW_ZH = "又(?!有人|有一|一个|一家|一起)|再次|现在|今天|今早|今晚|刚才|刚刚|这会儿|此刻|目前|昨天|昨晚|今儿"
_CURRENT_ZH = re.compile(_NOW_ZH + "|突然|最近|这两天")
# "when he was 18 months", "when I was little": an age the person has left behind.
_AS_A_CHILD_EN = r"when (?:he|she|i|they|we|my \w+) (?:was|were) (?:\d+|a baby|a toddler|little|small|a kid|a child|tiny)"
_PAST_BEFORE_EN = re.compile(
    r"\b(?:last year|years? ago|in the past|used to|history of|previously|as a child|when i was young|once had|"
    r"in (?:19|20)\d\d|" + _AS_A_CHILD_EN + r")\b(?P<between>.*)$")
_PAST_MONTHS_EN = re.compile(r"\b(?:last month|months? ago|last week)\b(?P<between>.*)$")
# A condition named as a doctor's diagnosis ("去医院说是热性惊厥", "the doctor said it was a febrile
# seizure"): over when the message says it is over ("现在好好的").
_DIAGNOSED_ZH = re.compile("(?:(?:医生|医院|大夫|急诊)(?:说|讲|看了说|诊断)(?:是|为)?|诊断(?:为|是)|确诊(?:为|是)?)(?P<between>.*)$")
_DIAGNOSED_EN = re.compile(r"\b(?:doctors?|hospital|gp|paediatrician|pediatrician|they) (?:said|told us|diagnosed)"
                           r"(?: (?:it|that) was| it's| (?:him|her|me|them) with)?(?P<between>.*)$")
_RESOLVED_EN = re.compile(r"\b(?:now fine|fine now|better now|recovered|all good now|ok now|okay now|healed|no longer|"
                          r"(?:totally|completely|perfectly) fine|been fine (?:ever )?since)\b")
_PAST_AFTER_EN = re.compile(r"^\W*(?:\w+\s+){0,5}?(?:(?:\d+|a|one|two|three|four|five|six|seven|eight|nine|ten|a few|"
                            r"several|many)\s+years?\s+ago|last year|in (?:19|20)\d\d|" + _AS_A_CHILD_EN + r")\b")
_CURRENT_EN = re.compile(r"\b(?:again|now|today|tonight|this morning|just now|right now|suddenly|currently|yesterday)\b")

# A danger told as a news or media story, or asked about as knowledge (what to do should it
# happen, the right way to give first aid, whether a belief is true): nothing current in between.
_STORY_OR_LESSON_ZH = re.compile(
    "(?:看新闻|新闻(?:上|里|说|报道)|电视(?:剧|上|里)|(?:剧|戏|电影|小说|短剧|综艺)(?:里|中)|网上(?:看到|说)|朋友圈(?:看到|里|上|说)|看到(?:一篇|一个|一则|篇)?(?:文章|报道|视频|新闻)|"
    "(?:文章|报道|视频)(?:上|里)?说|(?:万一|如果|要是|假如)(?:[^，。？！,.?!]{0,8}(?:遇到|碰到|看到|见到))?(?:有人|别人|路人|陌生人)|"
    "纪录片(?:里|说|讲)?|"
    "急救(?:课|培训|知识)|(?:想|要)(?:提前)?学(?:一下|习)?|学习(?:一下)?|正确的?(?:做法|方法|急救))(?P<between>.*)$")
_STORY_OR_LESSON_EN = re.compile(
    r"\b(?:on the news|in the news|news (?:story|report|article)|read (?:an?|this|that|some) (?:article|story|post|report)|"
    r"saw (?:an?|this|that) (?:video|article|post|story|documentary|report)|on (?:tv|telly|tiktok|youtube|facebook)|"
    r"in (?:an?|the) (?:film|movie|show|drama|series|novel|book)|(?:correct|right|proper|best|safest) way to|"
    r"first aid (?:for|course|class|training|lesson)|is it true|"
    r"(?:what|how) (?:should|do|would|can) (?:you|one|people|we) (?:do |help |treat |handle |respond )?(?:if|when|for) "
    r"(?:(?:you|we|i) (?:see|find|come across|witness|notice) )?"
    r"(?:someone|somebody|a person|anyone|people|they|a (?:baby|child|kid|toddler|friend))|"
    r"if (?:(?:you|we|i) (?:see|find|come across|witness|notice) )?(?:someone|somebody|a person|anyone|a stranger)"
    r"(?:'s| is| was| has| starts?| were| gets?| collapses?| having)?)\b(?P<between>.*)$")

# Someone of the user's own (or the user) named from the frame on, in the framed clause or with
# something happening now: the story or lesson may be about them ("看新闻说纽扣电池很危险 我家孩子吞
# 了一个", "is it true a stiff neck and a rash mean meningitis? my son has all three"), so the frame
# does not hold. Named with a prevention question alone ("…怎么跟我家孩子讲", "so it never happens to
# my kids") it still holds.
_KIN_ZH = "爸|妈|爷|奶|孩子|宝宝|儿子|女儿|闺女|老公|老婆|老伴|外公|外婆|孙"
_OWN_PEOPLE = re.compile("我|俺|咱|" + _KIN_ZH + "|婆婆|公公|哥|姐|弟|妹|"
                         r"\b(?:my|our|i|i'm|im|i've|i'd|me|we|we're|us)\b")
_HAPPENING_NOW = re.compile("现在|刚才|刚刚|突然|正在|还在|今天|今早|今晚|这会儿|"
                            r"\b(?:now|right now|just|today|tonight|currently|has|have|is having|keeps?)\b")

# In a story, its own "突然" (or 最近, 这两天) is the story's ("电视剧里那个女主角突然吐血晕倒"); the rest say it is now.
_STORY_CURRENT_ZH = re.compile(_NOW_ZH)
# "if someone has a seizure near me what should i do": a place, and the one asking, not someone of one's own.
_PLACE_OR_ASKER_EN = re.compile(r"\b(?:(?:near|around|in front of|next to|beside|with) me|what (?:should|do|can|would) i do|"
                       r"should i|can i|do i)\b")

# A whole message about fiction being written or one's work in health or rescue ("我在写小说 里面有个角色被毒蛇咬了",
# "I'm a paramedic and after a bad overdose call I can't switch off"; a blind batch, 2026-12-07): the danger is a
# character's or a patient's, unless someone of one's own is named or something is happening now.
_FICTION_OR_WORK = re.compile(
    "写小说|在写(?:一个|个|一部|部)?(?:故事|剧本|小说)|(?:小说|剧本|游戏|故事)里|我是(?:一名|一个|个)?(?:护士|医生|大夫|急救员|护工|"
    "救生员|消防员|急诊科)|我在(?:急诊|医院|icu|养老院)(?:上班|工作)|"
    r"\b(?:writing|write|wrote) (?:a|an|my) (?:mystery |crime |murder |short |horror )?(?:novel|story|book|screenplay|script|fanfic)\b|"
    r"\bin my (?:novel|story|book|game)\b|\bmy character\b|"
    r"\bi(?:'m| am) an? (?:nurse|paramedic|emt|doctor|carer|caregiver|lifeguard|firefighter|first responder)\b")
_FAMILY = re.compile(_KIN_ZH + "|"
                     r"\bmy (?:mum|mom|mother|dad|father|son|daughter|wife|husband|partner|baby|kid|child|grandma|grandpa)\b")
_NOW_STRICT = re.compile("现在|刚才|刚刚|正在|这会儿|此刻|突然|"
                         r"\b(?:now|right now|just now|at the moment|currently|is having|suddenly)\b")


def fiction_or_work(view: str) -> bool:
    """True when the message (:func:`mandarin_view`) tells of fiction being written or of one's own work in
    health or rescue, names nobody of one's own and nothing happening now: its red flags (not a crisis's)
    are a character's or a patient's."""
    return bool(_FICTION_OR_WORK.search(view)) and not _FAMILY.search(view) and not _NOW_STRICT.search(view)


# Asked ahead of time, just in case ("我在养老院当护工 老人吃饭噎着了该怎么处理 想提前学一下"; a blind batch,
# 2026-12-07): nothing is happening, unless something is said to be happening now.
_AHEAD = re.compile("提前(?:学|了解|准备|知道|做好)|以防万一|防患于未然|未雨绸缪|"
                    r"\b(?:just in case|in advance|ahead of time|beforehand)\b")

_PREVENT_ZH = re.compile("(?:预防|防止|避免|防范|怎么防|如何防|怎样防|远离|降低|(?:怎么|怎样|如何)(?:判断|识别|区分|分辨|知道|看出))"
                         + gap_zh(6) + "$")
_PREVENT_EN = re.compile(r"\b(?:prevent|preventing|prevention of|avoid|avoiding|risk of|reduce the risk of|"
                         r"worried about|afraid of|scared of|fear of|chance of|"
                         r"how (?:do|can|would) (?:i|you|we) (?:tell|know|recogni[sz]e|spot))\b(?:\s+[\w'-]+){0,3}\s*$")
# "心梗发作前有啥信号", "中风的前兆": asking about a condition, not describing one.
_ABOUT_AFTER = re.compile("^(?:前|之前|以前)?(?:会)?(?:有|会有)?(?:什么|啥|哪些)?(?:的)?(?:前兆|信号|征兆|先兆|症状|表现|早期)|"
                          # "心梗和心绞痛有啥区别": two conditions compared (a blind batch, 2026-12-07)
                          "^(?:(?:和|跟|与)[^，。？！,.?!]{1,8})?(?:有)?(?:啥|什么)?(?:的)?(?:区别|不同)|"
                          r"^\s*(?:signs|symptoms|warning signs)\b")
# "过敏性休克是什么样子的", "whats anaphylaxis?", "the difference between a heart attack and cardiac arrest":
# asking what a condition is (a blind batch, 2026-12-07). Not "是什么病" ("我爸突然晕倒了 是什么病" is an event).
_WHAT_IT_LOOKS_LIKE = re.compile("^(?:是|会是)?(?:什么|啥)样(?:子)?|^长(?:什么|啥)样")
_WHAT_IS_BEFORE_EN = re.compile(r"\b(?:(?:what(?:'s| is| are)|whats|what does|explain)\s+(?:a\s+|an\s+|the\s+)?|"
                                r"differences? between\s+(?:[\w'-]+\s+){0,4}?(?:(?:and|or)\s+(?:a\s+|an\s+|the\s+)?)?)$")
# A dream is never the event: "昨晚梦到自己心脏病发作", "had a dream i was drowning".
# Something current between the dream and the match wins ("做梦都没想到 我爸刚才突然倒地").
_DREAM = re.compile(r"(?:梦到|梦见|做梦(?![都也]没想到)|做了个?梦|噩梦|\b(?:dreamt|dreamed|dreaming|a dream|nightmare)\b)(?P<between>.*)$")
# "癫痫发作的时候旁边的人应该怎么做": what one should do when it happens, asked in general.
_WHEN_IT_HAPPENS = re.compile("^(?:发作|发生|出现|犯病|犯了)?(?:的)?(?:时候|时)[^，。？！,.?!]{0,10}(?:应该|该|要|需要)?(?:怎么|如何|咋)(?:做|办|处理|急救|帮)")
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

# Care already reached after the event: the person was taken to hospital or a doctor has seen it and
# named it ("突然昏倒 口吐白沫 送到医院查出来是癫痫 这病怎么治", "went to A&E, they diagnosed angina"), and
# nothing after that says it is going on or has come back. Such a message asks about a condition now in
# a clinician's hands: the decision head reads it (a referral, with a safety-net line when it finds danger),
# not the "call 120 now" reply. Real consultation questions of public datasets (2026-12-06, set 5) got
# that reply for epilepsy and heart disease found this way. Calling an ambulance is not care reached: it
# may still be on its way ("叫了救护车 现在怎么办").
_CARE_REACHED = re.compile(
    "(?:送|带|拉|抬|扶)着?(?:到|去|进)了?(?:医院|急诊)|送了?(?:医院|急诊)(?:查|检查|看了|看过)|(?:去|到|上|进)了?(?:医院|急诊)(?:后|以后|之后|才|检查|查|做|看|一查|医生|大夫)|"
    "住(?:了|过)?院|(?:医生|大夫|医院)(?:检查|看)?(?:后|了)?(?:说|诊断|确诊|告诉)|查出来|确诊|诊断(?:为|是|出)|"
    r"\b(?:hospitali[sz]ed|admitted to|taken to (?:the )?(?:hospital|er|a&e)|rushed to (?:the )?(?:hospital|er|a&e)|"
    r"(?:went|go|got) to (?:the )?(?:hospital|er|a&e)|diagnosed|discharged|"
    r"(?:doctors?|the er|hospital|they) (?:said|told|found))\b")
_CARE_WINDOW = 64  # characters after the event within which the care must be told
_STILL_NOW = ("还在|正在|此刻|这会儿|再次发作|现在(?:还|正|人|叫|怎么办)|"
              r"\b(?:still|right now|now (?:he|she|i|they|it)(?:'s| is| are| am| has| can))\b")
# ... and, after the event, 又 / again: it has come back ("现在又抽了"); 又 before the event is the story of a
# past recurrence ("又突然晕倒后经诊断为肺部感染"), and 又 leading to a hospital visit or a test is care again
_STILL = re.compile(_STILL_NOW + "|又(?!去|到|上了?医院|带|送|做|查|复查)|\\bagain\\b")
_STILL_NOW_BEFORE = re.compile(_STILL_NOW)

# A full stop between digits is a decimal point ("血糖2.8", "38.5度"), not a clause boundary.
_CLAUSE_SPLIT = re.compile(r"(?:[,;!?，。；！？\n]|(?<!\d)\.|\.(?!\d))+|但是|可是|但|然而|"
                           r"\b(?:but|however|although|though|except)\b")

# Cantonese → Mandarin words that change a red flag's meaning (透唔到氣 = 透不到气).
CANTONESE = str.maketrans({"唔": "不", "冇": "没", "咗": "了", "佢": "他", "係": "是", "喺": "在", "嘅": "的", "啲": "些",
                           "咩": "什么"})
# ... and phrases, on the text after OpenCC (係 → 系) and the characters above: "叫佢都唔係好應" (barely
# responds), "講嘢亂晒" (talks nonsense), "冇乜汗" (hardly sweating), "食咗花生成身紅晒 把聲沙咗 透氣好辛苦"
# (flushed all over after peanuts, hoarse, struggling to breathe); blind batches, 2026-12-07.
_CANTONESE_PHRASES = {"不系好": "不太", "系咪": "是不是", "但系": "但是", "讲嘢": "说话", "乱晒": "全乱了", "乱晒龙": "全乱了",
                      "没乜": "没什么", "透气好辛苦": "呼吸很困难", "唞气好辛苦": "呼吸很困难", "抖气好辛苦": "呼吸很困难",
                      "唞不到气": "喘不上气", "抖不到气": "喘不上气", "成身": "全身", "把声": "声音", "食了": "吃了"}
# where a phrase opens a Mandarin word instead (但系统: "but the system"; 变成身材)
_NOT_FOLLOWED_BY = {"但系": "统", "成身": "体|材|高|份|为"}
_CANTONESE_PHRASE = re.compile("|".join(
    k + (f"(?!{_NOT_FOLLOWED_BY[k]})" if k in _NOT_FOLLOWED_BY else "")
    for k in sorted(_CANTONESE_PHRASES, key=len, reverse=True)))  # the longest first: 乱晒龙 before 乱晒


def mandarin_view(normalized: str) -> str:
    """A normalized message with the Cantonese words that change a red flag's meaning in Mandarin
    (:data:`CANTONESE`, then phrases): what the red-flag rules read."""
    return _CANTONESE_PHRASE.sub(lambda m: _CANTONESE_PHRASES[m.group()], normalized.translate(CANTONESE))


# A sentence ends at 。！？!? or a line break, or a full stop that is no decimal point.
_SENTENCE_SPLIT = re.compile(r"[。！？!?\n]+|(?<!\d)\.|\.(?!\d)")


def split_clauses(text: str) -> list[str]:
    return [c for c in _CLAUSE_SPLIT.split(text) if c and c.strip()]


def split_sentence_clauses(text: str) -> tuple[list[str], list[int]]:
    """:func:`split_clauses` ``text`` (every sentence end is also a clause end), and for each clause the
    index one past the last clause of its sentence."""
    clauses: list[str] = []
    ends: list[int] = []
    for sentence in _SENTENCE_SPLIT.split(text):
        clauses += split_clauses(sentence)
        ends += [len(clauses)] * (len(clauses) - len(ends))
    return clauses, ends


def cancelled(clause: str, start: int, end: int, not_before: re.Pattern[str] | None, rest: str,
               next_clause: str, chronic_cancels: bool, sentence: str, about_cancels: bool = True) -> bool:
    """True when the context around ``clause[start:end]`` cancels the match; ``rest``
    is the message from this clause on (where "现在好了" may come later), ``sentence`` the
    rest of this clause's sentence (where care reached after the event is told). ``about_cancels``:
    a question of what the condition is, or a dream, cancels it (never for a crisis flag: "what's a
    painless way to go")."""
    before, after = clause[:start], clause[end:]
    if chronic_cancels and not _NEW_OR_SUDDEN.search(clause) and (
            _CHRONIC.search(after) or _CHRONIC_BEFORE.search(before)
            or (len(next_clause) <= _SHORT_CLAUSE and _CHRONIC.search(next_clause))):
        return True
    if not_before is not None and not_before.search(before):
        return True
    if chronic_cancels and not _STILL_NOW_BEFORE.search(before) and not _STILL.search(after):
        # told in the event's sentence, right after it (a later story of one's own check-up says nothing of it)
        tail = (after + sentence[len(clause):])[:_CARE_WINDOW]
        care = _CARE_REACHED.search(tail)
        if care and not _STILL.search(tail, care.end()):
            return True
    if _NEG_BEFORE_ZH.search(before) or _NEG_BEFORE_EN.search(before) or _NEG_AFTER_ZH.match(after):
        return True
    if _PREVENT_ZH.search(before) or _PREVENT_EN.search(before) or _ABOUT_AFTER.match(after):
        return True
    dream = _DREAM.search(before)
    if about_cancels and (_WHAT_IT_LOOKS_LIKE.match(after) or _WHAT_IS_BEFORE_EN.search(before) or dream and not (
            _CURRENT_ZH.search(dream.group("between")) or _CURRENT_EN.search(dream.group("between")))):
        return True
    if _WHEN_IT_HAPPENS.match(after) and not _OWN_PEOPLE.search(before) and not _HAPPENING_NOW.search(rest):
        return True
    if (_RISK_BEFORE.search(before) and _QUESTION_AFTER.match(after)) or _CAUSE_BEFORE_EN.search(before):
        return True
    if _HAD_BEFORE_ZH.search(before) and not _CURRENT_ZH.search(clause):
        return True
    for past, current in ((_PAST_BEFORE_ZH, _CURRENT_ZH), (_PAST_BEFORE_EN, _CURRENT_EN)):
        m = past.search(before)
        if m and not current.search(m.group("between")):
            return True
    for story, current in ((_STORY_OR_LESSON_ZH, _STORY_CURRENT_ZH), (_STORY_OR_LESSON_EN, _CURRENT_EN)):
        m = story.search(before)
        if m and not current.search(m.group("between")) and not (
                _OWN_PEOPLE.search(_PLACE_OR_ASKER_EN.sub(" ", clause[m.start("between"):]))
                or (_OWN_PEOPLE.search(_PLACE_OR_ASKER_EN.sub(" ", rest)) and _HAPPENING_NOW.search(rest))):
            return True
    if _AHEAD.search(rest) and not _HAPPENING_NOW.search(_AHEAD.sub(" ", rest)):  # "…噎着了该怎么处理 想提前学一下"
        return True
    for past, current, resolved in ((_PAST_MONTHS_ZH, _CURRENT_ZH, _RESOLVED_ZH),
                                    (_PAST_MONTHS_EN, _CURRENT_EN, _RESOLVED_EN),
                                    (_DIAGNOSED_ZH, _CURRENT_ZH, _RESOLVED_ZH), (_DIAGNOSED_EN, _CURRENT_EN, _RESOLVED_EN)):
        m = past.search(before)
        if m and not current.search(m.group("between")) and resolved.search(rest):
            return True
    return bool(_PAST_AFTER_ZH.match(after) or _PAST_AFTER_EN.match(after))


