"""Hybrid retrieval: dense (the e5 encoder through the inference pool) + lexical (BM25).

Each topic is represented densely by the embeddings of its example questions and
titles (both languages, e5 ``query: `` prefix on both sides: question-to-question
matching is a symmetric task), and lexically by one BM25 document (title,
questions and answer in both languages). A topic's score is

    hybrid = dense + LEXICAL_WEIGHT * bm25 / (bm25 + LEXICAL_SATURATION)

where ``dense`` is the mean of the two best cosines between the query and the topic's example
questions (less fooled than the single best by one example that shares a phrase with the query,
e.g. "is it ok to drink coffee ..." in the pregnancy topic; measured with ``healthbot eval``).
The confidence is a logistic map of the hybrid score and the margin to the
runner-up, calibrated on the knowledge base's own held-out phrasings (see
:data:`CALIBRATION`); below ``knowledge.min_confidence`` the bot says it does not
know (intent ``no_answer``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import math
from collections import Counter
from pathlib import Path

import numpy as np
import structlog
import yaml

from bot.embedding import TextEncoder, embed_all
from bot.knowledge import LANGS, KnowledgeBase
from bot.lexical import BM25, TopicTerms, tokenize, topic_terms
from bot.logs import logged_step
from bot.search_cache import Match, SearchCache, SearchResult
from bot.terms import canonical_terms
from bot.topic_scope import TopicScope

log = structlog.get_logger("healthbot.retrieval")

#: e5's prefix for documents (the answers); questions and examples take ``"query: "``.
PASSAGE = "passage: "
#: Weight and saturation constant of the lexical part (tuned with ``healthbot eval``).
LEXICAL_WEIGHT = 0.06
LEXICAL_SATURATION = 6.0
#: How many of a topic's best-matching example questions are averaged.
DENSE_TOP_K = 2
#: Labelled non-answer examples (out_of_scope, no_answer) for the nearest-neighbour check.
INTENT_EXAMPLES = Path(__file__).parent / "intent_examples.yaml"
#: A message is off-topic when its nearest labelled non-answer example is closer than its best topic's
#: nearest example question by more than this cosine margin (both: means of two best matches). Chosen on
#: the project's own safety set and probe questions, not the dev file: 0.0 keeps every answerable one
#: there while specialist and first-aid questions get no_answer.
OFF_TOPIC_MARGIN = {"out_of_scope": 0.0, "no_answer": 0.0}
#: Logistic calibration of the confidence: (scale, centre) for the hybrid score, weight of the margin.
CALIBRATION = {"scale": 40.0, "centre": 0.90, "margin_weight": 1.0}


#: A title word that at most this many topics use in their titles and example questions
#: names a subject (:meth:`Retriever.new_subject`).
SUBJECT_TOPICS = 12
#: ... and a word in at least RECURRING example questions of a topic, used by at most
#: RECURRING_TOPICS topics' titles and questions.
RECURRING = 3
RECURRING_TOPICS = 4

#: Scores ahead of the vector product in :func:`fit_features`.
N_SCORES = 11


def fit_features(scores: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], topic: int, q: np.ndarray,
                 centroid: np.ndarray, coverage: tuple[float, float, float], answers: np.ndarray) -> np.ndarray:
    """Features of one (question, topic) pair for the topic-fit verifier (bot/topic_fit.py).

    Args:
        scores: (hybrid, dense, best single cosine, saturated BM25), each float32[topics].
        topic: the topic's index; q: float32[D] question vector; centroid: float32[D] unit
            mean of the topic's example vectors.
        coverage: :meth:`Retriever.coverage` of the question's terms by the topic.
        answers: float32[topics], the question's cosine to each topic's answer text
            (:meth:`Retriever.answer_scores`).

    Returns:
        float32[N_SCORES + D]: hybrid, dense, best cosine, BM25, margin to the best other
        topic's hybrid score, cosine to the centroid, the three coverage figures, the
        cosine to the topic's answer and its margin to the best other topic's answer,
        then q * centroid.
    """
    hybrid, dense, best, lexical = scores
    others = np.delete(hybrid, topic)
    margin = float(hybrid[topic] - others.max()) if len(others) else 1.0
    rest = np.delete(answers, topic)
    answer_margin = float(answers[topic] - rest.max()) if len(rest) else 1.0
    head = [hybrid[topic], dense[topic], best[topic], lexical[topic], margin, float(q @ centroid), *coverage,
            float(answers[topic]), answer_margin]
    return np.concatenate([np.asarray(head, dtype=np.float32), (q * centroid).astype(np.float32)])


class Retriever:
    """Hybrid dense + BM25 search over a :class:`KnowledgeBase`.

    Build with :meth:`build` (embeds every example question once; the matrix is
    cached on disk keyed by the base's digest and the model's sha256).
    """

    def __init__(self, kb: KnowledgeBase, encoder: TextEncoder, vectors: np.ndarray, owners: np.ndarray,
                 example_vectors: dict[str, np.ndarray], answer_vectors: np.ndarray, terms: TopicTerms):
        self.kb = kb
        self.scope = TopicScope(kb)  # which topics cover which populations and named diseases
        self.encoder = encoder
        self.topic_ids = list(kb.topics)
        self.topic_index = {t: i for i, t in enumerate(self.topic_ids)}
        self.vectors = vectors          # float32[M, D], one row per example question / title
        self.owners = owners            # int32[M], topic index of each row
        self.example_vectors = example_vectors  # kind -> float32[E, D]
        #: float32[topics * len(LANGS), D]: each topic's title and answer per language, e5 "passage: "
        self.answer_vectors = answer_vectors
        #: "hybrid" (served), or "dense" / "bm25" alone for comparison (`healthbot eval --compare`)
        self.mode = "hybrid"
        #: ranks topics with the hybrid score (bot/topic_prior.py :class:`~bot.topic_prior.TopicPrior`),
        #: set after build; None ranks by the hybrid score alone
        self.prior = None
        #: whether a message with a facet cue follows the topic in context (bot/follow_up_judge.py
        #: :class:`~bot.follow_up_judge.FollowJudge`), set after build; None reads every such message on its own
        self.follow_judge = None
        #: results of repeated questions (bot/search_cache.py), as many as the embedding cache holds
        self.results: SearchCache[SearchResult] = SearchCache(getattr(getattr(encoder, "cache", None), "size", 0))
        #: per-topic scores (:meth:`_score`, read-only arrays) of texts searched before, by (text, mode): a
        #: follow-up searched with its context ("title text") scores the text alone again; as many as the
        #: results (about 4 KiB each)
        self.scores: SearchCache[tuple[np.ndarray, ...]] = SearchCache(self.results.size)
        # rows of each topic, padded with -1 into int64[topics, most examples] for top-k
        counts = np.bincount(owners, minlength=len(self.topic_ids))
        self._rows = np.full((len(self.topic_ids), int(counts.max())), -1, dtype=np.int64)
        for t in range(len(self.topic_ids)):
            idx = np.flatnonzero(owners == t)
            self._rows[t, :len(idx)] = idx
        # unit mean of each topic's example vectors, float32[topics, D] (topic-fit features)
        sums = np.zeros((len(self.topic_ids), vectors.shape[1]), dtype=np.float32)
        np.add.at(sums, owners, vectors)
        self._sums = sums
        self.centroids = sums / np.linalg.norm(sums, axis=1, keepdims=True)
        titles, questions = terms.titles, terms.questions
        docs = [[w for li in range(len(LANGS)) for w in (*titles[t][li], *(w for q in questions[t][li] for w in q),
                                                          *terms.answers[t][li])]
                for t in range(len(self.topic_ids))]
        self.bm25 = BM25(docs)
        self._top_idf = max(self.bm25.idf.values(), default=1.0)
        # the words a topic's title and example questions use: a follow-up that names a
        # subject outside them asks about something else (:meth:`new_subject`)
        self.topic_words = [{w for li in range(len(LANGS)) for w in (*titles[t][li], *(w for q in questions[t][li] for w in q))}
                            for t in range(len(self.topic_ids))]
        # the words that name a subject: those of the topics' titles that few topics' titles
        # and questions use (at most SUBJECT_TOPICS)
        spread = Counter(w for words in self.topic_words for w in words)
        self.subject_words = {w for per_lang in titles for ws in per_lang for w in ws if spread[w] <= SUBJECT_TOPICS}
        # ... and the words that some topic's example questions keep coming back to ("补肾"),
        # used by few topics: a one-off phrase in one question names nothing
        recurring = Counter((t, w) for t in range(len(self.topic_ids)) for per_lang in questions[t]
                            for q in per_lang for w in set(q))
        self.subject_words |= {w for (_, w), n in recurring.items() if n >= RECURRING and spread[w] <= RECURRING_TOPICS}

    @staticmethod
    def example_texts(kb: KnowledgeBase) -> tuple[list[str], list[int]]:
        """Every example question and title with the index of its topic."""
        texts, owners = [], []
        for i, t in enumerate(kb.topics.values()):
            for lang in LANGS:
                for q in [t.title[lang], *t.questions[lang]]:
                    texts.append(q)
                    owners.append(i)
        return texts, owners

    @staticmethod
    def answer_texts(kb: KnowledgeBase) -> list[str]:
        """Each topic's title and answer, per language (topic-major), as e5 passages."""
        return [f"{t.title[lang]}\n{t.answer[lang]}" for t in kb.topics.values() for lang in LANGS]

    def answer_scores(self, q: np.ndarray) -> np.ndarray:
        """float32[topics]: the question's best cosine to each topic's answer (either language)."""
        return (self.answer_vectors @ q).reshape(len(self.topic_ids), len(LANGS)).max(axis=1)

    def known_vectors(self) -> dict[str, np.ndarray]:
        """Every embedded text's vector, to rebuild after an edit without re-embedding it
        (answers are keyed ``"passage: " + text``: they were embedded as passages)."""
        texts, _ = self.example_texts(self.kb)
        known = dict(zip(texts, self.vectors))
        known.update(zip((PASSAGE + t for t in self.answer_texts(self.kb)), self.answer_vectors))
        examples = yaml.load(INTENT_EXAMPLES.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
        for kind, vectors in self.example_vectors.items():
            known.update(zip(examples.get(kind, []), vectors))
        return known

    @classmethod
    async def build(cls, kb: KnowledgeBase, encoder: TextEncoder, cache_dir: Path | None = None,
                    model_digest: str = "", known: dict[str, np.ndarray] | None = None) -> "Retriever":
        """Embed the base's example questions (or load them from ``cache_dir``).

        ``known``: vectors already computed for some texts (a hot reload embeds only
        the questions an edit added or changed).
        """
        texts, owners = cls.example_texts(kb)
        examples = yaml.load(INTENT_EXAMPLES.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
        kinds = sorted(examples)
        n_kb = len(texts)
        for kind in kinds:
            texts += examples[kind]
        passages = [PASSAGE + t for t in cls.answer_texts(kb)]
        key = hashlib.sha256((kb.index_digest + model_digest + INTENT_EXAMPLES.read_text(encoding="utf-8") + "/answers"
                              ).encode()).hexdigest()[:16]
        cache = Path(cache_dir) / f"kb-vectors-{key}.npy" if cache_dir else None
        vectors = None
        if cache and cache.exists():
            # Mapped, not read: every serving process of a host (``serve --processes``, replicas
            # sharing engines/) then scores against one copy in the page cache, which the CPU's
            # shared cache can hold, not one private copy each (10 MB for 6,700 examples, read
            # whole for each new question). Read-only; the file is replaced by rename, never
            # rewritten in place, so a mapping never sees it change.
            vectors = np.asarray(np.load(cache, mmap_mode="r"))
            if vectors.shape[0] != len(texts) + len(passages):
                vectors = None
        if vectors is None:
            known = dict(known or {})
            missing = list(dict.fromkeys(t for t in texts if t not in known))
            new = [p for p in passages if p not in known]
            with logged_step(log, "kb_embedding", texts=len(missing) + len(new),
                             cached_afterwards_in=str(cache_dir) if cache_dir else "nowhere"):
                known.update(zip(missing, await embed_all(encoder, missing)))
                known.update(zip(new, await embed_all(encoder, [p[len(PASSAGE):] for p in new], prefix=PASSAGE)))
            vectors = np.stack([known[t] for t in texts + passages]).astype(np.float32)
            if cache:
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_name(f"{cache.stem}.{os.getpid()}.tmp.npy")  # replicas may share engines/
                np.save(tmp, vectors)
                tmp.replace(cache)
        example_vectors, at = {}, n_kb
        for kind in kinds:
            example_vectors[kind] = vectors[at:at + len(examples[kind])]
            at += len(examples[kind])
        # the indexes (BM25, topic words, scope): seconds of Python, off the event loop a reload shares
        return await asyncio.to_thread(lambda: cls(kb, encoder, vectors[:n_kb], np.asarray(owners, dtype=np.int32),
                                                   example_vectors, vectors[at:at + len(passages)],
                                                   topic_terms(kb, cache_dir)))

    def _score(self, q: np.ndarray, terms: list[str], exclude: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(hybrid, dense, best single cosine, BM25) per topic, each float32[topics], for the
        question vector ``q`` and its index terms (:func:`~bot.lexical.tokenize`).

        ``exclude``: an example row left out (training the topic-fit verifier leave-one-out).
        """
        sims = np.append(self.vectors @ q, -1.0).astype(np.float32)  # index -1 = padding
        if exclude is not None:
            sims[exclude] = -1.0
        top = -np.partition(-sims[self._rows], DENSE_TOP_K - 1, axis=1)[:, :DENSE_TOP_K]
        dense = top.mean(axis=1)
        lexical = np.asarray(self.bm25.scores(terms), dtype=np.float32)
        if self.mode == "dense":
            hybrid = dense
        elif self.mode == "bm25":
            hybrid = lexical / (lexical + LEXICAL_SATURATION)
        else:
            hybrid = dense + LEXICAL_WEIGHT * lexical / (lexical + LEXICAL_SATURATION)
        return hybrid, dense, top.max(axis=1), lexical

    def new_subject(self, text: str, topic_id: str, generic: frozenset[str] = frozenset()) -> str | None:
        """A word of ``text`` that names a subject (a word of some topic's title that few topics
        use: :data:`SUBJECT_TOPICS`) that the title and example questions of topic ``topic_id``
        never use, else None: "便秘" in "老人便秘怎么办" after an insomnia answer.

        Args:
            text: the normalized message with the follow-up cues blanked out
                (bot/follow_up.py ``without_cues``).
            generic: title words that name no subject ("方法", "problem"); single Chinese
                characters and Latin words under three letters never count.
        """
        words = self.topic_words[self.topic_index[topic_id]]
        for term in tokenize(canonical_terms(text)):
            if (term in self.subject_words and term not in generic and len(term) >= (3 if term.isascii() else 2)
                    and term not in words):
                return term
        return None

    def coverage(self, terms: list[str], topic: int, minus: Counter | None = None) -> tuple[float, float, float]:
        """How well a topic's words cover a question's index terms.

        Returns:
            (covered, worst, unknown): the idf-weighted share of the question's terms that
            occur in the topic's document; the largest idf of a term it lacks, over the
            largest idf of the index (0 when none is lacking: "amphetamine" in a salt
            question); the idf-weighted share of terms no topic has. ``minus``: term counts
            taken out of the topic's document first (a knowledge-base example's own words,
            when the verifier is trained leave-one-out). A question with no terms gives
            (1, 0, 0).
        """
        doc = self.bm25.doc_tf[topic]
        # in order (a set's changes per process): the same sums, to the last bit, in every process
        weights = {t: self.bm25.idf.get(t, self._top_idf) for t in dict.fromkeys(terms)}
        total = sum(weights.values())
        if not total:
            return 1.0, 0.0, 0.0
        lacking = [t for t in weights if doc.get(t, 0) - (minus[t] if minus else 0) <= 0]
        unknown = sum(w for t, w in weights.items() if t not in self.bm25.idf)
        worst = max((weights[t] for t in lacking), default=0.0) / self._top_idf
        return 1.0 - sum(weights[t] for t in lacking) / total, worst, unknown / total

    def pair_features(self, q: np.ndarray, text: str, topic: int | None = None, exclude: int | None = None,
                      avoid: frozenset[int] = frozenset()) -> tuple[int, np.ndarray]:
        """(topic index, :func:`fit_features`) for ``q`` float32[D] and its canonical ``text``.

        ``topic``: the topic to describe (default: the best by hybrid score that is not in
        ``avoid``); ``exclude``: an example row left out of the index and of its topic's
        centroid (leave-one-out).
        """
        terms = tokenize(text)
        hybrid, dense, best, lexical = self._score(q, terms, exclude)
        own, minus = None, None
        if exclude is not None:  # the example's own words leave its topic's BM25 document and centroid
            own, minus = int(self.owners[exclude]), Counter(terms)
            lexical[own] = self.bm25.score_without(terms, own, minus)
        saturated = lexical / (lexical + LEXICAL_SATURATION)
        if exclude is not None:
            hybrid = dense + LEXICAL_WEIGHT * saturated
        t = int(np.argmax(np.where(np.isin(np.arange(len(hybrid)), list(avoid)), -np.inf, hybrid))) if topic is None else topic
        centroid = self.centroids[t]
        if own == t:
            rest = self._sums[t] - self.vectors[exclude]
            centroid = rest / max(float(np.linalg.norm(rest)), 1e-6)
        cov = self.coverage(terms, t, minus if own == t else None)
        return t, fit_features((hybrid, dense, best, saturated), t, q, centroid, cov, self.answer_scores(q))

    async def search(self, text: str, k: int = 3, context: str | None = None) -> SearchResult:
        """Top-``k`` topics for a normalized question, best first.

        Args:
            text: the user's question after safety.normalize (Simplified, lowercase Latin);
                everyday, dialect and TCM wordings are mapped to the base's words here
                (bot/terms.py).
            k: number of matches to return.
            context: for a follow-up question ("那饮食上呢"), the words of the topic
                it follows; topics are then scored by the mean of the scores of
                ``context + text`` and of ``text`` alone, so the follow-up's own
                words pick among the topics near the context.

        Raises:
            inference.batcher.BusyError / DeadlineExceeded: the inference pool is overloaded.
        """
        if (kept := self.results.get(key := (text, k, context, self.mode))) is not None:
            return kept
        texts = self.search_texts(text, context)
        result = self.read(texts, await self.encoder.encode(texts), k, scores=self.scores)
        self.results.put(key, result)
        return result

    @staticmethod
    def search_texts(text: str, context: str | None = None) -> list[str]:
        """The texts :meth:`search` embeds for ``text`` (and ``context``): ``[text]`` or
        ``[context + text, text]``, everyday wordings mapped (bot/terms.py)."""
        text = canonical_terms(text)
        return [text] if context is None else [f"{context} {text}", text]

    def read(self, texts: list[str], qs: np.ndarray, k: int = 3,
             scores: SearchCache[tuple[np.ndarray, ...]] | None = None) -> SearchResult:
        """:meth:`search` on :meth:`search_texts` ``texts`` already embedded as ``qs`` float32[len(texts), D]
        (training reads many at once, with nothing cached); ``scores``: each text's :meth:`_score` kept
        and reused by the text (``qs`` must then be what the encoder gives for ``texts``)."""
        terms = [tokenize(t) for t in texts]  # jieba once per text: BM25 and the coverage feature
        parts = [self._score(q, ts) if scores is None else scores.get_or_put((text, self.mode), lambda: self._score(q, ts))
                 for text, q, ts in zip(texts, qs, terms)]
        hybrid, dense, best_single, lexical = (np.mean([p[j] for p in parts], axis=0) for j in range(4))
        # the prior's logits once a question vector: for the ranking and for the verifier's prior terms
        logits = None if self.prior is None else list(self.prior.logits(qs, texts[-1]))
        ranked = hybrid if logits is None or self.mode != "hybrid" else self.prior.ranking(hybrid, logits)
        order = np.argsort(-ranked)[: max(k, 2)]
        margin = float(hybrid[order[0]] - hybrid[order[1]]) if len(order) > 1 else 1.0
        out = []
        for rank, i in enumerate(order[:k]):
            conf = confidence(float(hybrid[i]), margin if rank == 0 else 0.0)
            out.append(Match(self.topic_ids[i], float(hybrid[i]), float(dense[i]), float(lexical[i]), conf))
        # Both sides as the mean of their DENSE_TOP_K best matches: one stray example
        # ("my kid has a nosebleed") must not turn "my child has a cough" away.
        nearest = {kind: float(np.sort(v @ qs[0])[-DENSE_TOP_K:].mean()) for kind, v in self.example_vectors.items()}
        beaten = [k for k in ("out_of_scope", "no_answer")
                  if k in nearest and nearest[k] > dense[order[0]] + OFF_TOPIC_MARGIN[k]]
        off_topic = max(beaten, key=nearest.__getitem__) if beaten else None  # the nearer kind wins
        best = int(order[0])
        fit = fit_features((hybrid, dense, best_single, lexical / (lexical + LEXICAL_SATURATION)), best, qs[-1],
                           self.centroids[best], self.coverage(terms[-1], best),
                           self.answer_scores(qs[-1]))
        return SearchResult(out, off_topic, nearest, qs[-1], qs[0] if len(qs) > 1 else None, fit, hybrid,
                            contested=bool(hybrid[best] < hybrid.max()),
                            prior_terms=None if logits is None else self.prior.terms(logits[-1], best),
                            topic_index=self.topic_index)


def confidence(score: float, margin: float) -> float:
    """Logistic calibration of a hybrid score (and its margin to the runner-up) to [0, 1]."""
    c = CALIBRATION
    z = c["scale"] * (score - c["centre"] + c["margin_weight"] * margin)
    return 1.0 / (1.0 + math.exp(-z))
