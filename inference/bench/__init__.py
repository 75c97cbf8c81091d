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
takes about 40 s. Run: ``healthbot bench [--json] [--plot FILE.png]
[--engines ...] [--seconds S] [--loop auto|asyncio|uvloop] [--memory N]``.

Modules: :mod:`~inference.bench.load` (clients, ceiling batches, records),
:mod:`~inference.bench.runs`, :mod:`~inference.bench.report`, :mod:`~inference.bench.memory`,
:mod:`~inference.bench.cli`; their public names are importable from here.
"""

from inference.bench.cli import add_arguments, run_cli
from inference.bench.load import (CEILING_SECONDS, DEFAULT_CONCURRENCIES, DEFAULT_RUN_SECONDS, EngineSpec,
                                  ceiling_batches, ceiling_batches_for, drive, mean_batch)
from inference.bench.memory import memory_check, rss_bytes, rss_trend
from inference.bench.report import format_scaling, format_table, summarize, write_plot
from inference.bench.runs import bench_engine, bench_processes, default_engines, run_bench, run_scaling
from inference.multiproc.child import loop_factory, run_async
from inference.model.questions import QUESTIONS
from inference.multiproc.worker import ceiling_run

__all__ = ["add_arguments", "run_cli", "CEILING_SECONDS", "DEFAULT_CONCURRENCIES", "DEFAULT_RUN_SECONDS", "EngineSpec",
           "ceiling_batches", "ceiling_batches_for", "drive", "mean_batch", "memory_check", "rss_bytes", "rss_trend",
           "format_scaling", "format_table", "summarize", "write_plot", "bench_engine", "bench_processes",
           "default_engines", "run_bench", "run_scaling", "loop_factory", "run_async", "QUESTIONS", "ceiling_run"]
