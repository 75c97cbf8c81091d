"""Encoder throughput and latency, batched against unbatched (``healthbot bench``).

One pool (the configured engine and workers) is loaded once; two batchers run
over it: the configured one, and one with ``max_batch_size = 1`` (batching off).
Each is driven by 1 and by 32 concurrent clients, every client encoding one short
health question at a time, as the dispatcher does. Each run is bounded both in
requests and in seconds so the whole bench stays near a minute on 2 cores.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bot.config import InferenceConfig
from inference.batcher import BusyError, DeadlineExceeded
from inference.encoder import Encoder, batcher_for
from inference.engines.base import EngineError

#: A realistic mix of what users send: short Chinese and English everyday health
#: questions, a few words to two sentences (written for this bench).
QUESTIONS: tuple[str, ...] = (
    "失眠怎么办",
    "手脚冰凉怎么办",
    "每天凌晨三四点就醒，醒了就睡不着，正常吗",
    "晚上老做梦，早上起来很累",
    "喝绿茶会影响睡眠吗",
    "经常口腔溃疡是缺什么维生素",
    "秋天皮肤干燥怎么保养",
    "久坐腰疼有什么好的锻炼方法",
    "饭后散步多久比较好",
    "感冒了可以洗澡吗",
    "早上空腹喝蜂蜜水好不好",
    "老人便秘吃什么水果好",
    "眼睛干涩，每天看电脑十个小时，有什么办法缓解",
    "泡脚水温多少合适，泡多久",
    "孩子不爱吃蔬菜怎么办",
    "最近总是没精神，白天犯困",
    "冬天怎么进补比较好",
    "喝骨头汤能补钙吗",
    "how much water should I drink a day",
    "why do my hands and feet always feel cold",
    "is it bad to drink coffee after 4pm",
    "how long should a power nap be",
    "I keep waking up at 3am and can't fall back asleep, any tips?",
    "best stretches for lower back pain from sitting all day",
    "does eating late at night cause weight gain",
    "how can I reduce stress before exams",
    "is walking 10000 steps a day really necessary",
    "what foods help with constipation",
    "my eyes feel dry after staring at screens all day",
    "can I exercise when I have a cold",
    "头疼 睡不好 有点焦虑",
    "tips for better sleep hygiene",
)

DEFAULT_CONCURRENCIES = (1, 32)
#: Requests per run, at most.
DEFAULT_REQUESTS = 300
#: Seconds per run, at most (4 runs + model load + warm-up stay near a minute).
DEFAULT_RUN_SECONDS = 10.0
WARMUP_REQUESTS = 8


async def _drive(encoder: Encoder, concurrency: int, requests: int, run_seconds: float,
                 texts: Sequence[str]) -> dict[str, Any]:
    """``concurrency`` clients, one question per encode, until ``requests`` done or time is up."""
    latencies_ms: list[float] = []
    errors = 0
    issued = 0
    stop_at = time.perf_counter() + run_seconds

    async def client() -> None:
        nonlocal issued, errors
        while issued < requests and time.perf_counter() < stop_at:
            text = texts[issued % len(texts)]
            issued += 1
            t0 = time.perf_counter()
            try:
                await encoder.encode([text])
            except (BusyError, DeadlineExceeded, EngineError):
                errors += 1
                continue
            latencies_ms.append((time.perf_counter() - t0) * 1000.0)

    stats = encoder.batcher.stats
    batches0, reqs0 = stats.batches_run, stats.requests_run
    t_start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t_start
    batches = stats.batches_run - batches0
    lat = np.asarray(latencies_ms) if latencies_ms else np.zeros(1)
    return {
        "requests": len(latencies_ms),
        "errors": errors,
        "seconds": round(elapsed, 3),
        "throughput": round(len(latencies_ms) / elapsed, 1) if elapsed > 0 else 0.0,
        "p50_ms": round(float(np.percentile(lat, 50)), 2),
        "p99_ms": round(float(np.percentile(lat, 99)), 2),
        "mean_batch_size": round((stats.requests_run - reqs0) / batches, 2) if batches else 0.0,
    }


async def run_bench(cfg: InferenceConfig, engines_dir: Path, concurrencies: Sequence[int] = DEFAULT_CONCURRENCIES,
                    requests: int = DEFAULT_REQUESTS, run_seconds: float = DEFAULT_RUN_SECONDS,
                    texts: Sequence[str] = QUESTIONS) -> dict[str, Any]:
    """Measure the encoder batched (as configured) and unbatched (max_batch_size 1).

    Args:
        cfg: the inference config (engine order, workers, batcher knobs).
        engines_dir: the prepared model folder.
        concurrencies: concurrent clients per run.
        requests: encodes per run, at most.
        run_seconds: seconds per run, at most.
        texts: questions, cycled.

    Returns:
        ``{"engine", "workers", "intra_op_threads", "cpu_count", "batcher": {...},
        "runs": [{"engine", "batched", "concurrency", "throughput" (encodes/s),
        "p50_ms", "p99_ms", "requests", "errors", "seconds", "mean_batch_size"}]}``.

    Raises:
        FileNotFoundError / EngineError: as :meth:`Encoder.create`.
    """
    encoder = await Encoder.create(cfg, engines_dir)
    pool, tokenizer = encoder.pool, encoder.tokenizer
    unbatched = Encoder(tokenizer, pool, batcher_for(dataclasses.replace(cfg, max_batch_size=1), pool))
    runs = []
    try:
        for batched, enc in ((True, encoder), (False, unbatched)):
            for concurrency in concurrencies:
                for text in texts[:WARMUP_REQUESTS]:
                    await enc.encode([text])
                run = await _drive(enc, concurrency, requests, run_seconds, texts)
                runs.append({"engine": pool.engine_name, "batched": batched, "concurrency": concurrency, **run})
    finally:
        await unbatched.batcher.close()
        await encoder.close()
    return {
        "engine": pool.engine_name,
        "workers": pool.workers,
        "intra_op_threads": cfg.intra_op_threads,
        "cpu_count": os.cpu_count(),
        "batcher": {"max_batch_size": encoder.batcher.max_batch_size,
                    "max_batch_tokens": cfg.max_batch_tokens,
                    "max_queue_delay_ms": cfg.max_queue_delay_ms},
        "runs": runs,
    }


def format_table(result: dict[str, Any]) -> str:
    """A plain-text table of :func:`run_bench`'s result, one line per run."""
    b = result["batcher"]
    lines = [
        f"engine {result['engine']}, {result['workers']} worker(s), intra_op_threads {result['intra_op_threads']}, "
        f"{result['cpu_count']} CPU(s); batched = max_batch_size {b['max_batch_size']}, "
        f"max_queue_delay_ms {b['max_queue_delay_ms']}, max_batch_tokens {b['max_batch_tokens']}",
        f"{'engine':<12} {'batched':<8} {'conc':>4} {'encodes/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'batch':>6} {'done':>5} {'errors':>6}",
    ]
    for r in result["runs"]:
        lines.append(f"{r['engine']:<12} {'yes' if r['batched'] else 'no':<8} {r['concurrency']:>4} "
                     f"{r['throughput']:>10.1f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                     f"{r['mean_batch_size']:>6.2f} {r['requests']:>5} {r['errors']:>6}")
    return "\n".join(lines)
