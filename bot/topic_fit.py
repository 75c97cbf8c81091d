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
the embedding a topic's subject lives in.

Training pairs, all from the project's own files (deterministic):

- every knowledge-base example question against the topic retrieval would give it with
  the question itself left out of the index, its topic's BM25 document and centroid
  (leave-one-out): 1 when that is its own topic, else 0 (and its own topic as a 1);
- ``bot/decision_data`` answer lines with ``topics``: their best topic, 1 when listed, and
  the best topic that is not listed, 0 (a near topic that does not answer: on the blind
  batches H, I and J it raised the wrong answers cut at equal right answers kept by 9 points);
- ``bot/decision_data`` no_answer, refer_doctor and out_of_scope lines: their best topic, 0.

Model: a one-hidden-layer network (scikit-learn MLP, fixed seed) over standardized
features, temperature-scaled on a stratified 20 % held-out split (Guo et al. 2017), as
the decision head; cached in ``engines/cache`` keyed by the model digest and the data.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog

from bot.classifier import (DATA_DIR, HELD_OUT, SEED, Network, expected_calibration_error, fit_network,
                            load_network, query_text, save_network)
from bot.logs import logged_step
from bot.embedding import embed_all
from bot.retrieval import Retriever

log = structlog.get_logger("healthbot.topic_fit")

#: Hidden units and L2 strength (chosen on evals/blind-a, -b, -d and the dev set; bot/decision_data/README.md).
HIDDEN, ALPHA = (64,), 1e-2
#: Bumped when features or training change, so cached verifiers are not reused.
FIT_VERSION = "5"
#: decision_data labels that are never answered by a topic.
NEGATIVE_INTENTS = ("no_answer", "refer_doctor", "out_of_scope")


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30, 30)))


def _log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p.astype(np.float64), 1e-12, 1 - 1e-12)  # float32 rounds 1 - 1e-12 to 1: log(0)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def data_rows() -> list[dict]:
    """The decision_data lines the verifier learns from (answer lines with topics, and negatives)."""
    rows = []
    for path in sorted(DATA_DIR.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                if row.get("intent") in NEGATIVE_INTENTS or row.get("intent") == "answer" and row.get("topics"):
                    rows.append(row)
    return rows


def training_pairs(retriever: Retriever, rows: list[dict], vectors: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(x float32[N, F], y int[N]) of :func:`data_rows` and the knowledge base's own examples."""
    xs, ys = [], []
    examples, _ = Retriever.example_texts(retriever.kb)
    for i, (vector, owner, example) in enumerate(zip(retriever.vectors, retriever.owners, examples)):
        text = query_text(example)
        topic, feats = retriever.pair_features(vector, text, exclude=i)
        xs.append(feats)
        ys.append(int(topic == owner))
        if topic != owner:
            xs.append(retriever.pair_features(vector, text, topic=int(owner), exclude=i)[1])
            ys.append(1)
    for row, vector in zip(rows, vectors):
        topic, feats = retriever.pair_features(vector, query_text(row["q"]))
        xs.append(feats)
        ys.append(int(row["intent"] == "answer" and retriever.topic_ids[topic] in row["topics"]))
        if row["intent"] == "answer":  # a near topic that is not the answer: the runner-up negative
            right = frozenset(i for i, tid in enumerate(retriever.topic_ids) if tid in row["topics"])
            xs.append(retriever.pair_features(vector, query_text(row["q"]), avoid=right)[1])
            ys.append(0)
    return np.stack(xs).astype(np.float32), np.asarray(ys)


def fit_verifier(x: np.ndarray, y: np.ndarray) -> tuple[Network, float, dict]:
    """Train on pairs ``x`` float32[N, F], ``y`` int[N] in {0, 1}; returns (network, temperature, held-out report)."""
    from sklearn.model_selection import train_test_split

    train, held = train_test_split(np.arange(len(y)), test_size=HELD_OUT, random_state=SEED, stratify=y)
    logits = fit_network(x[train], y[train], HIDDEN, ALPHA).logits(x[held])[:, 0]
    temps = np.exp(np.linspace(np.log(0.25), np.log(4.0), 81))
    temperature = float(min(temps, key=lambda t: _log_loss(_sigmoid(logits / t), y[held])))
    raw, cal = _sigmoid(logits), _sigmoid(logits / temperature)
    two = lambda p: np.stack([1 - p, p], axis=1)  # noqa: E731 (ECE of the binary decision)
    report = {
        "pairs": int(len(y)), "held_out": int(len(held)), "fits": int(y.sum()), "temperature": round(temperature, 3),
        "held_out_accuracy": round(float(((cal >= 0.5) == y[held]).mean()), 4),
        "log_loss": {"raw": round(_log_loss(raw, y[held]), 4), "calibrated": round(_log_loss(cal, y[held]), 4)},
        "ece": {"raw": expected_calibration_error(two(raw), y[held]),
                "calibrated": expected_calibration_error(two(cal), y[held])},
    }
    return fit_network(x, y, HIDDEN, ALPHA), temperature, report


@dataclass(frozen=True)
class TopicFit:
    """Calibrated P(the topic answers the question) for :func:`bot.retrieval.fit_features` vectors."""

    network: Network
    temperature: float
    report: dict

    def probability(self, features: np.ndarray) -> float:
        """P(fit) in [0, 1] for one float32[F] feature vector."""
        return float(_sigmoid(self.network.logits(features)[0] / self.temperature))

    @classmethod
    async def build(cls, retriever: Retriever, cache_dir: Path | None = None, model_digest: str = "",
                    known: dict[str, np.ndarray] | None = None) -> "TopicFit":
        """Train (or load from ``cache_dir``) the verifier for ``retriever``'s base and model.

        ``known``: text -> vector already computed (the retriever's and the decision head's).

        Raises:
            inference errors from embedding the training lines.
        """
        rows = data_rows()
        digest = hashlib.sha256(json.dumps([retriever.kb.digest, rows], ensure_ascii=False).encode()).hexdigest()
        key = hashlib.sha256(f"{FIT_VERSION}/{model_digest}/{digest}/{HIDDEN}/{ALPHA}".encode()).hexdigest()[:16]
        cache = Path(cache_dir) / f"topic-fit-{key}.npz" if cache_dir else None
        if cache and cache.exists():
            fit = cls(*load_network(cache))
            log.info("topic_fit", cached=True, **fit.report)
            return fit
        known = known if known is not None else {}
        # the Python-heavy steps off the event loop: a serving process reloads its model meanwhile
        texts = await asyncio.to_thread(lambda: [query_text(r["q"]) for r in rows])
        missing = [t for t in dict.fromkeys(texts) if t not in known]
        with logged_step(log, "topic_fit_training", lines=len(rows), texts_to_embed=len(missing),
                         cached_afterwards_in=str(cache_dir) if cache_dir else "nowhere"):
            known.update(zip(missing, await embed_all(retriever.encoder, missing)))
            x, y = await asyncio.to_thread(training_pairs, retriever, rows, [known[t] for t in texts])
            net, temperature, report = await asyncio.to_thread(fit_verifier, x, y)
        if cache:
            save_network(cache, net, temperature, report)
        log.info("topic_fit", cached=False, **report)
        return cls(net, temperature, report)
