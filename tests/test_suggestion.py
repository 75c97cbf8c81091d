"""“Did you mean …?” (bot/suggestion.py): a topic the verifier doubts is offered, and a yes sends it.

The conversations run through the real dispatcher and model. Which questions fall in the
band between ``decision.suggest`` and ``decision.topic_fit`` depends on the trained verifier,
so the tests that need an offer move the band over every answer (``topic_fit`` 0.999,
``suggest`` 0): the question's own topic is then offered rather than answered.
"""

from __future__ import annotations

import itertools

import pytest

from bot import metrics
from bot.suggestion import DECLINED, answer_to_offer
from bot.types import Inbound, Intent, MessageKind
from tests.conftest import requires_model

_ids = itertools.count()


@pytest.mark.parametrize("text", ["是", "是的", "对对", "嗯嗯", "好的呀", "可以", "1", "第一个", "係呀", "yes", "yes please",
                                  "ok!", "sure", "yep", "the first one"])
def test_a_bare_yes_or_one_chooses_the_first_topic(text):
    assert answer_to_offer(text) == 0


@pytest.mark.parametrize("text, index", [("2", 1), ("第二个", 1), ("两", 1), ("２", 1), ("two", 1), ("number 2", 1),
                                         ("3", 2), ("第三个吧", 2), ("third one", 2)])
def test_a_number_chooses_that_topic(text, index):
    assert answer_to_offer(text) == index


@pytest.mark.parametrize("text", ["不是", "不对", "算了", "不用了", "都不是", "唔系", "no", "nope", "no thanks",
                                  "none of these"])
def test_a_bare_no_declines_it(text):
    assert answer_to_offer(text) == DECLINED


@pytest.mark.parametrize("text", ["是的 我想问高血压吃什么", "好的谢谢", "是不是湿气重", "不是很舒服", "yes but what about kids",
                                  "no idea why my knee hurts", "对了 还想问一下", "2岁宝宝发烧", "第二天还疼"])
def test_a_message_with_more_in_it_is_a_message_of_its_own(text):
    assert answer_to_offer(text) is None


def _msg(user: str, text: str) -> Inbound:
    n = next(_ids)
    return Inbound(channel="test", user_id=user, chat_id=user, message_id=f"sg{n}", kind=MessageKind.TEXT, text=text)


@pytest.fixture
def offers_every_topic(dispatcher, monkeypatch):
    """The verifier's band moved over every answer: each topic answer becomes an offer."""
    monkeypatch.setattr(dispatcher.cfg.decision, "topic_fit", 0.999)
    monkeypatch.setattr(dispatcher.cfg.decision, "topic_fit_sibling", 0.999)
    monkeypatch.setattr(dispatcher.cfg.decision, "suggest", 0.0)
    return dispatcher




@pytest.mark.model
@requires_model
async def test_offer_then_yes_sends_the_offered_topic(offers_every_topic):
    d, user = offers_every_topic, f"sg-user-{next(_ids)}"
    count = {e: metrics.REGISTRY.get_sample_value("healthbot_offers_total", {"event": e}) or 0.0
             for e in ("offered", "chosen")}
    offer = await d.handle(_msg(user, "失眠怎么调理"))
    assert offer.intent is Intent.NO_ANSWER and offer.topic is None
    assert offer.suggested[0] == "sleep.insomnia" and 1 <= len(offer.suggested) <= 3
    title = d.kb.topics["sleep.insomnia"].title["zh"]
    if len(offer.suggested) == 1:
        assert f"您是想了解「{title}」吗" in offer.text and "回复“是”" in offer.text
    else:  # a numbered list, best first
        assert "您是想了解下面哪一个？请回复数字" in offer.text and f"\n1. {title}\n" in offer.text
    assert "AI" in offer.text.splitlines()[-1]  # the disclaimer, as on every health text
    yes = await d.handle(_msg(user, "是的"))
    assert yes.intent is Intent.ANSWER and yes.topic == "sleep.insomnia" and yes.confidence == 1.0
    assert yes.text.startswith(d.kb.topics["sleep.insomnia"].render("zh")[:20])
    again = await d.handle(_msg(user, "是"))  # the offer was used: a second yes is not another answer of it
    assert again.topic != "sleep.insomnia"
    for event in ("offered", "chosen"):  # healthbot_offers_total{event}
        assert metrics.REGISTRY.get_sample_value("healthbot_offers_total", {"event": event}) == count[event] + 1


@pytest.mark.model
@requires_model
async def test_offer_then_no_asks_for_the_question_again_and_drops_the_offer(offers_every_topic):
    d, user = offers_every_topic, f"sg-user-{next(_ids)}"
    assert (await d.handle(_msg(user, "失眠怎么调理"))).suggested[0] == "sleep.insomnia"
    no = await d.handle(_msg(user, "不是"))
    assert no.intent is Intent.NO_ANSWER and no.topic is None and no.suggested == ()
    assert "换个说法" in no.text
    late_yes = await d.handle(_msg(user, "是"))
    assert late_yes.topic != "sleep.insomnia"
    digit = await d.handle(_msg(user, "2"))  # nothing offered now; a digit says no language: the offer's
    assert digit.topic is None and digit.lang == "zh"


@pytest.mark.model
@requires_model
async def test_another_question_replaces_the_offer(offers_every_topic):
    d, user = offers_every_topic, f"sg-user-{next(_ids)}"
    assert (await d.handle(_msg(user, "失眠怎么调理"))).suggested[0] == "sleep.insomnia"
    second = await d.handle(_msg(user, "how much water should I drink every day"))
    assert second.suggested[0] == "nutri.water" and "Did you mean" in second.text
    yes = await d.handle(_msg(user, "yes please"))
    assert yes.intent is Intent.ANSWER and yes.topic == "nutri.water" and yes.lang == "en"


@pytest.mark.model
@requires_model
async def test_traditional_offer_and_cantonese_yes(offers_every_topic):
    d, user = offers_every_topic, f"sg-user-{next(_ids)}"
    offer = await d.handle(_msg(user, "晚上總是睡不著怎麼辦"))
    assert offer.suggested[0] == "sleep.insomnia" and "您是想了解" in offer.text and ("嗎" in offer.text or "哪一個" in offer.text)
    yes = await d.handle(_msg(user, "係呀"))
    assert yes.intent is Intent.ANSWER and yes.topic == "sleep.insomnia" and "醫生" in yes.text
    # a digit says nothing of the script: the answer follows the offer's (Traditional, Hong Kong)
    other = f"sg-user-{next(_ids)}"
    assert (await d.handle(_msg(other, "成日瞓唔著 點算好"))).suggested
    first = await d.handle(_msg(other, "1"))
    assert first.intent is Intent.ANSWER and first.lang == "zh" and "醫生" in first.text


@pytest.mark.model
@requires_model
async def test_below_the_offer_threshold_the_reply_is_a_plain_no_answer(dispatcher, monkeypatch):
    monkeypatch.setattr(dispatcher.cfg.decision, "topic_fit", 0.999)
    monkeypatch.setattr(dispatcher.cfg.decision, "topic_fit_sibling", 0.999)
    monkeypatch.setattr(dispatcher.cfg.decision, "suggest", 0.999)
    user = f"sg-user-{next(_ids)}"
    reply = await dispatcher.handle(_msg(user, "失眠怎么调理"))
    assert reply.intent is Intent.NO_ANSWER and reply.suggested == () and "您是想了解" not in reply.text
    assert (await dispatcher.handle(_msg(user, "是"))).topic != "sleep.insomnia"


@pytest.mark.model
@requires_model
async def test_an_emergency_is_never_offered_as_a_topic(offers_every_topic):
    reply = await offers_every_topic.handle(_msg(f"sg-user-{next(_ids)}", "我爸胸口像压了块石头，一直出冷汗"))
    assert reply.intent is Intent.EMERGENCY and reply.suggested == () and "120" in reply.text


@pytest.mark.model
@requires_model
async def test_a_bare_no_without_an_offer_asks_for_a_question(dispatcher):
    reply = await dispatcher.handle(_msg(f"sg-user-{next(_ids)}", "不是"))
    assert reply.intent is Intent.NO_ANSWER and reply.topic is None and "换个说法" in reply.text


@pytest.mark.model
@requires_model
async def test_a_number_sends_that_topic_of_the_list(offers_every_topic):
    d, user = offers_every_topic, f"sg-user-{next(_ids)}"
    offer = await d.handle(_msg(user, "失眠怎么调理"))
    assert len(offer.suggested) >= 2, offer.suggested  # the insomnia topic has near neighbours
    for i, topic in enumerate(offer.suggested, 1):
        assert f"{i}. {d.kb.topics[topic].title['zh']}" in offer.text
    second = await d.handle(_msg(user, "2"))
    assert second.intent is Intent.ANSWER and second.topic == offer.suggested[1]


@pytest.mark.model
@requires_model
async def test_a_follow_up_while_topics_stand_offered_asks_which_then_sends_that_facet(offers_every_topic):
    """"那饮食上呢" right after "您是想了解下面哪一个？": the bot saw the question, so it does not say it has
    no earlier topic; it asks for the choice first, and the number chosen gets that topic's diet facet."""
    d, user = offers_every_topic, f"sg-user-{next(_ids)}"
    offer = await d.handle(_msg(user, "失眠怎么调理"))
    assert len(offer.suggested) >= 2
    ask = await d.handle(_msg(user, "那饮食上呢"))
    assert ask.intent is Intent.NO_ANSWER and ask.suggested == offer.suggested
    assert "「饮食」" in ask.text and "没有看到前面的话题" not in ask.text
    assert f"1. {d.kb.topics[offer.suggested[0]].title['zh']}" in ask.text
    chosen = await d.handle(_msg(user, "1"))
    topic = d.kb.topics[offer.suggested[0]]
    assert chosen.topic == topic.id
    assert topic.facet_text("diet", "zh")[:20] in chosen.text and topic.answer["zh"][:20] not in chosen.text
    again = await d.handle(_msg(f"{user}-b", "what about exercise?"))  # nothing offered, nothing answered
    assert again.intent is Intent.NO_ANSWER and not again.suggested
