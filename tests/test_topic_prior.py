"""The topic prior (bot/topic_prior.py): a linear classifier that ranks topics with retrieval."""

from __future__ import annotations

import numpy as np
import pytest

from bot.classifier import query_text
from bot.search_cache import SearchCache
from bot.topic_prior import FLOOR, fit_prior
from tests.conftest import requires_model


WORDS = ("失眠 睡不着", "胀气 打嗝", "手脚 冰凉", "sore throat")


def test_training_is_deterministic_and_reports_held_out_accuracy():
    rng = np.random.default_rng(2)
    y = np.repeat(np.arange(4), 50)
    x = (rng.normal(size=(200, 8)) + np.eye(8)[y] * 5).astype(np.float32)
    texts = [f"{WORDS[t]} {i}" for i, t in enumerate(y)]
    w, b, chars, report = fit_prior(x, y, 4, texts)
    w2, b2, chars2, _ = fit_prior(x, y, 4, texts)
    np.testing.assert_array_equal(w, w2)
    np.testing.assert_array_equal(chars.coef, chars2.coef)
    assert w.shape == (8, 4) and b.shape == (4,) and w.dtype == np.float32 and chars.coef.shape[1] == 4
    assert report["lines"] == 200 and report["held_out"] == 40 and report["held_out_top1"] > 0.9
    assert report["held_out_top1_embedding"] > 0.9
    assert int(chars.logits("老是失眠 怎么办").argmax()) == 0 and int(chars.logits("my sore throat").argmax()) == 3


def test_a_topic_without_training_lines_is_refused():
    x = np.eye(3, dtype=np.float32).repeat(10, axis=0)
    with pytest.raises(ValueError, match="1 topics have no training line"):
        fit_prior(x, np.repeat([0, 1, 2], 10), 4, ["失眠"] * 30)


def test_the_character_view_reads_what_scikit_learns_char_wb_tfidf_reads():
    from sklearn.feature_extraction.text import TfidfVectorizer

    from bot.char_view import MIN_DF, NGRAMS, fit_char_view

    texts = ["晚上 失眠 睡不着", "失眠 多梦", "饭后 胀气 打嗝", "胀气 怎么办", "Sore throat at night", "a sore THROAT",
             "手脚冰凉", "手脚 冰凉 怕冷"]
    view = fit_char_view(texts, np.asarray([0, 0, 1, 1, 2, 2, 3, 3]), 4)
    ref = TfidfVectorizer(analyzer="char_wb", ngram_range=NGRAMS, min_df=MIN_DF, sublinear_tf=True).fit(texts)
    assert view.vocabulary == ref.vocabulary_
    for text in [*texts, "喉咙 痛 sore", "x", ""]:
        cols, w = view.features(text)
        expected = ref.transform([text]).toarray()[0]
        got = np.zeros(len(view.vocabulary), dtype=np.float32)
        got[cols] = w
        np.testing.assert_allclose(got, expected, atol=1e-6)


@requires_model
async def test_the_prior_ranks_but_the_reported_scores_stay_the_hybrid_ones(dispatcher):
    retriever = dispatcher.retriever
    prior = retriever.prior
    assert prior is not None and prior.coef.shape == (384, len(retriever.topic_ids))
    text = query_text("吃完饭就胀气 肚子鼓鼓的 嗝也打不出来")
    vector = (await retriever.encoder.encode([text]))[0]
    ratio = prior.log_ratio(prior.logits(vector, text))
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
