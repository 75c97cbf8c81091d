"""Rule intents (greeting, handoff, out of scope) on evals/safety.jsonl and canned replies."""

from __future__ import annotations

import json
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
