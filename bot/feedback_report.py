"""``healthbot report feedback``: the topics whose answers users rated not helpful, most first.

Reads the votes recorded by bot/feedback.py over a period (``--since 7d``) and counts them per
knowledge-base topic: topics ordered by not-helpful votes (then by their share of all votes on
the topic, then by id), each with its helpful and not-helpful counts and its title from the
knowledge base. The top of the list is the answers to rewrite first. No model is loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass

from bot.config import Config
from bot.feedback import RETENTION_DAYS, read_votes
from bot.knowledge import KnowledgeBaseError, load_knowledge_base
from bot.store import StoreError, open_store
from bot.unanswered import DAY_S
from bot.unanswered_report import parse_period, utc


@dataclass
class TopicVotes:
    """One topic's votes, as printed."""

    topic: str
    title: str
    not_helpful: int
    helpful: int


def tally(votes: list[dict], titles: dict[str, str]) -> list[TopicVotes]:
    """Votes (from :func:`bot.feedback.read_votes`) per topic, most not-helpful first (ties: the
    larger not-helpful share, then the topic id); ``titles`` maps topic ids to titles ("" if absent)."""
    counts: dict[str, Counter[str]] = {}
    for v in votes:
        counts.setdefault(v["topic"], Counter())[v["vote"]] += 1
    rows = [TopicVotes(topic, titles.get(topic, ""), c["not_helpful"], c["helpful"]) for topic, c in counts.items()]
    return sorted(rows, key=lambda r: (-r.not_helpful, -r.not_helpful / (r.not_helpful + r.helpful), r.topic))


def format_report(rows: list[TopicVotes], *, votes: int, topics: int, since: float, until: float) -> str:
    """The report as text: a heading line, then one line per topic of ``rows`` (the first of ``topics``)."""
    lines = [f"Feedback {utc(since)} - {utc(until)}: {votes} vote(s) on {topics} topic(s); "
             f"the {len(rows)} most rated not helpful:", ""]
    width = max(len(r.topic) for r in rows)
    for n, r in enumerate(rows, 1):
        title = f'"{r.title}"' if r.title else "(no longer in the knowledge base)"
        lines.append(f"{n:3}. {r.topic:<{width}}  not helpful {r.not_helpful:4}  helpful {r.helpful:4}  {title}")
    return "\n".join(lines)


def _titles(cfg: Config) -> dict[str, str]:
    """Topic id → its Chinese title (else any), from the configured knowledge base; {} if it cannot be read."""
    try:
        kb = load_knowledge_base(cfg.kb_path)
    except (KnowledgeBaseError, OSError):
        return {}
    return {tid: t.title.get("zh") or next(iter(t.title.values()), "") for tid, t in kb.topics.items()}


async def run_feedback_report(cfg: Config, args: argparse.Namespace) -> int:
    """``healthbot report feedback``: read the period's votes, count them per topic, print (text or
    ``--json``). Exit status 2 for a bad ``--since`` / ``--top`` or a store that cannot be read."""
    try:
        period = parse_period(args.since)
    except ValueError as exc:
        print(f"healthbot report: {exc}", file=sys.stderr)
        return 2
    if args.top < 1:
        print("healthbot report: --top must be >= 1", file=sys.stderr)
        return 2
    until = time.time()
    since = until - min(period, RETENTION_DAYS * DAY_S)
    try:
        store = await open_store(cfg.effective_store_url)
        try:
            votes = await read_votes(store, period, until)
        finally:
            await store.close()
    except StoreError as exc:
        print(f"healthbot report: {exc}", file=sys.stderr)
        return 2
    rows = tally(votes, _titles(cfg) if votes else {})
    if args.json:
        print(json.dumps({"since": utc(since), "until": utc(until), "votes": len(votes), "topics_total": len(rows),
                          "topics": [asdict(r) for r in rows[:args.top]]}, ensure_ascii=False))
    elif not votes:
        print("No feedback recorded in the period.")
    else:
        print(format_report(rows[:args.top], votes=len(votes), topics=len(rows), since=since, until=until))
    return 0
