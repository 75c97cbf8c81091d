"""Rule intents (greeting, handoff, out of scope) on evals/safety.jsonl, canned replies, and the rule tables
(bot/intent_rules.yaml, safety/scope_rules.yaml): every entry's source and example."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bot.intents import intent_reply, is_end_handoff, rule_intent, unsupported_reply
from bot.types import Intent
from safety.normalize import normalize

EVALS = Path(__file__).resolve().parent.parent / "evals" / "safety.jsonl"
ROWS = [json.loads(line) for line in EVALS.read_text(encoding="utf-8").splitlines() if line.strip()]
RULE_ROWS = [r for r in ROWS if r["intent"] in ("greeting", "handoff", "out_of_scope")]
HEALTH_ROWS = [r for r in ROWS if r["intent"] in ("answer", "refer_doctor", "emergency")]


def _ids(rows):
    return [r["q"][:40] for r in rows]


def test_rule_intent_accuracy_on_eval_file():
    right = [r for r in RULE_ROWS if (rule_intent(normalize(r["q"])) or Intent.ANSWER).value == r["intent"]]
    wrongly_claimed = [r["q"] for r in HEALTH_ROWS if rule_intent(normalize(r["q"])) is not None]
    print(f"\n[intent eval] greeting/handoff/out_of_scope right {len(right)}/{len(RULE_ROWS)}; "
          f"health lines taken by a rule {len(wrongly_claimed)}/{len(HEALTH_ROWS)}")
    assert len(right) == len(RULE_ROWS)
    assert not wrongly_claimed


@pytest.mark.parametrize("row", RULE_ROWS, ids=_ids(RULE_ROWS))
def test_rule_line_is_classified(row):
    assert rule_intent(normalize(row["q"])) == Intent(row["intent"])


@pytest.mark.parametrize("row", HEALTH_ROWS, ids=_ids(HEALTH_ROWS))
def test_health_line_is_left_to_safety_and_retrieval(row):
    assert rule_intent(normalize(row["q"])) is None


@pytest.mark.parametrize("text", ["你好，我失眠怎么办", "hi, how can I sleep better", "谢谢，那高血压能喝茶吗"])
def test_greeting_with_a_question_is_not_a_greeting(text):
    assert rule_intent(normalize(text)) is None


def test_greeting_and_handoff_in_one_message_is_a_handoff():
    assert rule_intent(normalize("你好，转人工")) == Intent.HANDOFF


@pytest.mark.parametrize("text", ["有冇真人可以同我倾下", "搵个人工客服啦", "我想同真人讲"])
def test_cantonese_requests_for_a_person_are_a_handoff(text):
    assert rule_intent(normalize(text)) == Intent.HANDOFF


@pytest.mark.parametrize("text", ["人工关节能用多少年", "需要人工关节置换吗"])
def test_artificial_joint_is_not_a_handoff(text):
    assert rule_intent(normalize(text)) != Intent.HANDOFF


@pytest.mark.parametrize("text", ["天气热怎么防中暑", "糖尿病人红烧肉能吃吗", "旅游时晕车怎么办",
                                  "low salt recipe for high blood pressure",
                                  "groin strain from football last week, still a bit sore, how long to heal",
                                  "I sprained my ankle playing soccer"])
def test_health_word_keeps_message_in_scope(text):
    assert rule_intent(normalize(text)) is None


def test_canned_replies():
    greet = intent_reply(Intent.GREETING, "zh")
    assert "不是医生" in greet and "失眠" in greet
    assert "not a doctor" in intent_reply(Intent.GREETING, "en")
    assert "人工" in intent_reply(Intent.HANDOFF, "zh")
    assert "health" in intent_reply(Intent.OUT_OF_SCOPE, "en")
    no_answer = intent_reply(Intent.NO_ANSWER, "zh")
    assert "医生" in no_answer and "人工" in no_answer
    assert "reliably" in intent_reply(Intent.NO_ANSWER, "en")
    for intent in (Intent.GREETING, Intent.HANDOFF, Intent.OUT_OF_SCOPE, Intent.NO_ANSWER):
        for lang in ("zh", "en"):
            assert len(intent_reply(intent, lang).encode("utf-8")) < 2048  # WeChat passive reply limit


def test_answer_has_no_canned_reply():
    with pytest.raises(ValueError):
        intent_reply(Intent.ANSWER, "zh")


def test_unsupported_reply_asks_for_text():
    assert "文字" in unsupported_reply("zh")
    assert "text" in unsupported_reply("en")


@pytest.mark.parametrize("text, expected", [
    ("胆囊切除了 术后饮食要注意什么", True), ("做完白内障手术能洗澡吗", True), ("打完疫苗能吃鸡蛋吗", True),
    ("孩子出水痘了能吃什么", True), ("我爸化疗期间吃什么好", True), ("what to eat after my knee operation", True),
    ("can I drink coffee after my flu shot", True), ("sore arm after the covid jab", True),
    ("我怕做手术 怎么缓解紧张", False), ("吃完饭能马上洗澡吗", False), ("after a shot of whisky can I sleep", False),
    ("is it ok to shower after a long walk", False),
])
def test_aftercare_questions_are_recognised(text, expected):
    from bot.intents import is_aftercare

    assert is_aftercare(normalize(text)) is expected


@pytest.mark.parametrize("text", ["结束人工", "不用人工了", "结束人工服务。", "退出人工客服", "我想结束人工", "回到机器人",
                                  "結束人工", "End chat", "/end", "back to the bot!", "stop human"])
def test_leaving_a_person_for_the_bot_is_recognised(text):
    assert is_end_handoff(normalize(text))


@pytest.mark.parametrize("text", ["转人工", "人工", "结束人工呼吸培训在哪报名", "我不要人工关节", "how do I end my chat with my son",
                                  "怎么结束治疗"])
def test_other_messages_do_not_end_a_handoff(text):
    assert not is_end_handoff(normalize(text))


def _offers_a_person(text: str) -> bool:
    return "回复“人工”" in text or 'reply "human"' in text.lower()


def test_every_offer_of_a_person_in_the_bots_texts_can_be_dropped():
    from bot.config import SafetyConfig
    from bot.intents import ABUSE_REPLY, AFTERCARE_REPLY, HANDOFF_ENDED_REPLY, MEDICAL_DIET_REPLY, drop_handoff_offer
    from safety.review import FALLBACK
    from safety.triage import _LEAD, _WHILE_WAITING, crisis_reply, emergency_reply

    texts = [intent_reply(i, lang) for i in (Intent.GREETING, Intent.HANDOFF, Intent.OUT_OF_SCOPE, Intent.NO_ANSWER,
                                             Intent.REFER_DOCTOR, Intent.EMERGENCY) for lang in ("zh", "en")]
    for table in (ABUSE_REPLY, AFTERCARE_REPLY, HANDOFF_ENDED_REPLY, MEDICAL_DIET_REPLY, FALLBACK):
        texts += list(table.values())
    cfg = SafetyConfig()
    texts += [crisis_reply(lang, cfg) for lang in ("zh", "en")]
    texts += [emergency_reply(c, lang, cfg) for c in [*_WHILE_WAITING, *_LEAD, "other"] for lang in ("zh", "en")]
    offering = [t for t in texts if _offers_a_person(t)]
    assert len(offering) >= 15  # the texts above that offer one
    for t in offering:
        dropped = drop_handoff_offer(t)
        assert not _offers_a_person(dropped), t
        assert dropped and dropped[-1] in "。.！!）)" and len(dropped) > len(t) // 2, dropped


@pytest.mark.parametrize("text, off_topic", [("I spend 6 hours a day on my phone, how do I cut down", False),
                                             ("微信字体太小了 咋调大", True), ("my phone battery dies fast", True),
                                             ("邻居家的猫老是在我家院子里拉屎", True), ("养狗对老人身体好吗", False)])
def test_phones_and_pets_are_off_topic_unless_about_the_persons_health(text, off_topic):
    assert (rule_intent(normalize(text)) is Intent.OUT_OF_SCOPE) is off_topic


# ---- the rule tables: bot/intent_rules.yaml and safety/scope_rules.yaml ----------------------
# Every entry names the source it follows and carries one example message of its own that it
# must catch: the entry's own patterns match it, and the module gives it the entry's outcome.

def _load(path):
    import yaml

    return yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)


def _regex(value):
    return value if value is None or isinstance(value, str) else "|".join(value)


def _intent_entries():
    from bot.intents import TABLE

    table = _load(TABLE)
    sections = ("handoff", "end_handoff", "off_topic", "health_words")
    entries = [(section, e) for section in sections for e in table[section]]
    entries += [(group["name"], e) for group in table["care_team"] for e in group["rules"]]
    entries += [("greeting", table["greeting"]), ("abuse", table["abuse"])]
    return entries


INTENT_ENTRIES = _intent_entries()


def _entry_id(item):
    section, entry = item
    return f"{section}.{entry.get('name', section)}"


def _intent_outcome(section: str, text: str):
    """What the module does with ``text`` in terms of ``section`` (True when it is that section's outcome)."""
    from bot.intents import care_team_reply, is_abuse

    norm = normalize(text)
    if section in ("handoff", "greeting", "off_topic"):
        return rule_intent(norm) == {"handoff": Intent.HANDOFF, "greeting": Intent.GREETING,
                                     "off_topic": Intent.OUT_OF_SCOPE}[section]
    if section == "end_handoff":
        return is_end_handoff(norm)
    if section == "health_words":  # a health word keeps a message with an off-topic word in scope
        off_topic = "明天天气怎么样"
        return (rule_intent(normalize(off_topic)) is Intent.OUT_OF_SCOPE
                and rule_intent(normalize(f"{off_topic} {text}")) is None)
    if section == "abuse":
        return is_abuse(norm)
    hit = care_team_reply(norm, "zh")
    return hit is not None and hit[0] == section


@pytest.mark.parametrize("item", INTENT_ENTRIES, ids=[_entry_id(i) for i in INTENT_ENTRIES])
def test_every_intent_rule_has_a_source_and_its_example_matches_it(item):
    section, entry = item
    assert entry["source"].strip() and entry["example"].strip()
    text = normalize(entry["example"]).text
    if "pattern" in entry:
        assert re.search(_regex(entry["pattern"]), text.strip()), entry["example"]
        assert entry.get("also") is None or re.search(_regex(entry["also"]), text), entry["example"]
    assert _intent_outcome(section, entry["example"]), entry["example"]


def test_intent_rule_names_are_unique():
    names = [_entry_id(i) for i in INTENT_ENTRIES]
    assert len(names) == len(set(names))


def _scope_rules():
    from safety.scope import SCOPE_RULES

    return SCOPE_RULES


SCOPE_RULES = _scope_rules()


@pytest.mark.parametrize("rule", SCOPE_RULES, ids=[f"{r.reason}.{r.name}" for r in SCOPE_RULES])
def test_every_scope_rule_has_a_source_and_its_example_matches_it_first(rule):
    from safety.scope import check_scope, matching_rule

    assert rule.source.strip() and rule.example.strip()
    text = normalize(rule.example).text
    assert re.search(rule.pattern, text), rule.example
    assert rule.also is None or re.search(rule.also, text), rule.example
    assert rule.unless is None or not re.search(rule.unless, text), rule.example
    assert matching_rule(rule.example) == f"{rule.reason}.{rule.name}"  # not shadowed by an earlier rule
    assert check_scope(rule.example, normalize(rule.example).lang).reason == rule.reason


def test_scope_rule_names_are_unique_and_every_reason_has_a_reply():
    from safety.scope import _REPLIES

    assert len({r.name for r in SCOPE_RULES}) == len(SCOPE_RULES)
    assert {r.reason for r in SCOPE_RULES} == set(_REPLIES)


def _departments():
    from safety.scope import TABLE

    return _load(TABLE)["departments"]


DEPARTMENT_ENTRIES = _departments()


@pytest.mark.parametrize("index", range(len(DEPARTMENT_ENTRIES)), ids=[d["zh"] for d in DEPARTMENT_ENTRIES])
def test_every_department_example_gets_its_department(index):
    from safety.scope import DEPARTMENTS

    entry = DEPARTMENT_ENTRIES[index]
    text = normalize(entry["example"]).text
    first = next(i for i, (pattern, _, _) in enumerate(DEPARTMENTS) if re.search(pattern, text))
    assert first == index, (entry["example"], DEPARTMENTS[first][1])


@pytest.mark.parametrize("text, greeting", [
    ("谢谢你 上次说的泡脚方法很管用 我妈这几天睡得好多了", True),
    ("thanks, the tips worked, sleeping much better now", True),
    ("谢谢医生，按你说的做好多了", True),
    ("谢谢 我还是头疼得厉害", False),          # no news that it helped: read as a health message
    ("谢谢 泡脚有用吗", False),                # a question
    ("ok thanks it helped but how long should I keep doing it?", False),
])
def test_thanks_with_news_that_the_advice_helped_is_a_greeting_unless_it_asks(text, greeting):
    from safety.normalize import normalize
    assert (rule_intent(normalize(text)) is Intent.GREETING) is greeting


@pytest.mark.parametrize("q", ["看新闻说有小孩吞了纽扣电池很危险 家里还有什么要收好的", "新闻里说儿童误食洗衣凝珠的多了 怎么防"])
def test_a_childs_safety_after_a_news_story_is_not_out_of_scope(q):
    """The clean-clone check (2026-12-05): the out-of-scope rule read 新闻 alone and refused it."""
    assert rule_intent(normalize(q)) is None
