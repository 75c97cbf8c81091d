"""``healthbot bench``: its options and the run they ask for."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from inference.bench.load import DEFAULT_CONCURRENCIES, DEFAULT_RUN_SECONDS, EngineSpec
from inference.bench.memory import memory_check
from inference.bench.report import format_scaling, format_table, write_plot
from inference.bench.runs import default_engines, run_bench, run_scaling
from inference.multiproc.child import loop_factory, run_async
from inference.config import InferenceConfig
from inference.engines.base import EngineError


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
