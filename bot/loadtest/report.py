"""Reports of a ``healthbot loadtest`` run: a plain-text summary for the terminal, a Markdown
table (docs/loadtest.md, the README) and a PNG of latency over time (matplotlib, optional)."""

from __future__ import annotations

import math
from pathlib import Path

from bot.loadtest.messages import REPLY_DEADLINE_S
from bot.loadtest.traffic import OK_OUTCOMES, LoadtestResult

__all__ = ["format_markdown", "format_report", "write_plot"]


def format_report(result: LoadtestResult) -> str:
    """A plain-text report for the terminal."""
    s = result.summary()
    lines = [
        f"healthbot loadtest: {s['channel']} {result.config.url}, {s['users']} users, {s['seconds']} s",
        f"  requests    {s['requests']}   throughput {s['throughput_rps']} req/s",
        f"  latency ms  p50 {s['p50_ms']}   p95 {s['p95_ms']}   p99 {s['p99_ms']}   max {s['max_ms']}",
        f"  outcomes    {', '.join(f'{k} {v}' for k, v in s['outcomes'].items())}",
        f"  errors      {s['errors']}" + (f"  ({s['errors_by_kind']})" if s["errors"] else ""),
    ]
    return "\n".join(lines)


def format_markdown(result: LoadtestResult) -> str:
    """The summary as a Markdown table (for docs/loadtest.md and the README)."""
    s = result.summary()
    rows = [("channel", s["channel"]), ("simulated users", s["users"]), ("duration", f"{s['seconds']} s"),
            ("requests", s["requests"]), ("throughput", f"{s['throughput_rps']} req/s"),
            ("p50", f"{s['p50_ms']} ms"), ("p95", f"{s['p95_ms']} ms"), ("p99", f"{s['p99_ms']} ms"),
            ("max", f"{s['max_ms']} ms"),
            ("outcomes", ", ".join(f"{k} {v}" for k, v in s["outcomes"].items())),
            ("errors", s["errors"] if not s["errors"] else f"{s['errors']} {s['errors_by_kind']}")]
    return "| measure | value |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def write_plot(result: LoadtestResult, path: str | Path, title: str | None = None) -> Path:
    """A PNG: latency of every request over time (with p50/p99 per second), and requests per second.

    ``result``: a closed-loop result, or anything with ``samples`` (``at_s``, ``latency_s``,
    ``outcome``) and ``duration_s`` when ``title`` is given (an open-loop run).

    Raises:
        RuntimeError: matplotlib is not installed (``pip install matplotlib``).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
    import numpy as np

    at = np.array([x.at_s for x in result.samples])
    lat = np.array([x.latency_s * 1000.0 for x in result.samples])
    bad = np.array([x.outcome not in OK_OUTCOMES for x in result.samples], dtype=bool)
    seconds = int(math.ceil(result.duration_s)) or 1
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax1.scatter(at[~bad], lat[~bad], s=2, alpha=0.25, color="tab:blue", label="request")
    if bad.any():
        ax1.scatter(at[bad], lat[bad], s=8, color="tab:red", label="error")
    buckets = at.astype(int) if len(at) else np.array([], dtype=int)
    xs, p50, p99, rps = [], [], [], []
    for sec in range(seconds):
        sel = lat[buckets == sec]
        rps.append(len(sel))
        if len(sel):
            xs.append(sec + 0.5)
            p50.append(np.percentile(sel, 50))
            p99.append(np.percentile(sel, 99))
    ax1.plot(xs, p50, color="tab:green", lw=1.5, label="p50 per second")
    ax1.plot(xs, p99, color="tab:orange", lw=1.5, label="p99 per second")
    ax1.axhline(REPLY_DEADLINE_S * 1000.0, color="tab:red", ls="--", lw=1, label="WeChat deadline (5 s)")
    ax1.set_yscale("log")
    ax1.set_ylabel("latency (ms)")
    ax1.legend(loc="upper right", fontsize=8)
    if title is None:
        s = result.summary()
        title = (f"healthbot loadtest — {s['channel']}, {s['users']} users, {s['requests']} requests, "
                 f"{s['throughput_rps']} req/s; p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms, {s['errors']} errors")
    ax1.set_title(title, fontsize=9)
    ax2.bar(np.arange(seconds) + 0.5, rps, width=0.9, color="tab:gray")
    ax2.set_ylabel("requests/s")
    ax2.set_xlabel("seconds since start")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
