"""The topic prior (bot/topic_prior.py): a linear classifier that ranks topics with retrieval."""

from __future__ import annotations

import numpy as np
import pytest

from bot.classifier import query_text
from bot.search_cache import SearchCache
from bot.topic_prior import FLOOR, fit_prior
from tests.conftest import requires_model


def test_training_is_deterministic_and_reports_held_out_accuracy():
    rng = np.random.default_rng(2)
    y = np.repeat(np.arange(4), 50)
    x = (rng.normal(size=(200, 8)) + np.eye(8)[y] * 5).astype(np.float32)
    w, b, report = fit_prior(x, y, 4)
    w2, b2, _ = fit_prior(x, y, 4)
    np.testing.assert_array_equal(w, w2)
    assert w.shape == (8, 4) and b.shape == (4,) and w.dtype == np.float32
    assert report["lines"] == 200 and report["held_out"] == 40 and report["held_out_top1"] > 0.9


def test_a_topic_without_training_lines_is_refused():
    x = np.eye(3, dtype=np.float32).repeat(10, axis=0)
    with pytest.raises(ValueError, match="1 topics have no training line"):
        fit_prior(x, np.repeat([0, 1, 2], 10), 4)


@requires_model
async def test_the_prior_ranks_but_the_reported_scores_stay_the_hybrid_ones(dispatcher):
    retriever = dispatcher.retriever
    prior = retriever.prior
    assert prior is not None and prior.coef.shape == (384, len(retriever.topic_ids))
    text = query_text("吃完饭就胀气 肚子鼓鼓的 嗝也打不出来")
    vector = (await retriever.encoder.encode([text]))[0]
    ratio = prior.log_ratio(prior.logits(vector))
    assert ratio.max() == 0.0 and ratio.min() >= FLOOR
    assert retriever.topic_ids[int(ratio.argmax())] == "digest.bloating"
    found = await retriever.search(text)
    assert found.matches[0].topic_id == "digest.bloating" and found.contested
    retriever.prior, retriever.results = None, SearchCache(0)
    try:
        alone = {m.topic_id: m.score for m in (await retriever.search(text, k=10)).matches}
    finally:
        retriever.prior, retriever.results = prior, SearchCache(0)
    assert found.matches[0].score == pytest.approx(alone["digest.bloating"])


@requires_model
def test_healthbot_eval_reports_what_the_prior_was_trained_on(cli_main, tmp_path, capsys):
    import json
    labelled = tmp_path / "one.jsonl"
    labelled.write_text(json.dumps({"q": "吃完饭就胀气 嗝也打不出来", "intent": "answer", "lang": "zh",
                                    "topics": ["digest.bloating"]}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert cli_main(["eval", "--json", str(labelled)]) == 0
    prior = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["topic_prior"]
    assert prior["lines"] > 9000 and 0.5 < prior["held_out_top1"] <= 1.0
    assert cli_main(["eval", str(labelled)]) == 0
    assert f"topic prior: trained on {prior['lines']} lines" in capsys.readouterr().out
