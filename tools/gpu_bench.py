"""GPU measurements for the torch_cuda and TensorRT engines (what ran on the H200 for docs/benchmarks.md).

Two steps, because the prepared model (448 MiB) cannot travel to the GPU machine
(64 MiB limit):

``python tools/gpu_bench.py pack [--engines-dir engines] [--out .gpucarry]``
    on the development machine (CPU). Writes ``.gpucarry/`` (git-ignored):
    the 12 encoder layers in FP16 plus the embedding rows of every token id the
    test texts use (``weights.npz``, ~45 MB), the tokenizer files, and the FP32
    ONNX Runtime reference vectors for the parity windows (``reference.npz``).
    FP16 storage loses nothing: the FP16 engine rounds every weight to FP16 the
    same way, and LayerNorm parameters stay FP32.

``python tools/gpu_bench.py run [--carry .gpucarry] [--out DIR] [--seconds S]``
    on the GPU machine. Rebuilds a full-size BertModel (rows not carried are
    random, so memory and speed are those of the real model), then measures:

    1. parity: cosine of every parity window, CUDA graphs and eager, against
       the carried ONNX Runtime FP32 reference (target >= 0.999);
    2. engine latency (host to host, median) per batch and sequence bucket,
       eager against CUDA graphs, and the engine-only ceiling (encodes/s at max batch);
    3. GPU memory of the engine;
    4. throughput and p50/p99 through the project's DynamicBatcher +
       InferencePool (+ E5Tokenizer, i.e. ``Encoder.encode``) at concurrency
       1, 32, 256, batched and unbatched, 1 and 2 workers;
    5. the TensorRT engine's cuda-python path (device and pinned buffers,
       streams, per-thread cudaSetDevice, pool workers) on the real GPU, with
       the TensorRT API double of tests/trt_doubles.py standing in for
       TensorRT itself (not installable here);
    6. ``pytest tests/test_torch_cuda.py`` (its GPU tests run there).

    Writes ``results.json`` and ``bench.log`` under ``--out`` and prints a summary.

``--device cpu`` runs the same ``run`` steps on the CPU with short durations (a
smoke test of this script, numbers meaningless).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BATCHES = (1, 8, 32, 64, 128, 256)
SEQS = (16, 32, 64, 128, 256, 512)
CONCURRENCIES = (1, 32, 256)


# =========================================================================== texts
def parity_texts() -> list[tuple[str, str]]:
    """The accuracy check's fixed parity set (:func:`inference.model.accuracy.parity_texts`)."""
    from inference.model.accuracy import parity_texts as texts

    return texts()


# =========================================================================== pack (CPU)
def pack(engines_dir: Path, out: Path) -> None:
    import onnxruntime as ort

    from inference.engines.torch_cuda.weights import bert_from_onnx
    from inference.tokenizer import E5Tokenizer

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    tok = E5Tokenizer.load(engines_dir)
    texts = parity_texts()
    windows, owner = [], []
    for i, (prefix, text) in enumerate(texts):
        for w in tok.encode_batch([text], prefix=prefix)[0]:
            windows.append(w)
            owner.append(i)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(engines_dir / "model.onnx"), so, providers=["CPUExecutionProvider"])
    ref = np.stack([sess.run(["pooled"], {"input_ids": np.array([w], np.int64),
                                          "attention_mask": np.ones((1, len(w)), np.int64)})[0][0] for w in windows])
    lens = np.array([len(w) for w in windows])
    flat = np.full((len(windows), lens.max()), tok.pad_id, np.int64)
    for r, w in enumerate(windows):
        flat[r, :len(w)] = w
    np.savez(out / "reference.npz", ids=flat, lens=lens, owner=np.array(owner), pooled=ref.astype(np.float32))

    bert = bert_from_onnx(engines_dir / "model.onnx")
    state = {k: v.detach().numpy() for k, v in bert.state_dict().items() if "position_ids" not in k}
    word = state.pop("embeddings.word_embeddings.weight")
    used = np.unique(np.concatenate([np.array(w) for w in windows] + [np.array([0, 1, 2, 3])]))
    arrays = {"word_ids": used.astype(np.int64), "word_rows": word[used].astype(np.float16)}
    for k, v in state.items():
        arrays["w:" + k] = v.astype(np.float16) if v.ndim == 2 else v.astype(np.float32)
    write_carry(out, engines_dir, bert, tok.pad_id, arrays, texts=len(texts), windows=len(windows),
                rows_carried=int(used.size))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"packed {len(texts)} texts / {len(windows)} windows / {used.size} embedding rows into {out} "
          f"({size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s")


def write_carry(out: Path, engines_dir: Path, bert, pad_id: int, arrays: dict[str, np.ndarray], **meta_extra) -> None:
    """The carry's ``weights.npz`` (``arrays``), ``meta.json`` (what :func:`load_carried_bert` needs,
    the source model, ``meta_extra``) and ``engines/`` (manifest, normalization, gzipped tokenizer)."""
    np.savez(out / "weights.npz", **arrays)
    manifest = json.loads((engines_dir / "manifest.json").read_text(encoding="utf-8"))
    cfg = bert.config
    meta = {"vocab_rows": int(bert.embeddings.word_embeddings.weight.shape[0]), "heads": int(cfg.num_attention_heads),
            "eps": float(cfg.layer_norm_eps), "pad_id": int(pad_id), **meta_extra,
            "source": manifest.get("model"), "onnx_sha256": manifest.get("onnx_sha256")}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    eng = out / "engines"
    eng.mkdir(exist_ok=True)
    for name in ("manifest.json", "normalization.json"):
        shutil.copy2(engines_dir / name, eng / name)
    with open(engines_dir / "tokenizer.json", "rb") as src, gzip.open(eng / "tokenizer.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)


# =========================================================================== run (GPU)
class Recorder:
    """Collects results and log lines; each step runs guarded so one failure loses one step."""

    def __init__(self, out: Path):
        self.out = out
        self.results: dict[str, Any] = {}
        self.log_lines: list[str] = []

    def log(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.log_lines.append(line)

    def step(self, name: str, fn: Callable[[], Any]) -> Any:
        self.log(f"--- {name}")
        t0 = time.perf_counter()
        try:
            value = fn()
            self.results[name] = value
            return value
        except Exception as exc:  # noqa: BLE001 - record and go on
            self.results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            self.log(f"!!! {name} failed: {exc}\n{traceback.format_exc()}")
            return None
        finally:
            self.log(f"    {name}: {time.perf_counter() - t0:.1f} s")
            self.save()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
        (self.out / "bench.log").write_text("\n".join(self.log_lines) + "\n")


def load_carried_bert(carry: Path):
    """Full-size CPU FP32 BertModel: carried layers and rows, other rows random (seeded). Matrices
    carried as INT8 (``q:`` values, ``s:`` a scale per row: tools/e2e_bench.py) are dequantized."""
    from inference.engines.torch_cuda.weights import bert_from_state

    meta = json.loads((carry / "meta.json").read_text())
    z = np.load(carry / "weights.npz")
    state = {k[2:]: z[k].astype(np.float32) for k in z.files if k.startswith("w:")}
    state.update({k[2:]: z[k].astype(np.float32) * z["s:" + k[2:]] for k in z.files if k.startswith("q:")})
    hidden = state["embeddings.position_embeddings.weight"].shape[1]
    rng = np.random.default_rng(0)
    word = (rng.standard_normal((meta["vocab_rows"], hidden), dtype=np.float32) * 0.05)
    word[z["word_ids"]] = z["word_rows"].astype(np.float32)
    state["embeddings.word_embeddings.weight"] = word
    return bert_from_state(state, heads=meta["heads"], eps=meta["eps"], pad_id=meta["pad_id"]), meta


def unpack_engines_dir(carry: Path) -> Path:
    d = Path(tempfile.mkdtemp(prefix="engines-"))
    for name in ("manifest.json", "normalization.json"):
        shutil.copy2(carry / "engines" / name, d / name)
    with gzip.open(carry / "engines" / "tokenizer.json.gz", "rb") as src, open(d / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    return d


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def env_info(device: str) -> dict[str, Any]:
    import torch

    info = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "python": platform.python_version(),
            "torch": torch.__version__, "cuda_runtime": torch.version.cuda, "cpu_count": os.cpu_count(),
            "platform": platform.platform()}
    for dist in ("transformers", "numpy", "onnxruntime", "cuda-bindings", "cuda-python", "tokenizers"):
        with contextlib.suppress(Exception):
            import importlib.metadata as md

            info[dist] = md.version(dist)
    if device != "cpu" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    gpu_memory_gib=round(p.total_memory / 2**30, 1))
        with contextlib.suppress(Exception):
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    return info


def parity(make_engine, carry: Path) -> dict[str, Any]:
    z = np.load(carry / "reference.npz")
    ids, lens, ref = z["ids"], z["lens"], z["pooled"]
    out: dict[str, Any] = {"windows": int(len(lens)), "max_len": int(lens.max())}
    for label, graphs in (("graphs", True), ("eager", False)):
        eng = make_engine(cuda_graphs=graphs)
        one = np.stack([eng.infer(ids[i:i + 1, :lens[i]], np.ones((1, lens[i]), np.int64))[0] for i in range(len(lens))])
        # all windows as padded batches of 16, in length order (as the batcher groups them)
        order = np.argsort(lens)
        batched = np.empty_like(ref)
        for s in range(0, len(order), 16):
            rows = order[s:s + 16]
            t = int(lens[rows].max())
            mask = (np.arange(t)[None, :] < lens[rows][:, None]).astype(np.int64)
            batched[rows] = eng.infer(np.where(mask == 1, ids[rows, :t], 1), mask)
        c1, cb = cosine_rows(one, ref), cosine_rows(batched, ref)
        out[label] = {"single_min_cosine": float(c1.min()), "single_mean_cosine": float(c1.mean()),
                      "batched_min_cosine": float(cb.min()), "batched_mean_cosine": float(cb.mean()),
                      "max_abs_diff": float(np.abs(batched - ref).max()),
                      "graph_runs": eng.graph_runs, "eager_runs": eng.eager_runs}
        eng.close()
    return out


def latency_grid(make_engine, seconds_per_point: float, batches=BATCHES, seqs=SEQS) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    rows = []
    engines = {"graphs": make_engine(cuda_graphs=True), "eager": make_engine(cuda_graphs=False)}
    for t in seqs:
        for b in batches:
            ids = rng.integers(5, 250000, (b, t)).astype(np.int64)
            ids[:, 0] = 0
            mask = np.ones((b, t), np.int64)
            row = {"batch": b, "seq": t}
            for label, eng in engines.items():
                for _ in range(3):
                    eng.infer(ids, mask)
                times = []
                stop = time.perf_counter() + seconds_per_point
                while (len(times) < 10 or time.perf_counter() < stop) and len(times) < 300:
                    t0 = time.perf_counter()
                    eng.infer(ids, mask)
                    times.append((time.perf_counter() - t0) * 1000)
                row[f"{label}_ms"] = round(float(np.median(times)), 3)
                row[f"{label}_p90_ms"] = round(float(np.percentile(times, 90)), 3)
            row["graph_used"] = b * t <= engines["graphs"].graph_max_tokens
            row["speedup"] = round(row["eager_ms"] / row["graphs_ms"], 2)
            row["graphs_encodes_per_s"] = round(b / row["graphs_ms"] * 1000)
            rows.append(row)
    for eng in engines.values():
        eng.close()
    return {"rows": rows}


def memory(make_engine) -> dict[str, Any]:
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base_alloc = torch.cuda.memory_allocated()
    base_res = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    eng = make_engine(cuda_graphs=True, key="memory-probe")
    rng = np.random.default_rng(2)
    for b, t in ((1, 16), (32, 32), (256, 64), (32, 512), (256, 512)):
        eng.infer(rng.integers(5, 1000, (b, t)).astype(np.int64), np.ones((b, t), np.int64))
    torch.cuda.synchronize()
    out = {"graphs": len(eng.graph_shapes), "load_seconds": eng.load_seconds,
           "engine_reported_mib": round(eng.gpu_memory_bytes / 2**20, 1),
           "allocated_after_mib": round((torch.cuda.memory_allocated() - base_alloc) / 2**20, 1),
           "reserved_after_mib": round((torch.cuda.memory_reserved() - base_res) / 2**20, 1),
           "peak_allocated_mib": round((torch.cuda.max_memory_allocated() - base_alloc) / 2**20, 1),
           "weights_mib": round(eng._model.weight_bytes / 2**20, 1)}
    with contextlib.suppress(Exception):
        out["nvidia_smi_used_mib"] = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"],
                                                    capture_output=True, text=True, timeout=20).stdout.strip()
    eng.close()
    return out


def memory_caps(bert, pad_id: int) -> dict[str, Any]:
    """GPU memory an engine adds at load (weights + graphs + buffers), per graph token cap."""
    import gc

    import torch

    from inference.engines.torch_cuda.engine import TorchCudaEngine

    out = {}
    for cap in (8192, 16384):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        a0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        eng = TorchCudaEngine(bert, key=f"mem-{cap}", device=0, graph_max_tokens=cap, pad_id=pad_id)
        torch.cuda.synchronize()
        out[str(cap)] = {"graphs": len(eng.graph_shapes), "load_seconds": eng.load_seconds,
                         "reserved_mib": round((torch.cuda.memory_reserved() - r0) / 2**20, 1),
                         "allocated_mib": round((torch.cuda.memory_allocated() - a0) / 2**20, 1),
                         "weights_mib": round(eng._model.weight_bytes / 2**20, 1)}
        with contextlib.suppress(Exception):
            out[str(cap)]["nvidia_smi_used_mib"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        eng.close()
        del eng
    return out


def gpu_time(make_engine) -> dict[str, Any]:
    """Graph replay time on the GPU alone (CUDA events, median of 200) against the engine's host-to-host call."""
    import torch

    eng = make_engine(cuda_graphs=True)
    rows = []
    rng = np.random.default_rng(3)
    for b, t in ((1, 16), (1, 32), (8, 32), (32, 32), (128, 32), (256, 32), (32, 128), (16, 512)):
        g = eng._graphs[(b, t)]
        ids = rng.integers(5, 250000, (b, t)).astype(np.int64)
        mask = np.ones((b, t), np.int64)
        for _ in range(5):
            eng.infer(ids, mask)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(200)]
        with torch.cuda.stream(eng._stream):
            for e0, e1 in ev:
                e0.record()
                g.graph.replay()
                e1.record()
        eng._stream.synchronize()
        replay = float(np.median([e0.elapsed_time(e1) for e0, e1 in ev]))
        host = []
        for _ in range(200):
            t0 = time.perf_counter()
            eng.infer(ids, mask)
            host.append((time.perf_counter() - t0) * 1000)
        rows.append({"batch": b, "seq": t, "replay_ms": round(replay, 3), "infer_ms": round(float(np.median(host)), 3)})
    eng.close()
    return {"rows": rows}


class NullEngine:
    """Returns zeros at once: measures the front end (tokenizer, batcher, pool) without a model."""

    name = "null"
    dim = 384
    max_batch_size = 256
    max_seq_len = 512

    def infer(self, input_ids, attention_mask):
        return np.zeros((input_ids.shape[0], self.dim), np.float32)

    def close(self):
        pass


def frontend(engines_dir: Path, seconds: float, rec: Recorder) -> dict[str, Any]:
    """Per-request tokenizer cost, and pool throughput over a NullEngine (asyncio and uvloop)."""
    from inference.bench import QUESTIONS
    from inference.tokenizer import E5Tokenizer

    tok = E5Tokenizer.load(engines_dir)
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 1.0:
        for q in QUESTIONS:
            tok.encode_batch([q])
            n += 1
    out: dict[str, Any] = {"tokenize_one_us": round((time.perf_counter() - t0) / n * 1e6, 1)}
    t0 = time.perf_counter()
    for _ in range(20):
        tok.encode_batch(list(QUESTIONS))
    out["tokenize_batch32_us_per_text"] = round((time.perf_counter() - t0) / (20 * len(QUESTIONS)) * 1e6, 1)
    plan = [(1, "batched", 0.0, 256, "encode", (256,)), (1, "batched", 0.0, 256, "pretokenized", (256,))]
    out["null_asyncio"] = asyncio.run(pool_bench(lambda **kw: NullEngine(), engines_dir, seconds, rec, plan, "-null"))
    with contextlib.suppress(ImportError):
        import uvloop

        out["null_uvloop"] = asyncio.run(pool_bench(lambda **kw: NullEngine(), engines_dir, seconds, rec, plan,
                                                    "-null-uvloop"), loop_factory=uvloop.new_event_loop)
    return out


async def _drive(submit: Callable[[Any], Any], items: list, concurrency: int, seconds: float, batcher) -> dict:
    lat: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds
    b0, r0 = batcher.stats.batches_run, batcher.stats.requests_run

    async def client(start: int) -> None:
        nonlocal errors
        i = start
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            try:
                await submit(items[i % len(items)])
                lat.append((time.perf_counter() - t0) * 1000)
            except Exception:  # noqa: BLE001
                errors += 1
            i += concurrency

    t_start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    elapsed = time.perf_counter() - t_start
    batches = batcher.stats.batches_run - b0
    arr = np.asarray(lat) if lat else np.zeros(1)
    return {"concurrency": concurrency, "requests": len(lat), "errors": errors, "seconds": round(elapsed, 2),
            "throughput": round(len(lat) / elapsed, 1), "p50_ms": round(float(np.percentile(arr, 50)), 3),
            "p99_ms": round(float(np.percentile(arr, 99)), 3),
            "mean_batch": round((batcher.stats.requests_run - r0) / batches, 1) if batches else 0.0}


POOL_PLAN = [(1, "batched", 0.0, 256, "encode", CONCURRENCIES),
             (1, "batched", 0.0, 256, "pretokenized", CONCURRENCIES),
             (1, "batched", 2.0, 256, "encode", (32, 256)),
             (1, "unbatched", 0.0, 1, "encode", (32, 256)),
             (2, "batched", 0.0, 256, "encode", CONCURRENCIES)]
"""(workers, batching, max_queue_delay_ms, max_batch_size, mode, concurrencies) per pool run."""


async def pool_bench(make_engine, engines_dir: Path, seconds: float, rec: Recorder, plan=None,
                     tag: str = "") -> dict[str, Any]:
    from inference.config import InferenceConfig
    from inference.bench import QUESTIONS
    from inference.encoder import Encoder, batcher_for
    from inference.pool import InferencePool
    from inference.tokenizer import E5Tokenizer

    tok = E5Tokenizer.load(engines_dir)
    windows = [w for per in tok.encode_batch(list(QUESTIONS)) for w in per]
    runs = []
    plan = plan or POOL_PLAN
    for workers in sorted({p[0] for p in plan}):
        pool = await InferencePool.start(lambda: make_engine(cuda_graphs=True, key="pool"), workers, tok.pad_id)
        try:
            for w, label, delay, max_batch, mode, concs in plan:
                if w != workers:
                    continue
                cfg = InferenceConfig(workers=workers, max_batch_size=max_batch, max_batch_tokens=16384,
                                      max_queue_delay_ms=delay, max_queue_size=8192, deadline_ms=10000.0)
                enc = Encoder(tok, pool, batcher_for(cfg, pool))
                try:
                    for q in QUESTIONS[:8]:
                        await enc.encode([q])
                    if mode == "encode":
                        submit, items = (lambda text, enc=enc: enc.encode([text])), list(QUESTIONS)
                    else:
                        submit, items = (lambda win, enc=enc: enc.batcher.submit(win)), windows
                    for c in concs:
                        r = await _drive(submit, items, c, seconds, enc.batcher)
                        r.update(workers=workers, mode=mode, batching=label, max_queue_delay_ms=delay,
                                 max_batch_size=enc.batcher.max_batch_size, loop=tag or "asyncio")
                        rec.log(f"    pool{tag} w={workers} {label} delay={delay} {mode} c={c}: "
                                f"{r['throughput']}/s p50 {r['p50_ms']} p99 {r['p99_ms']} batch {r['mean_batch']}")
                        runs.append(r)
                finally:
                    await enc.batcher.close()
        finally:
            await pool.close()
    return {"runs": runs, "seconds_per_run": seconds}


def tensorrt_cuda_python_path(seconds: float) -> dict[str, Any]:
    """The TensorRT engine over the real cuda-python runtime, TensorRT replaced by the test double."""
    import cuda.bindings.runtime as cudart  # noqa: F401 - the real one must be what the engine imports

    from inference.batching.windows import pad_batch
    from inference.engines.cuda import import_cudart
    from inference.engines.tensorrt.engine import TensorRTEngine
    from inference.engines.tensorrt.spec import BuildSpec
    from inference.pool import InferencePool
    from tests import trt_doubles as mod

    out: dict[str, Any] = {"cudart_module": import_cudart().__name__}
    for version in ("10.13.3.9", "11.4.1.2"):
        sys.modules["tensorrt"] = mod.make_fake_tensorrt(version)
        d = Path(tempfile.mkdtemp(prefix="trt-"))
        onnx_path = mod.write_tiny_bert_onnx(d / "model.onnx")
        spec_small = BuildSpec(max_batch_size=64, max_tokens=1024, opt_tokens=256)
        probe = TensorRTEngine(d, spec=spec_small)  # made on this thread, like the manager's probe
        handed: list = [probe]

        def factory():
            return handed.pop() if handed else TensorRTEngine(d, spec=spec_small)

        async def go():
            pool = await InferencePool.start(factory, 2, 1)
            rng = np.random.default_rng(0)
            n, worst, t_end = 0, 1.0, time.perf_counter() + seconds
            try:
                while time.perf_counter() < t_end:
                    batches = []
                    for _ in range(8):
                        b, t = int(rng.integers(1, 64)), int(rng.integers(1, 300))
                        batches.append([[0] + list(rng.integers(3, 64, max(0, int(rng.integers(1, t + 1)) - 2))) + [2]
                                        for _ in range(b)])
                    outs = await asyncio.gather(*(pool.run_batch(w) for w in batches))
                    for w, o in zip(batches, outs):
                        ref = mod.ort_reference(onnx_path, *pad_batch(w, 1))
                        worst = min(worst, float(cosine_rows(o, ref).min()))
                        n += 1
            finally:
                await pool.close()
            return n, worst

        n, worst = asyncio.run(go())
        out[version] = {"batches": n, "min_cosine_vs_onnxruntime": worst, "engine_file": sorted(p.name for p in d.glob("*.engine")),
                        "builds": sys.modules["tensorrt"].stats["builds"],
                        "executions": sys.modules["tensorrt"].stats["executions"]}
        del sys.modules["tensorrt"]
    return out



# =========================================================================== issue 6 / 9 steps (new front end)
def accuracy_fp16(make_engine, carry: Path) -> dict[str, Any]:
    """The accuracy check's parity half (inference.model.accuracy.parity_check, FP16 threshold 0.999)
    for the torch_cuda engine, against the carried FP32 ONNX Runtime vectors."""
    from inference.model.accuracy import parity_check

    z = np.load(carry / "reference.npz")
    windows = [list(map(int, z["ids"][i, :z["lens"][i]])) for i in range(len(z["lens"]))]
    eng = make_engine(cuda_graphs=True)
    try:
        return parity_check(eng, windows, z["pooled"], "fp16", pad_id=1)
    finally:
        eng.close()


def patch_torch_cuda_loader(bert, meta, gpu: bool = True) -> None:
    """``healthbot bench``'s torch_cuda loader builds from the carried weights (no model.onnx here).
    Without a GPU (``--device cpu`` smoke test) it is placed on the CPU."""
    from inference.engines.loader import register_loader
    from inference.engines.torch_cuda.engine import TorchCudaEngine

    def load(cfg, engines_dir, device=None):
        dev = (device or 0) if gpu else "cpu"
        return TorchCudaEngine(bert, key=("carried", str(dev)), device=dev, pad_id=meta["pad_id"])

    register_loader("torch_cuda", load, gpu=gpu)


BENCH_PLAN = [
    # (label, loop, workers, max_queue_delay_ms, GIL switch interval ms (0: Python's 5 ms),
    #  tokenize inline up to (None: the default), concurrencies, modes (batched, unbatched))
    ("w2-d0-s0.5", "uvloop", 2, 0.0, 0.5, None, (1, 32, 256), (True, False)),
    ("w1-d0-s0.5", "uvloop", 1, 0.0, 0.5, None, (256,), (True,)),
    ("w2-d0-s0.1", "uvloop", 2, 0.0, 0.1, None, (256,), (True,)),
    ("w2-d0-s0.5-inline", "uvloop", 2, 0.0, 0.5, 10**9, (256,), (True,)),
    ("w2-d0-s0.5-asyncio", "asyncio", 2, 0.0, 0.5, None, (1, 256), (True,)),
    ("w2-d10-s0.5", "uvloop", 2, 10.0, 0.5, None, (1, 32, 256), (True, False)),
]
PLOT_LABELS = ("w2-d0-s0.5", "w2-d10-s0.5")


def healthbot_bench(engines_dir: Path, out: Path, seconds: float, rec: Recorder, plan=None) -> dict[str, Any]:
    """``inference.bench.run_bench`` for torch_cuda (tokenization included) per BENCH_PLAN row;
    writes bench-<label>.png under ``out`` for PLOT_LABELS."""
    import inference.batching.batcher as batcher_mod
    from inference.config import InferenceConfig
    from inference import bench

    results = {}
    default_inline = batcher_mod.INLINE_TOKENIZE_MAX
    for label, loop, workers, delay, switch_ms, inline, concs, modes in plan or BENCH_PLAN:
        cfg = InferenceConfig(workers=workers, max_queue_delay_ms=delay, max_queue_size=8192,
                              switch_interval_ms=switch_ms)
        factory = bench.loop_factory(loop)
        if loop == "uvloop" and factory is None:
            rec.log(f"    {label}: uvloop missing, skipped")
            continue
        batcher_mod.INLINE_TOKENIZE_MAX = default_inline if inline is None else inline
        sys.setswitchinterval(0.005)
        try:
            res = bench.run_async(bench.run_bench(cfg, engines_dir, concs, seconds, engines=["torch_cuda"], modes=modes,
                                                  progress=lambda line: rec.log(f"    {label}: {line}")), factory)
        finally:
            batcher_mod.INLINE_TOKENIZE_MAX = default_inline
            sys.setswitchinterval(0.005)
        res["inline_tokenize_max"] = inline
        results[label] = res  # (the JSON is in results.json: at most 8 files come back from the GPU machine)
        if label in PLOT_LABELS:
            with contextlib.suppress(Exception):
                bench.write_plot(res, out / f"bench-{label}.png")
        rec.log(bench.format_table(res))
    return results


def multi_gpu_bench(engines_dir: Path, seconds: float, rec: Recorder) -> dict[str, Any]:
    """Issue 9: the same ``healthbot bench`` pool on one GPU (``devices = ["0"]``) and on every
    visible GPU (``["all"]``), torch_cuda, uvloop, max queue delay 0, batched, c = 256 and 512."""
    from inference.config import InferenceConfig
    from inference import bench

    factory = bench.loop_factory("uvloop")
    results = {}
    for label, devices, workers in (("1gpu-w2", ["0"], 2), ("allgpu-w2", ["all"], 2), ("1gpu-w1", ["0"], 1),
                                    ("allgpu-w1", ["all"], 1)):
        cfg = InferenceConfig(workers=workers, max_queue_delay_ms=0.0, max_queue_size=8192, devices=devices,
                              switch_interval_ms=0.5)
        res = bench.run_async(bench.run_bench(cfg, engines_dir, (256, 512), seconds, engines=["torch_cuda"],
                                              modes=(True,), progress=lambda line: rec.log(f"    {label}: {line}")),
                              factory)
        results[label] = res
        rec.log(bench.format_table(res))
    return results


def _one_gpu_process(carry: str, device: str, seconds: float, start_at: float, queue) -> None:
    """Child of :func:`process_per_gpu`: one pool on one GPU, started at ``start_at`` (epoch s)."""
    from inference.config import InferenceConfig
    from inference import bench

    bert, meta = load_carried_bert(Path(carry))
    patch_torch_cuda_loader(bert, meta, device != "cpu")
    engines_dir = unpack_engines_dir(Path(carry))
    cfg = InferenceConfig(workers=2, max_queue_delay_ms=0.0, max_queue_size=8192,
                          devices=[device] if device != "cpu" else ["all"], switch_interval_ms=0.5)
    time.sleep(max(0.0, start_at - time.time()))
    res = bench.run_async(bench.run_bench(cfg, engines_dir, (256,), seconds, engines=["torch_cuda"], modes=(True,),
                                          ceiling_seconds=0.0), bench.loop_factory("uvloop"))
    queue.put((device, [r for r in res["runs"] if not r.get("engine_only")]))


def process_per_gpu(carry: Path, seconds: float, rec: Recorder, gpus: int, cpu: bool = False) -> dict[str, Any]:
    """Issue 9, scaling out inside one host: one process per GPU (each its own front end),
    run at the same time, c=256 each; throughput summed over the processes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    start_at = time.time() + 40.0  # every child loaded and warmed before the common start
    procs = [ctx.Process(target=_one_gpu_process, args=(str(carry), "cpu" if cpu else str(i), seconds, start_at,
                                                        queue)) for i in range(gpus)]
    for p in procs:
        p.start()
    runs = [queue.get(timeout=600) for _ in procs]
    runs = {f"{dev}#{k}": r for k, (dev, r) in enumerate(runs)}
    for p in procs:
        p.join(timeout=60)
    total = sum(r[0]["throughput"] for r in runs.values())
    for dev, r in sorted(runs.items()):
        rec.log(f"    process on GPU {dev}: {r[0]['throughput']:.0f}/s p50 {r[0]['p50_ms']} p99 {r[0]['p99_ms']}")
    rec.log(f"    {gpus} processes together: {total:.0f}/s")
    return {"per_process": runs, "total_throughput": total}


def materialize_engines_dir(carry: Path, dest: Path = REPO / "engines") -> Path:
    """A prepared-model folder ``healthbot bench`` loads unpatched (``model.onnx`` exported
    by ``inference.model.prepare.export_onnx`` from the carried weights: real encoder layers and
    the rows of every token the bench texts use, other rows random), kept when it exists."""
    if (dest / "model.onnx").is_file():
        return dest
    from inference.model.prepare import export_onnx

    bert, _ = load_carried_bert(carry)
    tmp = unpack_engines_dir(carry)
    export_onnx(bert, tmp / "model.onnx")
    dest.mkdir(parents=True, exist_ok=True)
    for f in tmp.iterdir():
        shutil.move(str(f), dest / f.name)
    return dest


#: ``healthbot bench`` runs (``inference.bench.run_bench``, what ``healthbot bench`` runs), per plan:
#: (label, environment, arguments); CLI_COMMON's environment applies to every run.
_I = "HEALTHBOT_INFERENCE_"
CLI_PLANS: dict[str, list[tuple[str, dict[str, str], list[str]]]] = {
    "scaling": [
        ("scaling-1proc-w2", {_I + "DEVICE_PROCESSES": "1", _I + "WORKERS": "2"}, ["--scaling", "--concurrency", "256"]),
        ("scaling-2proc-w1", {_I + "DEVICE_PROCESSES": "2", _I + "WORKERS": "1"}, ["--scaling", "--concurrency", "256"]),
    ],
    "scaling-in-process": [
        ("scaling-in-process-w2", {_I + "DEVICE_PROCESSES": "0", _I + "WORKERS": "2", "TOKENIZERS_PARALLELISM": "false"},
         ["--scaling", "--concurrency", "256"]),
    ],
    "single": [
        ("gpu0-2proc-w1", {_I + "DEVICES": "0", _I + "DEVICE_PROCESSES": "2", _I + "WORKERS": "1"},
         ["--concurrency", "1,32,256"]),
        ("gpu0-1proc-w2", {_I + "DEVICES": "0", _I + "DEVICE_PROCESSES": "1", _I + "WORKERS": "2"},
         ["--concurrency", "256"]),
        ("gpu0-3proc-w1", {_I + "DEVICES": "0", _I + "DEVICE_PROCESSES": "3", _I + "WORKERS": "1"},
         ["--concurrency", "256"]),
    ],
}
CLI_PLANS["tune"] = [
    ("gpu0-2proc-w2", {_I + "DEVICES": "0", _I + "DEVICE_PROCESSES": "2", _I + "WORKERS": "2"},
     ["--concurrency", "256", "--batched-only"]),
    ("gpu0-2proc-w1-d1", {_I + "DEVICES": "0", _I + "DEVICE_PROCESSES": "2", _I + "WORKERS": "1",
                          _I + "MAX_QUEUE_DELAY_MS": "1"}, ["--concurrency", "256", "--batched-only"]),
    ("gpu0-1proc-w2-d1", {_I + "DEVICES": "0", _I + "DEVICE_PROCESSES": "1", _I + "WORKERS": "2",
                          _I + "MAX_QUEUE_DELAY_MS": "1"}, ["--concurrency", "256", "--batched-only"]),
]
CLI_PLANS["mps"] = [  # run under an NVIDIA MPS control daemon (kernels of several processes share the GPU)
    ("mps-gpu0-2proc-w1", {_I + "DEVICES": "0", _I + "DEVICE_PROCESSES": "2", _I + "WORKERS": "1"},
     ["--concurrency", "256", "--batched-only"]),
    ("mps-gpu0-4proc-w1", {_I + "DEVICES": "0", _I + "DEVICE_PROCESSES": "4", _I + "WORKERS": "1"},
     ["--concurrency", "256", "--batched-only"]),
]
_S = {_I + "DEVICES": "0", _I + "ENGINE_SERVER": "true"}
CLI_PLANS["server-check"] = [  # the final code's best layouts against the old one, one machine instance
    ("check-server-4proc", {**_S, _I + "DEVICE_PROCESSES": "4", _I + "WORKERS": "1"},
     ["--concurrency", "256", "--batched-only"]),
    ("check-server-6proc", {**_S, _I + "DEVICE_PROCESSES": "6", _I + "WORKERS": "1"},
     ["--concurrency", "256", "--batched-only"]),
    ("check-noserver-2proc", {_I + "DEVICES": "0", _I + "DEVICE_PROCESSES": "2", _I + "WORKERS": "1"},
     ["--concurrency", "256", "--batched-only"]),
]
CLI_PLANS["server"] = [  # one engine server on GPU 0 (WORKERS engines), worker processes sending it batches
    ("server-6proc-e1", {**_S, _I + "DEVICE_PROCESSES": "6", _I + "WORKERS": "1"}, ["--concurrency", "1,32,256"]),
    ("server-6proc-e2", {**_S, _I + "DEVICE_PROCESSES": "6", _I + "WORKERS": "2"},
     ["--concurrency", "256", "--batched-only"]),
    ("server-4proc-e2", {**_S, _I + "DEVICE_PROCESSES": "4", _I + "WORKERS": "2"},
     ["--concurrency", "256", "--batched-only"]),
    ("server-8proc-e2", {**_S, _I + "DEVICE_PROCESSES": "8", _I + "WORKERS": "2"},
     ["--concurrency", "256", "--batched-only"]),
    ("server-4proc-e1", {**_S, _I + "DEVICE_PROCESSES": "4", _I + "WORKERS": "1"},
     ["--concurrency", "256", "--batched-only"]),
    ("noserver-2proc-w1", {_I + "DEVICES": "0", _I + "DEVICE_PROCESSES": "2", _I + "WORKERS": "1"},
     ["--concurrency", "256", "--batched-only"]),
]
CLI_PLANS["launch-check"] = [  # sixth session: launch behind the running batch, messages of >= 32 texts
    ("launch-server-6proc", {**_S, _I + "DEVICE_PROCESSES": "6", _I + "WORKERS": "1"}, ["--concurrency", "1,32,256"]),
    ("launch-server-4proc", {**_S, _I + "DEVICE_PROCESSES": "4", _I + "WORKERS": "1"},
     ["--concurrency", "256", "--batched-only"]),
    ("launch-noserver-2proc", {_I + "DEVICES": "0", _I + "DEVICE_PROCESSES": "2", _I + "WORKERS": "1"},
     ["--concurrency", "256", "--batched-only"]),
]
CLI_PLANS["direct-check"] = [  # seventh session: a worker's message runs as one batch at once (batcher direct path)
    ("direct-server-4proc", {**_S, _I + "DEVICE_PROCESSES": "4", _I + "WORKERS": "1"}, ["--concurrency", "1,32,256"]),
    ("direct-server-4proc-si0.1", {**_S, _I + "DEVICE_PROCESSES": "4", _I + "WORKERS": "1",
                                   _I + "SWITCH_INTERVAL_MS": "0.1"}, ["--concurrency", "256", "--batched-only"]),
]
#: ENGINE_SERVER false: the plans before the engine server measured each worker process with its own engine.
CLI_COMMON = {_I + "MAX_QUEUE_DELAY_MS": "0", _I + "MAX_QUEUE_SIZE": "8192", _I + "SWITCH_INTERVAL_MS": "0.5",
              _I + "ENGINE_SERVER": "false"}


def cli_bench(carry: Path, out: Path, seconds: float, rec: Recorder, plans: list[str], cpu: bool = False) -> dict:
    """The ``healthbot bench`` runs of ``CLI_PLANS[plan]`` as subprocesses (``--json``); tables logged,
    a PNG per full bench under ``out``."""
    from inference import bench

    engines_dir = REPO / "engines" if cpu else materialize_engines_dir(carry)
    results = {}
    for plan in plans:
        for label, overrides, args in CLI_PLANS[plan]:
            env = dict(os.environ, PYTHONUNBUFFERED="1", HEALTHBOT_INFERENCE_ENGINES_DIR=str(engines_dir))
            env.update({**CLI_COMMON, **overrides})
            cmd = [sys.executable, "-m", "bot.cli", "bench", "--json", "--seconds", str(seconds),
                   "--engines", "onnxruntime" if cpu else "torch_cuda", *args]
            if cpu:
                env["HEALTHBOT_INFERENCE_DEVICES"] = "all"
            rec.log(f"    {label}: {' '.join(f'{k}={v}' for k, v in overrides.items())} "
                    f"{' '.join(cmd[1:])}")
            proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=400)
            for line in proc.stderr.splitlines()[-40:]:
                rec.log(f"      {line}")
            if proc.returncode != 0:
                results[label] = {"error": f"exit {proc.returncode}", "stderr": proc.stderr[-3000:]}
                continue
            res = json.loads(proc.stdout)
            results[label] = res
            if "--scaling" in args:
                rec.log(bench.format_scaling(res))
            else:
                rec.log(bench.format_table(res))
                with contextlib.suppress(Exception):
                    bench.write_plot(res, out / f"bench-{label}.png")
    return results


FRONTEND_PLAN = [  # (loop, GIL switch interval ms, tokenize inline up to)
    ("uvloop", 5.0, None), ("uvloop", 0.5, None), ("uvloop", 0.1, None), ("uvloop", 0.5, 10**9), ("asyncio", 0.5, None)]


def frontend_null(engines_dir: Path, seconds: float, plan=None) -> dict[str, Any]:
    """The new front end alone: Encoder.encode over a NullEngine pool at c=256 (delay 0),
    per FRONTEND_PLAN row (event loop, GIL switch interval, inline tokenization)."""
    import inference.batching.batcher as batcher_mod
    from inference.config import InferenceConfig
    from inference import bench
    from inference.encoder import Encoder, batcher_for
    from inference.pool import InferencePool
    from inference.tokenizer import E5Tokenizer

    async def go(concs):
        import gc

        tok = E5Tokenizer.load(engines_dir)
        pool = await InferencePool.start(lambda: NullEngine(), 1, tok.pad_id)
        gc.collect()
        gc.freeze()
        cfg = InferenceConfig(max_batch_size=256, max_queue_delay_ms=0, max_queue_size=8192)
        enc = Encoder(tok, pool, batcher_for(cfg, pool, tok))
        out = {}
        try:
            for c in concs:
                out[f"c{c}"] = await bench.drive(lambda t: enc.encode([t]), bench.QUESTIONS, c, seconds, enc.batcher)
        finally:
            await enc.batcher.close()
            await pool.close()
        return out

    res = {}
    default_inline = batcher_mod.INLINE_TOKENIZE_MAX
    for loop, switch_ms, inline in plan or FRONTEND_PLAN:
        factory = None if loop == "asyncio" else bench.loop_factory("uvloop")
        if loop == "uvloop" and factory is None:
            continue
        batcher_mod.INLINE_TOKENIZE_MAX = default_inline if inline is None else inline
        sys.setswitchinterval(switch_ms / 1000.0)
        try:
            res[f"{loop}-s{switch_ms}-{'inline' if inline else 'thread'}"] = bench.run_async(go((256,)), factory)
        finally:
            batcher_mod.INLINE_TOKENIZE_MAX = default_inline
            sys.setswitchinterval(0.005)
    return res


class _Breakable:
    """Wraps an engine; ``infer`` raises EngineError while ``broken`` is set (the fault injection)."""

    def __init__(self, engine, broken, name=None):
        self._e = engine
        self.broken = broken
        self.name = name or engine.name
        self.dim, self.max_batch_size, self.max_seq_len = engine.dim, engine.max_batch_size, engine.max_seq_len
        self.calls = 0

    def infer(self, ids, mask):
        from inference.engines.base import EngineError

        self.calls += 1
        if self.broken.is_set():
            raise EngineError("injected: CUDA error: an illegal memory access was encountered")
        return self._e.infer(ids, mask)

    def close(self):
        self._e.close()


def fault_and_swap(bert, meta, engines_dir: Path, dev: Any = 0) -> dict[str, Any]:
    """On the real GPU: (1) the torch_cuda engine fails mid-run under 64 clients, the
    circuit opens to a CPU engine (the same model, PyTorch FP32 on the CPU), the GPU
    recovers and a half-open probe closes the circuit; (2) hot swap to a new GPU engine
    under load. Counts failed requests (target 0)."""
    import threading

    from inference import bench
    from inference.batching.batcher import DynamicBatcher
    from inference.encoder import Encoder
    from inference.engines.torch_cuda.engine import TorchCudaEngine
    from inference.manager import ModelManager
    from inference.pool import InferencePool
    from inference.tokenizer import E5Tokenizer

    broken = threading.Event()
    gpu_engines = []

    def gpu_factory():
        e = _Breakable(TorchCudaEngine(bert, key=("carried", str(dev)), device=dev, pad_id=meta["pad_id"]), broken)
        gpu_engines.append(e)
        return e

    async def go():
        tok = E5Tokenizer.load(engines_dir)
        primary = await InferencePool.start(gpu_factory, 1, tok.pad_id)
        cpu = await InferencePool.start(
            lambda: _Breakable(TorchCudaEngine(bert, device="cpu", pad_id=meta["pad_id"], max_batch_size=32),
                               threading.Event(), name="cpu_torch"), 1, tok.pad_id, record_workers=False)
        m = ModelManager(primary, cpu, circuit_failures=3, reset_s=0.5, pool_options={"workers": 1, "pad_id": tok.pad_id})
        enc = Encoder(tok, m, DynamicBatcher(m.run_batch, max_batch_size=256, max_queue_delay_ms=0, max_queue_size=8192,
                                             deadline_ms=10000, tokenize=tok.encode_batch))
        states: list = []
        errors: list = []
        done = [0]
        stop = asyncio.Event()

        async def client(i):
            j = i
            while not stop.is_set():
                try:
                    await enc.encode([bench.QUESTIONS[j % len(bench.QUESTIONS)]])
                    done[0] += 1
                except Exception as exc:  # noqa: BLE001
                    errors.append(repr(exc))
                j += 1

        async def watch():
            while not stop.is_set():
                if not states or states[-1][1] != m.state:
                    states.append((round(time.perf_counter() - t0, 3), m.state, done[0]))
                await asyncio.sleep(0.005)

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(client(i)) for i in range(64)] + [asyncio.create_task(watch())]
        await asyncio.sleep(1.0)
        before = done[0]
        broken.set()
        await asyncio.sleep(1.5)
        during = done[0] - before
        broken.clear()
        await asyncio.sleep(1.5)
        fault = {"requests": done[0], "errors": len(errors), "error_samples": errors[:3], "states": states,
                 "served_while_broken": during, "fallback_batches": m.fallback_batches, "final_state": m.state}
        # hot swap under load
        errors.clear()
        n0 = done[0]
        t_swap = time.perf_counter()
        await m.swap(lambda: TorchCudaEngine(bert, key=("carried-v2", str(dev)), device=dev, pad_id=meta["pad_id"]))
        swap_s = time.perf_counter() - t_swap
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*tasks)
        swap = {"requests_during_and_after": done[0] - n0, "errors": len(errors), "error_samples": errors[:3],
                "swap_seconds": round(swap_s, 2), "old_closed": gpu_engines[0]._e._closed, "swaps": m.swaps}
        await enc.close()
        return {"fault": fault, "swap": swap}

    return bench.run_async(go(), bench.loop_factory("auto"))


def server_fault(carry: Path, rec: Recorder, kill_at_s: float = 5.0, run_s: float = 60.0) -> dict[str, Any]:
    """The engine server killed (SIGKILL) under load: 2 worker processes, c = 64 for ``run_s``;
    the workers' batches go to their ONNX Runtime fallback until the restarted server
    (model load included) answers their circuit's probe. Errors counted; which engine
    the workers served with, sampled every 0.5 s."""
    from inference.config import InferenceConfig
    from inference.bench import QUESTIONS, drive
    from inference.multiproc.router import ProcessPoolEncoder

    engines_dir = materialize_engines_dir(carry)

    async def go() -> dict[str, Any]:
        cfg = InferenceConfig(device_processes=2, engine_server=True, devices=["0"], onnx_precision="fp32",
                              engine_order=["torch_cuda", "onnxruntime"], fallback_engine="onnxruntime",
                              max_queue_delay_ms=0, max_queue_size=8192, circuit_reset_s=1.0,
                              circuit_max_reset_s=4.0)
        enc = await ProcessPoolEncoder.create(cfg, engines_dir)
        server = enc.servers[0]
        samples: list[tuple[float, list[str]]] = []
        t0 = time.perf_counter()
        old_pid = server.info["pid"]

        async def watch() -> None:
            killed = False
            while time.perf_counter() - t0 < run_s:
                now = time.perf_counter() - t0
                if not killed and now >= kill_at_s:
                    os.kill(old_pid, 9)
                    killed = True
                samples.append((round(now, 1), sorted(w.engine_name for w in enc.workers)))
                await asyncio.sleep(0.5)

        try:
            r, _ = await asyncio.gather(drive(lambda t: enc.encode([t]), QUESTIONS, 64, run_s), watch())
        finally:
            await enc.close()
        back = next((t for t, names in samples if t > kill_at_s and set(names) == {"torch_cuda"}), None)
        out = {"requests": r["requests"], "errors": r["errors"], "throughput": r["throughput"],
               "p99_ms": r["p99_ms"], "server_restarts": server.restarts, "old_pid": old_pid,
               "new_pid": server.info.get("pid"), "killed_at_s": kill_at_s, "all_back_on_gpu_at_s": back,
               "samples": samples}
        rec.log(f"    server killed at {kill_at_s} s: {r['requests']} requests, {r['errors']} errors, "
                f"restarts {server.restarts}, all workers back on torch_cuda at {back} s")
        return out

    return asyncio.run(go())


def run_pytest() -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_torch_cuda.py",
                        "-rs"], cwd=REPO, capture_output=True, text=True, timeout=300)
    tail = (p.stdout + p.stderr).strip().splitlines()[-15:]
    return {"returncode": p.returncode, "tail": tail}


ALL_STEPS = ("parity", "latency", "memory", "pool", "tensorrt", "pytest")


def run(carry: Path, out: Path, seconds: float, device: str, steps=ALL_STEPS) -> int:
    rec = Recorder(out)
    import torch

    from inference.engines.torch_cuda.engine import TorchCudaEngine

    rec.results["env"] = env_info(device)
    rec.log(json.dumps(rec.results["env"]))
    bert, meta = load_carried_bert(carry)
    rec.results["meta"] = meta
    dev: Any = 0 if device == "cuda" else "cpu"

    def make_engine(cuda_graphs: bool = True, key: Any = "bench", **kw):
        return TorchCudaEngine(bert, key=key, device=dev, cuda_graphs=cuda_graphs, pad_id=meta["pad_id"], **kw)

    engines_dir = unpack_engines_dir(carry)
    quick = device == "cpu"
    want = set(steps)
    gpu = device == "cuda"
    if "parity" in want:
        rec.step("parity", lambda: parity(make_engine, carry))
    if "latency" in want:
        grid_b, grid_t = ((1, 8), (16, 64)) if quick else (BATCHES, SEQS)
        rec.step("latency", lambda: latency_grid(make_engine, 0.05 if quick else 0.25, grid_b, grid_t))
    if "memory" in want and gpu:
        rec.step("memory", lambda: memory(make_engine))
    if "memory_caps" in want and gpu:
        rec.step("memory_caps", lambda: memory_caps(bert, meta["pad_id"]))
    if "gpu_time" in want and gpu:
        rec.step("gpu_time", lambda: gpu_time(make_engine))
    if "frontend" in want:
        rec.step("frontend", lambda: frontend(engines_dir, seconds, rec))
    if "pool" in want:
        rec.step("pool", lambda: asyncio.run(pool_bench(make_engine, engines_dir, seconds, rec)))
    if "pool_uvloop" in want:
        import uvloop

        plan = [(1, "batched", 0.0, 256, "encode", CONCURRENCIES), (1, "batched", 0.0, 256, "pretokenized", CONCURRENCIES)]
        rec.step("pool_uvloop", lambda: asyncio.run(pool_bench(make_engine, engines_dir, seconds, rec, plan, "-uvloop"),
                                                    loop_factory=uvloop.new_event_loop))
    if "accuracy" in want:
        rec.step("accuracy_fp16", lambda: accuracy_fp16(make_engine, carry))
    if "frontend_null" in want:
        rec.step("frontend_null", lambda: frontend_null(engines_dir, seconds))
    if "bench" in want:
        patch_torch_cuda_loader(bert, meta, gpu)
        plan = BENCH_PLAN if gpu else [("cpu-smoke", "auto", 1, 0.0, 0.5, None, (1, 8), (True, False)),
                                       ("cpu-smoke-inline", "auto", 1, 0.0, 0.5, 10**9, (8,), (True,))]
        rec.step("healthbot_bench", lambda: healthbot_bench(engines_dir, out, seconds, rec, plan))
    if "procs" in want:
        rec.step("process_per_gpu_1", lambda: process_per_gpu(carry, seconds, rec, 1, quick))
        rec.step("process_per_gpu_2", lambda: process_per_gpu(carry, seconds, rec, 2, quick))
    for plan in CLI_PLANS:
        if f"cli-{plan}" in want:
            rec.step(f"cli_{plan}", lambda plan=plan: cli_bench(carry, out, seconds, rec, [plan], quick))
    if "multigpu" in want:
        patch_torch_cuda_loader(bert, meta, gpu)
        rec.step("multi_gpu_bench", lambda: multi_gpu_bench(engines_dir, seconds, rec))
    if "server-fault" in want:
        rec.step("server_fault", lambda: server_fault(carry, rec))
    if "fault" in want:
        rec.step("fault_and_swap", lambda: fault_and_swap(bert, meta, engines_dir, dev))
    if "tensorrt" in want and gpu:
        rec.step("tensorrt_cuda_python", lambda: tensorrt_cuda_python_path(2.0))
    if "pytest" in want and gpu:
        rec.step("pytest_torch_cuda", run_pytest)
    summarize(rec)
    rec.save()
    del torch
    return 0


def summarize(rec: Recorder) -> None:
    r = rec.results
    lines = ["", "===== SUMMARY ====="]
    p = r.get("parity") or {}
    for k in ("graphs", "eager"):
        if isinstance(p.get(k), dict):
            lines.append(f"parity {k}: min cos single {p[k]['single_min_cosine']:.6f} batched {p[k]['batched_min_cosine']:.6f}")
    lat = (r.get("latency") or {}).get("rows", [])
    if lat:
        lines.append("batch seq  eager_ms graphs_ms speedup enc/s(graphs)")
        lines += [f"{x['batch']:5d} {x['seq']:4d} {x['eager_ms']:9.3f} {x['graphs_ms']:9.3f} {x['speedup']:7.2f} "
                  f"{x['graphs_encodes_per_s']:9d}" for x in lat]
    if "memory" in r:
        lines.append(f"memory: {json.dumps(r['memory'])}")
    for x in (r.get("pool") or {}).get("runs", []):
        lines.append(f"pool w={x['workers']} {x['batching']:9s} d={x['max_queue_delay_ms']} {x['mode']:12s} "
                     f"c={x['concurrency']:3d}: {x['throughput']:9.1f}/s p50 {x['p50_ms']:7.2f} p99 {x['p99_ms']:7.2f} "
                     f"batch {x['mean_batch']} err {x['errors']}")
    for k in ("memory_caps",):
        if k in r:
            lines.append(f"{k}: {json.dumps(r[k])}")
    for x in (r.get("gpu_time") or {}).get("rows", []):
        lines.append(f"gpu_time B={x['batch']:3d} T={x['seq']:3d}: replay {x['replay_ms']:.3f} ms, infer {x['infer_ms']:.3f} ms")
    fe = r.get("frontend") or {}
    if "tokenize_one_us" in fe:
        lines.append(f"tokenize: {fe['tokenize_one_us']} us/text alone, {fe['tokenize_batch32_us_per_text']} us/text in 32s")
    for key in ("null_asyncio", "null_uvloop"):
        for x in (fe.get(key) or {}).get("runs", []):
            lines.append(f"{key} {x['mode']:12s} c={x['concurrency']}: {x['throughput']:9.1f}/s p50 {x['p50_ms']} p99 {x['p99_ms']} batch {x['mean_batch']}")
    for x in (r.get("pool_uvloop") or {}).get("runs", []):
        lines.append(f"pool-uvloop {x['mode']:12s} c={x['concurrency']:3d}: {x['throughput']:9.1f}/s p50 {x['p50_ms']:7.2f} "
                     f"p99 {x['p99_ms']:7.2f} batch {x['mean_batch']}")
    if isinstance(r.get("accuracy_fp16"), dict) and "min_cosine" in r["accuracy_fp16"]:
        a = r["accuracy_fp16"]
        lines.append(f"accuracy fp16: min cosine {a['min_cosine']} (threshold {a['threshold']}): "
                     f"{'ok' if a['passed'] else 'FAILED'}")
    for loop, runs in (r.get("frontend_null") or {}).items():
        if isinstance(runs, dict):
            for c, x in runs.items():
                lines.append(f"null-engine front end {loop} {c}: {x['throughput']:.0f}/s p50 {x['p50_ms']} p99 {x['p99_ms']} "
                             f"batch {x['mean_batch_size']}")
    for label, res in (r.get("healthbot_bench") or {}).items():
        if isinstance(res, dict) and "runs" in res:
            for x in res["runs"]:
                mode = "engine-only" if x.get("engine_only") else ("batched" if x["batched"] else "unbatched")
                lines.append(f"bench {label} {mode:11s} c={x['concurrency']}: {x['throughput']:9.1f}/s p50 {x['p50_ms']} "
                             f"p99 {x['p99_ms']} batch {x.get('mean_batch_size', x.get('batch_size'))}")
            lines.append(f"bench {label} engines: {json.dumps(res.get('engines'))}")
    if "fault_and_swap" in r:
        lines.append(f"fault_and_swap: {json.dumps(r['fault_and_swap'])[:900]}")
    for k in ("tensorrt_cuda_python", "pytest_torch_cuda"):
        if k in r:
            lines.append(f"{k}: {json.dumps(r[k])[:600]}")
    for k, v in r.items():
        if isinstance(v, dict) and "error" in v:
            lines.append(f"FAILED {k}: {v['error']}")
    rec.log("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--engines-dir", type=Path, default=REPO / "engines")
    p.add_argument("--out", type=Path, default=REPO / ".gpucarry")
    r = sub.add_parser("run")
    r.add_argument("--carry", type=Path, default=REPO / ".gpucarry")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    r.add_argument("--seconds", type=float, default=4.0, help="seconds per pool run")
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    r.add_argument("--steps", default=",".join(ALL_STEPS),
                   help="comma list of: parity, latency, memory, memory_caps, gpu_time, frontend, pool, "
                        "pool_uvloop, tensorrt, pytest; and (new front end) accuracy, frontend_null, bench, fault; "
                        "procs, multigpu, server-fault; cli-scaling, cli-scaling-in-process, cli-single, cli-tune, "
                        "cli-mps, cli-server, cli-server-check (healthbot bench runs, CLI_PLANS)")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        pack(args.engines_dir, args.out)
        return 0
    return run(args.carry, args.out, args.seconds, args.device, tuple(args.steps.split(",")))


if __name__ == "__main__":
    sys.exit(main())
