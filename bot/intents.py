"""Rule-based intents: greeting, human handoff, out of scope; and the canned replies.

Runs after emergency triage (``safety.triage``) and next to the scope rules
(``safety.scope``); anything these rules do not claim goes to knowledge retrieval.

* GREETING only when the whole message is a greeting, thanks, "who are you" or
  "help" (with polite filler): "你好" is a greeting, "你好，我失眠怎么办" is not.
* HANDOFF whenever the user asks for a person: "转人工", "人工客服", "talk to a
  person", or the bare word the bot itself suggests ("人工", "human").
* OUT_OF_SCOPE conservatively: a non-health subject (weather, stocks, lottery,
  homework, recipes, jokes, code, sports, travel, ...) AND no health word
  anywhere in the message ("天气热怎么防中暑" is a health question).

Rules are data (:data:`GREETING_TOKENS`, :data:`HANDOFF_PATTERNS`,
:data:`OFF_TOPIC_PATTERNS`, :data:`HEALTH_WORDS`), matched on
:attr:`safety.normalize.Normalized.text` (Simplified, lowercased).
"""

from __future__ import annotations

import re
from typing import Callable

from bot.types import Intent
from safety.normalize import Normalized

__all__ = ["rule_intent", "intent_reply", "unsupported_reply", "care_team_reply", "is_aftercare", "is_medical_diet",
           "CARE_TEAM_RULES", "MEDICAL_DIET_CONDITIONS", "MEDICAL_DIET_REPLY", "GREETING_TOKENS",
           "HANDOFF_PATTERNS", "END_HANDOFF_PATTERNS", "HANDOFF_ENDED_REPLY", "HANDOFF_UNAVAILABLE_REPLY",
           "is_end_handoff", "HANDOFF_OFFERS", "drop_handoff_offer", "OFF_TOPIC_PATTERNS", "HEALTH_WORDS", "AFTERCARE_PATTERNS", "AFTERCARE_REPLY"]

# A message is a greeting when it is made only of these tokens (and punctuation/spaces).
GREETING_TOKENS: tuple[str, ...] = (
    # zh: hello / thanks / who are you / what can you do / help / bye
    "你好", "您好", "你们好", "大家好", "哈喽", "哈啰", "嗨", "喂", "在吗", "在不在", "在么", "有人吗", "早上好", "上午好",
    "中午好", "下午好", "晚上好", "早安", "午安", "晚安", "早", "谢谢", "多谢", "谢了", "感谢", "非常感谢", "太感谢了",
    "辛苦了", "好的", "知道了", "明白了", "收到", "ok", "嗯嗯", "嗯", "哦", "再见", "拜拜",
    "你是谁", "你是什么", "你叫什么", "你叫什么名字", "你是机器人吗", "你是真人吗", "你是ai吗", "你是医生吗",
    "你能做什么", "你会什么", "你能干什么", "你可以做什么", "你有什么用", "你能帮我什么", "能帮我什么", "怎么用",
    "帮助", "菜单", "使用说明", "功能", "太谢谢", "太感谢", "谢谢啦", "你能帮我做什么", "你是干什么的", "你是做什么的",
    "怎么用这个", "这个怎么用", "这是什么", "这是干什么的", "你是真人还是机器人", "真人还是机器人", "是真人还是机器人",
    "说得挺好", "说得好", "说得对", "讲得好", "讲得挺好", "很有用", "挺有用", "有帮助", "很有帮助", "学到了", "受教了",
    # en
    "hi", "hello", "hey", "hiya", "good morning", "good afternoon", "good evening", "morning", "thanks", "thank you",
    "thank you very much", "thanks a lot", "thx", "ty", "cheers", "ok", "okay", "bye", "goodbye",
    "who are you", "what are you", "are you a bot", "are you a robot", "are you human", "are you a doctor",
    "what can you do", "what do you do", "how do i use this", "how does this work", "help", "menu", "/start", "/help",
    "start", "that helps", "that's helpful", "great", "got it", "who am i talking to", "who is this",
    "are you a real doctor", "are you real", "what is this", "what's this", "that was helpful",
    "that was really helpful", "that was very helpful", "really helpful", "very helpful", "helpful", "good advice",
    "that makes sense", "that's useful", "useful", "are you a person or a bot", "are you a bot or a person",
)
# Words that may surround a greeting without making it a question ("医生你好呀", "thanks so much").
_GREETING_FILLER: tuple[str, ...] = (
    "啊", "呀", "哈", "呢", "吗", "了", "哦", "喔", "嘛", "啦", "哟", "~", "请问", "医生", "大夫", "老师", "小助手", "助手",
    "机器人", "朋友", "你", "您", "们", "a lot", "so much", "very much", "there", "doctor", "doc", "bot", "again",
    "for your help", "for the help", "please", "dear", "everyone", "all", "so", "very", "!", "?", ".", ",",
)
_GREETING_RE = re.compile(
    r"^(?:\s|[,.!?;:~，。！？；：、]|"
    + "|".join(sorted((re.escape(t) for t in GREETING_TOKENS + _GREETING_FILLER), key=len, reverse=True))
    + r")+$")

# Asking for a human. The bare words match only as the whole message.
HANDOFF_PATTERNS: tuple[str, ...] = (
    r"转人工|转真人|转接人工|转接真人|人工客服|人工服务|人工坐席|接人工|(?<!需)要人工(?![\u4e00-\u9fff])|找人工(?![\u4e00-\u9fff])|我要人工|真人客服|找真人|和真人|跟真人|真人聊|"
    r"客服|人工在吗|有没有人工|有人工吗|找个人聊|找医生聊|真人回复|找个真人|有没有真人|真人在吗|投诉",
    r"\b(?:talk|speak|chat)\s+(?:to|with)\s+(?:a|an|some|the)?\s*(?:real\s+)?(?:person|human|agent|someone|somebody|"
    r"people|operator|staff|representative|nurse)\b|\bhuman agent\b|\breal person\b|\blive agent\b|\blive chat\b|"
    r"\bcustomer service\b|\btransfer me\b|\bconnect me to\b|\bget me a (?:human|person|real person)\b|"
    r"\b(?:person|human|someone|somebody) (?:i|we) can (?:talk|speak|chat) (?:to|with)\b|\bmake a complaint\b",
    r"^(?:人工|真人|客服|human|agent|person|operator|real person)(?: please| pls)?[!?.！？。 ]*$",
)
_HANDOFF_RE = tuple(re.compile(p) for p in HANDOFF_PATTERNS)

# Leaving a person for the bot: the whole message only (during a handoff every other
# message goes to the person, "我不要人工呼吸的那种急救课" included).
END_HANDOFF_PATTERNS: tuple[str, ...] = (
    r"^(?:我想|我要|请|帮我)?(?:结束|退出|取消|关闭|关掉|不要|不用|不需要)了?(?:人工|真人|客服)(?:客服|服务|对话|聊天)?了?$",
    r"^(?:回到|返回|切换到|切回|换回)(?:机器人|智能助手|小助手|健康助手)$",
    r"^(?:/end|/bot|end (?:the )?(?:chat|handoff)|stop (?:the )?(?:human|agent|handoff)|back to (?:the )?bot|"
    r"cancel (?:the )?(?:human|agent|handoff)|no (?:human|agent) (?:needed|please))$",
)
_END_HANDOFF_RE = tuple(re.compile(p) for p in END_HANDOFF_PATTERNS)

#: The bot takes the chat back (the user ended a handoff, or asked to while in none).
HANDOFF_ENDED_REPLY = {
    "zh": "好的，现在由我（健康养生小助手）继续为您解答，可以直接提问。需要人工帮助时再回复“人工”。",
    "en": 'OK, you\'re chatting with the health assistant (the bot) again; ask me anything. Reply "human" '
          "if you need a person later.",
}
#: Nobody can answer a handoff on this channel (no agent console, no agents' group).
HANDOFF_UNAVAILABLE_REPLY = {
    "zh": "抱歉，现在没有人工客服可以接待您。健康方面的问题可以继续问我；身体不适请及时就医，情况紧急请直接拨打120。",
    "en": "Sorry, no member of our team can chat right now. You can keep asking me health questions; if you feel "
          "unwell, please see a doctor, and in an emergency call your local emergency number (112 / 911) now.",
}


#: Every "reply 人工 / human to reach a person" offer in the bot's texts (this module,
#: safety/review.py, safety/triage.py), with what replaces it: where nobody can take a
#: handoff the offer is dropped (:func:`drop_handoff_offer`), not made and then refused.
HANDOFF_OFFERS: tuple[tuple[str, str], ...] = (
    ("；也可以回复“人工”找工作人员。", "。"),
    ("；如需人工帮助，请回复“人工”。", "。"),
    ("如需人工帮助，请回复“人工”。", ""),
    ("需要人工帮助时再回复“人工”。", ""),
    ("需要人工帮助请回复“人工”。", ""),
    (', or reply "human" to reach a person.', "."),
    ('; reply "human" to talk to a person.', "."),
    (' Reply "human" if you need a person later.', ""),
    ('Reply "human" to talk to a person.', ""),
)


def drop_handoff_offer(text: str) -> str:
    """``text`` without its offer of a person (:data:`HANDOFF_OFFERS`), trailing space removed."""
    for offer, replacement in HANDOFF_OFFERS:
        text = text.replace(offer, replacement)
    return text.rstrip()


def is_end_handoff(norm: Normalized) -> bool:
    """Whether the whole message asks to leave the person and return to the bot
    ("结束人工", "不用人工了", "回到机器人", "end chat", "/end"; :data:`END_HANDOFF_PATTERNS`)."""
    text = norm.text.strip().strip("!?.,;:~，。！？；：、～ ")
    return any(p.match(text) for p in _END_HANDOFF_RE)

# Subjects that are not about health.
OFF_TOPIC_PATTERNS: tuple[str, ...] = (
    r"天气(?:怎么样|如何|好不好|预报|热不热|冷不冷)|气温多少|几度|下雨吗|会下雨|下雪吗|几级风|雾霾指数|下雨不|下不下雨|下雪不|"
    r"(?:猫|狗|猫咪|狗狗|宠物|鹦鹉|仓鼠|兔子)(?:不吃|不爱吃|拉稀|拉肚子|生病|呕吐|吐了|掉毛|发烧|咳嗽|打喷嚏|"
    r"(?:天天|老是|总是|晚上|半夜)?(?:叫|吵|乱叫|拉屎|乱拉|掉毛))|"
    r"(?:猫|狗|猫咪|狗狗)[^,.;!?，。；！？咬抓挠]{0,10}(?:拉屎|乱拉|随地大小便|乱叫|叫个不停|一直叫|汪汪叫)|"
    r"(?:微信|手机|电脑|平板|电视)(?:的|上|里)?(?:字体|字|声音|铃声|内存|设置|屏幕|截屏|截图|密码|网)|截屏|截图|字体(?:太小|调大|放大)",
    r"股票|股市|炒股|基金|(?<![a-z])a股|大盘|涨停|跌停|比特币|虚拟币|理财|汇率|黄金价格|油价|房价|利率",
    r"彩票|双色球|大乐透|福彩|体彩|中奖号码|开奖",
    r"作业|数学题|应用题|作文|解方程|语文题|英语题|考试答案|奥数|背课文|翻译(?:一下|成)",
    r"菜谱|怎么做(?:才)?好吃|做法|红烧|糖醋|清蒸|爆炒|蛋糕|烘焙|烤箱|包饺子|卤肉|下厨",
    r"笑话|讲个故事|脑筋急转弯|唱首歌|猜谜|段子",
    r"代码|编程|程序|(?<![a-z])(?:python|java|c\+\+|sql|bug)(?![a-z])|写个脚本",
    r"比分|足球|篮球|(?<![a-z])(?:nba|cba)(?![a-z])|世界杯|欧冠|奥运会|赛程|球赛|谁赢了",
    r"旅游|景点|门票|机票|火车票|高铁票|酒店|攻略|签证|自驾",
    r"电影|电视剧|综艺|明星|追剧|小说|游戏|王者荣耀|星座|算命|运势|风水|生肖",
    r"快递|外卖|打车|导航|手机|充话费|流量|电脑|打印机|信号|下载|安装|软件|密码|账号|微信怎么|(?<![a-z])(?:wifi|app)(?![a-z])",
    r"^你(?:几岁|多大|喜欢|结婚|是男|是女|住在?哪|有男朋友|有女朋友|吃饭了|在干嘛|今年)",
    r"几点了|今天几号|星期几|现在几点|什么日子|新闻|去哪(?:里|儿)?玩|好玩的地方",
    r"\bweather\b|\bforecast\b|\brain(?:ing)? (?:today|tomorrow)|\bstocks?\b|\bstock market\b|\bbitcoin\b|\bcrypto\b|"
    r"\blottery\b|\bhomework\b|\bmath(?:s)? problem|\bessay\b|\brecipe\b|\bhow (?:do i|to) (?:cook|bake|make) |"
    r"\bjoke\b|\bcode\b|\bcoding\b|\bpython\b|\bjavascript\b|\bprogram(?:ming)?\b|\bfootball\b|\bsoccer\b|"
    r"\bbasketball\b|\bscores?\b|\bnba\b|\bmatch result|\btravel\b|\bflights?\b|\bhotels?\b|\btourist\b|\bmovie\b|"
    r"\bsong\b|\bcapital of\b|\btranslate\b|\bwhat time is it\b|\bhoroscope\b|\bexchange rate\b|\bpoem\b|"
    r"\bstory\b|\blaptop\b|\bcomputer\b|\bphone\b|\belection\b|\bpresident\b|\bpolitic|\bbread\b|\bcake\b|"
    r"(?<!\d)\d+\s*(?:times|plus|minus|divided by|×|\*)\s*\d+|"
    r"\b(?:dogs?|cats?|puppy|puppies|kittens?)\b[^.?!]{0,25}\b(?:barking|barks|pooping|poops|peeing|meowing|digging|"
    r"won'?t eat|not eating|throwing up|vomiting|shedding)\b",
)
_OFF_TOPIC_RE = tuple(re.compile(p) for p in OFF_TOPIC_PATTERNS)

# Any of these anywhere means the message may be about health: never out of scope.
HEALTH_WORDS: tuple[str, ...] = (
    r"健康|养生|保健|身体|病|症|疼|痛|痒|酸痛|反酸|尿酸|腰酸|发麻|麻木|晕|咳|发烧|高烧|低烧|烧心|炎|肿|血|药|医|诊|睡|失眠|饮食|营养|减肥|体重|胖|瘦|卡路里|热量|"
    r"血压|血糖|血脂|心脏|心慌|胃|肠|肝|肾|肺|关节|腰|颈|眼|牙|皮肤|过敏|感冒|发烧|中暑|防晒|上火|湿气|体质|气虚|"
    r"阳虚|阴虚|脾|孕|经期|月经|更年期|运动|锻炼|走路|跑步|散步|泡脚|按摩|穴位|艾灸|拔罐|刮痧|维生素|钙|蛋白质|盐|"
    r"糖尿|胆固醇|便秘|腹泻|拉肚子|消化|骨头|骨质|骨折|骨科|筋骨|骨密度|抵抗力|免疫|老人|老年|宝宝|婴儿|喝水|喝茶|咖啡|喝酒|抽烟|戒烟|熬夜|精神|"
    r"情绪|压力|焦虑|抑郁|心情|孤独|累|乏力|疲劳|头发|脱发|晕车|晕船|高原|时差|食疗|药膳|进补|滋补|补品|调理|"
    r"少油|少盐|低脂|低糖|清淡|适合.{0,4}吃|能不能吃|能吃吗|可以吃吗|吃了会|对身体|养胃|护肝|长寿|体检|疫苗|"
    r"伤|崴|脚踝|手腕|出汗|手脚|呼吸|喘|嗓子|喉咙|鼻|耳朵|耳鸣|头痛|头疼|头晕|头皮|肚子|恶心|呕吐|食欲|胃口|嘴唇|口干|干裂|干燥|"
    r"脸上|手上|脚上|腿|胳膊|后背|指甲|便|尿|体温|感染|保暖|着凉|受凉|冻疮|痱子|玩手机|看手机|刷手机|屏幕|用眼|"
    r"水土不服|多久合适|危害|好处|坏处|有害|洗手|肩|背(?!景|包|书|单词|后)|酸(?!菜|奶|梅)|梗|中风|癌|瘤|空调|冷气|暖气|熬(?!汤|粥|药|中药)|戒|太久|姿势|坐姿|趴着|驼背|看多久|玩多久",
    r"\bhealth|\bwellness|\bpain\b|\bache|\bhurt|\bsick\b|\bill\b|\bdisease|\bdoctor|\bmedic|\bpills?\b|\bdrugs?\b|"
    r"\bscreen time|\bhours? (?:a|per|each) day on (?:my|his|her|the) phone|\bphone addict\w*|\baddicted to (?:my|the) phone|"
    r"\bblood\b|\bheart\b|\bstomach|\bsleep|\binsomnia|\btired|\bfatigue|\bdiet\b|\bweight\b|\bcalorie|\bexercise|"
    r"\bworkout|\bwalk(?:ing)?\b|\bnutrition|\bvitamin|\bprotein|\bsalt\b|\bsugar\b|\bsodium|\bfat\b|\bcholesterol|"
    r"\bcough|\bcold\b|\bflu\b|\bfever|\ballerg|\bskin\b|\beyes?\b|\bteeth|\btooth|\bbreath|\bpregnan|\bperiod\b|"
    r"\bstress|\banxi|\bmood|\bdepress|\bsymptom|\bbody\b|\bmuscle|\bbones?\b|\bjoints?\b|\bheadache|\bdizz|\bnause|"
    r"\bsore\b|\bstrain\w*|\bsprain\w*|\binjur\w*|\bheal(?:s|ing|ed)?\b|\bgroin\b|\bankles?\b|\bwrists?\b|"
    r"\belbows?\b|\bhips?\b|\bthighs?\b|\bcalf\b|\bcalves\b|\bhamstrings?\b|"
    r"\bvomit|\bdiarrh|\bconstipat|\bdigest|\bdiabet|\bpressure\b|\bsmok|\balcohol|\bhydrat|\bimmun|\bsunscreen|"
    r"\bsunburn|\bheat ?stroke|\baltitude|\bjet ?lag|\bmotion sickness|\bhealthy|\blow[- ]salt|\blow[- ]sugar|"
    r"\bdiabetic|\bgluten|\bsafe to eat|\bnutritious|\bcheck-?up|\bvaccin|\bscreen time|\bposture|\bbad for\b|"
    r"\bgood for (?:you|me|kids|children|health)|\bappetite|\beat(?:ing)?\b|\bfood|\bmeals?\b|\bswell|\bswollen|"
    r"\bfeet\b|\bfoot\b|\bhands?\b|\bfingers?\b|\blegs?\b|\barms?\b|\bback\b|\bneck\b|\bshoulders?\b|\bknees?\b|"
    r"\bawake\b|\bnap|\bgroggy|\bhappy|\bsad\b|\blonely|\bupset|\boil\b|\bfried\b|\bfruit|\bvegetable|\btcm\b|"
    r"\byang\b|\byin\b|\bqi\b|\belderly|\bbaby|\bkids?\b|\bchild|\bwash|\bgerms?\b|\bbath|\bshower|\bsun\b|"
    r"\bscroll|\bscreens?\b|\bstroke\b|\bcancer|\btumou?r|\bdrink(?:ing)?\b|\bwater\b|\bheat\b|\bhot weather|"
    r"\b(?:travel|car|sea|air)[- ]?sick|\bsickness\b|\bginger\b|\bmou?ldy?\b|\b(?:too much|too long|hours|all day)(?: time)? on (?:my|the|his|her) "
    r"phone|\bon (?:my|the|his|her) phone (?:too|all|for hours)|\bphone (?:addiction|too much)",
)
_HEALTH_RE = tuple(re.compile(p) for p in HEALTH_WORDS)

# Everyday questions about recovering from an operation or a vaccination, or during a
# treatment ("胆囊切除了 术后饮食要注意什么", "打完疫苗能洗澡吗"): the knowledge base's
# everyday topics (bathing, eggs) would answer the everyday half and ignore the rest, so
# the honest reply is no_answer (ask the treating team), as ../shared/eval labels them.
AFTERCARE_PATTERNS: tuple[str, ...] = (
    "手术(?:后|以后|之后|完)|(?:做|动|开)(?:完|了|过)[^,.;!?，。；！？]{0,8}手术|术后|开(?:完|了)?刀(?:后|以后|之后)|"
    "打(?:完|了)[^,.;!?，。；！？]{0,6}(?:疫苗|预防针)|(?:疫苗|预防针|接种)(?:后|以后|之后)|"
    "拔(?:完|了)?(?:牙|智齿)(?:后|以后|之后)|化疗|放疗|透析|(?:出|长|得了?|发)水痘",
    r"\bafter (?:my |his |her |their |the |a |an )?(?:\w+ )?(?:surgery|operation|op|procedure)\b|\bpost[- ]?op\b|"
    r"\bafter (?:my |his |her |their |the |a )?(?:\w+ )?(?:vaccine|vaccination|jab|booster)s?\b|"
    r"\bafter (?:my |his |her |their |the |a )?(?:flu|covid|tetanus|pneumonia|shingles) shots?\b|"
    r"\bchemo(?:therapy)?\b|\bradiotherapy\b|\bdialysis\b|\bchicken ?pox\b|\bafter (?:a |my )?(?:tooth|teeth) "
    r"(?:extraction|out|pulled)",
)
_AFTERCARE_RE = tuple(re.compile(p) for p in AFTERCARE_PATTERNS)


#: Reply to an aftercare question, in our own words: the treating team's instructions come
#: first and they are the ones to ask (the advice of health services' recovery pages, e.g.
#: NHS "Recovering from an operation"), plus the usual warning signs that need a doctor
#: now (fever, a red, swollen or leaking wound, worsening pain, breathing trouble).
#: Listed for clinician review with the other safety texts.
AFTERCARE_REPLY: dict[str, str] = {
    "zh": "手术、打疫苗之后或治疗期间能做什么、该注意什么，要以给您做手术、治疗或接种的医院的医嘱为准，"
          "我不能替他们回答，怕说错耽误您。请看出院或接种时给的注意事项，或打电话问主治医生、科室护士或接种点。"
          "如果出现发热、伤口红肿渗液、疼痛越来越重、呼吸困难或胸痛，请马上就医，紧急情况拨打120。"
          "需要人工帮助请回复“人工”。",
    "en": "What is safe after an operation or a vaccination, or during a treatment, is for the team that treated "
          "you to say, so I won't guess. Please follow the instructions you were given when you left, or phone the "
          "ward, your surgeon's or specialist's clinic, or the vaccination site. If you have a fever, a wound that "
          "is red, swollen or leaking, pain that keeps getting worse, trouble breathing or chest pain, see a doctor "
          'now or call your emergency number. Reply "human" to talk to a person.',
}


# Eating with a condition whose diet the treating team sets (kidney disease, liver cirrhosis,
# Parkinson's): how much protein, potassium, salt or fluid is right depends on the stage, the
# blood tests and the medicines, and the general diet topics can be wrong there (the older
# people's topic says "protein at every meal"; kidney disease may limit it; in Parkinson's,
# protein can affect levodopa). Conditions the knowledge base has a diet topic for
# (diabetes, high blood pressure, gout, cholesterol) are not listed. "肾虚" (a TCM notion)
# and a bare "肾不好" are not matched.
MEDICAL_DIET_CONDITIONS: tuple[str, ...] = (
    "肾病|肾脏病|肾功能(?:不全|不好|差|下降|衰竭|减退)|肾不好|肾衰|尿毒症|透析|慢性肾|肌酐(?:高|偏高)|肝硬化|帕金森|"
    "渐冻症|运动神经元病|吞咽困难|吞咽障碍",
    r"\bkidney (?:disease|failure|problems?|function)\b|\bckd\b|\brenal (?:disease|failure)\b|\bdialysis\b|"
    r"\bcirrhosis\b|\bparkinson'?s?\b|\bals\b|\bmotor neurone? disease\b|\bdysphagia\b|"
    r"\b(?:trouble|difficulty|problems?) swallowing\b",
)
MEDICAL_DIET_EATING: tuple[str, ...] = (
    "吃|饮食|食物|食谱|喝|忌口|营养|蛋白",
    r"\beat(?:s|ing)?\b|\bdiet\b|\bfoods?\b|\bmeals?\b|\bdrink\b|\bprotein\b|\bnutrition\b",
)
_MEDICAL_DIET_RE = tuple((re.compile(c), re.compile(e)) for c, e in zip(MEDICAL_DIET_CONDITIONS, MEDICAL_DIET_EATING))

#: Reply to such a question, in our own words (the advice of kidney and dietetic services,
#: e.g. NHS "Chronic kidney disease - treatment": diet advice comes from the care team or a
#: renal dietitian). Listed for clinician review with the other safety texts.
MEDICAL_DIET_REPLY: dict[str, str] = {
    "zh": "肾病、肝硬化、帕金森病、渐冻症或吞咽困难这类情况怎么吃，要按病情轻重、化验结果和正在用的药来定："
          "蛋白质、钾、盐和水吃多少，饭菜要做多软多稠，每个人都不一样，一般的健康饮食建议不一定适合，"
          "我不想说错误导您。请问给您看这个病的医生，或到医院营养科请营养师制订方案。需要人工帮助请回复“人工”。",
    "en": "How to eat with kidney disease, liver cirrhosis, Parkinson's, motor neurone disease or swallowing "
          "problems depends on the stage, the blood tests and the medicines: the right amount of protein, "
          "potassium, salt or fluid, and how soft food must be, differ from person to person, so general "
          "healthy-eating advice may not fit and I won't guess. Please ask the doctor who treats the condition, "
          'or a hospital dietitian, for a plan. Reply "human" to talk to a person.',
}


def is_medical_diet(norm: Normalized) -> bool:
    """True for a question about eating with a condition whose diet the treating team sets
    (:data:`MEDICAL_DIET_CONDITIONS` and an eating word in the same language's pattern)."""
    return any(c.search(norm.text) and e.search(norm.text) for c, e in _MEDICAL_DIET_RE)


def is_aftercare(norm: Normalized) -> bool:
    """True for an everyday question after an operation or a vaccination, or during a
    treatment (:data:`AFTERCARE_PATTERNS`). Checked after triage and the scope rules, so an
    emergency or a medicine question keeps its own reply."""
    return any(p.search(norm.text) for p in _AFTERCARE_RE)


#: Everyday questions that the person's treating team must answer, not the knowledge base:
#: (rule name, matcher, reply per language), checked in order.
CARE_TEAM_RULES: tuple[tuple[str, Callable[[Normalized], bool], dict[str, str]], ...] = (
    ("aftercare", is_aftercare, AFTERCARE_REPLY),
    ("medical_diet", is_medical_diet, MEDICAL_DIET_REPLY),
)


def care_team_reply(norm: Normalized, lang: str) -> tuple[str, str] | None:
    """``(rule name, reply in lang)`` of the first :data:`CARE_TEAM_RULES` entry that matches
    (``"zh"``, else English, as :func:`intent_reply`), or None. Checked after triage and the
    scope rules, so an emergency or a medicine question keeps its own reply."""
    for rule, matches, replies in CARE_TEAM_RULES:
        if matches(norm):
            return rule, replies["zh" if lang == "zh" else "en"]
    return None


def _is_greeting(text: str) -> bool:
    return bool(text) and len(text) <= 40 and bool(_GREETING_RE.match(text))


def rule_intent(norm: Normalized) -> Intent | None:
    """Classify a message by rule, or return ``None`` to let retrieval decide.

    Args:
        norm: the normalized message (:func:`safety.normalize.normalize`). Call
            after ``safety.triage``: an emergency wins over everything here.

    Returns:
        :attr:`Intent.HANDOFF` (asked for a person; checked first, so "你好，转人工"
        is a handoff), :attr:`Intent.GREETING` (the whole message is a greeting,
        thanks, who-are-you or help, at most 40 characters),
        :attr:`Intent.OUT_OF_SCOPE` (a non-health subject and no health word), or
        ``None``.
    """
    text = norm.text.strip()
    if not text:
        return None
    if any(p.search(text) for p in _HANDOFF_RE):
        return Intent.HANDOFF
    if _is_greeting(text):
        return Intent.GREETING
    if any(p.search(text) for p in _OFF_TOPIC_RE) and not any(p.search(text) for p in _HEALTH_RE):
        return Intent.OUT_OF_SCOPE
    return None


_REPLIES: dict[Intent, tuple[str, str]] = {
    Intent.GREETING: (
        "您好！我是健康养生小助手，可以用通俗的话回答日常保健问题，比如：\n"
        "· 失眠睡不着怎么调理？\n· 高血压饮食要注意什么？\n· 老人怎么预防跌倒？\n"
        "我不是医生，不能诊断、开药或解读化验单；身体不适请及时就医。需要人工帮助请回复“人工”。",
        "Hello! I'm a health and wellness assistant. I answer everyday questions in plain words, for example:\n"
        "- How can I sleep better?\n- What should I eat with high blood pressure?\n- How can older people avoid falls?\n"
        "I'm not a doctor: I can't diagnose, prescribe or read test results. If you feel unwell, please see a "
        'doctor. Reply "human" to talk to a person.'),
    Intent.HANDOFF: (
        "好的，正在为您转接人工客服，请稍候。工作人员接入前，您可以先把问题描述一下。如果情况紧急，请直接拨打120。"
        "想回到机器人，请回复“结束人工”。",
        "OK, I'm connecting you to a member of our team; please wait a moment. You can describe your question in "
        'the meantime. In an emergency, call your local emergency number (112 / 911) now. Reply "end chat" to '
        "come back to the bot."),
    Intent.OUT_OF_SCOPE: (
        "抱歉，这个问题不在我能帮忙的范围内。我专门回答健康养生方面的问题，比如睡眠、饮食、运动、慢病生活方式、"
        "中医养生、老人和孩子的日常保健。有这方面的问题，欢迎随时问我。",
        "Sorry, that's outside what I can help with. I answer health and wellness questions: sleep, food, exercise, "
        "living with long-term conditions, traditional Chinese wellness, and everyday care for older people and "
        "children. Ask me anything about those."),
    Intent.NO_ANSWER: (
        "这个问题我没办法给您可靠的回答，不想随便说误导您。建议咨询医生，或到医院的全科门诊问一问。"
        "需要人工帮助请回复“人工”。",
        "I'm afraid this isn't something I can answer reliably, and I'd rather not guess. Please ask a doctor "
        '(your GP or family doctor is a good start). Reply "human" to talk to a person.'),
    Intent.REFER_DOCTOR: (
        "这个问题需要医生结合您的具体情况判断，我不能代替医生诊断或开药。建议到医院全科或相应专科就诊，用药问题可以问药师。",
        "This needs a doctor who knows your situation: I can't diagnose or prescribe. Please see your GP or "
        "family doctor; a pharmacist can help with questions about medicines."),
    Intent.EMERGENCY: (
        "⚠️这可能是危急情况，请立即拨打120急救电话（香港请拨999）。如需人工帮助，请回复“人工”。",
        "⚠️ This may be an emergency. Call 112 / 911 now (your local emergency number; 999 in the UK and Hong "
        'Kong). Reply "human" to talk to a person.'),
}


def intent_reply(intent: Intent, lang: str) -> str:
    """The canned reply for ``intent`` in ``lang`` (``"zh"`` Simplified or ``"en"``).

    Covers GREETING (what the bot does, example questions, not a doctor),
    HANDOFF (connecting to a person), OUT_OF_SCOPE (kind; what it can help
    with), NO_ANSWER (honest: cannot answer reliably, see a doctor, offer a
    person), plus generic REFER_DOCTOR and EMERGENCY texts for callers without a
    :mod:`safety.scope` / :mod:`safety.triage` result (prefer those: they are
    specific). Emergency numbers: 120 / 999 (zh), 112 / 911 / 999 (en).

    Raises:
        ValueError: for :attr:`Intent.ANSWER` and :attr:`Intent.SYSTEM`, which
            have no canned text.
    """
    try:
        zh, en = _REPLIES[Intent(intent)]
    except (KeyError, ValueError):
        raise ValueError(f"no canned reply for intent {intent!r}: answers come from the knowledge base") from None
    return zh if lang == "zh" else en


def unsupported_reply(lang: str) -> str:
    """Reply to images, voice, stickers, video and other non-text messages, in ``lang``."""
    if lang == "zh":
        return "我暂时只能看懂文字，请用文字描述您的问题，比如“最近总是失眠怎么办”。"
    return 'I can only read text for now. Please type your question, for example "How can I sleep better?"'


#: Insults and swearing aimed at the bot (Simplified after normalization; English lowercase).
ABUSE_WORDS = re.compile(
    r"蠢|笨蛋|傻[逼瓜子x]|sb|智障|白痴|弱智|垃圾|废物|破机器人|烂机器人|滚|去死|闭嘴|有病吧|脑残|他妈的|tmd|nmsl|"
    r"\b(?:stupid|idiot|useless|dumb|moron|shut up|fuck\w*|f\*+k|shit|crap|trash|garbage|suck|sucks)\b")
#: Words left after removing the insult that still make a question ("你真笨，我失眠怎么办").
_ABUSE_FILLER = re.compile(r"[你这个机器人真是太了吧啊呀的就是个简直]|\b(?:you|are|so|this|bot|is|a|an|such|really|the)\b|[\s,.!?，。！？~～]")


def is_abuse(norm: Normalized) -> bool:
    """True when the message is only an insult (no question left once the insult is removed)."""
    text = norm.text.strip().lower()
    if not ABUSE_WORDS.search(text):
        return False
    rest = _ABUSE_FILLER.sub("", ABUSE_WORDS.sub("", text))
    return len(rest) <= 4


ABUSE_REPLY = {
    "zh": "抱歉没能帮上您，让您着急了。您可以换个说法再描述一下身体哪里不舒服，我尽力解答；也可以回复“人工”找工作人员。",
    "en": "I'm sorry I haven't been helpful. You could describe what's bothering you in another way and I'll do my best, "
          "or reply \"human\" to reach a person.",
}


def abuse_reply(lang: str) -> str:
    """A calm reply to an insult: apologise, invite a rephrase, offer a human."""
    return ABUSE_REPLY.get(lang, ABUSE_REPLY["zh"])
