"""Where the time goes in the engine-server layout at c = 256 (what the sixth session's
finding in docs/benchmarks.md was measured with, on the H200).

For each run of a plan: a :class:`~inference.multiproc.router.ProcessPoolEncoder` on GPU 0
(engine server, ``procs`` worker processes, max queue delay 0, switch interval 0.5 ms),
200 warm-up texts, then ``drive`` at c = 256 for ``seconds``; it prints one ``SUM`` line:
encodes/s, p50, the workers' and the engine server's mean batch, the engine-only ceiling
(``ceiling`` = 1), the CPU time per text of the routing process, the worker processes and
the engine server (from /proc, all threads), and the server's view of the GPU: the share of
wall time a batch was on it (``busy``) and the mean time per merged batch.

Usage (on the GPU machine, after ``gpu_bench.materialize_engines_dir``)::

    python3 tools/pool_profile.py engines '[["real", 6, 4, 1, {}], ["null", 6, 3, 0, {}]]'

Each run is ``[loader, procs, seconds, ceiling, knobs]``: loader ``real`` (the GPU engine
``inference.multiproc.engine_server`` loads, timed) or ``null`` (answers at once: the front end
alone); knobs override constants of the routing process
(``inference.batching.merge.MIN_TEXTS_PER_MESSAGE``, ``inference.multiproc.supervision.REMOTE_BATCHES_IN_FLIGHT``), ``InferenceConfig`` fields
(``switch_interval_ms``) or, as ``slots``, the batches the
server may launch on the GPU before the last one finished (1 = one at a time).
``HEALTHBOT_ASSUME_GPU=1`` runs the ``null`` loader on a CPU machine (smoke test; numbers meaningless).
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tools"), os.environ.get("PYTHONPATH")]))

#: Where the engine server's hook writes its GPU view (one file per profiling process).
STATS = Path(os.environ.setdefault("POOL_PROFILE_STATS",
                                   str(Path(tempfile.gettempdir()) / f"pool-profile-{os.getpid()}.json")))
_TICK = os.sysconf("SC_CLK_TCK")


class _Timed:
    """Wraps the server's engine: wall time a batch was on the GPU (from its launch, or the
    previous batch's end, to its finish), written to :data:`STATS` every 500 batches."""

    def __init__(self, engine, slots: int | None) -> None:
        self.engine, self._lock = engine, threading.Lock()
        if slots is not None:
            self.launch_slots = slots
        self._reset(0.0)

    def _reset(self, now: float) -> None:
        self.calls, self.busy, self.first, self.prev_end = 0, 0.0, now, now

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _record(self, started: float, ended: float) -> None:
        with self._lock:
            self.calls += 1
            self.busy += ended - max(started, self.prev_end)
            self.prev_end = ended
            if self.calls == 500:
                STATS.write_text(json.dumps({"busy": round(self.busy / (ended - self.first), 3),
                                             "ms_per_batch": round(self.busy / self.calls * 1000, 3)}))
                self._reset(ended)

    def launch(self, ids, mask):
        started = time.perf_counter()
        if hasattr(self.engine, "launch"):
            finish = self.engine.launch(ids, mask)
        else:
            out = self.engine.infer(ids, mask)
            finish = lambda: out  # noqa: E731

        def timed():
            out = finish()
            self._record(started, time.perf_counter())
            return out

        return timed

    def infer(self, ids, mask):
        return self.launch(ids, mask)()


class _Null:
    name, dim, max_batch_size, max_seq_len, precision, gpu_memory_bytes = "torch_cuda", 384, 256, 512, "fp16", 1

    def infer(self, ids, mask):
        return np.ones((ids.shape[0], 384), np.float32)

    def close(self) -> None:
        pass


def _slots():
    return json.loads(os.environ.get("POOL_PROFILE_KNOBS") or "{}").get("slots")


def real(cfg, engines_dir, device):
    """Server loader hook: the GPU engine the engine server would load, timed."""
    from inference.multiproc.engine_server import load_engines

    return _Timed(load_engines(dataclasses.replace(cfg, workers=1), engines_dir, device)[0], _slots())


def null(cfg, engines_dir, device):
    """Server loader hook: an engine that answers at once (the front end alone)."""
    return _Timed(_Null(), _slots())


def _cpu_seconds(pid: int) -> float:
    total = 0.0
    for task in glob.glob(f"/proc/{pid}/task/*/stat"):
        try:
            fields = Path(task).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


async def run(engines_dir: Path, loader: str, procs: int, seconds: float, ceiling: int, knobs: dict) -> None:
    from inference.config import InferenceConfig
    from inference.multiproc import router as process_pool
    from inference.multiproc import supervision as process_supervision
    from inference.batching import merge
    from inference.bench import QUESTIONS, ceiling_batches_for, drive, mean_batch
    from inference.tokenizer import E5Tokenizer

    saved = {(m, k): getattr(m, k) for m in (merge, process_supervision) for k in knobs if hasattr(m, k)}
    for m, k in saved:
        setattr(m, k, knobs[k])
    os.environ["POOL_PROFILE_KNOBS"] = json.dumps(knobs)
    STATS.unlink(missing_ok=True)
    cfg = InferenceConfig(devices=["0"], device_processes=procs, workers=1, engine_server=True,
                          engine_order=["torch_cuda"], fallback_engine="", max_queue_delay_ms=0,
                          max_queue_size=8192, switch_interval_ms=0.5)
    cfg = dataclasses.replace(cfg, **{k: v for k, v in knobs.items() if hasattr(cfg, k)})
    enc = await process_pool.ProcessPoolEncoder.create(cfg, engines_dir, server_loader=f"pool_profile:{loader}")
    try:
        for text in QUESTIONS[:200]:
            await enc.encode([text])
        groups = {"main": [os.getpid()], "workers": [w.process.pid for w in enc.workers],
                  "server": [s.process.pid for s in enc.servers.values()]}
        b0, s0 = await enc.batch_stats(), await enc.server_stats()
        c0 = {g: sum(map(_cpu_seconds, pids)) for g, pids in groups.items()}
        r = await drive(lambda t: enc.encode([t]), QUESTIONS, 256, seconds)
        c1 = {g: sum(map(_cpu_seconds, pids)) for g, pids in groups.items()}
        b1, s1 = await enc.batch_stats(), await enc.server_stats()
        gpu = json.loads(STATS.read_text()) if STATS.exists() else {}
        ceil = None
        if ceiling:
            tok = E5Tokenizer.load(engines_dir)
            batches = ceiling_batches_for(tok, QUESTIONS, 256, cfg.max_batch_tokens)
            got = await asyncio.gather(*(enc.call(w, "engine_only", batches=batches, pad_id=tok.pad_id, seconds=3.0)
                                         for w in enc.workers))
            ceil = round(sum(g["throughput"] for g in got))
        us = {g: round((c1[g] - c0[g]) / r["requests"] * 1e6, 1) for g in groups}
        print("SUM", loader, procs, knobs, "encodes/s", round(r["throughput"]), "p50", r["p50_ms"],
              "worker batch", mean_batch(b0, b1), "merged", mean_batch(s0, s1), "ceiling", ceil,
              "us/text main", us["main"], "workers", us["workers"], "server", us["server"],
              "gpu busy", gpu.get("busy"), "ms/batch", gpu.get("ms_per_batch"), flush=True)
    finally:
        await enc.close()
        STATS.unlink(missing_ok=True)
        for (m, k), v in saved.items():
            setattr(m, k, v)


async def main(argv: list[str]) -> None:
    for spec in json.loads(argv[1]):
        await run(Path(argv[0]), *spec)


if __name__ == "__main__":
    from inference.multiproc.child import loop_factory, run_async

    run_async(main(sys.argv[1:]), loop_factory("auto"))
