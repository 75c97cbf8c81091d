"""The bench runs: one engine's pool through the real front end and its engine-only ceiling
(:func:`bench_engine`), worker processes (:func:`bench_processes`), one GPU against all
(:func:`run_scaling`), and the whole bench (:func:`run_bench`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from inference.config import InferenceConfig
from inference.devices import gpu_visible, resolve_devices
from inference.encoder import Encoder, apply_process_settings, batcher_for
from inference.engines.base import EngineError
from inference.engines.loader import LOADERS, call_loader
from inference.model.questions import QUESTIONS
from inference.model_files import require_prepared
from inference.pool import InferencePool
from inference.multiproc.router import ProcessPoolEncoder
from inference.multiproc.worker import ceiling_run
from inference.tokenizer import E5Tokenizer
from inference.bench.load import (CEILING_SECONDS, DEFAULT_CONCURRENCIES, DEFAULT_RUN_SECONDS, GPU_ENGINES,
                                  WARMUP_REQUESTS, EngineSpec, ceiling_batches_for, ceiling_record, drive, mean_batch,
                                  served_record)


async def bench_engine(spec: EngineSpec, cfg: InferenceConfig, engines_dir: Path, tokenizer: Any, *,
                       concurrencies: Sequence[int], run_seconds: float, texts: Sequence[str],
                       ceiling_seconds: float, progress: Callable[[str], None],
                       modes: Sequence[bool] = (True, False)) -> tuple[dict, list[dict]]:
    """Bench one engine (module doc); returns ``(engine info, runs)``.

    Raises:
        EngineError: the engine does not load here.
    """
    ecfg = dataclasses.replace(cfg, onnx_precision=spec.precision or cfg.onnx_precision)
    if ecfg.device_processes:
        return await bench_processes(spec, ecfg, engines_dir, tokenizer, concurrencies=concurrencies,
                                     run_seconds=run_seconds, texts=texts, ceiling_seconds=ceiling_seconds,
                                     progress=progress, modes=modes)
    loader = LOADERS[spec.name]
    devices = resolve_devices(ecfg.devices, spec.name)
    t0 = time.perf_counter()
    pool = await InferencePool.start(
        lambda d=None: call_loader(loader, ecfg, engines_dir, d), ecfg.workers, tokenizer.pad_id, devices=devices)
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
                    runs.append(served_record(spec, precision, batched, c, r, enc.batcher.max_batch_size,
                                               enc.batcher.max_queue_delay_ms, progress))
            finally:
                await enc.batcher.close()
        if ceiling_seconds > 0:
            batches = ceiling_batches_for(tokenizer, texts, batched_bs, ecfg.max_batch_tokens)
            ceil = await pool.call_on_worker(ceiling_run(batches, tokenizer.pad_id, ceiling_seconds))
            runs.append(ceiling_record(spec, precision, info, [ceil], progress))
    finally:
        await pool.close()
    return info, runs


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
                r["mean_batch_size"] = mean_batch(b0, b1)
                if enc.servers:  # the GPU's batches: the workers' batches merged in the engine server
                    r["mean_engine_batch_size"] = mean_batch(s0, s1)
                runs.append(served_record(spec, precision, batched, c, r, enc.info["max_batch_size"],
                                           bcfg.max_queue_delay_ms, progress, processes=len(enc.workers)))
            if batched and ceiling_seconds > 0:
                batches = ceiling_batches_for(tokenizer, texts, int(enc.info["max_batch_size"]), bcfg.max_batch_tokens)
                ceils = await asyncio.gather(*(enc.call(w, "engine_only", batches=batches, pad_id=tokenizer.pad_id,
                                                        seconds=ceiling_seconds) for w in enc.workers))
                runs.append(ceiling_record(spec, precision, info, list(ceils), progress))
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

    for name in cfg.engine_order:
        if name in GPU_ENGINES and not gpu_visible():
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
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), **gpu_info()},
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


def gpu_info() -> dict[str, Any]:
    if "torch" not in sys.modules:
        return {}
    torch = sys.modules["torch"]
    with contextlib.suppress(Exception):
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            return {"gpu": p.name, "gpus": torch.cuda.device_count(), "gpu_memory_gib": round(p.total_memory / 2**30, 1)}
    return {}
