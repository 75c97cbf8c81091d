"""The bench's load: what is benched (:class:`EngineSpec`), the clients that drive an encoder
(:func:`drive`), the batches of the engine-only ceiling, and the records of a run."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from inference.batching.errors import BusyError, DeadlineExceeded
from inference.batching.windows import bucket_for
from inference.engines.base import EngineError

DEFAULT_CONCURRENCIES = (1, 32, 256)
#: Seconds per run (6 runs per engine + the ceiling keep one CPU engine near 40 s).
DEFAULT_RUN_SECONDS = 4.0
#: Seconds of the engine-only run.
CEILING_SECONDS = 3.0
WARMUP_REQUESTS = 8

GPU_ENGINES = ("tensorrt", "torch_cuda")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """One engine to bench: ``name`` and, for onnxruntime, ``precision`` (fp32 | int8 | auto)."""

    name: str
    precision: str = ""

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        """``"onnxruntime:int8"`` → EngineSpec("onnxruntime", "int8"); ``"torch_cuda"`` → no precision.

        Raises:
            ValueError: an unknown engine or precision.
        """
        name, _, prec = text.strip().partition(":")
        if name not in ("tensorrt", "torch_cuda", "onnxruntime"):
            raise ValueError(f"unknown engine {name!r}: tensorrt, torch_cuda, onnxruntime[:fp32|int8]")
        if prec and (name != "onnxruntime" or prec not in ("fp32", "int8", "auto")):
            raise ValueError(f"{text!r}: only onnxruntime takes a precision (fp32, int8, auto)")
        return cls(name, prec)


def percentiles(lat_ms: list[float]) -> tuple[float, float]:
    if not lat_ms:
        return 0.0, 0.0
    arr = np.asarray(lat_ms)
    return round(float(np.percentile(arr, 50)), 3), round(float(np.percentile(arr, 99)), 3)


async def drive(submit: Callable[[Any], Any], items: Sequence[Any], concurrency: int, run_seconds: float,
                batcher: Any = None) -> dict[str, Any]:
    """``concurrency`` clients, each awaiting ``submit(item)`` in a loop for ``run_seconds``.

    Returns:
        ``{"requests", "errors", "seconds", "throughput" (completed/s), "p50_ms",
        "p99_ms", "mean_batch_size"}``; requests started before the end are
        waited for and counted.
    """
    latencies_ms: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + run_seconds
    perf = time.perf_counter
    record = latencies_ms.append

    async def client(start: int) -> None:
        nonlocal errors
        i = start
        n = len(items)
        while perf() < stop_at:
            t0 = perf()
            try:
                await submit(items[i % n])
            except (BusyError, DeadlineExceeded, EngineError):
                errors += 1
            else:
                record((perf() - t0) * 1000.0)
            i += concurrency

    stats = batcher.stats if batcher is not None else None
    b0, r0 = (stats.batches_run, stats.requests_run) if stats else (0, 0)
    t_start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    elapsed = time.perf_counter() - t_start
    p50, p99 = percentiles(latencies_ms)
    batches = (stats.batches_run - b0) if stats else 0
    return {"requests": len(latencies_ms), "errors": errors, "seconds": round(elapsed, 3),
            "throughput": round(len(latencies_ms) / elapsed, 1) if elapsed > 0 else 0.0,
            "p50_ms": p50, "p99_ms": p99,
            "mean_batch_size": round((stats.requests_run - r0) / batches, 2) if batches else 0.0}


def ceiling_batches(windows: Sequence[Sequence[int]], max_batch_size: int, max_batch_tokens: int,
                    buckets: Sequence[int] = (16, 32, 64, 128, 256, 512)) -> list[list[Sequence[int]]]:
    """The batches the batcher would form from ``windows`` when all are queued at once:
    grouped by sequence bucket, in order, each up to ``max_batch_size`` windows
    and ``max_batch_tokens`` padded tokens."""
    by: dict[int, list[Sequence[int]]] = {}
    for w in windows:
        by.setdefault(bucket_for(len(w), buckets), []).append(w)
    out = []
    for b in sorted(by):
        cur: list[Sequence[int]] = []
        longest = 0
        for w in by[b]:
            nl = max(longest, len(w))
            if cur and (len(cur) >= max_batch_size or nl * (len(cur) + 1) > max_batch_tokens):
                out.append(cur)
                cur, nl = [], len(w)
            cur.append(w)
            longest = nl
        if cur:
            out.append(cur)
    return out


def mean_batch(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Mean rows per batch between two ``(batches, rows)`` counts (0.0 when no batch ran)."""
    batches, rows = after[0] - before[0], after[1] - before[1]
    return round(rows / batches, 2) if batches > 0 else 0.0


def served_record(spec: EngineSpec, precision: str, batched: bool, concurrency: int, r: dict[str, Any],
                   max_batch_size: int, max_queue_delay_ms: float, progress: Callable[[str], None],
                   processes: int | None = None) -> dict[str, Any]:
    """One run through the front end (``r`` from :func:`drive`) as a ``runs`` entry; its progress line emitted."""
    where = f", {processes} processes" if processes else ""
    merged = f", engine server batch {r['mean_engine_batch_size']}" if "mean_engine_batch_size" in r else ""
    progress(f"{spec.name}/{precision} {'batched' if batched else 'unbatched'} c={concurrency}{where}: "
             f"{r['throughput']:.0f}/s p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms batch {r['mean_batch_size']}"
             f"{merged}")
    return {"engine": spec.name, "precision": precision, "batched": batched, "concurrency": concurrency,
            "engine_only": False, "max_batch_size": max_batch_size, "max_queue_delay_ms": max_queue_delay_ms,
            **({"processes": processes} if processes else {}), **r}


def ceiling_batches_for(tokenizer: Any, texts: Sequence[str], batch_size: int,
                         max_batch_tokens: int) -> list[list[Sequence[int]]]:
    windows = [w for per in tokenizer.encode_batch(list(texts)) for w in per]
    windows = [windows[i % len(windows)] for i in range(max(4 * batch_size, len(windows)))]
    return ceiling_batches(windows, batch_size, max_batch_tokens)


def ceiling_record(spec: EngineSpec, precision: str, info: dict, ceils: list[dict],
                    progress: Callable[[str], None]) -> dict[str, Any]:
    """Engine-only runs made at the same time (one per worker process; ``ceils``): throughputs summed."""
    info["gpu_memory_mib"] = ceils[0].pop("gpu_memory_mib")
    if info["gpu_memory_mib"] is not None:
        info["gpu_memory_note"] = "memory one engine added on its GPU at load (weights, graphs, buffers)"
    c0 = ceils[0]
    total = round(sum(c["throughput"] for c in ceils), 1)
    progress(f"{spec.name}/{precision} engine only, batches up to {c0['batch_size']} x {c0['seq_len']} tokens"
             f"{f', {len(ceils)} processes at once' if len(ceils) > 1 else ''}: {total:.0f}/s "
             f"({c0['median_ms']:.2f} ms per batch)")
    return {"engine": spec.name, "precision": precision, "batched": True, "concurrency": None, "engine_only": True,
            "throughput": total, "p50_ms": c0["median_ms"], "p99_ms": None, "batch_size": c0["batch_size"],
            "seq_len": c0["seq_len"], "calls": sum(c["calls"] for c in ceils), "processes": len(ceils)}
