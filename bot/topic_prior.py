"""Topic prior: a linear classifier over the question embedding that ranks topics with retrieval.

Retrieval scores a topic by the question's nearest example questions (bot/retrieval.py):
a nearest-neighbour judgement that one example sharing a phrase can sway ("每天下午犯困
喝咖啡也不管用" lands on the coffee topic). A multinomial logistic regression trained on
all of a topic's examples at once learns which directions of the embedding a topic's
subject lives in. Retrieval ranks topics by

    hybrid + PRIOR_WEIGHT * log(p(topic | q) / max over topics of p(topic | q))

which is the hybrid score for the classifier's favourite and lower for the rest; the
scores reported (``Match.score``, the confidence, the topic-fit features) stay the hybrid
ones, so the verifier (bot/topic_fit.py) judges a promoted topic on its own evidence.

Measured before it was adopted (2026-12-03, answerable lines of the development batches
evals/blind-h … blind-p, 1,114 lines): the right topic first 88.5 % by the hybrid score
alone, 90.7 % with a prior trained on the knowledge base's examples, 92.2 % with the
decision_data answer lines added; PRIOR_WEIGHT 0.01-0.03 within 0.3 points of each other.

Two views of the question, their log-probabilities averaged (2026-12-05): the regression on
the embedding, and a regression on the message's character n-grams (bot/char_view.py), which
reads the words the embedding blurs. On the answer lines of the development batches (2,370)
the prior's first topic was right 91.0 % from the embedding alone and 93.7 % from both. End to
end on the never-read batches X, Z, AA, BB, CC, FF, JJ and KK (1,140 lines, 591 answerable): the
right topic answered 78.5 -> 80.2 %, confidently wrong 48 -> 40 replies (4.2 -> 3.5 %),
emergencies 146 of 146 and false alarms 5 both; on the development batches (4,180 lines) 83.0 ->
83.8 % and 4.1 -> 3.9 %. Their sum instead of the mean (twice the prior's weight in the ranking)
gave 81.5 % on topic on X-CC against 78.6 %, but 31 confidently wrong replies against 26.

Training data: the knowledge base's example questions and titles (the retriever's own
vectors: nothing embedded again) and ``bot/decision_data`` answer lines with ``topics``
(their first topic). scikit-learn's LogisticRegression (lbfgs, L2, C = :data:`C`) and the
character view's SGD regression, deterministic; about 35 s on 2 cores, cached in
``engines/cache`` keyed by the model digest, the base and the data. Serving costs one
float32[384] x [384, topics] product and the character view's 20-130 µs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog

from bot.char_view import SETTINGS as CHAR_SETTINGS, CharView, fit_char_view
from bot.classifier import HELD_OUT, SEED, data_rows, query_text, save_arrays
from bot.embedding import embed_all
from bot.logs import logged_step
from bot.retrieval import Retriever

log = structlog.get_logger("healthbot.topic_prior")

#: Weight of the log-probability ratio in the ranking, and the regression's inverse L2 strength
#: (chosen on the development batches above: 0.02 and 10; C 3 and 30 within 0.3 points).
PRIOR_WEIGHT, C = 0.02, 10.0
#: The lowest log-ratio added (a topic the classifier all but rules out is not pushed further).
FLOOR = -20.0
#: Folds of the out-of-fold logits the topic-fit verifier is trained on (:func:`out_of_fold_logits`).
FOLDS = 5
#: Bumped when the training changes, so cached priors are not reused.
PRIOR_VERSION = "4"


def _fit(x: np.ndarray, y: np.ndarray, topics: int) -> tuple[np.ndarray, np.ndarray]:
    """(coef float32[D, topics], intercept float32[topics]) of a regression on x float32[N, D], y int[N].

    Raises:
        ValueError: some topic has no training line.
    """
    from sklearn.linear_model import LogisticRegression  # training only: serving reads the cached arrays

    model = LogisticRegression(C=C, max_iter=500, random_state=SEED).fit(x, y)
    if len(model.classes_) != topics:
        raise ValueError(f"{topics - len(model.classes_)} topics have no training line")
    return model.coef_.T.astype(np.float32), model.intercept_.astype(np.float32)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return (z - np.log(np.exp(z).sum(axis=-1, keepdims=True))).astype(np.float32)


def _both(embedding: np.ndarray, chars: np.ndarray) -> np.ndarray:
    """The prior's logits from the two views' logits (float32[..., topics] each): the mean of their
    log-probabilities, on the scale of one view's (``PRIOR_WEIGHT`` was chosen on one)."""
    return (_log_softmax(embedding) + _log_softmax(chars)) / 2


def out_of_fold_logits(x: np.ndarray, y: np.ndarray, topics: int, texts: list[str]) -> np.ndarray:
    """float32[N, topics]: each line's :meth:`TopicPrior.logits` (both views) from a prior trained
    without it (:data:`FOLDS` stratified folds), as the topic-fit verifier must see the prior on
    questions it never learned; ``texts``: the lines' search texts, in x's order.

    Raises:
        ValueError: some topic has fewer lines than :data:`FOLDS`.
    """
    from sklearn.model_selection import StratifiedKFold

    out = np.zeros((len(y), topics), dtype=np.float32)
    for train, held in StratifiedKFold(FOLDS, shuffle=True, random_state=SEED).split(x, y):
        w, b = _fit(x[train], y[train], topics)
        chars = fit_char_view([texts[i] for i in train], y[train], topics, SEED)
        out[held] = _both(x[held] @ w + b, np.stack([chars.logits(texts[i]) for i in held]))
    return out


def training_lines(retriever: Retriever, known: dict[str, np.ndarray], rows: list[dict]
                   ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(x float32[N, D], topic indices y int[N], search texts): the retriever's examples, then ``rows``
    (answer lines whose first topic is in the base, vectors in ``known``)."""
    index = {tid: i for i, tid in enumerate(retriever.topic_ids)}
    x = np.concatenate([retriever.vectors, *([np.stack([known[query_text(r["q"])] for r in rows])] if rows else [])])
    y = np.concatenate([retriever.owners, np.asarray([index[r["topics"][0]] for r in rows], dtype=np.int32)])
    examples, _ = Retriever.example_texts(retriever.kb)
    texts = [query_text(t) for t in examples] + [query_text(r["q"]) for r in rows]
    return x.astype(np.float32), y, texts


def prior_rows(retriever: Retriever) -> list[dict]:
    """The decision_data answer lines the prior learns from (first topic in the base)."""
    return [r for r in data_rows() if r["intent"] == "answer" and r["topics"][0] in retriever.topic_ids]


def fit_prior(x: np.ndarray, y: np.ndarray, topics: int, texts: list[str]) -> tuple[np.ndarray, np.ndarray, CharView, dict]:
    """Train both views on x float32[N, D], topic indices y int[N] and the lines' search texts;
    returns (coef, intercept, character view, report), the report's top-1 accuracy taken on a
    :data:`HELD_OUT` split of the lines (the embedding alone, and both views)."""
    from sklearn.model_selection import train_test_split

    train, held = train_test_split(np.arange(len(y)), test_size=HELD_OUT, random_state=SEED, stratify=y)
    w, b = _fit(x[train], y[train], topics)
    chars = fit_char_view([texts[i] for i in train], y[train], topics, SEED)
    e5 = x[held] @ w + b
    both = _both(e5, np.stack([chars.logits(texts[i]) for i in held]))
    report = {"lines": int(len(y)), "held_out": int(len(held)),
              "held_out_top1_embedding": round(float((e5.argmax(axis=1) == y[held]).mean()), 4),
              "held_out_top1": round(float((both.argmax(axis=1) == y[held]).mean()), 4)}
    w, b = _fit(x, y, topics)
    return w, b, fit_char_view(texts, y, topics, SEED), report


@dataclass(frozen=True)
class TopicPrior:
    """Log p(topic | question) of a linear classifier, for ranking (module docstring).

    Attributes:
        coef: float32[D, topics]; intercept: float32[topics], topics in the retriever's order.
        chars: the character view (bot/char_view.py).
        report: lines trained on and held-out top-1 accuracy.
    """

    coef: np.ndarray
    intercept: np.ndarray
    chars: CharView
    report: dict

    def logits(self, q: np.ndarray, text: str) -> np.ndarray:
        """float32[topics] for q float32[D] (float32[K, topics] for K readings q float32[K, D]): the mean
        of log p(topic) of the embedding's regression and of the character view for ``text``, the
        message's own search text, read once (bot/retrieval.py ``search_texts``; for a follow-up read
        with the topic in context, the message alone: the characters of the context's title would
        outvote it, "冬季养生 那夏天呢")."""
        return _both(q @ self.coef + self.intercept, self.chars.logits(text))

    @staticmethod
    def log_ratio(logits: np.ndarray) -> np.ndarray:
        """float32[topics]: log(p(t) / max_t p(t)) in [:data:`FLOOR`, 0] for :meth:`logits` float32[topics]."""
        return np.maximum(logits - logits.max(), FLOOR)

    @staticmethod
    def terms(logits: np.ndarray, topic: int) -> np.ndarray:
        """float32[2] for the topic-fit verifier (bot/topic_fit.py): the topic's log-probability ratio
        to the classifier's favourite (floored at :data:`FLOOR`) and its probability, for
        :meth:`logits` float32[topics]."""
        z = logits.astype(np.float64) - float(logits.max())
        p = np.exp(z)
        return np.asarray([max(z[topic], FLOOR), p[topic] / p.sum()], dtype=np.float32)

    def ranking(self, hybrid: np.ndarray, logits: list[np.ndarray]) -> np.ndarray:
        """float32[topics]: ``hybrid`` plus :data:`PRIOR_WEIGHT` times the mean log-ratio of the
        :meth:`logits` of K question vectors (a follow-up's ``context + text`` and ``text``, as
        retrieval averages their scores)."""
        return hybrid + PRIOR_WEIGHT * np.mean([self.log_ratio(z) for z in logits], axis=0)

    @classmethod
    async def build(cls, retriever: Retriever, cache_dir: Path | None = None, model_digest: str = "",
                    known: dict[str, np.ndarray] | None = None) -> "TopicPrior":
        """Train (or load from ``cache_dir``) the prior for ``retriever``'s base and model.

        ``known``: text -> vector already computed; the data lines embedded here are added to it.

        Raises:
            ValueError: a topic with no training line; inference errors from embedding.
        """
        rows = prior_rows(retriever)
        digest = hashlib.sha256(json.dumps([retriever.kb.index_digest, rows], ensure_ascii=False).encode()).hexdigest()
        key = hashlib.sha256(f"{PRIOR_VERSION}/{model_digest}/{digest}/{C}/{CHAR_SETTINGS}".encode()).hexdigest()[:16]
        cache = Path(cache_dir) / f"topic-prior-{key}.npz" if cache_dir else None
        if cache and cache.exists():
            saved = np.load(cache)
            prior = cls(saved["coef"], saved["intercept"], CharView.from_arrays(saved), json.loads(str(saved["report"])))
            log.info("topic_prior", cached=True, **prior.report)
            return prior
        known = known if known is not None else {}
        texts = await asyncio.to_thread(lambda: [query_text(r["q"]) for r in rows])
        missing = [t for t in dict.fromkeys(texts) if t not in known]
        with logged_step(log, "topic_prior_training", lines=len(rows) + len(retriever.vectors),
                         texts_to_embed=len(missing), cached_afterwards_in=str(cache_dir) if cache_dir else "nowhere"):
            known.update(zip(missing, await embed_all(retriever.encoder, missing)))
            x, y, lines = await asyncio.to_thread(training_lines, retriever, known, rows)
            w, b, chars, report = await asyncio.to_thread(fit_prior, x, y, len(retriever.topic_ids), lines)
        if cache:
            save_arrays(cache, coef=w, intercept=b, report=json.dumps(report), **chars.arrays())
        log.info("topic_prior", cached=False, **report)
        return cls(w, b, chars, report)
