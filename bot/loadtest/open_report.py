"""Reports of open-loop runs (bot/loadtest/openloop.py): the terminal text, a Markdown table,
the ramp's table, and the plot of latency percentiles against the offered rate (a PNG with
matplotlib, else, or for a ``.csv`` name, a CSV of the same figures)."""

from __future__ import annotations

import csv
from pathlib import Path

from bot.loadtest.openloop import OpenLoopResult, RampResult, passes

__all__ = ["RAMP_COLUMNS", "format_open", "format_open_markdown", "format_ramp", "ramp_rows", "write_ramp_plot"]

RAMP_COLUMNS = ("offered_rps", "sent_rps", "answered_rps", "p50_ms", "p95_ms", "p99_ms", "p99_9_ms", "max_ms",
                "errors", "deferred", "late", "not_answers", "cpu_ms_per_msg", "front_end_cpu_ms_per_msg",
                "event_loop_cpu_ms_per_msg")


def _cpu_parts(s: dict) -> str:
    """The server's CPU in parts where measured, e.g. ``, front ends 1.2 ms, event-loop threads 1.0 ms,
    encoder's processes 0.3 ms``."""
    parts = []
    if s.get("encoder_cpu_ms_per_msg"):
        parts.append(f"front ends {s['front_end_cpu_ms_per_msg']} ms")
    if s.get("event_loop_cpu_ms_per_msg") is not None:
        parts.append(f"event-loop threads {s['event_loop_cpu_ms_per_msg']} ms")
    if s.get("encoder_cpu_ms_per_msg"):
        parts.append(f"encoder's processes {s['encoder_cpu_ms_per_msg']} ms")
    return "".join(f", {p}" for p in parts)


def _cpu_line(s: dict) -> str:
    others = (f"; other processes kept {s['other_processes_cores']} cores busy"
              if s.get("other_processes_cores") is not None else "")
    if s["cpu_ms_per_msg"] is None:
        return (f"  server CPU  not measured (give --server-pid or --start-server); load generator "
                f"{s['client_cpu_ms_per_msg']} ms/msg{others}")
    return (f"  server CPU  {s['cpu_ms_per_msg']} ms per message{_cpu_parts(s)}  ({s['cpu_source']}); "
            f"load generator {s['client_cpu_ms_per_msg']} ms/msg{others}")


def format_open(result: OpenLoopResult) -> str:
    """A plain-text report of one open-loop run."""
    s = result.summary()
    warm = f" (first {s['warmup_s']:g} s left out)" if s["warmup_s"] else ""
    not_real = f"  ({s['not_answers_by_kind']})" if s["not_answers"] else ""
    return "\n".join([
        f"healthbot loadtest (open loop): {s['channel']} {result.config.url}, {s['arrivals']} arrivals at "
        f"{s['offered_rps']:g}/s for {s['seconds']} s{warm}",
        f"  messages    {s['requests']} sent ({s['sent_rps']}/s), {s['answered_rps']}/s answered, "
        f"at most {s['max_in_flight']} in flight",
        f"  latency ms  p50 {s['p50_ms']}   p95 {s['p95_ms']}   p99 {s['p99_ms']}   p99.9 {s['p99_9_ms']}   "
        f"max {s['max_ms']}   (from the scheduled send; client send lag p99 {s['send_lag_p99_ms']} ms)",
        f"  outcomes    {', '.join(f'{k} {v}' for k, v in s['outcomes'].items())}",
        f"  answers     deferred {s['deferred']}, late {s['late']}, paged {s['paged']}, "
        f"not a real answer {s['not_answers']}{not_real}",
        f"  errors      {s['errors']}" + (f"  ({s['errors_by_kind']})" if s["errors"] else ""),
        _cpu_line(s),
    ])


def format_open_markdown(result: OpenLoopResult) -> str:
    """One open-loop run as a Markdown table."""
    s = result.summary()
    rows = [("mode", f"open loop, {s['arrivals']} arrivals"), ("offered rate", f"{s['offered_rps']:g} msg/s"),
            ("duration", f"{s['seconds']} s" + (f" (first {s['warmup_s']:g} s left out)" if s["warmup_s"] else "")),
            ("messages", f"{s['requests']} ({s['answered_rps']}/s answered)"),
            ("p50 / p95 / p99 / p99.9", f"{s['p50_ms']} / {s['p95_ms']} / {s['p99_ms']} / {s['p99_9_ms']} ms"),
            ("max", f"{s['max_ms']} ms"), ("outcomes", ", ".join(f"{k} {v}" for k, v in s["outcomes"].items())),
            ("deferred / late / not a real answer", f"{s['deferred']} / {s['late']} / {s['not_answers']}"),
            ("errors", s["errors"] if not s["errors"] else f"{s['errors']} {s['errors_by_kind']}"),
            ("server CPU per message", "not measured" if s["cpu_ms_per_msg"] is None else
             f"{s['cpu_ms_per_msg']} ms{_cpu_parts(s)}"),
            ("load generator CPU per message", f"{s['client_cpu_ms_per_msg']} ms"),
            ("other processes during the run", "not measured" if s.get("other_processes_cores") is None else
             f"{s['other_processes_cores']} cores busy")]
    return "| measure | value |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def ramp_rows(ramp: RampResult) -> list[dict]:
    """One dict per step, by offered rate, with :data:`RAMP_COLUMNS` and ``pass``."""
    rows = []
    for step in sorted(ramp.steps, key=lambda r: r.config.rate):
        s = step.summary()
        rows.append({**{k: s[k] for k in RAMP_COLUMNS}, "pass": passes(s, ramp.p99_ms)})
    return rows


def format_ramp(ramp: RampResult, markdown: bool = False) -> str:
    """The ramp's table (plain text, or Markdown), and the highest rate within the bound."""
    head = ["offered/s", "sent/s", "answered/s", "p50", "p95", "p99", "p99.9", "max", "errors", "deferred",
            "late", "not answer", "CPU ms/msg", "loop ms/msg", f"p99 ≤ {ramp.p99_ms:g} ms"]
    body = [[f"{r[c]:g}" if isinstance(r[c], float) else str(r[c]) for c in RAMP_COLUMNS]
            + ["yes" if r["pass"] else "no"] for r in ramp_rows(ramp)]
    best = (f"highest rate with p99 ≤ {ramp.p99_ms:g} ms and no errors: "
            + (f"{ramp.best_rate:g} messages/s" if ramp.best_rate is not None else "none of the rates tried"))
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines) + f"\n\n{best} (latencies in ms)\n"
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), *(fmt.format(*r) for r in body), best])


def write_ramp_plot(ramp: RampResult, path: str | Path) -> Path:
    """Latency percentiles (p50, p95, p99, p99.9) against the offered rate, with the bound.

    A PNG when matplotlib is installed and ``path`` does not end in ``.csv``; otherwise a CSV of
    :func:`ramp_rows` at ``path`` with its suffix changed to ``.csv``. Returns the file written.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = ramp_rows(ramp)
    plt = None
    if out.suffix.lower() != ".csv":
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            plt = None
    if plt is None:
        out = out.with_suffix(".csv")
        with out.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=[*RAMP_COLUMNS, "pass"])
            writer.writeheader()
            writer.writerows(rows)
        return out
    fig, ax = plt.subplots(figsize=(8, 5))
    rates = [r["offered_rps"] for r in rows]
    for key, label in (("p50_ms", "p50"), ("p95_ms", "p95"), ("p99_ms", "p99"), ("p99_9_ms", "p99.9")):
        ax.plot(rates, [r[key] for r in rows], marker="o", label=label)
    ax.axhline(ramp.p99_ms, color="tab:red", ls="--", lw=1, label=f"p99 bound {ramp.p99_ms:g} ms")
    if ramp.best_rate is not None:
        ax.axvline(ramp.best_rate, color="tab:gray", ls=":", lw=1, label=f"highest passing {ramp.best_rate:g}/s")
    ax.set_yscale("log")
    ax.set_xlabel("offered rate (messages/s, open loop)")
    ax.set_ylabel("latency from scheduled send (ms)")
    ax.set_title("healthbot loadtest --ramp: latency against offered rate", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
