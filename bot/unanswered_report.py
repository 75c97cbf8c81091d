"""``healthbot report unanswered``: what users asked that the bot could not answer, grouped.

Reads the questions recorded by bot/unanswered.py over a period (``--since 7d``), embeds
them with the bot's own encoder (the model and engine the server uses, opened through
:func:`bot.runtime.open_dispatcher`), groups them by cosine similarity and prints the
largest groups first: size, the intents and why, three example questions (those nearest the
group's centre) and the knowledge-base topic retrieval finds nearest — the list of what
to write next.

Grouping is greedy, in the order the questions came: a question joins the group whose
centre (the normalized mean of its vectors) is most similar, if that cosine is at least
``--threshold``, else starts a group of its own; one pass, O(questions x groups), so a
month of questions stays cheap. The default :data:`DEFAULT_THRESHOLD` was read off the
model: rewordings of one question ("做完心脏支架手术后多久可以坐飞机" / "放了心脏支架以后多久可以坐飞机",
"布洛芬一次吃几片" / "布洛芬每次吃多少片") score 0.97-0.99; neighbouring questions stay apart
("布洛芬一次吃几片" / "阿莫西林一次吃几粒": 0.92), unrelated ones score 0.76-0.88.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Callable

import numpy as np

from bot.config import Config
from bot.embedding import embed_all
from bot.retrieval import Retriever
from bot.runtime import open_dispatcher
from bot.store import StoreError, open_store
from bot.unanswered import DAY_S, read_unanswered
from safety.normalize import normalize

#: Cosine at or above which a question joins a group (see the module docstring).
DEFAULT_THRESHOLD = 0.93
#: Example questions printed per group.
EXAMPLES = 3

_PERIOD = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([wdhm]?)\s*$")
_UNIT_S = {"w": 7 * DAY_S, "d": DAY_S, "h": 3600, "m": 60, "": DAY_S}


def parse_period(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"2w"``, ``"30m"`` or a bare number of days → seconds (for ``--since``).

    Raises:
        ValueError: anything else.
    """
    m = _PERIOD.match(text)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"--since {text!r}: use a period such as 7d, 24h or 2w")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def group_vectors(vectors: np.ndarray, threshold: float) -> list[list[int]]:
    """Greedy grouping of L2-normalized row vectors by cosine to each group's centre; the
    groups as lists of row indexes, largest first (ties: the earlier group first)."""
    members: list[list[int]] = []
    sums = np.zeros((0, vectors.shape[1]), dtype=np.float64)
    for i, v in enumerate(vectors):
        if members:
            centres = sums / np.linalg.norm(sums, axis=1, keepdims=True)
            sims = centres @ v
            best = int(np.argmax(sims))
            if sims[best] >= threshold:
                members[best].append(i)
                sums[best] += v
                continue
        members.append([i])
        sums = np.vstack([sums, v[None, :].astype(np.float64)])
    return sorted(members, key=len, reverse=True)


@dataclass
class Group:
    """One group of similar questions, as printed."""

    size: int
    examples: list[str]
    intents: dict[str, int]
    #: why they went unanswered: each entry's ``reason`` (a scope or care-team rule, ``head``, a
    #: missing facet), else what decided (``retrieval``, ``topic_fit``, ``topic_scope``, ...).
    reasons: dict[str, int]
    nearest_topic: dict


async def build_report(entries: list[dict], retriever: Retriever, *, top: int,
                       threshold: float = DEFAULT_THRESHOLD) -> tuple[list[Group], int]:
    """The ``top`` largest groups of ``entries`` (from :func:`bot.unanswered.read_unanswered`), and
    how many groups there are in all."""
    if not entries:
        return [], 0
    texts = [normalize(e["text"]).text for e in entries]
    vectors = np.asarray(await embed_all(retriever.encoder, texts), dtype=np.float32)
    grouped = group_vectors(vectors, threshold)
    groups = []
    for rows in grouped[:top]:
        centre = vectors[rows].mean(axis=0)
        nearest_first = sorted(rows, key=lambda r: -float(vectors[r] @ centre))
        examples: list[str] = []
        for i in nearest_first:
            if entries[i]["text"] not in examples:
                examples.append(entries[i]["text"])
            if len(examples) == EXAMPLES:
                break
        match = (await retriever.search(texts[nearest_first[0]], k=1)).matches[0]
        lang = Counter(entries[i].get("lang") or "zh" for i in rows).most_common(1)[0][0]
        title = retriever.kb.topics[match.topic_id].title
        groups.append(Group(
            size=len(rows), examples=examples,
            intents=dict(Counter(str(entries[i].get("intent")) for i in rows).most_common()),
            reasons=dict(Counter(str(entries[i].get("reason") or entries[i].get("decided_by")) for i in rows)
                         .most_common()),
            nearest_topic={"id": match.topic_id, "title": title.get(lang) or next(iter(title.values())),
                           "confidence": round(match.confidence, 3)}))
    return groups, len(grouped)


def utc(ts: float) -> str:
    """Unix time → ``2026-12-02T16:30Z``."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%MZ")


def format_report(groups: list[Group], *, questions: int, total_groups: int, since: float, until: float,
                  threshold: float) -> str:
    """The report as text: a heading line, then one block per group."""
    lines = [f"Unanswered questions {utc(since)} - {utc(until)}: {questions} in {total_groups} group(s) "
             f"(cosine >= {threshold:g}); the {len(groups)} largest:"]
    for n, g in enumerate(groups, 1):
        intents = ", ".join(f"{k} {v}" for k, v in g.intents.items())
        reasons = ", ".join(f"{k} {v}" for k, v in g.reasons.items())
        t = g.nearest_topic
        lines += ["", f"{n:2}. {g.size} question(s) ({intents}; why: {reasons})",
                  f"    nearest topic: {t['id']} \"{t['title']}\" (retrieval confidence {t['confidence']:.2f})"]
        lines += [f"    - {q}" for q in g.examples]
    return "\n".join(lines)


async def run_report(cfg: Config, args: argparse.Namespace, ensure_model: Callable[[], None] | None = None) -> int:
    """``healthbot report unanswered``: read the period's questions, group them, print (text or ``--json``).

    ``ensure_model`` (prepares a missing model) is called only when there is something to group.
    """
    try:
        period = parse_period(args.since)
    except ValueError as exc:
        print(f"healthbot report: {exc}", file=sys.stderr)
        return 2
    threshold = DEFAULT_THRESHOLD if args.threshold is None else args.threshold
    if args.top < 1 or not 0.0 < threshold <= 1.0:
        print("healthbot report: --top must be >= 1 and --threshold in (0, 1]", file=sys.stderr)
        return 2
    until = time.time()
    since = until - min(period, cfg.knowledge.unanswered_retention_days * DAY_S)
    try:
        store = await open_store(cfg.effective_store_url)
        try:
            entries = await read_unanswered(store, period, cfg.knowledge.unanswered_retention_days, until)
        finally:
            await store.close()
    except StoreError as exc:
        print(f"healthbot report: {exc}", file=sys.stderr)
        return 2
    groups: list[Group] = []
    total = 0
    if entries:
        if ensure_model is not None:
            ensure_model()
        cfg.inference.max_queue_delay_ms = 0.0  # one caller: no batch to wait for
        async with open_dispatcher(cfg) as dispatcher:
            groups, total = await build_report(entries, dispatcher.retriever, top=args.top, threshold=threshold)
    if args.json:
        print(json.dumps({"since": utc(since), "until": utc(until), "questions": len(entries), "groups_total": total,
                          "threshold": threshold, "recording": cfg.knowledge.record_unanswered,
                          "groups": [asdict(g) for g in groups]}, ensure_ascii=False))
        return 0
    if not entries:
        off = ("" if cfg.knowledge.record_unanswered else " (recording is off: set knowledge.record_unanswered "
               "= true, or HEALTHBOT_KNOWLEDGE_RECORD_UNANSWERED=1)")
        print(f"No unanswered questions recorded in the period{off}.")
        return 0
    print(format_report(groups, questions=len(entries), total_groups=total, since=since, until=until,
                        threshold=threshold))
    return 0
