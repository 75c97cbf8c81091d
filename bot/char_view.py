"""The topic prior's second reading of a question: its characters, not its embedding.

The e5 embedding (bot/embedding.py) places a question by meaning, and a short or colloquial one
("娃儿晚上睡觉老是出汗") can land near a topic that shares its sense but not its subject. A
classifier over the question's character n-grams reads the words themselves: two views that
err differently. The topic prior (bot/topic_prior.py) averages their log-probabilities.

Features: TF-IDF of character 1- to 3-grams inside each word padded with spaces (scikit-learn's
``char_wb`` analyzer, written here so that serving needs neither scikit-learn nor its per-call
overhead: 20-130 µs a question), sublinear term frequency, L2-normalized; n-grams seen in fewer
than :data:`MIN_DF` training lines are dropped. Model: a multinomial logistic regression trained by
stochastic gradient descent (scikit-learn's ``SGDClassifier``, log loss, L2 :data:`ALPHA`, fixed
seed), about 25 s on 2 cores for the prior's 13,628 lines.

Measured before it was adopted (2026-12-05, the answer lines of the development blind batches,
2,370 lines): the prior's first topic right 91.0 % from the embedding alone, 91.6 % from the
characters alone, 93.7 % from both; on blind FF, JJ and KK (240 lines, never read) 91.7, 90.8 and
94.6 %.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

#: Character n-gram lengths, the fewest training lines an n-gram must appear in, and the
#: regression's L2 strength and epochs (chosen on the development batches above: alpha 1e-5 gave
#: 93.5 %, a regression by lbfgs 93.4 % in 70 s, complement naive Bayes 92.0 %).
NGRAMS, MIN_DF, ALPHA, EPOCHS = (1, 3), 2, 1e-6, 30
#: What a cache key of a model that holds a view must read.
SETTINGS = f"char_wb{NGRAMS}/{MIN_DF}/{ALPHA}/{EPOCHS}"


def ngrams(text: str) -> Iterator[str]:
    """Character n-grams of each whitespace-separated word of ``text`` (lowercased) padded with
    one space each side, lengths :data:`NGRAMS`, in order (a gram as often as it occurs)."""
    lo, hi = NGRAMS
    for word in text.lower().split():
        padded = f" {word} "
        for n in range(lo, min(hi, len(padded)) + 1):
            for i in range(len(padded) - n + 1):
                yield padded[i:i + n]


def tfidf_row(text: str, vocabulary: dict[str, int], idf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(columns int[K], weights float32[K]) of ``text``'s L2-normalized TF-IDF row over ``vocabulary``
    (n-gram -> column) and ``idf`` float32[F]; empty arrays when no n-gram is in the vocabulary."""
    counts: dict[int, int] = {}
    for gram in ngrams(text):
        if (col := vocabulary.get(gram)) is not None:
            counts[col] = counts.get(col, 0) + 1
    if not counts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    cols = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    tf = 1.0 + np.log(np.fromiter(counts.values(), dtype=np.float32, count=len(counts)))
    w = tf * idf[cols]
    return cols, w / np.linalg.norm(w)


@dataclass(frozen=True)
class CharView:
    """Topic logits of a question from its characters.

    Attributes:
        vocabulary: n-gram -> column; idf: float32[F]; coef: float16[F, topics] (half the memory of a
            serving process's largest array, 22 MB for 44,000 n-grams and 256 topics; the logits move by
            about 1e-3); intercept: float32[topics].
    """

    vocabulary: dict[str, int]
    idf: np.ndarray
    coef: np.ndarray
    intercept: np.ndarray

    def features(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(columns int[K], weights float32[K]) of ``text``'s L2-normalized TF-IDF row (:func:`tfidf_row`)."""
        return tfidf_row(text, self.vocabulary, self.idf)

    def logits(self, text: str) -> np.ndarray:
        """float32[topics] for one search text (bot/retrieval.py ``search_texts``)."""
        cols, w = self.features(text)
        return w @ self.coef[cols].astype(np.float32) + self.intercept

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays to cache (:meth:`from_arrays` reads them back)."""
        terms = np.asarray(sorted(self.vocabulary, key=self.vocabulary.__getitem__))
        return {"char_terms": terms, "char_idf": self.idf, "char_coef": self.coef, "char_intercept": self.intercept}

    @classmethod
    def from_arrays(cls, saved) -> "CharView":
        """The view :meth:`arrays` saved (an ``np.load`` result or a dict)."""
        terms = saved["char_terms"].tolist()
        return cls({t: i for i, t in enumerate(terms)}, saved["char_idf"], saved["char_coef"], saved["char_intercept"])


def _matrix(texts: list[str], vocabulary: dict[str, int], idf: np.ndarray):
    from scipy.sparse import csr_matrix  # training only

    rows = [tfidf_row(t, vocabulary, idf) for t in texts]
    indptr = np.cumsum([0] + [len(c) for c, _ in rows])
    cols = np.concatenate([c for c, _ in rows]) if rows else np.zeros(0, np.int64)
    data = np.concatenate([w for _, w in rows]) if rows else np.zeros(0, np.float32)
    return csr_matrix((data, cols, indptr), shape=(len(texts), len(vocabulary)), dtype=np.float32)


def fit_char_view(texts: list[str], y: np.ndarray, topics: int, seed: int = 0) -> CharView:
    """Train on search texts (bot/classifier.py ``query_text``) and topic indices y int[N].

    Raises:
        ValueError: some topic has no training line.
    """
    from sklearn.linear_model import SGDClassifier  # training only: serving reads the cached arrays

    df: Counter = Counter()
    for t in texts:
        df.update(set(ngrams(t)))
    kept = sorted(g for g, n in df.items() if n >= MIN_DF)
    vocabulary = {g: i for i, g in enumerate(kept)}
    idf = np.asarray([math.log((1 + len(texts)) / (1 + df[g])) + 1.0 for g in kept], dtype=np.float32)
    # one binary problem a topic, on every core (threads; the seeds are drawn up front: the same model)
    model = SGDClassifier(loss="log_loss", alpha=ALPHA, max_iter=EPOCHS, tol=None, random_state=seed, n_jobs=-1)
    model.fit(_matrix(texts, vocabulary, idf), y)
    if len(model.classes_) != topics:
        raise ValueError(f"{topics - len(model.classes_)} topics have no training line")
    return CharView(vocabulary, idf, model.coef_.T.astype(np.float16), model.intercept_.astype(np.float32))
