"""GPU machine only: which worker-process layout serves one GPU best, and what one batch costs.

Not part of the product or CI. Run from the repository root on the GPU machine,
after ``engines/model.onnx`` exists (``tools/gpu_bench.py`` materializes it from
``.gpucarry/``)::

    python3 tools/gpu_layouts.py engine            # host-to-host ms per batch shape
    python3 tools/gpu_layouts.py layouts 2x1 4x1   # P processes x W engines, c = 256
    # with NVIDIA MPS: nvidia-cuda-mps-control -d; ... layouts 4x1 6x1; echo quit | nvidia-cuda-mps-control

``layouts`` drives the same :class:`inference.process_pool.ProcessPoolEncoder`
``healthbot bench`` drives (256 clients, one question per call, 1 s warm-up, 3 s
measured; max queue delay 0, max queue size 8192, GIL switch interval 0.5 ms)
and prints throughput, p50/p99, the workers' mean batch and the routing
process's CPU use (cores). Results of 2026-11-29: docs/benchmarks.md, fourth session.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ENGINES = REPO / "engines"
SHAPES = ((1, 27), (20, 27), (40, 27), (100, 27), (250, 27))


def engine_latency(runs: int = 200) -> None:
    """Median host-to-host time of ``TorchCudaEngine.infer`` per (B, T), graphs replayed."""
    import numpy as np

    from inference.engines.torch_cuda import TorchCudaEngine

    eng = TorchCudaEngine.from_engines_dir(ENGINES)
    print(f"torch_cuda on {eng.device}: {len(eng.graph_shapes)} graphs, {eng.gpu_memory_bytes / 2**20:.0f} MiB, "
          f"loaded in {eng.load_seconds} s")
    for b, t in SHAPES:
        ids = np.random.default_rng(b).integers(5, 1000, size=(b, t)).astype(np.int64)
        mask = np.ones_like(ids)
        mask[b // 4:, t - 7:] = 0
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            eng.infer(ids, mask)
            times.append(time.perf_counter() - t0)
        med = float(np.median(times))
        print(f"  {b:4d} x {t}: {med * 1e3:.3f} ms per batch, {b / med:,.0f} encodes/s")
    eng.close()


async def layout(procs: int, workers: int, concurrency: int = 256, seconds: float = 3.0) -> str:
    """One layout through ProcessPoolEncoder; returns the printed line."""
    from bot.config import InferenceConfig
    from inference import bench
    from inference.process_pool import ProcessPoolEncoder

    cfg = InferenceConfig(device_processes=procs, workers=workers, max_queue_delay_ms=0, max_queue_size=8192,
                          engine_order=["torch_cuda"], fallback_engine="", devices=["0"], switch_interval_ms=0.5)
    pool = await ProcessPoolEncoder.create(cfg, ENGINES)
    try:
        gc.collect()
        gc.freeze()
        await bench.drive(lambda q: pool.encode([q]), bench.QUESTIONS, concurrency, 1.0)
        b0, c0 = await pool.batch_stats(), os.times()
        r = await bench.drive(lambda q: pool.encode([q]), bench.QUESTIONS, concurrency, seconds)
        c1, b1 = os.times(), await pool.batch_stats()
    finally:
        await pool.close()
    batch = (b1[1] - b0[1]) / max(1, b1[0] - b0[0])
    cpu = (c1.user + c1.system - c0.user - c0.system) / seconds
    line = (f"{procs} process(es) x {workers} engine(s), c = {concurrency}: {r['throughput']:,.0f}/s "
            f"p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms, mean batch {batch:.1f}, "
            f"errors {r['errors']}, routing process {cpu:.2f} cores")
    print(line, flush=True)
    return line


def main(argv: list[str]) -> int:
    if argv[:1] == ["engine"]:
        engine_latency()
        return 0
    if argv[:1] == ["layouts"] and argv[1:]:
        from inference import bench

        async def sweep():
            for spec in argv[1:]:
                p, w = (int(x) for x in spec.split("x"))
                await layout(p, w)

        bench.run_async(sweep(), bench.loop_factory("uvloop"))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
