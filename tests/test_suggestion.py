"""“Did you mean …?” (bot/suggestion.py): a topic the verifier doubts is offered, and a yes sends it.

The conversations run through the real dispatcher and model. Which questions fall in the
band between ``decision.suggest`` and ``decision.topic_fit`` depends on the trained verifier,
so the tests that need an offer move the band over every answer (``topic_fit`` 0.999,
``suggest`` 0): the question's own topic is then offered rather than answered.
"""

from __future__ import annotations

import itertools

import pytest

from bot.suggestion import answer_to_offer
from bot.types import Inbound, Intent, MessageKind
from tests.conftest import requires_model

_ids = itertools.count()


@pytest.mark.parametrize("text", ["是", "是的", "对对", "嗯嗯", "好的呀", "可以", "1", "係呀", "yes", "yes please", "ok!",
                                  "sure", "yep"])
def test_a_bare_yes_accepts_the_offer(text):
    assert answer_to_offer(text) == "yes"


@pytest.mark.parametrize("text", ["不是", "不对", "算了", "不用了", "唔系", "no", "nope", "no thanks"])
def test_a_bare_no_declines_it(text):
    assert answer_to_offer(text) == "no"


@pytest.mark.parametrize("text", ["是的 我想问高血压吃什么", "好的谢谢", "是不是湿气重", "不是很舒服", "yes but what about kids",
                                  "no idea why my knee hurts", "对了 还想问一下"])
def test_a_message_with_more_in_it_is_a_message_of_its_own(text):
    assert answer_to_offer(text) is None


def _msg(user: str, text: str) -> Inbound:
    n = next(_ids)
    return Inbound(channel="test", user_id=user, chat_id=user, message_id=f"sg{n}", kind=MessageKind.TEXT, text=text)


@pytest.fixture
def offers_every_topic(dispatcher, monkeypatch):
    """The verifier's band moved over every answer: each topic answer becomes an offer."""
    monkeypatch.setattr(dispatcher.cfg.decision, "topic_fit", 0.999)
    monkeypatch.setattr(dispatcher.cfg.decision, "suggest", 0.0)
    return dispatcher




@pytest.mark.model
@requires_model
async def test_offer_then_yes_sends_the_offered_topic(offers_every_topic):
    d, user = offers_every_topic, f"sg-user-{next(_ids)}"
    offer = await d.handle(_msg(user, "失眠怎么调理"))
    assert offer.intent is Intent.NO_ANSWER and offer.topic is None
    assert offer.suggested == "sleep.insomnia"
    title = d.kb.topics["sleep.insomnia"].title["zh"]
    assert f"您是想了解「{title}」吗" in offer.text and "回复“是”" in offer.text
    assert "AI" in offer.text.splitlines()[-1]  # the disclaimer, as on every health text
    yes = await d.handle(_msg(user, "是的"))
    assert yes.intent is Intent.ANSWER and yes.topic == "sleep.insomnia" and yes.confidence == 1.0
    assert yes.text.startswith(d.kb.topics["sleep.insomnia"].render("zh")[:20])
    again = await d.handle(_msg(user, "是"))  # the offer was used: a second yes is not another answer of it
    assert again.topic != "sleep.insomnia"


@pytest.mark.model
@requires_model
async def test_offer_then_no_asks_for_the_question_again_and_drops_the_offer(offers_every_topic):
    d, user = offers_every_topic, f"sg-user-{next(_ids)}"
    assert (await d.handle(_msg(user, "失眠怎么调理"))).suggested == "sleep.insomnia"
    no = await d.handle(_msg(user, "不是"))
    assert no.intent is Intent.NO_ANSWER and no.topic is None and no.suggested is None
    assert "换个说法" in no.text
    late_yes = await d.handle(_msg(user, "是"))
    assert late_yes.topic != "sleep.insomnia"


@pytest.mark.model
@requires_model
async def test_another_question_replaces_the_offer(offers_every_topic):
    d, user = offers_every_topic, f"sg-user-{next(_ids)}"
    assert (await d.handle(_msg(user, "失眠怎么调理"))).suggested == "sleep.insomnia"
    second = await d.handle(_msg(user, "how much water should I drink every day"))
    assert second.suggested == "nutri.water" and "Did you mean" in second.text
    yes = await d.handle(_msg(user, "yes please"))
    assert yes.intent is Intent.ANSWER and yes.topic == "nutri.water" and yes.lang == "en"


@pytest.mark.model
@requires_model
async def test_traditional_offer_and_cantonese_yes(offers_every_topic):
    d, user = offers_every_topic, f"sg-user-{next(_ids)}"
    offer = await d.handle(_msg(user, "晚上總是睡不著怎麼辦"))
    assert offer.suggested == "sleep.insomnia" and "您是想了解" in offer.text and "嗎" in offer.text
    yes = await d.handle(_msg(user, "係呀"))
    assert yes.intent is Intent.ANSWER and yes.topic == "sleep.insomnia" and "醫生" in yes.text


@pytest.mark.model
@requires_model
async def test_below_the_offer_threshold_the_reply_is_a_plain_no_answer(dispatcher, monkeypatch):
    monkeypatch.setattr(dispatcher.cfg.decision, "topic_fit", 0.999)
    monkeypatch.setattr(dispatcher.cfg.decision, "suggest", 0.999)
    user = f"sg-user-{next(_ids)}"
    reply = await dispatcher.handle(_msg(user, "失眠怎么调理"))
    assert reply.intent is Intent.NO_ANSWER and reply.suggested is None and "您是想了解" not in reply.text
    assert (await dispatcher.handle(_msg(user, "是"))).topic != "sleep.insomnia"


@pytest.mark.model
@requires_model
async def test_an_emergency_is_never_offered_as_a_topic(offers_every_topic):
    reply = await offers_every_topic.handle(_msg(f"sg-user-{next(_ids)}", "我爸胸口像压了块石头，一直出冷汗"))
    assert reply.intent is Intent.EMERGENCY and reply.suggested is None and "120" in reply.text


@pytest.mark.model
@requires_model
async def test_a_bare_no_without_an_offer_asks_for_a_question(dispatcher):
    reply = await dispatcher.handle(_msg(f"sg-user-{next(_ids)}", "不是"))
    assert reply.intent is Intent.NO_ANSWER and reply.topic is None and "换个说法" in reply.text
