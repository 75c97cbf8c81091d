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

Training data: the knowledge base's example questions and titles (the retriever's own
vectors: nothing embedded again) and ``bot/decision_data`` answer lines with ``topics``
(their first topic). scikit-learn's LogisticRegression (lbfgs, L2, C = :data:`C`),
deterministic; about 10 s on 2 cores, cached in ``engines/cache`` keyed by the model
digest, the base and the data. Serving costs one float32[384] x [384, topics] product.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog

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
PRIOR_VERSION = "1"


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


def out_of_fold_logits(x: np.ndarray, y: np.ndarray, topics: int) -> np.ndarray:
    """float32[N, topics]: each line's logits from a regression trained without it (:data:`FOLDS`
    stratified folds), as the topic-fit verifier must see the prior on questions it never learned.

    Raises:
        ValueError: some topic has fewer lines than :data:`FOLDS`.
    """
    from sklearn.model_selection import StratifiedKFold

    out = np.zeros((len(y), topics), dtype=np.float32)
    for train, held in StratifiedKFold(FOLDS, shuffle=True, random_state=SEED).split(x, y):
        w, b = _fit(x[train], y[train], topics)
        out[held] = x[held] @ w + b
    return out


def training_lines(retriever: Retriever, known: dict[str, np.ndarray], rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(x float32[N, D], topic indices y int[N]): the retriever's example vectors, then ``rows``
    (answer lines whose first topic is in the base, vectors in ``known``)."""
    index = {tid: i for i, tid in enumerate(retriever.topic_ids)}
    x = np.concatenate([retriever.vectors, *([np.stack([known[query_text(r["q"])] for r in rows])] if rows else [])])
    y = np.concatenate([retriever.owners, np.asarray([index[r["topics"][0]] for r in rows], dtype=np.int32)])
    return x.astype(np.float32), y


def prior_rows(retriever: Retriever) -> list[dict]:
    """The decision_data answer lines the prior learns from (first topic in the base)."""
    return [r for r in data_rows() if r["intent"] == "answer" and r["topics"][0] in retriever.topic_ids]


def fit_prior(x: np.ndarray, y: np.ndarray, topics: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Train on x float32[N, D], topic indices y int[N]; returns (coef, intercept, report), the
    report's top-1 accuracy taken on a :data:`HELD_OUT` split of the lines."""
    from sklearn.model_selection import train_test_split

    train, held = train_test_split(np.arange(len(y)), test_size=HELD_OUT, random_state=SEED, stratify=y)
    w, b = _fit(x[train], y[train], topics)
    accuracy = float(((x[held] @ w + b).argmax(axis=1) == y[held]).mean())
    w, b = _fit(x, y, topics)
    return w, b, {"lines": int(len(y)), "held_out": int(len(held)), "held_out_top1": round(accuracy, 4)}


@dataclass(frozen=True)
class TopicPrior:
    """Log p(topic | question) of a linear classifier, for ranking (module docstring).

    Attributes:
        coef: float32[D, topics]; intercept: float32[topics], topics in the retriever's order.
        report: lines trained on and held-out top-1 accuracy.
    """

    coef: np.ndarray
    intercept: np.ndarray
    report: dict

    def logits(self, q: np.ndarray) -> np.ndarray:
        """float32[topics]: the classifier's logits for q float32[D]."""
        return q @ self.coef + self.intercept

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
        digest = hashlib.sha256(json.dumps([retriever.kb.digest, rows], ensure_ascii=False).encode()).hexdigest()
        key = hashlib.sha256(f"{PRIOR_VERSION}/{model_digest}/{digest}/{C}".encode()).hexdigest()[:16]
        cache = Path(cache_dir) / f"topic-prior-{key}.npz" if cache_dir else None
        if cache and cache.exists():
            saved = np.load(cache)
            prior = cls(saved["coef"], saved["intercept"], json.loads(str(saved["report"])))
            log.info("topic_prior", cached=True, **prior.report)
            return prior
        known = known if known is not None else {}
        texts = await asyncio.to_thread(lambda: [query_text(r["q"]) for r in rows])
        missing = [t for t in dict.fromkeys(texts) if t not in known]
        with logged_step(log, "topic_prior_training", lines=len(rows) + len(retriever.vectors),
                         texts_to_embed=len(missing), cached_afterwards_in=str(cache_dir) if cache_dir else "nowhere"):
            known.update(zip(missing, await embed_all(retriever.encoder, missing)))
            x, y = await asyncio.to_thread(training_lines, retriever, known, rows)
            w, b, report = await asyncio.to_thread(fit_prior, x, y, len(retriever.topic_ids))
        if cache:
            save_arrays(cache, coef=w, intercept=b, report=json.dumps(report))
        log.info("topic_prior", cached=False, **report)
        return cls(w, b, report)
