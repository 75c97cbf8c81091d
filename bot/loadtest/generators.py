"""The open loop sent by several processes: ``healthbot loadtest --rate R --generators N``.

One load-generator process costs about 1.3-1.9 ms of CPU a message (aiohttp client, WeChat
signing, XML), so one process cannot offer more than a few hundred messages a second: past
that its own lag, not the server, would set the latencies. Here N processes (spawned, so no
event loop or connection is inherited) each run :func:`~bot.loadtest.openloop.run_open_loop` at
``R / N`` messages/s with their own seed and OpenIDs, from one shared start time; the parent
merges their samples into one :class:`~bot.loadtest.openloop.OpenLoopResult` (percentiles over
all messages, not an average of percentiles) and measures the server's CPU over the whole run.
The generators' own CPU is summed into the result's client CPU.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

import aiohttp

from bot.loadtest.cpu import CpuMeter, own_cpu_s
from bot.loadtest.openloop import OpenLoopConfig, OpenLoopResult, OpenSample, run_open_loop, validate_open
from bot.loadtest.traffic import check_ready

__all__ = ["MAX_GENERATORS", "START_DELAY_S", "run_generators"]

#: Seconds from spawning the generators to their first send (a spawned Python imports the load
#: test in about a second on a slow core).
START_DELAY_S = 4.0
MAX_GENERATORS = 64


def _generate(cfg: OpenLoopConfig) -> tuple[list[tuple[float, float, str, str, float]], int, float]:
    """One generator process: its samples as tuples, its most messages in flight, its CPU seconds."""
    started_s = own_cpu_s()
    result = asyncio.run(run_open_loop(cfg))
    samples = [(s.at_s, s.latency_s, s.outcome, s.kind, s.lag_s) for s in result.samples]
    return samples, result.max_in_flight, own_cpu_s() - started_s


async def run_generators(cfg: OpenLoopConfig, generators: int, progress: Any = None) -> OpenLoopResult:
    """Run ``cfg``'s open loop from ``generators`` processes (module doc).

    Raises:
        ValueError: ``generators`` outside [1, :data:`MAX_GENERATORS`], or a bound of ``cfg`` broken;
        RuntimeError: no server or not ready.
    """
    if not 1 <= generators <= MAX_GENERATORS:
        raise ValueError(f"--generators must be in [1, {MAX_GENERATORS}], not {generators}")
    if generators == 1:
        return await run_open_loop(cfg, progress)
    base = validate_open(cfg)
    start_at = time.time() + START_DELAY_S
    parts = [replace(cfg, rate=cfg.rate / generators, seed=cfg.seed * 1000 + i, server_pid=None, start_at=start_at)
             for i in range(generators)]
    loop = asyncio.get_running_loop()
    result = OpenLoopResult(cfg, duration_s=cfg.seconds)
    async with aiohttp.ClientSession(base_url=base) as http:
        await check_ready(http, base)
        meter = CpuMeter(cfg.server_pid, http)
        with ProcessPoolExecutor(generators, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [loop.run_in_executor(pool, _generate, part) for part in parts]
            await asyncio.sleep(max(0.0, start_at - time.time()))
            await meter.start()
            if progress is not None:
                progress(f"  {generators} generators at {cfg.rate / generators:g} messages/s each")
            done = await asyncio.gather(*futures)
            cpu = await meter.stop()
    client_s = 0.0
    for samples, in_flight, used_s in done:
        result.samples.extend(OpenSample(*s) for s in samples)
        result.max_in_flight += in_flight
        client_s += used_s
    result.samples.sort(key=lambda s: s.at_s)
    if cpu is not None:
        result.cpu = replace(cpu, client_s=client_s,
                             source=f"{cpu.source}; client: {generators} generator processes")
    return result
