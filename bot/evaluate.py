"""``healthbot eval``: score the bot on a labelled file (format of ../shared/eval/dev.jsonl).

Scoring (../shared/eval/README.md): intent accuracy over all lines; topic
accuracy over ``answer`` lines that carry a ``topics`` label (top-1 topic among
them; an unlabelled answer line counts for intent only);
emergency recall (emergency lines answered as emergency) and false alarms
(non-emergency lines answered as emergency).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bot.dispatcher import Dispatcher
from bot.types import Inbound, MessageKind


@dataclass
class EvalResult:
    """Counts and the misclassified lines of one evaluation run."""

    total: int = 0
    intent_ok: int = 0
    answer_lines: int = 0
    topic_ok: int = 0
    emergency_lines: int = 0
    emergency_hit: int = 0
    false_alarms: int = 0
    confusion: Counter = field(default_factory=Counter)
    misses: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        """The headline figures as fractions in [0, 1] plus counts."""
        def frac(a: int, b: int) -> float:
            return round(a / b, 4) if b else 0.0
        return {
            "lines": self.total,
            "intent_accuracy": frac(self.intent_ok, self.total),
            "topic_accuracy": frac(self.topic_ok, self.answer_lines),
            "emergency_recall": frac(self.emergency_hit, self.emergency_lines),
            "false_alarms": self.false_alarms,
            "answer_lines": self.answer_lines,
            "emergency_lines": self.emergency_lines,
        }


def read_labelled(path: Path) -> list[dict]:
    """Lines of a labelled JSONL file; raises ValueError naming the line of a bad one."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
        if "q" not in row or "intent" not in row:
            raise ValueError(f"{path}:{n}: needs 'q' and 'intent'")
        rows.append(row)
    return rows


async def evaluate(dispatcher: Dispatcher, rows: list[dict], run: str = "") -> EvalResult:
    """Run every labelled question through the dispatcher and score it.

    ``run`` names the run; it keeps the message ids of repeated runs apart (the
    dispatcher answers a repeated message id from its dedup cache).
    """
    res = EvalResult()
    run = f"{run}-{time.time_ns()}"  # message ids unique to this run: the store keeps replies across runs
    for i, row in enumerate(rows):
        reply = await dispatcher.handle(Inbound(channel="eval", user_id=f"eval-{run}-{i}", chat_id=f"eval-{run}-{i}",
                                                message_id=f"eval-{run}-{i}", kind=MessageKind.TEXT, text=row["q"],
                                                lang=None))
        got, want = reply.intent.value, row["intent"]
        res.total += 1
        res.confusion[(want, got)] += 1
        ok = got == want
        res.intent_ok += ok
        topic_ok = True
        if want == "answer" and row.get("topics"):  # unlabelled answer lines count for intent only
            res.answer_lines += 1
            topic_ok = reply.topic in row["topics"]
            res.topic_ok += topic_ok
        if want == "emergency":
            res.emergency_lines += 1
            res.emergency_hit += got == "emergency"
        elif got == "emergency":
            res.false_alarms += 1
        if not ok or not topic_ok:
            res.misses.append({"q": row["q"], "want": want, "got": got, "want_topics": row.get("topics"),
                               "got_topic": reply.topic, "confidence": round(reply.confidence, 3)})
    return res


async def retrieval_accuracy(retriever, rows: list[dict]) -> float:
    """Share of topic-labelled ``answer`` lines whose top-1 retrieved topic is right (retrieval alone, no intents)."""
    from safety.normalize import normalize
    lines = [r for r in rows if r["intent"] == "answer" and r.get("topics")]
    ok = 0
    for row in lines:
        found = await retriever.search(normalize(row["q"]).text)
        ok += found.matches[0].topic_id in row["topics"]
    return ok / len(lines) if lines else 0.0


def format_report(res: EvalResult) -> str:
    """A short human-readable report of :class:`EvalResult`."""
    s = res.summary()
    lines = [
        f"lines              {s['lines']}",
        f"intent accuracy    {s['intent_accuracy']:.1%}",
        f"topic accuracy     {_pct(s['topic_accuracy'], s['answer_lines'])}  (on {s['answer_lines']} answer lines "
        f"with a topic label)",
        f"emergency recall   {_pct(s['emergency_recall'], s['emergency_lines'])}  (on {s['emergency_lines']} "
        f"emergency lines)",
        f"false alarms       {s['false_alarms']}",
    ]
    return "\n".join(lines)


def _pct(value: float, lines: int) -> str:
    """``"98.7%"``, or ``"n/a"`` when no line was scored."""
    return f"{value:.1%}" if lines else "n/a"
