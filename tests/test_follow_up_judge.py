"""The follow-up judge (bot/follow_up_judge.py): whether a message with a facet cue asks about the
topic just answered, with the real model, knowledge base and trained judge."""

from __future__ import annotations

import pytest

from bot.follow_up import FollowUp, read_cue, refers_back
from bot.follow_up_judge import FEATURES, FOLLOW_PROBABILITY, features_of, judge_readings, plan_follow_up, training_pairs
from inference.batcher import BusyError
from safety.normalize import normalize


def _norm(text: str) -> str:
    return normalize(text).text


@pytest.mark.parametrize("text, cue", [
    ("我爸76了也这样 老年人要注意啥", (FollowUp("elders"), True)),
    ("我外公快九十了 老人洗要注意啥", (FollowUp("elders"), False)),
    ("should i still hit the gym today?", (FollowUp("activity"), False)),
    ("还有别的办法吗 眼药水不想一直点", (FollowUp(None), False)),
    ("my 5 year old too? does this apply to kids", (FollowUp("children"), True)),
    ("头疼了三天", None),
    ("is this any different for my father? he's 79", (FollowUp("elders"), False)),  # an age told as "he's 79"
    ("she's 80 percent better now, anything else?", (FollowUp(None), False)),  # not an age
    ("我爸爸八十五岁了，这些方法他也适合吗", (FollowUp("elders"), True)),  # 八十五岁, not a child of 十五 or 五
    ("孩子两岁了能用吗", (FollowUp("children"), False)),
    ("how long should i wait before seeing someone", (FollowUp("see_doctor"), False)),
    ("我家老人最近晚上老是睡不着觉，白天又没精神，吃饭也不香，一个人在家总是唉声叹气，儿女都在外地工作，"
     "我们做子女的应该怎么办才好呢 有什么好办法吗", None),  # past CUE_MAX_CHARS: a question of its own
])
def test_a_cue_says_what_a_message_would_ask_of_the_topic_in_context(text, cue):
    assert read_cue(_norm(text)) == cue


@pytest.mark.parametrize("text, back", [
    ("喂奶期间能吃吗 我特别馋", True),  # the object left out
    ("这个要紧吗", True),
    ("will it go away on its own?", True),
    ("are there foods that set it off?", True),
    ("这个季节吃什么好", False),  # a time, not what was said
    ("is it safe to do yoga while pregnant?", False),  # a dummy "it"
    ("why do my fingers go white when it's cold?", False),
    ("what can kids eat for breakfast that isn't full of sugar", False),  # a relative "that"
    ("我家孩子老是眨眼睛 怎么回事", False),
])
def test_words_that_point_back_at_the_last_answer_are_one_input_of_the_judge(text, back):
    assert refers_back(_norm(text)) is back
    assert "refers_back" in FEATURES


async def test_the_trained_judge_tells_a_follow_up_from_a_question_of_its_own(dispatcher):
    retriever = dispatcher.retriever
    judge = retriever.follow_judge
    assert judge is not None and judge.weights.shape == (len(FEATURES),)
    assert judge.report["pairs"] > 1000 and 0 < judge.report["follows"] < judge.report["pairs"]
    assert judge.report["held_out_accuracy"] > 0.8
    insomnia, cold_hands = retriever.kb.topics["sleep.insomnia"], retriever.kb.topics["body.cold_hands_feet"]

    async def p(text: str, topic) -> float:
        t = _norm(text)
        own, ctx = await judge_readings(retriever, t, topic, "zh")
        return judge.probability(features_of(retriever, t, topic.id, read_cue(t), own, ctx))

    assert await p("我妈七十多了也睡不好 老人要注意啥", insomnia) >= FOLLOW_PROBABILITY
    assert await p("我爸76了也这样 老年人要注意啥", cold_hands) >= FOLLOW_PROBABILITY
    assert await p("我家孩子老是流鼻血 怎么回事", insomnia) < FOLLOW_PROBABILITY
    assert await p("我妈膝盖疼 上下楼梯更疼 老人吃什么好", cold_hands) < FOLLOW_PROBABILITY


async def test_a_message_is_read_on_its_own_when_the_encoder_cannot_judge_it(dispatcher, monkeypatch):
    retriever = dispatcher.retriever
    insomnia = retriever.kb.topics["sleep.insomnia"]
    text = _norm("我妈七十多了也睡不好 老人要注意啥")
    assert (await plan_follow_up(text, insomnia, "zh", retriever)).loose == FollowUp("elders")

    async def busy(*args, **kwargs):
        raise BusyError("full")

    monkeypatch.setattr(retriever, "search", busy)
    # the reading of a message seen before is remembered and needs no encoder; a new one does
    assert (await plan_follow_up(text, insomnia, "zh", retriever)).loose == FollowUp("elders")
    plan = await plan_follow_up(text, retriever.kb.topics["body.cold_hands_feet"], "zh", retriever)
    assert plan.loose is None and not plan.with_context
    retriever.follow_judge.seen.clear()
    plan = await plan_follow_up(text, insomnia, "zh", retriever)
    assert plan.loose is None and not plan.with_context
    monkeypatch.undo()  # the encoder serves again: a reading it missed was not kept
    assert (await plan_follow_up(text, insomnia, "zh", retriever)).loose == FollowUp("elders")
    monkeypatch.setattr(retriever, "search", busy)
    monkeypatch.setattr(retriever, "follow_judge", None)
    assert (await plan_follow_up(text, insomnia, "zh", retriever)).loose is None
    assert (await plan_follow_up("那饮食上呢", insomnia, "zh", retriever)).facet == FollowUp("diet")  # no judge needed


def test_training_pairs_need_every_field_and_keep_only_cue_messages(tmp_path, monkeypatch):
    import bot.follow_up_judge as judge

    monkeypatch.setattr(judge, "DATA_DIR", tmp_path)
    (tmp_path / "a.jsonl").write_text(
        '{"topic": "sleep.insomnia", "second": "老人呢 我妈七十了", "lang": "zh", "follows": true}\n'
        '{"topic": "sleep.insomnia", "second": "头疼了三天", "lang": "zh", "follows": false}\n', encoding="utf-8")
    topics = {"sleep.insomnia": object(), "body.acne": object()}
    helper = [p for p in training_pairs(topics) if p[1] == "sleep.insomnia" and p[3]]
    assert helper == [(_norm("老人呢 我妈七十了"), "sleep.insomnia", "zh", True)]
    assert all(read_cue(text) is not None for text, *_ in training_pairs(topics))
    (tmp_path / "b.jsonl").write_text('{"topic": "sleep.insomnia", "second": "老人呢", "lang": "zh"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="b.jsonl:1"):
        training_pairs(topics)
