"""The memory check: resident memory over many encodes of random lengths (``healthbot bench --memory N``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from inference.config import InferenceConfig
from inference.encoder import Encoder


def rss_bytes() -> int:
    """Resident set size of this process in bytes (``VmRSS`` of /proc/self/status; 0 elsewhere)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


#: The memory check samples RSS every this many encodes.
MEMORY_SAMPLE_EVERY = 500


async def memory_check(cfg: InferenceConfig, engines_dir: Path, encodes: int = 10_000, concurrency: int = 32,
                       seed: int = 0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """RSS over ``encodes`` windows of random lengths 1..512 through the configured encoder.

    Each window has a uniformly random length (2..512 ids, ``<s>``/``</s>``
    included, i.e. 0..510 content tokens of random ids), submitted by
    ``concurrency`` clients through the batcher, so the engine sees a new
    (batch, length) shape on nearly every call. RSS is sampled every
    :data:`MEMORY_SAMPLE_EVERY` encodes.

    Returns:
        ``{"encodes", "seconds", "rss_mib": [samples], "first_mib", "last_mib",
        "max_mib", "trend_second_half_mib_per_1000" (:func:`rss_trend` over the second
        half), "engine", "precision"}``.
    """
    emit = progress or (lambda line: None)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 513, encodes)
    windows = [[0] + rng.integers(5, 250_000, int(n) - 2).tolist() + [2] for n in lengths]
    encoder = await Encoder.create(cfg, engines_dir)
    precision = await encoder.pool.call_on_worker(lambda e: getattr(e, "precision", "?"))
    samples: list[float] = [rss_bytes() / 2**20]
    done = 0
    next_i = 0
    t0 = time.perf_counter()

    async def client() -> None:
        nonlocal done, next_i
        while next_i < encodes:
            i = next_i
            next_i += 1
            await encoder.batcher.submit(windows[i], deadline_ms=600_000)
            done += 1
            if done % MEMORY_SAMPLE_EVERY == 0:
                samples.append(rss_bytes() / 2**20)
                emit(f"{done} encodes, RSS {samples[-1]:.0f} MiB, {done / (time.perf_counter() - t0):.1f}/s")

    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        await encoder.close()
    return {"engine": encoder.engine_name, "precision": precision, "encodes": encodes,
            "seconds": round(time.perf_counter() - t0, 1), "rss_mib": [round(s, 1) for s in samples],
            "first_mib": round(samples[0], 1), "last_mib": round(samples[-1], 1), "max_mib": round(max(samples), 1),
            "trend_second_half_mib_per_1000": round(rss_trend(samples[len(samples) // 2:], MEMORY_SAMPLE_EVERY), 2),
            "mean_tokens": float(lengths.mean())}


def rss_trend(samples_mib: Sequence[float], every: int) -> float:
    """Least-squares slope of RSS samples taken every ``every`` encodes, in MiB per 1,000
    encodes (0.0 for fewer than 3 samples). A fitted slope, not last minus first: single RSS
    samples of the CPU engine scatter by ±50 MiB with the batch in progress
    (docs/benchmarks.md), so two samples' difference says nothing about growth."""
    if len(samples_mib) < 3:
        return 0.0
    x = np.arange(len(samples_mib), dtype=np.float64) * every / 1000.0
    return float(np.polyfit(x, np.asarray(samples_mib, dtype=np.float64), 1)[0])
