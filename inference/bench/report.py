"""The bench's result as a table (:func:`format_table`, :func:`format_scaling`), a summary
(:func:`summarize`) and a plot (:func:`write_plot`, needs matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def format_table(result: dict[str, Any]) -> str:
    """A plain-text table of :func:`run_bench`'s result, one line per run."""
    b = result["batcher"]
    m = result.get("machine", {})
    lines = [
        f"{m.get('cpu_count')} CPU(s){', ' + m['gpu'] if m.get('gpu') else ''}, loop {m.get('event_loop', '?')}; "
        f"batched = max_batch_size {b['max_batch_size']} (GPU {b['gpu_max_batch_size']}), "
        f"max_queue_delay_ms {b['max_queue_delay_ms']}, max_batch_tokens {b['max_batch_tokens']}, "
        f"{b['workers']} engine(s) per {'worker process' if b.get('device_processes') else 'device'}, "
        f"{'engine server per GPU, ' if b.get('engine_server') else ''}"
        f"GIL switch interval {b.get('switch_interval_ms')} ms; "
        f"unbatched = max_batch_size 1",
    ]
    for info in result.get("engines", []):
        mem = f", GPU memory {info['gpu_memory_mib']} MiB" if info.get("gpu_memory_mib") else ""
        procs = f" in {info['processes']} worker processes" if info.get("processes") else ""
        lines.append(f"  {info['engine']}/{info['precision']}: {info['workers']} engine(s){procs} on "
                     f"{', '.join(info['devices'])}, loaded in {info['load_seconds']} s{mem}")
    for name, why in result.get("skipped", {}).items():
        lines.append(f"  {name}: skipped ({why})")
    lines.append(f"{'engine':<12} {'prec':<5} {'mode':<11} {'conc':>4} {'encodes/s':>10} {'p50 ms':>8} "
                 f"{'p99 ms':>8} {'batch':>6} {'done':>6} {'errors':>6}")
    for r in result["runs"]:
        if r.get("engine_only"):
            lines.append(f"{r['engine']:<12} {r['precision']:<5} {'engine-only':<11} {'-':>4} {r['throughput']:>10.1f} "
                         f"{r['p50_ms']:>8.2f} {'-':>8} {r['batch_size']:>6} {r['calls']:>6} {'-':>6}"
                         f"  (ms per batch; batches up to {r['batch_size']} x {r['seq_len']} tokens)")
            continue
        lines.append(f"{r['engine']:<12} {r['precision']:<5} {'batched' if r['batched'] else 'unbatched':<11} "
                     f"{r['concurrency']:>4} {r['throughput']:>10.1f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                     f"{r['mean_batch_size']:>6.2f} {r['requests']:>6} {r['errors']:>6}"
                     + (f"  (engine server batch {r['mean_engine_batch_size']:.2f})"
                        if "mean_engine_batch_size" in r else ""))
    lines += [f"{k}: {v}" for k, v in summarize(result).items()]
    lines.append(f"total {result.get('total_seconds')} s")
    return "\n".join(lines)


def format_scaling(result: dict[str, Any]) -> str:
    """A plain-text table of :func:`run_scaling`'s result."""
    lines = [f"{result['engine']}, batched, {result['workers']} engine(s) per "
             f"{'process' if result['device_processes'] else 'device'}, "
             f"{result['device_processes'] or 'no'} worker process(es) per device, "
             f"max_queue_delay_ms {result['max_queue_delay_ms']}",
             f"{'devices':<22} {'conc':>5} {'encodes/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'batch':>6} {'errors':>6}"]
    for r in result["runs"]:
        lines.append(f"{','.join(r['device_list']):<22} {r['concurrency']:>5} {r['throughput']:>10.1f} "
                     f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['mean_batch_size']:>6.2f} {r['errors']:>6}")
    lines.append(f"speed-up, all devices / one: {result['speedup']}x")
    return "\n".join(lines)


def summarize(result: dict[str, Any]) -> dict[str, str]:
    """Per engine: batched/unbatched ratio at each concurrency and the pool's share of the ceiling."""
    out = {}
    by = {}
    for r in result["runs"]:
        by.setdefault((r["engine"], r["precision"]), []).append(r)
    for (eng, prec), rs in by.items():
        ceil = next((r["throughput"] for r in rs if r.get("engine_only")), None)
        parts = []
        for c in sorted({r["concurrency"] for r in rs if not r.get("engine_only")}):
            b = next((r for r in rs if r["concurrency"] == c and r["batched"] and not r.get("engine_only")), None)
            u = next((r for r in rs if r["concurrency"] == c and not r["batched"]), None)
            if b and u and u["throughput"]:
                parts.append(f"c={c}: batched/unbatched {b['throughput'] / u['throughput']:.2f}x")
            if b and ceil:
                parts.append(f"c={c}: pool {100 * b['throughput'] / ceil:.0f}% of ceiling")
        out[f"{eng}/{prec}"] = "; ".join(parts)
    return out


def write_plot(result: dict[str, Any], path: str | Path) -> Path:
    """PNG: throughput (left) and p99 latency (right) against concurrency, per engine,
    batched (solid) vs unbatched (dashed), the engine-only ceiling dotted.

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(11, 4.2))
    by: dict[tuple[str, str], list[dict]] = {}
    for r in result["runs"]:
        by.setdefault((r["engine"], r["precision"]), []).append(r)
    for i, ((eng, prec), rs) in enumerate(by.items()):
        color = f"C{i}"
        for batched, style in ((True, "-"), (False, "--")):
            pts = sorted((r["concurrency"], r["throughput"], r["p99_ms"]) for r in rs
                         if not r.get("engine_only") and r["batched"] == batched)
            if not pts:
                continue
            label = f"{eng}/{prec} {'batched' if batched else 'max batch 1'}"
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=color, label=label)
            ax_p.plot([p[0] for p in pts], [p[2] for p in pts], style, marker="o", color=color, label=label)
        ceil = next((r for r in rs if r.get("engine_only")), None)
        if ceil:
            ax_t.axhline(ceil["throughput"], linestyle=":", color=color,
                         label=f"{eng}/{prec} engine only (batch {ceil['batch_size']})")
    for ax in (ax_t, ax_p):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_ylabel("encodes / s")
    ax_t.set_yscale("log")
    ax_p.set_ylabel("p99 latency, ms")
    ax_p.set_yscale("log")
    ax_t.legend(fontsize=7)
    m = result.get("machine", {})
    fig.suptitle(f"healthbot bench, {m.get('gpu') or str(m.get('cpu_count')) + ' CPUs'}, {m.get('date_utc', '')}",
                 fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
