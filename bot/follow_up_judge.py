"""The follow-up judge: does a short message with a facet cue ask about the topic just answered?

After an answer on insomnia, "我妈七十多了也睡不好 老人要注意啥" asks for the topic's facet for
elders, while "我家孩子老是流鼻血 怎么回事" asks something new although it names a child and a cause.
The words alone cannot tell them apart (bot/follow_up.py reads the cue: who it is for, diet, why...);
how the message reads against the topic can. The judge is a logistic regression over
:data:`FEATURES`, all from two retrieval readings of the message: on its own, and with the topic's
title in front (one encoder call serves both: :meth:`~bot.retrieval.Retriever.search`).

It replaced a cascade of hand-set rules (a title word the topic never uses, a score margin of 0.02,
a confidence of 0.8 past 18 characters), each chosen on the same few follow-up sets. On those sets
(1-5) and standalone questions put after an unrelated topic, the rules followed 82.8 % of follow-ups
and took 3.3 % of the standalone questions for follow-ups; the judge, which never trained on them,
follows 87.1 % at the same 3.3 %; on sets 6-8, 82.7 % against the rules' 71.5 %. Follow-up set 9,
written after it, got the facet's text end to end for 65.2 -> 71.0 % of its conversations
(evals/README.md; bot/follow_up_data/README.md says how it was chosen).

Training pairs (all written for this project, deterministic):

- ``bot/follow_up_data/*.jsonl``: a topic, a second message and whether it follows that topic
  (follow-ups of every facet, and messages that switch subject in the same words);
- every ``bot/decision_data`` question with a cue, put after a topic that does not answer it
  (drawn with a fixed seed): not a follow-up.

Cached in ``engines/cache``, keyed by the model digest and a digest of the knowledge base and data.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import structlog

from bot.classifier import DATA_DIR as DECISION_DATA, HELD_OUT, SEED, binary_log_loss, save_arrays, sigmoid
from bot.embedding import embed_all
from bot.follow_up import (POPULATION_FACETS, RULES_PATH, FollowUp, FollowUpPlan, cue_length, is_bare_follow_up,
                           is_follow_up, new_subject_of, read_cue, read_follow_up, refers_back)
from bot.knowledge import Topic
from bot.logs import logged_step
from bot.retrieval import Retriever
from bot.search_cache import SearchResult
from bot.topic_prior import PRIOR_VERSION
from inference.batcher import BusyError, DeadlineExceeded
from inference.engines.base import EngineError
from inference.lru import LRUCache
from safety.normalize import normalize
from safety.pii import mask_pii

log = structlog.get_logger("healthbot.follow_up_judge")

DATA_DIR = Path(__file__).parent / "follow_up_data"
#: The judge's inputs, in order (:func:`features_of`).
FEATURES = ("own_confidence", "own_gap", "own_context_score", "context_gap", "context_first", "new_subject",
            "length", "tied", "population", "more", "lead", "own_near", "answer_score", "answer_gap", "refers_back")
#: L2 strength (scikit-learn's C) of the logistic regression, whose two classes weigh the same
#: (there are about seven pairs that do not follow for one that does); chosen on follow-up sets 1-5
#: and the standalone-question guard (bot/follow_up_data/README.md).
C = 1.0
#: Bumped when features or training change, so cached judges are not reused.
JUDGE_VERSION = "3"
#: P(follows) from which a message with a cue is answered from the topic in context; chosen on
#: follow-up sets 1-5 and the standalone-question guard (bot/follow_up_data/README.md).
FOLLOW_PROBABILITY = 0.4
#: P(follows) from which a message with a cue that the judge put below :data:`FOLLOW_PROBABILITY` is
#: still answered from the topic in context when, read on its own, it finds a topic about that facet in
#: general ("would exercise help?" after restless legs finds the exercise topic; bot/follow_up.py
#: ``asks_in_general``). Chosen on follow-up sets 1-9, switch sets 8-9 and the standalone-question guard
#: (2026-12-06): facet text 448 -> 466 of 630 conversations, guard questions taken 41 -> 42 of 1,049; at
#: 0.2, 452 and 41; with no floor, 467 and 56.
GENERAL_FOLLOW_PROBABILITY = 0.1


async def judge_readings(retriever: Retriever, text: str, topic: Topic, lang: str) -> tuple[SearchResult, SearchResult]:
    """The two retrieval readings the judge reads (:func:`features_of`) of ``text`` (normalized, personal
    data masked) after ``topic``'s answer in ``lang``: alone, and with the topic's title in front.

    Raises:
        inference errors (BusyError, DeadlineExceeded, EngineError) from embedding ``text``.
    """
    return await retriever.search(text), await retriever.search(text, context=topic.title[lang])


def features_of(retriever: Retriever, text: str, topic_id: str, cue: tuple[FollowUp, bool], own: SearchResult,
                ctx: SearchResult) -> np.ndarray:
    """:data:`FEATURES` of ``text`` after topic ``topic_id`` from its two readings, float32[F]: ``own``
    (alone) and ``ctx`` (with the topic's title in front).
    Scores are bot/retrieval.py hybrid scores: ``own_gap`` is how far the best topic of the message
    read on its own is ahead of the topic in context, ``context_gap`` the same with the title in front."""
    facet, tied = cue
    answers, t = retriever.answer_scores(own.vector), retriever.topic_index[topic_id]
    own_score, ctx_score = own.score_of(topic_id), ctx.score_of(topic_id)
    return np.asarray([own.matches[0].confidence, own.matches[0].score - own_score, own_score,
                       ctx.matches[0].score - ctx_score, ctx.matches[0].topic_id == topic_id,
                       new_subject_of(retriever, text, topic_id) is not None, cue_length(text), tied,
                       facet.facet in POPULATION_FACETS, facet.facet is None, is_follow_up(text),
                       topic_id in [m.topic_id for m in own.matches], answers[t], answers.max() - answers[t],
                       refers_back(text)],
                      dtype=np.float32)


async def training_features(retriever: Retriever, pairs: list[tuple[str, str, str, bool]],
                            known: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """float32[len(pairs), F] of :func:`training_pairs`; every text not in ``known`` (text -> vector,
    the decision head's) embedded in chunks first (:func:`~bot.embedding.embed_all`), so that a busy
    start-up never trips the request deadline."""
    texts = [(retriever.search_texts(text), retriever.search_texts(text, retriever.kb.topics[tid].title[lang]))
             for text, tid, lang, _ in pairs]
    vectors = dict(known or {})
    unique = [t for t in dict.fromkeys(t for own, ctx in texts for t in (*own, *ctx)) if t not in vectors]
    vectors.update(zip(unique, await embed_all(retriever.encoder, unique)))

    def one(pair: tuple[str, str, str, bool], own: list[str], ctx: list[str]) -> np.ndarray:
        text, tid = pair[0], pair[1]
        return features_of(retriever, text, tid, read_cue(text),
                           retriever.read(own, np.stack([vectors[t] for t in own])),
                           retriever.read(ctx, np.stack([vectors[t] for t in ctx])))

    return await asyncio.to_thread(lambda: np.stack([one(p, *t) for p, t in zip(pairs, texts)]))


def training_pairs(topics: dict[str, Topic]) -> list[tuple[str, str, str, bool]]:
    """(text normalized and masked, topic id, lang, follows) for every pair the judge learns from
    (module docstring); only texts with a cue (:func:`bot.follow_up.read_cue`) and topics that exist.

    Raises:
        ValueError: a follow_up_data line without ``topic``, ``second``, ``lang`` or ``follows``.
    """
    def text_of(raw: str) -> str:
        return mask_pii(normalize(raw).text)

    pairs = []
    for path in sorted(DATA_DIR.glob("*.jsonl")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not (isinstance(row.get("second"), str) and row.get("lang") in ("zh", "en")
                    and isinstance(row.get("follows"), bool) and isinstance(row.get("topic"), str)):
                raise ValueError(f"{path}:{n}: needs 'topic', 'second', 'lang' (zh|en) and 'follows' (true|false)")
            if row["topic"] in topics:
                pairs.append((text_of(row["second"]), row["topic"], row["lang"], row["follows"]))
    rng, ids = random.Random(SEED), sorted(topics)
    for path in sorted(DECISION_DATA.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line) if line.strip() else {}
            if row.get("intent") not in ("answer", "no_answer"):
                continue
            right = set(row.get("topics") or ())
            other = rng.choice([t for t in ids if t not in right])
            pairs.append((text_of(row["q"]), other, "en" if row["q"].isascii() else "zh", False))
    return [p for p in pairs if read_cue(p[0]) is not None]


@dataclass(frozen=True)
class FollowJudge:
    """P(a message with a cue follows the topic in context) from :data:`FEATURES`.

    Attributes:
        mean, scale: float32[F] feature standardization; weights float32[F], bias: the regression.
        report: training figures (pairs, held-out accuracy and log loss), logged at start.
    """

    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    bias: float
    report: dict
    #: whether a message followed the topic in context, by (message, topic id, language), for
    #: repeated messages; as many as the retriever's search cache holds (:meth:`build`), none by default
    seen: LRUCache[float] = field(default_factory=lambda: LRUCache(0), compare=False, repr=False)

    def probability(self, features: np.ndarray) -> float:
        """P(follows) in [0, 1] for one float32[F] :func:`features_of` vector."""
        return float(self.probabilities(features[None, :])[0])

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        """P(follows) float[N] for rows x float32[N, F]."""
        return sigmoid(((x - self.mean) / self.scale) @ self.weights + self.bias)

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray) -> "FollowJudge":
        """Fit on x float32[N, F], y int[N] in {0, 1}; the report reads a stratified held-out split."""
        from sklearn.linear_model import LogisticRegression  # training only
        from sklearn.model_selection import train_test_split

        def fitted(rows: np.ndarray) -> "FollowJudge":
            mean, scale = x[rows].mean(axis=0), x[rows].std(axis=0) + 1e-6
            model = LogisticRegression(C=C, max_iter=3000, class_weight="balanced").fit((x[rows] - mean) / scale, y[rows])
            return cls(mean.astype(np.float32), scale.astype(np.float32), model.coef_[0].astype(np.float32),
                       float(model.intercept_[0]), {})

        train, held = train_test_split(np.arange(len(y)), test_size=HELD_OUT, random_state=SEED, stratify=y)
        p = fitted(train).probabilities(x[held])  # one fit on the training split
        report = {"pairs": int(len(y)), "follows": int(y.sum()), "held_out": int(len(held)),
                  "held_out_accuracy": round(float(((p >= 0.5) == y[held]).mean()), 4),
                  "log_loss": round(binary_log_loss(p, y[held]), 4)}
        judge = fitted(np.arange(len(y)))
        return cls(judge.mean, judge.scale, judge.weights, judge.bias, report)

    @classmethod
    async def build(cls, retriever: Retriever, cache_dir: Path | None = None, model_digest: str = "",
                    known: dict[str, np.ndarray] | None = None) -> "FollowJudge":
        """Train (or load from ``cache_dir``) the judge for ``retriever``'s base and model; ``known``:
        text -> vector already computed (the decision head's training lines), not embedded again.

        Raises:
            ValueError: a bad training line; inference errors from embedding the pairs.
        """
        pairs = await asyncio.to_thread(training_pairs, retriever.kb.topics)
        digest = hashlib.sha256(json.dumps([retriever.kb.index_digest, pairs], ensure_ascii=False).encode()).hexdigest()
        # the features read retrieval's ranking, and so the topic prior (bot/topic_prior.py)
        prior = retriever.prior.report if retriever.prior is not None else None
        # and the cues of bot/follow_up_rules.yaml, read into the features of every pair
        rules = hashlib.sha256(RULES_PATH.read_bytes()).hexdigest()
        key = hashlib.sha256(f"{JUDGE_VERSION}/{model_digest}/{digest}/{C}/{FEATURES}/{PRIOR_VERSION}/{prior}/{rules}"
                             .encode()).hexdigest()[:16]
        cache = Path(cache_dir) / f"follow-judge-{key}.npz" if cache_dir else None
        if cache and cache.exists():
            saved = np.load(cache)
            judge = cls(saved["mean"], saved["scale"], saved["weights"], float(saved["bias"]),
                        json.loads(str(saved["report"])), seen=LRUCache(retriever.results.size))
            log.info("follow_judge", cached=True, **judge.report)
            return judge
        with logged_step(log, "follow_judge_training", pairs=len(pairs),
                         cached_afterwards_in=str(cache_dir) if cache_dir else "nowhere"):
            x = await training_features(retriever, pairs, known)
            y = np.asarray([int(p[3]) for p in pairs])
            judge = await asyncio.to_thread(cls.fit, x, y)
        if cache:
            save_arrays(cache, mean=judge.mean, scale=judge.scale, weights=judge.weights, bias=judge.bias,
                        report=json.dumps(judge.report))
        log.info("follow_judge", cached=False, **judge.report)
        return replace(judge, seen=LRUCache(retriever.results.size))


async def plan_follow_up(text: str, last: Topic | None, lang: str, retriever: Retriever, *,
                         referred: bool = False) -> FollowUpPlan:
    """How to read ``text`` (normalized, personal data masked) given the topic answered last in
    ``lang`` (``None``: none in the last 30 minutes). ``referred``: a scope rule already refers the
    message (a medicine or diagnosis question): only the facet the judge reads as following the topic
    (``loose``, for below the referral: bot/follow_up.py ``below_referral``), never a facet reply or a
    question back instead of the referral.

    - a bare facet cue ("那饮食上呢", bot/follow_up.py :func:`~bot.follow_up.read_follow_up`): that
      facet of the topic in context, or with no topic a question back;
    - a facet cue inside a longer message (:func:`~bot.follow_up.read_cue`): follows the topic when
      the judge (``retriever.follow_judge``) gives it :data:`FOLLOW_PROBABILITY` or more; read on
      its own when it does not, when no judge is loaded, or when the encoder cannot serve;
    - a message that opens as a continuation ("那夏天呢"): retrieval reads it with the topic.
    """
    strict = None if referred else read_follow_up(text)
    if last is None:
        return FollowUpPlan(ask_back=not referred and (strict is not None or is_bare_follow_up(text)))
    if strict is not None:
        return FollowUpPlan(facet=strict)
    judge: FollowJudge | None = retriever.follow_judge
    searched: dict[tuple[str, str | None], SearchResult] = {}
    if judge is not None and (cue := read_cue(text)) is not None:
        if (follows := judge.seen.get(key := (text, last.id, lang))) is None:
            try:
                own, ctx = await judge_readings(retriever, text, last, lang)
                searched = {(text, None): own, (text, last.title[lang]): ctx}
                follows = judge.probability(features_of(retriever, text, last.id, cue, own, ctx))
                judge.seen.put(key, follows)
            except (BusyError, DeadlineExceeded, EngineError):
                follows = 0.0  # read on its own this time; not remembered
        if follows >= FOLLOW_PROBABILITY:
            return FollowUpPlan(loose=cue[0], with_context=not referred, searched=searched)
        if follows >= GENERAL_FOLLOW_PROBABILITY and not referred:
            return FollowUpPlan(with_context=is_follow_up(text), cue=cue[0], searched=searched)
    return FollowUpPlan(with_context=is_follow_up(text) and not referred, searched=searched)
