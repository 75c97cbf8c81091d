"""Topic fit: the calibrated probability that the retrieved topic answers the question.

The decision head (bot/classifier.py) reads the question alone: it can tell a self-care
question from a prescription question, but not whether the *best topic* is about what
was asked. Real questions showed the gap: eczema answered with the TCM "dampness"
topic, amphetamine salts with salt intake, red urine with flank pain with lower-back
care, all at high retrieval confidence. This verifier reads the question together with
its best topic and says how likely the topic's answer fits; the policy answers only
above ``decision.topic_fit`` (bot/decision.py), and this probability is the confidence
reported to clients.

Features of a (question, topic) pair, float32[``N_SCORES`` + D] (bot/retrieval.py
:func:`~bot.retrieval.fit_features`): the hybrid score, the dense score (mean of the two
best cosines), the best single cosine, the saturated BM25 score, the margin to the best
other topic, the cosine to the topic's centroid, how well the topic's words cover the
question's terms (:meth:`~bot.retrieval.Retriever.coverage`), the question's cosine to the
topic's answer text embedded as an e5 passage (what e5 was trained for: does this text
answer this query?) and its margin over the best other topic's answer, and the elementwise product of the
question vector and the centroid (D = 384), which lets the network learn which parts of
the embedding a topic's subject lives in. Then two terms of the topic prior (bot/topic_prior.py
:meth:`~bot.topic_prior.TopicPrior.terms`: the topic's log-probability ratio to the classifier's favourite and its
probability), a judge trained on all of every topic's questions at once. The training pairs read them
from priors not trained on the pair's question (five folds, :func:`~bot.topic_prior.out_of_fold_logits`),
as a user's question is never in the prior's data: read from the prior trained on them, the network
would learn to trust it blindly. With them (FIT_VERSION 6) the verifier's held-out pair accuracy rose from
84.0 to 85.2 % and its log loss fell from 0.363 to 0.341; on the development batches the right topic rose
by 1-4 points at equal confidently-wrong rates (bot/decision.py ``topic_fit``).

Training pairs, all from the project's own files (deterministic):

- every knowledge-base example question against the topic retrieval would give it with
  the question itself left out of the index, its topic's BM25 document and centroid
  (leave-one-out): 1 when that is its own topic, else 0 (and its own topic as a 1);
- ``bot/decision_data`` answer lines with ``topics``: their best topic, 1 when listed, and
  the best topic that is not listed, 0 (a near topic that does not answer: on the blind
  batches H, I and J it raised the wrong answers cut at equal right answers kept by 9 points);
- ``bot/decision_data`` no_answer, refer_doctor and out_of_scope lines: their best topic, 0.

A *sibling* of a right topic (:func:`sibling_pairs`: some answer line lists the two together, as knee pain
and knee osteoarthritis) is never taken as a 0: 95 % of the answer lines name one topic, and a question
between two topics that both answer it taught the verifier to doubt both (FIT_VERSION 12 leaves out 2,293
such pairs of 26,878; on the blind development batches, 8,430 lines, the right topic 85.0 -> 86.8 % at 3.6 ->
3.9 % confidently wrong, with ``decision.topic_fit`` 0.45 -> 0.5).

Model: boosted trees (bot/trees.py, weight :data:`TREE_WEIGHT`) beside the mean of :data:`MEMBERS`
one-hidden-layer networks (scikit-learn MLP), both with fixed seeds, their logits mixed and
temperature-scaled on a stratified 20 % held-out split (Guo et al. 2017); cached
in ``engines/cache`` keyed by the model digest and the data. On the development batches (4,020 lines)
at the same ``decision.topic_fit`` (0.4), one network (FIT_VERSION 6) -> eight (7) -> eight and the trees
(8): right topic 81.6 -> 82.3 -> 82.7 %, confidently wrong 4.4 -> 4.3 -> 4.2 %, emergencies 486 of 486
each time; with the trees, 0.35 gave 83.6 % and 4.4 %, 0.45 gave 82.1 % and 3.9 %.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog

from bot.classifier import (HELD_OUT, SEED, Network, binary_log_loss, data_rows, expected_calibration_error,
                            fit_network, load_network, query_text, save_arrays, sigmoid)
from bot.logs import logged_step
from bot.embedding import embed_all
from bot.retrieval import Retriever
from bot.topic_prior import C, FOLDS, PRIOR_VERSION, TopicPrior, out_of_fold_logits, prior_rows, training_lines
from bot.trees import Trees, fit_trees
from inference.lru import LRUCache

log = structlog.get_logger("healthbot.topic_fit")

#: Hidden units and L2 strength (chosen on evals/blind-a, -b, -d and the dev set; bot/decision_data/README.md).
HIDDEN, ALPHA = (64,), 1e-2
#: Networks averaged (bot/classifier.py :func:`~bot.classifier.fit_network`): each stops early on its own
#: split, and one alone moves with it; eight gave held-out pair accuracy 84.6 -> 85.7 % and log loss
#: 0.379 -> 0.350 before calibration (2026-12-05).
MEMBERS = 8
#: Weight of the boosted trees (bot/trees.py) in the verifier's logit; the networks have the rest.
#: On the held-out pairs (2026-12-05): networks alone 85.7 % accuracy, log loss 0.350; trees alone
#: 87.2 %, 0.308; 0.7 trees + 0.3 networks 87.7 %, 0.296 (raw, before the temperature).
TREE_WEIGHT = 0.7
#: Bumped when features or training change, so cached verifiers are not reused.
FIT_VERSION = "12"


def training_pairs(retriever: Retriever, rows: list[dict], vectors: list[np.ndarray], example_logits: np.ndarray,
                   row_logits: dict[str, np.ndarray], prior: TopicPrior) -> tuple[np.ndarray, np.ndarray]:
    """(x float32[N, F + 2], y int[N]) of :func:`~bot.classifier.data_rows` and the knowledge base's own
    examples: each pair's retrieval features, then the topic prior's :meth:`~bot.topic_prior.TopicPrior.terms`
    from logits of a prior not trained on the question (``example_logits`` float32[examples, topics]
    and ``row_logits`` text -> float32[topics], :func:`out_of_fold_logits`); lines the prior does not
    learn (the negatives) are read by ``prior`` itself."""
    xs, ys = [], []

    def add(feats: np.ndarray, topic: int, logits: np.ndarray, fits: bool) -> None:
        xs.append(np.concatenate([feats, TopicPrior.terms(logits, topic)]))
        ys.append(int(fits))

    ids, siblings = retriever.topic_ids, sibling_pairs(rows)

    def sibling(topic: int, right: Sequence[str]) -> bool:
        return any((r, ids[topic]) in siblings for r in right)

    examples, _ = Retriever.example_texts(retriever.kb)
    for i, (vector, owner, example) in enumerate(zip(retriever.vectors, retriever.owners, examples)):
        text = query_text(example)
        topic, feats = retriever.pair_features(vector, text, exclude=i)
        if topic == owner or not sibling(topic, [ids[owner]]):
            add(feats, topic, example_logits[i], topic == owner)
        if topic != owner:
            add(retriever.pair_features(vector, text, topic=int(owner), exclude=i)[1], int(owner), example_logits[i], True)
    for row, vector in zip(rows, vectors):
        text = query_text(row["q"])
        logits = row_logits[text] if text in row_logits else prior.logits(vector, text)
        topic, feats = retriever.pair_features(vector, text)
        right_ids = (row.get("topics") or ()) if row["intent"] == "answer" else ()
        if ids[topic] in right_ids or not sibling(topic, right_ids):
            add(feats, topic, logits, ids[topic] in right_ids)
        if row["intent"] == "answer":  # a near topic that is not the answer: the runner-up negative
            right = frozenset(i for i, tid in enumerate(ids) if tid in right_ids)
            topic, feats = retriever.pair_features(vector, text, avoid=right)
            if not sibling(topic, right_ids):
                add(feats, topic, logits, False)
    return np.stack(xs).astype(np.float32), np.asarray(ys)


@dataclass(frozen=True)
class Verifier:
    """The verifier's two models: logit = :data:`TREE_WEIGHT` x trees + (1 - it) x networks."""

    network: Network
    trees: Trees

    def logits(self, x: np.ndarray) -> np.ndarray:
        """float32[R] for rows x float32[R, F], float32[1] for one row float32[F]."""
        nets = self.network.logits(x)[..., 0]
        return TREE_WEIGHT * self.trees.logits(x) + (1 - TREE_WEIGHT) * np.atleast_1d(nets)


def _fit(x: np.ndarray, y: np.ndarray) -> Verifier:
    return Verifier(fit_network(x, y, HIDDEN, ALPHA, MEMBERS), fit_trees(x, y, SEED))


def fit_verifier(x: np.ndarray, y: np.ndarray) -> tuple[Verifier, float, dict]:
    """Train on pairs ``x`` float32[N, F], ``y`` int[N] in {0, 1}; returns (verifier, temperature, held-out report)."""
    from sklearn.model_selection import train_test_split

    train, held = train_test_split(np.arange(len(y)), test_size=HELD_OUT, random_state=SEED, stratify=y)
    logits = _fit(x[train], y[train]).logits(x[held])
    temps = np.exp(np.linspace(np.log(0.25), np.log(4.0), 81))
    temperature = float(min(temps, key=lambda t: binary_log_loss(sigmoid(logits / t), y[held])))
    raw, cal = sigmoid(logits), sigmoid(logits / temperature)
    two = lambda p: np.stack([1 - p, p], axis=1)  # noqa: E731 (ECE of the binary decision)
    report = {
        "pairs": int(len(y)), "held_out": int(len(held)), "fits": int(y.sum()), "temperature": round(temperature, 3),
        "held_out_accuracy": round(float(((cal >= 0.5) == y[held]).mean()), 4),
        "log_loss": {"raw": round(binary_log_loss(raw, y[held]), 4), "calibrated": round(binary_log_loss(cal, y[held]), 4)},
        "ece": {"raw": expected_calibration_error(two(raw), y[held]),
                "calibrated": expected_calibration_error(two(cal), y[held])},
    }
    return _fit(x, y), temperature, report


def _pairs(retriever: Retriever, rows: list[dict], vectors: list[np.ndarray], known: dict[str, np.ndarray],
           prior: TopicPrior) -> tuple[np.ndarray, np.ndarray]:
    """:func:`training_pairs` with the prior's out-of-fold logits computed for it."""
    lines = prior_rows(retriever)
    x, y, texts = training_lines(retriever, known, lines)
    oof = out_of_fold_logits(x, y, len(retriever.topic_ids), texts)
    examples = len(retriever.vectors)
    row_logits = {query_text(r["q"]): oof[examples + j] for j, r in enumerate(lines)}
    return training_pairs(retriever, rows, vectors, oof[:examples], row_logits, prior)


def sibling_pairs(rows: list[dict]) -> frozenset[tuple[str, str]]:
    """Ordered (topic, topic) pairs that some answer line of ``rows`` lists together as right answers
    (knee pain and knee osteoarthritis, insomnia and waking early): neighbours that both answer such
    questions, whatever the verifier's margin between them says."""
    return frozenset((a, b) for r in rows for a in r.get("topics") or () for b in r.get("topics") or () if a != b)


@dataclass(frozen=True)
class TopicFit:
    """Calibrated P(the topic answers the question) for :func:`bot.retrieval.fit_features` vectors."""

    verifier: Verifier
    temperature: float
    report: dict
    #: P(fit) of inputs seen before (repeated questions), by their bytes; as many as the encoder's
    #: embedding cache holds (:meth:`build`), none by default
    seen: LRUCache[float] = field(default_factory=lambda: LRUCache(0), compare=False, repr=False)
    #: :func:`sibling_pairs` of the training data
    siblings: frozenset[tuple[str, str]] = field(default=frozenset(), compare=False, repr=False)

    def runner_up_is_sibling(self, matches: Sequence) -> bool:
        """True when the second of retrieval's ``matches`` (ranked, each with ``topic_id``) is a sibling
        of the first (:func:`sibling_pairs`): the question sits between two topics that both answer it."""
        return len(matches) > 1 and (matches[0].topic_id, matches[1].topic_id) in self.siblings

    def probability(self, features: np.ndarray, prior: np.ndarray | None) -> float:
        """P(fit) in [0, 1] for one float32[F] retrieval feature vector and the topic prior's
        float32[2] :meth:`~bot.topic_prior.TopicPrior.terms` of the same topic; ``prior`` None (the prior is
        off until the next start after a reload changed the topics) reads the training pairs' mean."""
        terms = np.asarray(self.report["prior_terms_mean"], dtype=np.float32) if prior is None else prior
        x = np.concatenate([features, terms])
        return self.seen.get_or_put(x.tobytes(), lambda: float(sigmoid(self.verifier.logits(x)[0] / self.temperature)))

    @classmethod
    async def build(cls, retriever: Retriever, prior: TopicPrior, cache_dir: Path | None = None,
                    model_digest: str = "", known: dict[str, np.ndarray] | None = None) -> "TopicFit":
        """Train (or load from ``cache_dir``) the verifier for ``retriever``'s base and model.

        ``prior``: the retriever's topic prior, trained on the same base and data (its out-of-fold
        logits are computed here: :data:`~bot.topic_prior.FOLDS` more fits, about a minute on 2 cores).
        ``known``: text -> vector already computed (the retriever's and the decision head's).

        Raises:
            inference errors from embedding the training lines.
        """
        rows = data_rows()
        siblings = sibling_pairs(rows)
        digest = hashlib.sha256(json.dumps([retriever.kb.index_digest, rows], ensure_ascii=False).encode()).hexdigest()
        # the verifier learns from the prior's out-of-fold logits: a new prior is a new verifier
        key = hashlib.sha256(f"{FIT_VERSION}/{model_digest}/{digest}/{HIDDEN}/{ALPHA}/{MEMBERS}/{TREE_WEIGHT}/{C}/{FOLDS}"
                             f"/{PRIOR_VERSION}".encode()).hexdigest()[:16]
        cache = Path(cache_dir) / f"topic-fit-{key}.npz" if cache_dir else None
        seen = LRUCache(retriever.results.size)
        if cache and cache.exists():
            net, temperature, report = load_network(cache)
            fit = cls(Verifier(net, Trees.from_arrays(np.load(cache))), temperature, report, seen=seen, siblings=siblings)
            log.info("topic_fit", cached=True, **fit.report)
            return fit
        known = known if known is not None else {}
        # the Python-heavy steps off the event loop: a serving process reloads its model meanwhile
        texts = await asyncio.to_thread(lambda: [query_text(r["q"]) for r in rows])
        missing = [t for t in dict.fromkeys(texts) if t not in known]
        with logged_step(log, "topic_fit_training", lines=len(rows), texts_to_embed=len(missing),
                         cached_afterwards_in=str(cache_dir) if cache_dir else "nowhere"):
            known.update(zip(missing, await embed_all(retriever.encoder, missing)))
            x, y = await asyncio.to_thread(_pairs, retriever, rows, [known[t] for t in texts], known, prior)
            verifier, temperature, report = await asyncio.to_thread(fit_verifier, x, y)
            report["prior_terms_mean"] = [round(float(v), 4) for v in x[:, -2:].mean(axis=0)]
        if cache:
            save_arrays(cache, temperature=temperature, report=json.dumps(report), **verifier.network.arrays(),
                        **verifier.trees.arrays())
        log.info("topic_fit", cached=False, **report)
        return cls(verifier, temperature, report, seen=seen, siblings=siblings)
