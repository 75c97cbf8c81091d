"""The accuracy check, one function for every reduced-precision variant (issue 6).

A variant (INT8 ONNX Runtime, FP16 torch_cuda or TensorRT) passes when both hold:

1. **Parity**: on the fixed parity windows (:func:`parity_texts`: the bench
   questions, knowledge-base questions and answers, and two long passages, 122
   texts / 127 windows up to 512 tokens), the cosine between the variant's
   mean-pooled vector and the FP32 ONNX Runtime reference (``engines/model.onnx``
   on the CPU) is at least :data:`MIN_COSINE` of the precision (0.999 FP16,
   0.99 INT8) for every window, run one window per call AND in padded batches
   of 16 (padding and batch contents must not move a vector: per-tensor INT8
   failed exactly there).
2. **Answer quality**: ``healthbot eval FILE`` with the variant gives intent
   accuracy and topic accuracy each within :data:`EVAL_TOLERANCE` (1 point)
   of the same eval with the FP32 model. Both evals run as subprocesses
   (``python -m bot.cli eval FILE --json``) picking the engine with
   ``HEALTHBOT_INFERENCE_*`` overrides, each with fresh data and engines
   directories (the retriever caches knowledge-base vectors keyed by the FP32
   model only: a cached FP32 set would hide the variant's error) and an
   in-memory store.

Run: ``python -m inference.model.accuracy --engine onnxruntime --precision int8
[--eval ../shared/eval/dev.jsonl] [--json]`` (exit 0 when passed, 1 when not);
``healthbot build-engine --engine onnxruntime --precision int8`` runs it after
building and records the report in the variant's sidecar.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from inference.batching.windows import pad_batch
from inference.model.questions import QUESTIONS
from inference.model_files import onnx_sha256_of
from inference.probe import MIN_COSINE, write_reference

REPO = Path(__file__).resolve().parents[2]

EVAL_TOLERANCE = 0.01
"""Intent and topic accuracy may each drop at most 1 point (0.01) against FP32."""

DEFAULT_EVAL_FILE = REPO.parent / "shared" / "eval" / "dev.jsonl"
"""The labelled dev set beside the checkout (../shared/eval/dev.jsonl, 150 lines)."""

PARITY_BATCH = 16
"""Batch size of the padded half of the parity check (windows grouped by length,
as the batcher groups them)."""

REFERENCE_FILE = "parity-reference.npz"
"""FP32 reference vectors cached in the engines folder, keyed by the ONNX sha256
and the parity windows."""

#: ``HEALTHBOT_*`` overrides that make ``healthbot eval`` use one variant.
_EVAL_ENV: dict[tuple[str, str], dict[str, str]] = {
    ("onnxruntime", "fp32"): {"HEALTHBOT_INFERENCE_ENGINE_ORDER": "onnxruntime",
                              "HEALTHBOT_INFERENCE_ONNX_PRECISION": "fp32"},
    ("onnxruntime", "int8"): {"HEALTHBOT_INFERENCE_ENGINE_ORDER": "onnxruntime",
                              "HEALTHBOT_INFERENCE_ONNX_PRECISION": "int8"},
    ("torch_cuda", "fp16"): {"HEALTHBOT_INFERENCE_ENGINE_ORDER": "torch_cuda",
                             "HEALTHBOT_INFERENCE_FALLBACK_ENGINE": ""},
    ("tensorrt", "fp16"): {"HEALTHBOT_INFERENCE_ENGINE_ORDER": "tensorrt",
                           "HEALTHBOT_INFERENCE_FALLBACK_ENGINE": ""},
}


# --------------------------------------------------------------------------- parity set
def parity_texts() -> list[tuple[str, str]]:
    """The fixed parity set as ``(prefix, text)``: the 32 bench questions, up to 2
    questions per language of the first 4 topics of the first 4 knowledge-base
    files, 24 of their answers as passages, and two long passages (~300 and
    ~600 tokens, the second needing 2 windows). Deterministic for a given KB."""
    import yaml

    out = [("query: ", q) for q in QUESTIONS]
    answers: list[str] = []
    for f in sorted((REPO / "bot" / "kb").glob("*.yaml"))[:4]:
        data = yaml.load(f.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader) or {}
        for topic in (data.get("topics") or [])[:4]:
            for lang in ("zh", "en"):
                qs = ((topic.get("questions") or {}).get(lang) or [])[:2]
                out += [("query: ", q) for q in qs]
                a = (topic.get("answer") or {}).get(lang)
                if a:
                    answers.append(a)
    out += [("passage: ", a) for a in answers[:24]]
    out.append(("passage: ", " ".join(answers[:6])))
    out.append(("passage: ", " ".join(answers[:14])))
    return out


def parity_windows(tokenizer: Any, texts: Sequence[tuple[str, str]] | None = None) -> list[list[int]]:
    """Token windows of the parity texts, in order (a long text gives several)."""
    texts = parity_texts() if texts is None else texts
    return [w for prefix, text in texts for w in tokenizer.encode_batch([text], prefix=prefix)[0]]


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of two float[N, D] arrays (float64[N])."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)


def infer_windows(engine: Any, windows: Sequence[Sequence[int]], pad_id: int, batch: int = 1) -> np.ndarray:
    """float32[W, D]: the engine's vectors of ``windows``, ``batch`` at a time (windows
    sorted by length into padded batches when ``batch`` > 1, rows returned in input order)."""
    out = np.empty((len(windows), engine.dim), np.float32)
    order = np.argsort([len(w) for w in windows], kind="stable") if batch > 1 else np.arange(len(windows))
    for s in range(0, len(order), batch):
        rows = order[s:s + batch]
        out[rows] = engine.infer(*pad_batch([windows[r] for r in rows], pad_id))
    return out


def reference_vectors(engines_dir: Path, windows: Sequence[Sequence[int]], pad_id: int) -> np.ndarray:
    """FP32 ONNX Runtime vectors of ``windows`` (one window per call), cached in
    ``engines/parity-reference.npz`` under the ONNX sha256 and a digest of the windows.

    Raises:
        inference.engines.base.EngineError: ``model.onnx`` missing or unloadable.
    """
    from inference.engines.onnxruntime import OnnxRuntimeEngine

    engines_dir = Path(engines_dir)
    onnx_path = engines_dir / "model.onnx"
    digest = hashlib.sha256(json.dumps([list(map(int, w)) for w in windows]).encode()).hexdigest()[:16]
    key = f"{onnx_sha256_of(onnx_path)[:16]}-{digest}" if onnx_path.is_file() else ""
    cache = engines_dir / REFERENCE_FILE
    if key and cache.is_file():
        with np.load(cache) as z:
            if str(z["key"]) == key:
                return z["pooled"]
    eng = OnnxRuntimeEngine(onnx_path)
    try:
        ref = infer_windows(eng, windows, pad_id, batch=1)
    finally:
        eng.close()
    tmp = cache.with_name(f"{cache.stem}.tmp{os.getpid()}.npz")
    np.savez(tmp, key=np.array(key), pooled=ref)
    os.replace(tmp, cache)
    return ref


def write_probe_reference(engines_dir: Path) -> dict[str, Any]:
    """The hot swap's probe reference (inference/probe.py) for the prepared model in ``engines_dir``:
    the FP32 ONNX Runtime vectors of the :func:`parity_texts` that fit one window (120 of 122: the
    two long passages would outlast a serving request's deadline on a busy CPU, and how windows
    combine is code, the same for every model), one per call; blocking, a few seconds on 2 cores.

    Returns:
        the manifest entry (``{"file", "sha256", "texts"}``) to store under ``"probe"``.

    Raises:
        inference.engines.base.EngineError: ``model.onnx`` missing or unloadable.
    """
    from inference.engines.onnxruntime import OnnxRuntimeEngine
    from inference.tokenizer import E5Tokenizer

    engines_dir = Path(engines_dir)
    tok = E5Tokenizer.load(engines_dir)
    texts = [(p, t, w[0]) for p, t in parity_texts() if len(w := tok.encode_batch([t], prefix=p)[0]) == 1]
    eng = OnnxRuntimeEngine(engines_dir / "model.onnx")
    try:
        pooled = infer_windows(eng, [w for _, _, w in texts], tok.pad_id, batch=1)
    finally:
        eng.close()
    return write_reference(engines_dir, [p for p, _, _ in texts], [t for _, t, _ in texts],
                           pooled / np.linalg.norm(pooled, axis=1, keepdims=True))


def parity_check(engine: Any, windows: Sequence[Sequence[int]], reference: np.ndarray, precision: str,
                 pad_id: int = 1) -> dict[str, Any]:
    """Cosine of ``engine``'s vectors to ``reference``, single windows and padded batches.

    Args:
        engine: any :class:`inference.engines.base.Engine`.
        windows: the parity windows (:func:`parity_windows`).
        reference: float32[W, D] FP32 vectors of the same windows.
        precision: ``"fp16"``, ``"int8"``, ... (picks the threshold of :data:`MIN_COSINE`).
        pad_id: the tokenizer's pad id.

    Returns:
        ``{"windows", "min_cosine", "threshold", "passed", "single": {min, mean},
        "batched": {min, mean, batch}, "max_abs_diff", "seconds"}``.
    """
    t0 = time.perf_counter()
    single = infer_windows(engine, windows, pad_id, batch=1)
    batched = infer_windows(engine, windows, pad_id, batch=PARITY_BATCH)
    c1, cb = cosine_rows(single, reference), cosine_rows(batched, reference)
    threshold = MIN_COSINE[precision]
    worst = float(min(c1.min(), cb.min()))
    return {"windows": len(windows), "precision": precision, "threshold": threshold,
            "min_cosine": round(worst, 6), "passed": bool(worst >= threshold),
            "single": {"min": round(float(c1.min()), 6), "mean": round(float(c1.mean()), 6)},
            "batched": {"min": round(float(cb.min()), 6), "mean": round(float(cb.mean()), 6), "batch": PARITY_BATCH},
            "max_abs_diff": round(float(np.abs(batched - reference).max()), 6),
            "seconds": round(time.perf_counter() - t0, 1)}


# --------------------------------------------------------------------------- eval
def eval_env(engine: str, precision: str) -> dict[str, str]:
    """The ``HEALTHBOT_*`` overrides that make the bot use ``engine`` at ``precision``.

    Raises:
        ValueError: no such variant.
    """
    try:
        return dict(_EVAL_ENV[(engine, precision)])
    except KeyError:
        raise ValueError(f"no variant {engine}/{precision}: choose from "
                         f"{sorted(f'{e}/{p}' for e, p in _EVAL_ENV)}") from None


def run_eval(overrides: dict[str, str], eval_file: Path, engines_dir: Path | None = None,
             timeout_s: float = 1800.0) -> dict[str, Any]:
    """``healthbot eval FILE --json`` in a subprocess with ``overrides``; returns its summary dict.

    The subprocess gets a fresh data directory, an in-memory store and a fresh
    engines directory (links to the files of ``engines_dir``, none of its
    caches), so every vector it uses (knowledge-base examples included, which
    the bot caches per FP32 model) is computed by the variant under test.

    Raises:
        RuntimeError: the eval failed (its stderr tail is in the message).
    """
    src = Path(engines_dir) if engines_dir is not None else REPO / "engines"
    with tempfile.TemporaryDirectory(prefix="healthbot-eval-") as tmp:
        data_dir, eng_dir = Path(tmp) / "data", Path(tmp) / "engines"
        eng_dir.mkdir()
        for f in src.iterdir():
            if f.is_file() and not f.name.startswith("."):
                os.symlink(f.resolve(), eng_dir / f.name)
        env = {**os.environ, "HEALTHBOT_DATA_DIR": str(data_dir), "HEALTHBOT_STORE_URL": "memory://",
               "HEALTHBOT_INFERENCE_ENGINES_DIR": str(eng_dir), **overrides}
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "bot.cli", "eval", str(eval_file), "--json"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"healthbot eval with {overrides} failed (exit {p.returncode}): {p.stderr.strip()[-800:]}")
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    return summary


def eval_check(engine: str, precision: str, eval_file: Path, engines_dir: Path | None = None,
               runner: Callable[..., dict[str, Any]] = run_eval) -> dict[str, Any]:
    """Intent and topic accuracy of the variant against FP32 ONNX Runtime on ``eval_file``.

    Returns:
        ``{"file", "fp32": summary, "variant": summary, "intent_delta", "topic_delta",
        "tolerance", "passed"}`` (deltas = variant − FP32, in accuracy fractions).
    """
    base = runner(eval_env("onnxruntime", "fp32"), eval_file, engines_dir)
    var = runner(eval_env(engine, precision), eval_file, engines_dir)
    di = round(var["intent_accuracy"] - base["intent_accuracy"], 4)
    dt = round(var["topic_accuracy"] - base["topic_accuracy"], 4)
    return {"file": str(eval_file), "fp32": base, "variant": var, "intent_delta": di, "topic_delta": dt,
            "tolerance": EVAL_TOLERANCE, "passed": bool(di >= -EVAL_TOLERANCE and dt >= -EVAL_TOLERANCE)}


# --------------------------------------------------------------------------- the check
def make_variant_engine(engines_dir: Path, engine: str, precision: str) -> Any:
    """The engine of one variant, loaded directly (no fallback).

    Raises:
        inference.engines.base.EngineError: it cannot load here (no GPU, file missing).
        ValueError: an unknown variant.
    """
    engines_dir = Path(engines_dir)
    eval_env(engine, precision)  # validates the pair
    if engine == "onnxruntime":
        from inference.engines.onnxruntime import OnnxRuntimeEngine
        from inference.onnx_variants import variant_path

        path = variant_path(engines_dir, precision)
        if not path.is_file():
            from inference.engines.base import EngineError

            raise EngineError(f"{path} missing: run 'healthbot build-engine --engine onnxruntime --precision {precision}'")
        return OnnxRuntimeEngine(path, precision=precision)
    if engine == "torch_cuda":
        from inference.engines.torch_cuda.engine import TorchCudaEngine

        return TorchCudaEngine.from_engines_dir(engines_dir)
    from inference.engines.tensorrt.engine import TensorRTEngine

    return TensorRTEngine(engines_dir, build_missing=False)


def check_accuracy(engines_dir: Path, engine: str = "onnxruntime", precision: str = "int8",
                   eval_file: Path | None = None, log: Callable[..., None] | None = None) -> dict[str, Any]:
    """Run the accuracy check of one variant (module doc); blocking.

    Args:
        engines_dir: the prepared model folder.
        engine, precision: the variant (``onnxruntime``/``int8``, ``torch_cuda``/``fp16``,
            ``tensorrt``/``fp16``).
        eval_file: labelled JSONL for the eval half; None skips it, and a variant
            whose eval did not run does not pass (``reason`` says so).
        log: ``log(event, **fields)`` for progress.

    Returns:
        ``{"engine", "precision", "parity": {...}, "eval": {...} | None, "passed", "reason", "checked"}``.
    """
    from inference.tokenizer import E5Tokenizer

    emit = log or (lambda event, **kw: None)
    engines_dir = Path(engines_dir)
    tok = E5Tokenizer.load(engines_dir)
    windows = parity_windows(tok)
    ref = reference_vectors(engines_dir, windows, tok.pad_id)
    eng = make_variant_engine(engines_dir, engine, precision)
    try:
        parity = parity_check(eng, windows, ref, precision, tok.pad_id)
    finally:
        eng.close()
    emit("accuracy_parity", engine=engine, precision=precision, min_cosine=parity["min_cosine"],
         passed=parity["passed"])
    ev = None
    if eval_file is not None and parity["passed"]:
        ev = eval_check(engine, precision, Path(eval_file), engines_dir)
        emit("accuracy_eval", intent_delta=ev["intent_delta"], topic_delta=ev["topic_delta"], passed=ev["passed"])
    if not parity["passed"]:
        reason = f"parity min cosine {parity['min_cosine']} < {parity['threshold']}"
    elif ev is None:
        reason = "eval not run (no eval file): parity alone does not pass the check"
    elif not ev["passed"]:
        reason = (f"eval intent {ev['intent_delta']:+.4f}, topic {ev['topic_delta']:+.4f} "
                  f"against FP32 (tolerance -{EVAL_TOLERANCE})")
    else:
        reason = ""
    return {"engine": engine, "precision": precision, "parity": parity, "eval": ev, "passed": not reason,
            "reason": reason, "checked": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def format_report(report: dict[str, Any]) -> str:
    """A few human-readable lines of :func:`check_accuracy`'s report."""
    p = report["parity"]
    lines = [f"{report['engine']}/{report['precision']}: parity over {p['windows']} windows: min cosine "
             f"{p['min_cosine']} (single {p['single']['min']}, batched {p['batched']['min']}; "
             f"mean {p['single']['mean']}), threshold {p['threshold']}: {'ok' if p['passed'] else 'FAILED'}"]
    ev = report.get("eval")
    if ev:
        lines.append(f"eval {ev['file']}: intent {ev['fp32']['intent_accuracy']:.4f} -> "
                     f"{ev['variant']['intent_accuracy']:.4f} ({ev['intent_delta']:+.4f}), topic "
                     f"{ev['fp32']['topic_accuracy']:.4f} -> {ev['variant']['topic_accuracy']:.4f} "
                     f"({ev['topic_delta']:+.4f}), tolerance -{ev['tolerance']}: {'ok' if ev['passed'] else 'FAILED'}")
    lines.append("PASSED" if report["passed"] else f"NOT PASSED: {report['reason']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m inference.model.accuracy --engine onnxruntime --precision int8 [--eval FILE] [--json]``."""
    ap = argparse.ArgumentParser(description="accuracy check of a reduced-precision variant against FP32")
    ap.add_argument("--engines-dir", type=Path, default=REPO / "engines")
    ap.add_argument("--engine", choices=("onnxruntime", "torch_cuda", "tensorrt"), default="onnxruntime")
    ap.add_argument("--precision", choices=("int8", "fp16"), default="int8")
    ap.add_argument("--eval", dest="eval_file", type=Path, default=DEFAULT_EVAL_FILE if DEFAULT_EVAL_FILE.is_file() else None,
                    help="labelled JSONL (default ../shared/eval/dev.jsonl when present)")
    ap.add_argument("--no-eval", action="store_true", help="parity only (the variant then does not pass)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    report = check_accuracy(args.engines_dir, args.engine, args.precision, None if args.no_eval else args.eval_file,
                            log=lambda event, **kw: print(event, json.dumps(kw), file=sys.stderr))
    print(json.dumps(report, ensure_ascii=False) if args.json else format_report(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
