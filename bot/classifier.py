"""The learned decision head: a small calibrated network over the query embedding.

The retriever already embeds every question (e5, 384 dimensions, L2-normalized); the
head reads that same vector, so it costs two small products (float32[384] x [384, 256]
and [256] x [256, 8]: tens of microseconds), never a second encoder call.

Labels (:data:`LABELS`): answer, emergency, crisis, refer_doctor, handoff, greeting,
out_of_scope, no_answer. Training data, all written for this project
(bot/decision_data/README.md says how to add more):

- every ``bot/decision_data/*.jsonl`` line (``q``, ``intent`` among :data:`LABELS`);
- the knowledge base's example questions and titles, as ``answer``;
- bot/intent_examples.yaml's out_of_scope and no_answer lists.

Training is deterministic (fixed seeds), runs at the first start for a given model and
data (about two minutes on 2 cores after the texts are embedded) and is cached beside the
knowledge-base vectors, keyed by the model digest and a digest of the training data.
Probabilities are calibrated by temperature scaling (Guo et al. 2017, "On Calibration of
Modern Neural Networks") fitted on a held-out fifth of the lines chosen by a hash of each
line's text (:func:`held_out_mask`), so that adding lines never reshuffles which old lines are
held out; the report (held-out accuracy, per-label recall, log loss and expected calibration
error before and after) is logged at start (event ``decision_head``) and printed by
``healthbot eval``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog
import yaml

from bot.knowledge import LANGS, KnowledgeBase
from bot.logs import logged_step
from bot.embedding import embed_all
from bot.terms import canonical_terms
from inference.lru import LRUCache
from safety.normalize import normalize

log = structlog.get_logger("healthbot.classifier")

LABELS = ("answer", "emergency", "crisis", "refer_doctor", "handoff", "greeting", "out_of_scope", "no_answer")
DATA_DIR = Path(__file__).parent / "decision_data"
INTENT_EXAMPLES = Path(__file__).parent / "intent_examples.yaml"
#: Hidden units and L2 strength of the network, chosen on evals/safety.jsonl and the dev set.
HIDDEN, ALPHA = (256,), 1e-2
#: Networks averaged in the head (:func:`fit_network`): the retrain after seven topics were added
#: (2026-12-03) moved single borderline messages far (a bee sting 0.65 -> 0.82 emergency, a
#: "burden" message 0.22 -> 0.05 crisis). 3 -> 8 (2026-12-07): a head retrained without 2 % of its
#: lines changed its full-alarm reading (P(danger) >= 0.8 or P(crisis) >= 0.5) on 50 of 9,670
#: labelled evaluation messages with 3 networks, 35 with 8; its top label on 187 and 120.
MEMBERS = 8
#: Share of the lines held out for calibration and the report; seed of the networks.
HELD_OUT, SEED = 0.2, 0
#: Bumped when features or training change, so cached heads are not reused.
HEAD_VERSION = "4"
#: decision_data labels that are never answered by a topic.
NEGATIVE_INTENTS = ("no_answer", "refer_doctor", "out_of_scope")


def data_rows() -> list[dict]:
    """The decision_data lines the topic-fit verifier and the topic prior learn from: answer
    lines with ``topics``, and the :data:`NEGATIVE_INTENTS` lines."""
    rows = []
    for path in sorted(DATA_DIR.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                if row.get("intent") in NEGATIVE_INTENTS or row.get("intent") == "answer" and row.get("topics"):
                    rows.append(row)
    return rows


def query_text(text: str) -> str:
    """What the retriever embeds for a message: normalized, then everyday wordings mapped (bot/terms.py)."""
    return canonical_terms(normalize(text).text)


def training_rows(kb: KnowledgeBase) -> list[tuple[str, str]]:
    """``(text, label)`` pairs: decision_data files, knowledge-base questions, intent examples.

    Raises:
        ValueError: a data line without ``q`` or with a label outside :data:`LABELS`.
    """
    rows: list[tuple[str, str]] = []
    for path in sorted(DATA_DIR.glob("*.jsonl")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("q"), str) or row.get("intent") not in LABELS:
                raise ValueError(f"{path}:{n}: needs 'q' and an 'intent' among {LABELS}")
            rows.append((query_text(row["q"]), row["intent"]))
    for t in kb.topics.values():
        for lang in LANGS:
            rows += [(query_text(q), "answer") for q in (t.title[lang], *t.questions[lang])]
    examples = yaml.load(INTENT_EXAMPLES.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    for kind in ("out_of_scope", "no_answer"):
        rows += [(query_text(q), kind) for q in examples.get(kind, [])]
    return [(text, label) for text, label in dict(rows).items() if text]  # one label per text: the last


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _log_loss(p: np.ndarray, y: np.ndarray) -> float:
    return float(-np.mean(np.log(np.clip(p[np.arange(len(y)), y], 1e-12, None))))


def sigmoid(z: np.ndarray | float) -> np.ndarray:
    """The logistic function, its input clipped to [-30, 30] (no overflow warnings)."""
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30, 30)))


def binary_log_loss(p: np.ndarray, y: np.ndarray) -> float:
    """Mean log loss of P(class 1) ``p`` float[N] for labels ``y`` int[N] in {0, 1}."""
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-12, 1 - 1e-12)  # float32 rounds 1 - 1e-12 to 1: log(0)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def expected_calibration_error(p: np.ndarray, y: np.ndarray, bins: int = 10) -> float:
    """ECE of the top-label confidence over ``bins`` equal-width bins (Naeini et al. 2015)."""
    conf, pred = p.max(axis=1), p.argmax(axis=1)
    edges = np.linspace(0.0, 1.0, bins + 1)
    ece = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (conf > lo) & (conf <= hi)
        if m.any():
            ece += m.mean() * abs(float((pred[m] == y[m]).mean()) - float(conf[m].mean()))
    return round(ece, 4)


@dataclass(frozen=True)
class Network:
    """A one-hidden-layer perceptron over standardized embeddings, as plain arrays.

    logits float32[L] = relu(((v - mean) / scale) @ w1 + b1) @ w2 + b2, for v float32[D];
    w1 float32[D, H], w2 float32[H, L].
    """

    mean: np.ndarray
    scale: np.ndarray
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray

    def logits(self, x: np.ndarray) -> np.ndarray:
        """float32[..., L] for x float32[..., D]."""
        h = np.maximum(((x - self.mean) / self.scale) @ self.w1 + self.b1, 0.0)
        return h @ self.w2 + self.b2

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in ("mean", "scale", "w1", "b1", "w2", "b2")}


def fit_network(x: np.ndarray, y: np.ndarray, hidden: tuple[int, ...], alpha: float, members: int = 1) -> Network:
    """Train a :class:`Network` on x float32[N, D], labels y int[N] (the decision head and the
    topic-fit verifier, bot/topic_fit.py).

    scikit-learn's MLPClassifier (Adam, L2 ``alpha``, early stopping on a 10 % split, fixed
    seed): on the project's own files it beat a logistic regression on raw or standardized
    embeddings (answer recall 0.87 vs 0.63-0.86 on evals/safety.jsonl at equal or fewer false
    alarms; bot/decision_data/README.md). One output per label, or, with two labels, one
    output: the logit of label 1.

    ``members`` > 1 trains that many networks (seeds ``SEED`` + i, each with its own
    early-stopping split) and returns their mean logits as one network with their hidden
    units side by side: one network's answer on a borderline message moves with small changes of
    the training data (its early stop, its split); the mean moves less.
    """
    from sklearn.neural_network import MLPClassifier  # training only: serving reads the cached arrays

    mean, scale = x.mean(axis=0), x.std(axis=0) + 1e-6
    parts = []
    for i in range(members):
        model = MLPClassifier(hidden, alpha=alpha, max_iter=300, early_stopping=True, random_state=SEED + i)
        model.fit((x - mean) / scale, y)
        parts.append((model.coefs_, model.intercepts_))
    w1 = np.concatenate([c[0] for c, _ in parts], axis=1)
    b1 = np.concatenate([b[0] for _, b in parts])
    w2 = np.concatenate([c[1] for c, _ in parts], axis=0) / members
    b2 = np.mean([b[1] for _, b in parts], axis=0)
    return Network(*(np.asarray(a, dtype=np.float32) for a in (mean, scale, w1, b1, w2, b2)))


def load_network(cache: Path) -> tuple[Network, float, dict]:
    """(network, temperature, report) saved by :func:`save_network`."""
    saved = np.load(cache)
    net = Network(*(saved[k] for k in ("mean", "scale", "w1", "b1", "w2", "b2")))
    return net, float(saved["temperature"]), json.loads(str(saved["report"]))


def save_arrays(cache: Path, **arrays) -> None:
    """``np.savez`` to ``cache`` atomically (replicas may share the folder: a temporary file, then a rename)."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f"{cache.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(cache)


def save_network(cache: Path, net: Network, temperature: float, report: dict) -> None:
    """Write ``cache`` atomically (:func:`save_arrays`)."""
    save_arrays(cache, temperature=temperature, report=json.dumps(report), **net.arrays())


def _fit(x: np.ndarray, y: np.ndarray) -> Network:
    """The head's network on x float32[N, D], labels y int[N] (every label of :data:`LABELS` present)."""
    net = fit_network(x, y, HIDDEN, ALPHA, MEMBERS)
    if net.w2.shape[1] != len(LABELS):
        raise ValueError(f"training data lacks labels: has {sorted(LABELS[c] for c in np.unique(y))}")
    return net


def held_out_mask(texts: list[str]) -> np.ndarray:
    """bool[N]: the lines held out for calibration, about :data:`HELD_OUT` of them, chosen by a
    hash of each text alone (SHA-1), so that a line added or removed moves no other line in or out."""
    cut = int(HELD_OUT * 2**32)
    return np.array([int.from_bytes(hashlib.sha1(t.encode()).digest()[:4], "big") < cut for t in texts], dtype=bool)


def fit_head(x: np.ndarray, y: np.ndarray, texts: list[str]) -> tuple[Network, float, dict]:
    """Train on ``x`` float32[N, D] with labels ``y`` int[N] (indices into :data:`LABELS`) of
    ``texts`` (N; they choose the held-out lines, :func:`held_out_mask`).

    Returns:
        (network, temperature, report): the network refit on all lines, the temperature
        fitted on the held-out split, and the held-out report.
    """
    mask = held_out_mask(texts)
    held, train = np.flatnonzero(mask), np.flatnonzero(~mask)
    logits = _fit(x[train], y[train]).logits(x[held])
    temps = np.exp(np.linspace(np.log(0.25), np.log(4.0), 81))
    temperature = float(min(temps, key=lambda t: _log_loss(_softmax(logits / t), y[held])))
    raw, cal = _softmax(logits), _softmax(logits / temperature)
    pred = cal.argmax(axis=1)
    report = {
        "lines": int(len(y)), "held_out": int(len(held)), "temperature": round(temperature, 3),
        "held_out_accuracy": round(float((pred == y[held]).mean()), 4),
        "log_loss": {"raw": round(_log_loss(raw, y[held]), 4), "calibrated": round(_log_loss(cal, y[held]), 4)},
        "ece": {"raw": expected_calibration_error(raw, y[held]), "calibrated": expected_calibration_error(cal, y[held])},
        "recall": {LABELS[k]: round(float((pred[y[held] == k] == k).mean()), 4)
                   for k in range(len(LABELS)) if (y[held] == k).any()},
        "lines_per_label": {LABELS[k]: int((y == k).sum()) for k in range(len(LABELS))},
    }
    return _fit(x, y), temperature, report


@dataclass(frozen=True)
class DecisionHead:
    """Calibrated label probabilities for a query embedding.

    Attributes:
        network: the trained :class:`Network`; temperature: its logits are divided by it.
        report: the held-out report of :func:`fit_head`.
    """

    network: Network
    temperature: float
    report: dict
    #: probabilities of vectors seen before (repeated questions), by the vector's bytes; as many as
    #: the encoder's embedding cache holds (:meth:`build`), none by default
    seen: LRUCache[dict[str, float]] = field(default_factory=lambda: LRUCache(0), compare=False, repr=False)

    def probabilities(self, vector: np.ndarray) -> dict[str, float]:
        """``{label: probability}`` (sums to 1, a new dict the caller may change) for one float32[D]
        L2-normalized query embedding."""
        return dict(self.seen.get_or_put(vector.tobytes(), lambda: dict(zip(
            LABELS, _softmax(self.network.logits(vector) / self.temperature).tolist()))))

    @classmethod
    async def build(cls, kb: KnowledgeBase, encoder, cache_dir: Path | None = None, model_digest: str = "",
                    known: dict[str, np.ndarray] | None = None) -> "DecisionHead":
        """Train (or load from ``cache_dir``) the head for ``encoder``'s model.

        ``known``: text -> vector already computed (the retriever's), not embedded again; the
        vectors embedded here are added to it.

        Raises:
            ValueError: a bad training line; inference errors from embedding.
        """
        rows = await asyncio.to_thread(training_rows, kb)  # off the event loop: a model reload runs beside serving
        data_digest = hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode()).hexdigest()
        key = hashlib.sha256(f"{HEAD_VERSION}/{model_digest}/{data_digest}/{HIDDEN}/{ALPHA}".encode()
                             ).hexdigest()[:16]
        cache = Path(cache_dir) / f"decision-head-{key}.npz" if cache_dir else None
        seen = LRUCache(getattr(getattr(encoder, "cache", None), "size", 0))
        if cache and cache.exists():
            head = cls(*load_network(cache), seen=seen)
            log.info("decision_head", cached=True, **head.report)
            return head
        known = known if known is not None else {}  # updated in place: the caller may reuse the vectors
        texts = [t for t, _ in rows]
        missing = [t for t in dict.fromkeys(texts) if t not in known]
        with logged_step(log, "decision_head_training", lines=len(rows), texts_to_embed=len(missing),
                         cached_afterwards_in=str(cache_dir) if cache_dir else "nowhere"):
            known.update(zip(missing, await embed_all(encoder, missing)))
            x = np.stack([known[t] for t in texts]).astype(np.float32)
            y = np.asarray([LABELS.index(label) for _, label in rows])
            net, temperature, report = await asyncio.to_thread(fit_head, x, y, texts)
        if cache:
            save_network(cache, net, temperature, report)
        log.info("decision_head", cached=False, **report)
        return cls(net, temperature, report, seen=seen)
