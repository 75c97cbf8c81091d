"""The topic-fit verifier (bot/topic_fit.py) and the features retrieval gives it (bot/retrieval.py)."""

from __future__ import annotations

import numpy as np
import pytest

from bot.classifier import query_text, sigmoid
from bot.topic_fit import fit_verifier


def test_training_is_deterministic_and_calibrated_on_a_held_out_split():
    rng = np.random.default_rng(1)
    y = np.repeat([0, 1], 150)
    x = (rng.normal(size=(300, 12)) + y[:, None] * 0.8).astype(np.float32)
    a, b = fit_verifier(x, y), fit_verifier(x, y)
    np.testing.assert_array_equal(a[0].network.w1, b[0].network.w1)
    np.testing.assert_array_equal(a[0].trees.threshold, b[0].trees.threshold)
    net, temperature, report = a
    assert report["held_out"] == 60 and report["fits"] == 150 and temperature > 0
    assert report["log_loss"]["calibrated"] <= report["log_loss"]["raw"] + 1e-9
    assert report["held_out_accuracy"] > 0.7


async def test_coverage_says_which_words_of_the_question_the_topic_lacks(dispatcher):
    retriever = dispatcher.retriever
    salt = retriever.topic_ids.index("nutri.salt")
    from bot.lexical import tokenize

    covered, worst, unknown = retriever.coverage(tokenize(query_text("每天吃多少盐合适")), salt)
    assert covered == pytest.approx(1.0) and worst == 0.0 and unknown == 0.0
    covered, worst, unknown = retriever.coverage(tokenize(query_text("amphetamine salts for adhd")), salt)
    assert covered < 0.5 and worst > 0.5 and unknown > 0.0


async def pair(dispatcher, text: str, topic: str) -> float:
    retriever = dispatcher.retriever
    q = query_text(text)
    vector = (await retriever.encoder.encode([q]))[0]
    index = retriever.topic_ids.index(topic)
    _, features = retriever.pair_features(vector, q, topic=index)
    return dispatcher.topic_fit.probability(features, retriever.prior.terms(retriever.prior.logits(vector, q), index))


@pytest.mark.parametrize("text, topic", [
    ("晚上翻来覆去到两点都睡不着 有啥办法", "sleep.insomnia"),
    ("my feet are always freezing even in bed", "body.cold_hands_feet"),
])
async def test_a_question_on_the_topics_subject_fits(dispatcher, text, topic):
    assert await pair(dispatcher, text, topic) >= dispatcher.cfg.decision.topic_fit


@pytest.mark.parametrize("text, topic", [
    ("what is the usual dose of amphetamine salts for adhd", "nutri.salt"),
    ("膝盖做完置换手术多久能爬山", "exercise.walking"),
])
async def test_a_question_on_another_subject_does_not_fit(dispatcher, text, topic):
    assert await pair(dispatcher, text, topic) < dispatcher.cfg.decision.topic_fit


async def test_the_verifier_reports_its_calibration(dispatcher):
    report = dispatcher.topic_fit.report
    assert report["pairs"] > 5000 and report["ece"]["calibrated"] <= 0.05
    assert report["held_out_accuracy"] >= 0.75


async def test_a_repeated_question_is_scored_once_and_the_caller_gets_its_own_copy(dispatcher):
    retriever, head, fit = dispatcher.retriever, dispatcher.head, dispatcher.topic_fit
    found = await retriever.search(query_text("晚上翻来覆去到两点都睡不着 有啥办法"))
    scored = len(head.seen), len(fit.seen)
    probs = head.probabilities(found.vector)
    p = fit.probability(found.fit_features, found.prior_terms)
    logits = head.network.logits(found.vector) / head.temperature
    expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert list(probs.values()) == pytest.approx(expected.tolist(), abs=1e-6)
    logit = fit.verifier.logits(np.concatenate([found.fit_features, found.prior_terms]))[0] / fit.temperature
    assert p == pytest.approx(float(sigmoid(logit)), abs=1e-6)
    probs["crisis"] = 1.0  # the dispatcher raises danger labels in its own dict
    assert head.probabilities(found.vector)["crisis"] == pytest.approx(float(expected[list(probs).index("crisis")]))
    assert fit.probability(found.fit_features, found.prior_terms) == p
    assert len(head.seen) <= scored[0] + 1 and len(fit.seen) <= scored[1] + 1 and head.seen.size > 0
