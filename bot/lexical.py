"""Lexical retrieval: Okapi BM25 over jieba words (Chinese) and lowercase words (English).

BM25 as in Robertson & Zaragoza, "The Probabilistic Relevance Framework: BM25 and
Beyond" (2009), with the usual k1 = 1.5, b = 0.75 and the non-negative idf
``ln(1 + (N - n + 0.5) / (n + 0.5))`` (Lucene's variant).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import jieba
import numpy as np

from bot.knowledge import LANGS, KnowledgeBase

jieba.setLogLevel(logging.WARNING)

_WORD = re.compile(r"[a-z0-9]+|[\u3400-\u9fff]+")
_LATIN = re.compile(r"[a-z0-9]+")

#: Function words that carry no topic: Chinese particles and question words, English stop words.
STOPWORDS = frozenset(
    "的 了 吗 呢 吧 啊 呀 哦 嘛 么 是 我 你 他 她 它 我们 你们 他们 这 那 这个 那个 有 没有 会 要 能 可以 "
    "怎么 怎么办 怎样 如何 什么 为什么 咋 咋办 啥 哪些 多少 一下 一些 就 都 也 还 又 很 太 挺 老 总 总是 "
    "老是 经常 最近 一直 特别 非常 有点 有些 感觉 觉得 请问 问 问问 想 想问 知道 应该 需要 注意 事项 "
    "好 好不好 行 行不行 对 对不对 正常 吗 和 跟 与 或 或者 还是 在 到 从 给 让 被 把 着 过 得 地 "
    "一 个 天 每天 人 家里 自己 现在 时候 平时 "
    "a an the is are am was were be been do does did i my me you your he she it its we they them "
    "what how why when which who should can could would will shall may might to of in on at for "
    "with and or but if so about any some this that these those there here have has had get got "
    "not no yes just really very too much many please tell know any anything something".split()
)


def tokenize(text: str) -> list[str]:
    """Index terms of an already normalized text (Simplified Chinese, lowercase Latin).

    Chinese runs are cut with jieba's search mode (words and their sub-words);
    stop words are removed; single CJK characters are kept only when jieba
    leaves them alone (they are often the key word: 胀, 晕, 痒).
    """
    terms: list[str] = []
    for run in _WORD.findall(text.lower()):
        if _LATIN.fullmatch(run):
            if run not in STOPWORDS and len(run) > 1:
                terms.append(_stem(run))
            continue
        for word in jieba.lcut_for_search(run):
            if word not in STOPWORDS:
                terms.append(word)
    return terms


def _stem(word: str) -> str:
    """A light English plural/verb-suffix folding (feet/foot are left as they are)."""
    for suffix, min_len in (("ing", 6), ("ies", 5), ("es", 5), ("s", 4)):
        if word.endswith(suffix) and len(word) >= min_len and not word.endswith("ss"):
            return word[: -len(suffix)] + ("y" if suffix == "ies" else "")
    return word


class BM25:
    """An in-memory BM25 index over short documents.

    Args:
        documents: one list of terms per document (see :func:`tokenize`).
        k1: term-frequency saturation (1.5).
        b: length normalization (0.75).
    """

    def __init__(self, documents: list[list[str]], k1: float = 1.5, b: float = 0.75):
        self.k1, self.b = k1, b
        self.doc_tf = [Counter(d) for d in documents]
        self.doc_len = [len(d) for d in documents]
        self.avg_len = (sum(self.doc_len) / len(documents)) if documents else 0.0
        df: Counter[str] = Counter()
        for tf in self.doc_tf:
            df.update(tf.keys())
        n = len(documents)
        self.idf = {t: math.log(1.0 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}
        # Postings: term -> (documents holding it, ascending; each one's BM25 term weight), so a
        # query costs its postings' length in numpy, not terms × documents in Python.
        rows: dict[str, tuple[list[int], list[float]]] = {}
        for i, tf in enumerate(self.doc_tf):
            for term, f in tf.items():
                docs, weights = rows.setdefault(term, ([], []))
                docs.append(i)
                weights.append(self._weight(term, f, self.doc_len[i]))
        self.postings = {t: (np.asarray(d, dtype=np.intp), np.asarray(w)) for t, (d, w) in rows.items()}

    def _weight(self, term: str, f: int, length: int) -> float:
        """BM25's weight of ``term``, found ``f`` times in a document of ``length`` terms."""
        norm = self.k1 * (1 - self.b + self.b * length / self.avg_len)
        return self.idf[term] * f * (self.k1 + 1) / (f + norm)

    def score_without(self, query_terms: list[str], doc: int, minus: Counter) -> float:
        """BM25 score of document ``doc`` with the term counts ``minus`` taken out of it
        (idf and average length unchanged): a knowledge-base example scored against its
        own topic as if it were not there (bot/topic_fit.py trains leave-one-out)."""
        tf, length = self.doc_tf[doc], self.doc_len[doc] - sum(minus.values())
        out = 0.0
        for term in dict.fromkeys(query_terms):  # in order (a set's changes per process)
            f = tf.get(term, 0) - minus.get(term, 0)
            if f > 0 and term in self.idf:
                out += self._weight(term, f, max(length, 1))
        return out

    def scores(self, query_terms: list[str]) -> np.ndarray:
        """BM25 score of every document for the query terms, float64[documents] (0 where nothing matches)."""
        out = np.zeros(len(self.doc_tf))
        for term in dict.fromkeys(query_terms):  # in order (a set's order changes per process)
            posting = self.postings.get(term)
            if posting is not None:
                out[posting[0]] += posting[1]
        return out


@dataclass(frozen=True)
class TopicTerms:
    """The index terms (:func:`tokenize`) of each topic's texts, topics in the base's order and
    languages in :data:`bot.knowledge.LANGS` order: ``titles[t][l]``, ``questions[t][l][q]``,
    ``answers[t][l]`` (each a list of terms)."""

    titles: list[list[list[str]]]
    questions: list[list[list[list[str]]]]
    answers: list[list[list[str]]]


def topic_terms(kb: KnowledgeBase, cache_dir: Path | None = None) -> TopicTerms:
    """Tokenize every title, example question and answer of ``kb`` once (jieba: about 3 s of CPU
    for 248 topics on 2 cores), or read them from ``cache_dir`` (``kb-terms-<key>.json``, keyed by
    the base's digest, this module's source and jieba's version; a folder that cannot be written
    is skipped)."""
    key = hashlib.sha256(f"{kb.index_digest}/{jieba.__version__}/".encode() + Path(__file__).read_bytes()).hexdigest()[:16]
    cache = Path(cache_dir) / f"kb-terms-{key}.json" if cache_dir is not None else None
    if cache is not None and cache.is_file():
        jieba.initialize()  # the dictionary, loaded now rather than on the first question
        return TopicTerms(**json.loads(cache.read_text(encoding="utf-8")))
    topics = list(kb.topics.values())
    terms = TopicTerms(titles=[[tokenize(t.title[lang].lower()) for lang in LANGS] for t in topics],
                       questions=[[[tokenize(q.lower()) for q in t.questions[lang]] for lang in LANGS] for t in topics],
                       answers=[[tokenize(t.answer[lang].lower()) for lang in LANGS] for t in topics])
    if cache is not None:
        tmp = cache.with_name(f"{cache.stem}.{os.getpid()}.tmp")
        try:  # replicas may share the folder: a temporary file, then a rename
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(terms.__dict__, ensure_ascii=False), encoding="utf-8")
            tmp.replace(cache)
        except OSError:
            tmp.unlink(missing_ok=True)
    return terms
