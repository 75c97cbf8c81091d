"""``healthbot build-engine``: the TensorRT engine for this GPU
(:func:`inference.engines.tensorrt.build.build_engine`), or with ``--engine onnxruntime
--precision int8`` the ONNX Runtime INT8 variant (:func:`inference.model.int8.build_int8`)
with its accuracy check."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from inference.engines.tensorrt.build import build_engine
from inference.engines.tensorrt.spec import DEFAULT_MAX_BATCH, BuildError, BuildSpec
from inference.model.accuracy import format_report
from inference.model.int8 import VariantError, build_int8


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``build-engine`` options (shared by ``healthbot build-engine`` and ``-m``)."""
    ap.add_argument("--engine", choices=("tensorrt", "onnxruntime"), default="tensorrt",
                    help="tensorrt: a .engine for this GPU (default); onnxruntime: the INT8 ONNX variant "
                         "(engines/model.int8.onnx, with --precision int8), checked for accuracy")
    ap.add_argument("--engines-dir", type=Path, default=None,
                    help="folder with model.onnx (default: the config's engines_dir, else engines/)")
    ap.add_argument("--onnx", default="model.onnx", help="ONNX file name inside --engines-dir")
    ap.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH)
    ap.add_argument("--precision", choices=("fp16", "fp32", "int8"), default=None,
                    help="tensorrt: fp16 (default), fp32, or int8 (needs an explicitly quantized Q/DQ ONNX); "
                         "onnxruntime: int8 (the default there)")
    ap.add_argument("--single-profile", action="store_true",
                    help="one profile over T 1..512 instead of one per sequence bucket")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if a current engine exists")
    ap.add_argument("--eval", dest="eval_file", type=Path, default=None,
                    help="onnxruntime: labelled JSONL for the eval half of the accuracy check "
                         "(default ../shared/eval/dev.jsonl when present)")
    ap.add_argument("--no-check", action="store_true",
                    help="onnxruntime: skip the accuracy check (the variant is then never used by 'auto')")


def _run_onnxruntime_cli(args: argparse.Namespace, engines_dir: Path) -> int:
    precision = args.precision or "int8"
    if precision != "int8":
        print(f"error: --engine onnxruntime builds the int8 variant only (fp32 is engines/model.onnx from "
              f"'healthbot prepare-model'), not {precision}", file=sys.stderr)
        return 2
    try:
        meta = build_int8(engines_dir, force=args.force, check=not args.no_check, eval_file=args.eval_file,
                          log=lambda event, **kw: print(event, json.dumps(kw, default=str), file=sys.stderr))
    except (VariantError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    acc = meta.get("accuracy")
    if acc:
        print(format_report(acc), file=sys.stderr)
    print(engines_dir / "model.int8.onnx")
    if acc and not acc["passed"]:
        print("the INT8 variant did not pass the accuracy check: inference.onnx_precision=auto keeps FP32",
              file=sys.stderr)
        return 1
    return 0


def run_cli(args: argparse.Namespace) -> int:
    """Build from parsed ``build-engine`` arguments; print the engine path. Exit code 0/1
    (2 for a bad combination of options)."""
    engines_dir = Path(args.engines_dir) if args.engines_dir else Path("engines")
    if getattr(args, "engine", "tensorrt") == "onnxruntime":
        return _run_onnxruntime_cli(args, engines_dir)
    spec = BuildSpec(max_batch_size=args.max_batch, precision=args.precision or "fp16",
                     per_bucket=not args.single_profile)
    try:
        res = build_engine(engines_dir / args.onnx, engines_dir, spec, device=args.device,
                           force=args.force,
                           log=lambda event, **kw: print(event, json.dumps(kw, default=str), file=sys.stderr))
    except (BuildError, ImportError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(res.engine)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m inference.model.build_cli [--force] ...``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
