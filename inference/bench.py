"""Encoder throughput and latency per engine, batched against unbatched, and the engine-only ceiling
(``healthbot bench``).

For each engine benched (default: the engine ``inference.engine_order`` selects
here; ``--engines onnxruntime:fp32,onnxruntime:int8,torch_cuda`` for several),
one pool is loaded (``inference.workers`` engines per device) and driven through
the real front end, tokenization included: ``concurrency`` clients each call
``Encoder.encode([one question])`` in a loop, as the dispatcher does, with

- the configured batcher (``batched``), and
- the same batcher with ``max_batch_size = 1`` (``batched: false``),

at concurrency 1, 32 and 256, each run for ``run_seconds``; then the engine
alone (``engine.infer`` on its worker thread, no asyncio, no tokenizer) on a
the batches the batcher would form from the same questions all queued at once
(grouped by length bucket, up to the batched size): the ceiling the pool is compared to.
GPU memory of the engine (``gpu_memory_bytes`` of engines that report it) is
recorded where CUDA exists.

Output: a table (:func:`format_table`), the JSON form
``{"runs": [{"engine", "precision", "batched", "concurrency", "throughput",
"p50_ms", "p99_ms", ...}], ...}`` with engine-only runs marked
``"engine_only": true``, and a PNG plot (:func:`write_plot`, needs matplotlib).

On a 2-core CPU the default bench (one engine, 6 runs of 4 s + the ceiling)
takes about 40 s. Run: ``python -m inference.bench [--json] [--plot FILE.png]
[--engines ...] [--seconds S] [--loop auto|asyncio|uvloop] [--memory N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from inference.config import InferenceConfig
from inference.batcher import BusyError, DeadlineExceeded
from inference.encoder import Encoder, apply_process_settings, batcher_for, require_prepared
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


def _percentiles(lat_ms: list[float]) -> tuple[float, float]:
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
    p50, p99 = _percentiles(latencies_ms)
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
    from inference.batcher import bucket_for

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


def ceiling_run(batches: list[list[Sequence[int]]], pad_id: int, seconds: float) -> Callable[[Any], dict[str, Any]]:
    """A function for a pool worker's thread: ``engine.infer`` over ``batches``
    (padded once, beforehand) in a loop for ``seconds``; returns ``{"batch_size",
    "seq_len", "calls", "median_ms" (per batch), "throughput" (windows/s), "gpu_memory_mib"}``."""
    from inference.pool import pad_batch

    padded = [pad_batch(b, pad_id) for b in batches]
    windows = sum(ids.shape[0] for ids, _ in padded)

    def run(engine: Any) -> dict[str, Any]:
        for ids, mask in padded[:3]:
            engine.infer(ids, mask)
        rounds = 0
        t0 = time.perf_counter()
        stop = t0 + seconds
        while time.perf_counter() < stop or rounds < 1:
            for ids, mask in padded:
                engine.infer(ids, mask)
            rounds += 1
        elapsed = time.perf_counter() - t0
        return {"batch_size": max(ids.shape[0] for ids, _ in padded),
                "seq_len": "/".join(sorted({str(ids.shape[1]) for ids, _ in padded}, key=int)),
                "calls": rounds * len(padded), "median_ms": round(elapsed / (rounds * len(padded)) * 1000.0, 3),
                "throughput": round(rounds * windows / elapsed, 1),
                "gpu_memory_mib": (round(engine.gpu_memory_bytes / 2**20, 1)
                                   if getattr(engine, "gpu_memory_bytes", None) else None)}

    return run


async def bench_engine(spec: EngineSpec, cfg: InferenceConfig, engines_dir: Path, tokenizer: Any, *,
                       concurrencies: Sequence[int], run_seconds: float, texts: Sequence[str],
                       ceiling_seconds: float, progress: Callable[[str], None],
                       modes: Sequence[bool] = (True, False)) -> tuple[dict, list[dict]]:
    """Bench one engine (module doc); returns ``(engine info, runs)``.

    Raises:
        EngineError: the engine does not load here.
    """
    from inference.manager import _LOADERS, _call_loader, resolve_devices
    from inference.pool import InferencePool

    ecfg = dataclasses.replace(cfg, onnx_precision=spec.precision or cfg.onnx_precision)
    if ecfg.device_processes:
        return await bench_processes(spec, ecfg, engines_dir, tokenizer, concurrencies=concurrencies,
                                     run_seconds=run_seconds, texts=texts, ceiling_seconds=ceiling_seconds,
                                     progress=progress, modes=modes)
    loader = _LOADERS[spec.name]
    devices = resolve_devices(ecfg.devices, spec.name)
    t0 = time.perf_counter()
    pool = await InferencePool.start(
        lambda d=None: _call_loader(loader, ecfg, engines_dir, d), ecfg.workers, tokenizer.pad_id, devices=devices)
    load_s = time.perf_counter() - t0
    apply_process_settings(cfg)  # as Encoder.create does (gc.freeze, GIL switch interval)
    precision = pool.precision
    info: dict[str, Any] = {"engine": spec.name, "precision": precision, "workers": pool.workers,
                            "devices": ["cpu" if d is None else f"cuda:{d}" for d in pool.devices],
                            "load_seconds": round(load_s, 2)}
    runs: list[dict] = []
    try:
        batched_bs = min(ecfg.gpu_max_batch_size if pool.on_gpu else ecfg.max_batch_size, pool.max_batch_size)
        for batched in modes:
            bcfg = ecfg if batched else dataclasses.replace(ecfg, max_batch_size=1, gpu_max_batch_size=1)
            enc = Encoder(tokenizer, pool, batcher_for(bcfg, pool, tokenizer))
            try:
                for text in texts[:WARMUP_REQUESTS]:
                    await enc.encode([text])
                for c in concurrencies:
                    r = await drive(lambda t, enc=enc: enc.encode([t]), texts, c, run_seconds, enc.batcher)
                    runs.append(_served_record(spec, precision, batched, c, r, enc.batcher.max_batch_size,
                                               enc.batcher.max_queue_delay_ms, progress))
            finally:
                await enc.batcher.close()
        if ceiling_seconds > 0:
            batches = _ceiling_batches_for(tokenizer, texts, batched_bs, ecfg.max_batch_tokens)
            ceil = await pool.call_on_worker(ceiling_run(batches, tokenizer.pad_id, ceiling_seconds))
            runs.append(_ceiling_record(spec, precision, info, [ceil], progress))
    finally:
        await pool.close()
    return info, runs


def _mean_batch(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Mean rows per batch between two ``(batches, rows)`` counts (0.0 when no batch ran)."""
    batches, rows = after[0] - before[0], after[1] - before[1]
    return round(rows / batches, 2) if batches > 0 else 0.0


def _served_record(spec: EngineSpec, precision: str, batched: bool, concurrency: int, r: dict[str, Any],
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


def _ceiling_batches_for(tokenizer: Any, texts: Sequence[str], batch_size: int,
                         max_batch_tokens: int) -> list[list[Sequence[int]]]:
    windows = [w for per in tokenizer.encode_batch(list(texts)) for w in per]
    windows = [windows[i % len(windows)] for i in range(max(4 * batch_size, len(windows)))]
    return ceiling_batches(windows, batch_size, max_batch_tokens)


def _ceiling_record(spec: EngineSpec, precision: str, info: dict, ceils: list[dict],
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


async def bench_processes(spec: EngineSpec, cfg: InferenceConfig, engines_dir: Path, tokenizer: Any, *,
                          concurrencies: Sequence[int], run_seconds: float, texts: Sequence[str],
                          ceiling_seconds: float, progress: Callable[[str], None],
                          modes: Sequence[bool] = (True, False)) -> tuple[dict, list[dict]]:
    """:func:`bench_engine` with ``inference.device_processes`` ≥ 1: the clients here call
    :meth:`ProcessPoolEncoder.encode`, the worker processes tokenize, batch and run the
    engine; the ceiling is every worker process's engine running alone at the same
    time (no tokenizer, no batcher), summed.

    Raises:
        EngineError: a worker process could not load the engine.
    """
    from inference.process_pool import ProcessPoolEncoder

    pcfg = dataclasses.replace(cfg, engine_order=[spec.name], fallback_engine="")
    info: dict[str, Any] = {}
    runs: list[dict] = []
    for batched in modes:
        bcfg = pcfg if batched else dataclasses.replace(pcfg, max_batch_size=1, gpu_max_batch_size=1)
        t0 = time.perf_counter()
        enc = await ProcessPoolEncoder.create(bcfg, engines_dir)
        try:
            precision = enc.info["precision"]
            if not info:
                info = {"engine": spec.name, "precision": precision, "processes": len(enc.workers),
                        "workers": sum(int(w.info["engines"]) for w in enc.workers),
                        "devices": [w.label for w in enc.workers], "load_seconds": round(time.perf_counter() - t0, 2)}
            for text in texts[:WARMUP_REQUESTS]:
                await enc.encode([text])
            for c in concurrencies:
                b0, s0 = await enc.batch_stats(), await enc.server_stats()
                r = await drive(lambda t, enc=enc: enc.encode([t]), texts, c, run_seconds)
                b1, s1 = await enc.batch_stats(), await enc.server_stats()
                r["mean_batch_size"] = _mean_batch(b0, b1)
                if enc.servers:  # the GPU's batches: the workers' batches merged in the engine server
                    r["mean_engine_batch_size"] = _mean_batch(s0, s1)
                runs.append(_served_record(spec, precision, batched, c, r, enc.info["max_batch_size"],
                                           bcfg.max_queue_delay_ms, progress, processes=len(enc.workers)))
            if batched and ceiling_seconds > 0:
                batches = _ceiling_batches_for(tokenizer, texts, int(enc.info["max_batch_size"]), bcfg.max_batch_tokens)
                ceils = await asyncio.gather(*(enc.call(w, "engine_only", batches=batches, pad_id=tokenizer.pad_id,
                                                        seconds=ceiling_seconds) for w in enc.workers))
                runs.append(_ceiling_record(spec, precision, info, list(ceils), progress))
        finally:
            await enc.close()
    return info, runs


async def run_scaling(cfg: InferenceConfig, engines_dir: Path, spec: EngineSpec | str,
                      concurrency_per_device: int = 256, run_seconds: float = DEFAULT_RUN_SECONDS,
                      texts: Sequence[str] = QUESTIONS,
                      progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Throughput on 1 device against all of ``cfg.devices`` (issue 9): the batched pool at
    ``concurrency_per_device`` × devices clients (a closed loop keeps each device as busy
    as the one-device run), same config otherwise.

    Returns:
        ``{"engine", "device_processes", "runs": [{"devices", "concurrency", "throughput",
        "p50_ms", "p99_ms", "errors", ...}], "speedup"}`` (all devices / one device).

    Raises:
        EngineError: the engine does not load, or fewer than 2 devices are visible.
    """
    from inference.manager import resolve_devices
    from inference.tokenizer import E5Tokenizer

    emit = progress or (lambda line: None)
    spec = EngineSpec.parse(spec) if isinstance(spec, str) else spec
    if spec.name not in GPU_ENGINES:
        raise EngineError(f"scaling compares GPUs: {spec.name} runs on the CPU (use --engines torch_cuda or tensorrt)")
    devices = resolve_devices(cfg.devices, spec.name)
    if len(devices) < 2:
        raise EngineError(f"scaling needs 2 or more GPUs; {spec.name} sees {len(devices)} (inference.devices)")
    tokenizer = await asyncio.to_thread(E5Tokenizer.load, Path(engines_dir))
    runs = []
    for k in (1, len(devices)):
        kcfg = dataclasses.replace(cfg, devices=[str(d) for d in devices[:k]])
        c = concurrency_per_device * k
        info, r = await bench_engine(spec, kcfg, Path(engines_dir), tokenizer, concurrencies=(c,),
                                     run_seconds=run_seconds, texts=texts, ceiling_seconds=0.0, progress=emit,
                                     modes=(True,))
        runs.append({"devices": k, "device_list": info["devices"], **r[0]})
    speedup = round(runs[-1]["throughput"] / runs[0]["throughput"], 2) if runs[0]["throughput"] else 0.0
    emit(f"{spec.name}: {len(devices)} devices {runs[-1]['throughput']:.0f}/s (p99 {runs[-1]['p99_ms']:.2f} ms) vs "
         f"1 device {runs[0]['throughput']:.0f}/s (p99 {runs[0]['p99_ms']:.2f} ms): {speedup}x")
    return {"engine": spec.name, "device_processes": cfg.device_processes, "workers": cfg.workers,
            "max_queue_delay_ms": cfg.max_queue_delay_ms, "runs": runs, "speedup": speedup}


def default_engines(cfg: InferenceConfig) -> list[EngineSpec]:
    """The engine ``inference.engine_order`` would select here (GPU engines only where a GPU is visible)."""
    from inference.manager import _gpu_visible

    for name in cfg.engine_order:
        if name in GPU_ENGINES and not _gpu_visible():
            continue
        if name == "tensorrt":
            with contextlib.suppress(ImportError):
                import tensorrt  # noqa: F401

                return [EngineSpec(name)]
            continue
        return [EngineSpec(name)]
    return [EngineSpec("onnxruntime")]


async def run_bench(cfg: InferenceConfig, engines_dir: Path, concurrencies: Sequence[int] = DEFAULT_CONCURRENCIES,
                    run_seconds: float = DEFAULT_RUN_SECONDS, texts: Sequence[str] = QUESTIONS,
                    engines: Sequence[EngineSpec | str] | None = None, ceiling_seconds: float = CEILING_SECONDS,
                    progress: Callable[[str], None] | None = None, modes: Sequence[bool] = (True, False),
                    **_ignored: Any) -> dict[str, Any]:
    """Bench each engine (module doc).

    Args:
        cfg: the inference config (engine order, workers, devices, batcher knobs).
        engines_dir: the prepared model folder.
        concurrencies: concurrent clients per run.
        run_seconds: seconds per run.
        texts: questions, cycled.
        engines: what to bench (:class:`EngineSpec` or ``"onnxruntime:int8"``);
            default :func:`default_engines`. An engine that does not load is
            reported under ``"skipped"``.
        ceiling_seconds: seconds of each engine-only run.
        progress: called with one line per finished run.
        modes: ``(True, False)``: batched and unbatched (max batch 1) runs.

    Returns:
        ``{"machine": {...}, "batcher": {...}, "engines": [{engine, precision, workers,
        devices, load_seconds, gpu_memory_mib}], "skipped": {name: reason},
        "runs": [{"engine", "precision", "batched", "concurrency", "engine_only",
        "throughput" (encodes/s), "p50_ms", "p99_ms", "requests", "errors",
        "seconds", "mean_batch_size", ...}]}``.

    Raises:
        FileNotFoundError: the model is not prepared.
    """
    from inference.tokenizer import E5Tokenizer

    emit = progress or (lambda line: None)
    engines_dir = Path(engines_dir)
    require_prepared(engines_dir)
    specs = [EngineSpec.parse(e) if isinstance(e, str) else e for e in (engines or default_engines(cfg))]
    tokenizer = await asyncio.to_thread(E5Tokenizer.load, engines_dir)
    t0 = time.perf_counter()
    infos, runs, skipped = [], [], {}
    for spec in specs:
        try:
            info, r = await bench_engine(spec, cfg, engines_dir, tokenizer, concurrencies=concurrencies,
                                         run_seconds=run_seconds, texts=texts, ceiling_seconds=ceiling_seconds,
                                         progress=emit, modes=modes)
        except EngineError as exc:
            skipped[spec.name + (f":{spec.precision}" if spec.precision else "")] = str(exc)
            emit(f"{spec.name}: skipped ({exc})")
            continue
        infos.append(info)
        runs += r
    loop = asyncio.get_running_loop()
    return {
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "event_loop": f"{type(loop).__module__}.{type(loop).__name__}",
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), **_gpu_info()},
        "batcher": {"max_batch_size": cfg.max_batch_size, "gpu_max_batch_size": cfg.gpu_max_batch_size,
                    "max_batch_tokens": cfg.max_batch_tokens, "max_queue_delay_ms": cfg.max_queue_delay_ms,
                    "workers": cfg.workers, "device_processes": cfg.device_processes,
                    "engine_server": cfg.engine_server, "intra_op_threads": cfg.intra_op_threads,
                    "switch_interval_ms": round(sys.getswitchinterval() * 1000.0, 3)},
        "run_seconds": run_seconds,
        "total_seconds": round(time.perf_counter() - t0, 1),
        "engines": infos,
        "skipped": skipped,
        "runs": runs,
    }


def _gpu_info() -> dict[str, Any]:
    if "torch" not in sys.modules:
        return {}
    torch = sys.modules["torch"]
    with contextlib.suppress(Exception):
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            return {"gpu": p.name, "gpus": torch.cuda.device_count(), "gpu_memory_gib": round(p.total_memory / 2**30, 1)}
    return {}


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


# --------------------------------------------------------------------------- memory check
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


# --------------------------------------------------------------------------- CLI
def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``bench`` options (for ``healthbot bench`` and ``python -m inference.bench``)."""
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--plot", metavar="FILE.png", help="write a throughput / p99 plot (needs matplotlib)")
    ap.add_argument("--engines", help="comma list: onnxruntime[:fp32|int8], torch_cuda, tensorrt "
                                      "(default: the engine inference.engine_order selects here)")
    ap.add_argument("--seconds", type=float, default=DEFAULT_RUN_SECONDS, help="seconds per run")
    ap.add_argument("--concurrency", default=",".join(map(str, DEFAULT_CONCURRENCIES)),
                    help="comma list of concurrent clients")
    ap.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                    help="event loop (auto: uvloop when installed)")
    ap.add_argument("--batched-only", action="store_true", help="skip the unbatched (max batch 1) runs")
    ap.add_argument("--scaling", action="store_true",
                    help="instead: batched throughput on 1 GPU against all GPUs of inference.devices, with "
                         "the last --concurrency value of clients per GPU")
    ap.add_argument("--memory", type=int, metavar="N", default=0,
                    help="instead: RSS over N encodes of random lengths 1..512 (the memory check)")


def loop_factory(kind: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``uvloop.new_event_loop`` for ``uvloop`` (and ``auto`` when installed), else None (asyncio's).

    Raises:
        ImportError: ``uvloop`` asked for but not installed.
    """
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise
        return None
    return uvloop.new_event_loop


def run_async(coro: Any, factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> Any:
    """``asyncio.run(coro)`` on a loop from ``factory`` (Python 3.11's ``asyncio.run``
    has no ``loop_factory``; ``asyncio.Runner`` does)."""
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def run_cli(args: argparse.Namespace, cfg: InferenceConfig, engines_dir: Path) -> int:
    """Run the bench from parsed :func:`add_arguments` options; prints table or JSON. Exit code 0."""
    progress = (lambda line: print(line, file=sys.stderr, flush=True))
    factory = loop_factory(args.loop)
    if args.memory:
        result = run_async(memory_check(cfg, engines_dir, args.memory, progress=progress), factory)
        print(json.dumps(result))
        return 0
    engines = [EngineSpec.parse(e) for e in args.engines.split(",")] if args.engines else None
    concs = tuple(int(c) for c in str(args.concurrency).split(","))
    if args.scaling:
        spec = (engines or default_engines(cfg))[0]
        try:
            result = run_async(run_scaling(cfg, engines_dir, spec, concs[-1], args.seconds, progress=progress), factory)
        except EngineError as exc:
            print(f"scaling: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(result, ensure_ascii=False) if args.json else format_scaling(result))
        return 0
    modes = (True,) if args.batched_only else (True, False)
    result = run_async(run_bench(cfg, engines_dir, concs, args.seconds, engines=engines, progress=progress,
                                 modes=modes), factory)
    print(json.dumps(result, ensure_ascii=False) if args.json else format_table(result))
    if args.plot:
        print(f"plot: {write_plot(result, args.plot)}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m inference.bench [options]`` with the effective config (TOML + ``HEALTHBOT_*``)."""
    from bot.config import load_config

    ap = argparse.ArgumentParser(description="encoder throughput and latency per engine")
    ap.add_argument("--config", help="TOML config file (default: $HEALTHBOT_CONFIG)")
    add_arguments(ap)
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    from bot.logs import configure_logging

    configure_logging("WARNING", "console")
    return run_cli(args, cfg.inference, cfg.engines_path)


if __name__ == "__main__":
    sys.exit(main())
