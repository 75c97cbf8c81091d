"""Engine server: one process per GPU that owns the GPU engine and runs the padded
batches of every worker process on it, merged into fewer, larger batches
(``inference.engine_server``, issue 6).

Why: a replayed e5-small batch on an H200 costs about what its kernels' launch
latencies add up to (20 x 27 tokens 0.71 ms, 100 x 27 1.50 ms, 250 x 27 2.60 ms;
docs/benchmarks.md), so the worker processes' batches of 15-40, each run by its
own engine, kept the GPU busy with small batches (kernels of different processes
take turns without NVIDIA MPS). Here the worker processes keep their tokenizer,
dynamic batcher and CPU fallback, but their GPU engine is a
:class:`~inference.engines.remote.RemoteEngine` that sends each padded batch
here; whatever batches arrived while the GPU was busy run as one, and the next
merged batch is launched behind the running one (two on the GPU), so the GPU does
not wait for this process's Python between batches. Measured on one H200 at
c = 256 with 4 worker processes: 45.7-57.5k encodes/s against 33-36k/s with an
engine per worker process on the same machine instances (docs/benchmarks.md,
sixth session); 45.8-62.9k/s since each worker runs a message as one batch at
once (seventh session), 51.5-63.7k/s since SentencePiece splits the texts (eighth),
50.4-67.4k/s since each worker tokenizes on its event loop (ninth).

The server holds ``inference.workers`` engines of the GPU (each on its own
thread and CUDA stream; torch_cuda instances share the weights); 1 measured best
(two raised the engine-only ceiling more than the pool: eighth session).

Started by :class:`~inference.multiproc.router.ProcessPoolEncoder` as ``python -m
inference.multiproc.engine_server --fd N`` (a fresh interpreter), with a control socket
(``N``) and a Unix socket path that worker processes connect to. Messages on
both are framed by :mod:`inference.multiproc.framing` (processes of this user only: the
socket's folder is created mode 0700 by the pool).

- control, parent → server: ``("init", {cfg, engines_dir, device, path})`` once,
  ``("call", id, "stats")`` (batches, rows, requests, and ``running_s``: how
  long the oldest batch on an engine has been running; the pool kills a server
  whose batch runs past the deadline), ``("close",)``; server → parent:
  ``("ready", info)`` or ``("failed", message)`` once, ``("result", id, value)``.
  End of file on the control socket (the parent died) stops the server.
- per worker connection: server → worker ``("hello", info)`` on connect; worker
  → server ``("infer", int64[B, T] input_ids, int64[B, T] attention_mask)``,
  one at a time; server → worker ``("ok", float32[B, D])`` or ``("err", message)``.

``info``: ``name`` (the engine that loaded, e.g. ``"torch_cuda"``), ``dim``,
``max_batch_size``, ``max_seq_len``, ``precision``, ``gpu_memory_bytes``,
``device``, ``pid``.

**Merging.** The server takes every batch waiting when the GPU becomes free
(no added delay: the front ends' batchers already waited) and runs them in as
few engine calls as :func:`merge_plan` allows: up to ``min(engine.max_batch_size,
inference.gpu_max_batch_size)`` rows and ``inference.max_batch_tokens`` padded
tokens per call, with at most 2x padding waste, padded to the group's longest
window. Added columns get id 0 with mask 0: masked positions do not change the
output (attention ignores them as keys, mean pooling skips them).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import pickle
import queue
import selectors
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import structlog

from inference.batching.merge import merge, merge_plan
from inference.multiproc.child import child_config, import_hook
from inference.config import InferenceConfig
from inference.devices import GPU_ENGINES
from inference.encoder import apply_process_settings
from inference.engines.base import Engine, engine_precision
from inference.engines.loader import load_engine_factory
from inference.multiproc.framing import recv_frame, send_frame

log = structlog.get_logger("healthbot.inference.engine_server")

class EngineServer:
    """The server loop over one or more loaded engines of one GPU (module doc).

    This thread accepts connections, reads batches, forms merged batches and
    answers the callers. Each engine has a launch thread (merges the batches and
    starts them: :meth:`TorchCudaEngine.launch` queues the batch on the engine's
    stream and returns) and a finish thread (waits for each launched batch in
    order and hands its rows back here). A merged batch is handed to an engine as
    soon as it has fewer than ``launch_slots`` batches unfinished (2 for
    torch_cuda: the next batch waits on the GPU behind the running one, so the GPU
    does not wait for this process's Python in between; 1 for an engine without
    ``launch``, which runs each batch to the end); batches that arrive meanwhile
    wait together for the next free slot, and the last batch's callers are
    answered after the next batch is on its way.

    Attributes:
        batches: merged batches run; ``rows``: rows run; ``requests``: worker batches served.
    """

    def __init__(self, engines: Sequence[Engine], listener: socket.socket, control: socket.socket, max_rows: int,
                 max_tokens: int, info: dict[str, Any]) -> None:
        self.engines = list(engines)
        self.listener = listener
        self.control = control
        self.max_rows = max(1, min(int(self.engines[0].max_batch_size), max_rows))
        self.max_tokens = max_tokens
        self.info = info
        self.batches = self.rows = self.requests = 0
        self._stats_lock = threading.Lock()
        #: Merged batches each engine may have unfinished (touched by this thread only: _in_flight).
        self._slots = [int(getattr(e, "launch_slots", 1)) if hasattr(e, "launch") else 1 for e in self.engines]
        self._in_flight = [0] * len(self.engines)
        #: Per engine, time.monotonic() of each unfinished batch's launch, oldest first (under _stats_lock).
        self._launched_at: list[collections.deque[float]] = [collections.deque() for _ in self.engines]
        self._done: queue.SimpleQueue[tuple[int, list, list]] = queue.SimpleQueue()
        self._jobs: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in self.engines]
        self._launched: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in self.engines]
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, "listen")
        self._sel.register(control, selectors.EVENT_READ, "control")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._threads = [threading.Thread(target=loop, args=(i,), name=f"engine-{i}-{loop.__name__[1:-5]}", daemon=True)
                         for i in range(len(self.engines)) for loop in (self._launch_loop, self._finish_loop)]

    def serve(self) -> None:
        """Serve until ``close`` or end of file on the control socket; then let the engine
        threads finish their batches and stop them (the engines stay open)."""
        for t in self._threads:
            t.start()
        try:
            self._loop()
        finally:
            for jobs in self._jobs:
                jobs.put(None)
            for t in self._threads:
                t.join()
            self._wake_r.close()
            self._wake_w.close()

    def _free_engine(self) -> int | None:
        """The engine with a free launch slot and the fewest batches unfinished, or None."""
        free = [i for i, n in enumerate(self._in_flight) if n < self._slots[i]]
        return min(free, key=self._in_flight.__getitem__) if free else None

    def _loop(self) -> None:
        pending: list[tuple[socket.socket, np.ndarray, np.ndarray]] = []
        while True:
            can_run = pending and self._free_engine() is not None
            for key, _ in self._sel.select(timeout=0 if can_run else None):
                if key.data == "listen":
                    self._accept()
                elif key.data == "control":
                    if not self._control():
                        return
                elif key.data == "wake":
                    self._wake_r.recv(4096)
                else:
                    try:
                        msg = recv_frame(key.fileobj)
                    except (OSError, ConnectionError, pickle.UnpicklingError, EOFError):
                        self._drop(key.fileobj)
                        continue
                    if msg[0] == "infer":
                        pending.append((key.fileobj, msg[1], msg[2]))
            finished = []
            while not self._done.empty():
                index, items, replies = self._done.get()
                self._in_flight[index] -= 1
                finished.append((items, replies))
            if pending:
                groups = merge_plan([ids.shape for _, ids, _ in pending], self.max_rows, self.max_tokens)
                while groups and (index := self._free_engine()) is not None:
                    self._in_flight[index] += 1
                    self._jobs[index].put([pending[i] for i in groups.pop(0)])
                pending = [pending[i] for g in groups for i in g]
            for items, replies in finished:  # after the next batch is on its way to the GPU
                self._answer(items, replies)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.setblocking(True)
        try:
            send_frame(conn, ("hello", self.info))
        except OSError:
            conn.close()
            return
        self._sel.register(conn, selectors.EVENT_READ, "worker")

    def _drop(self, conn: socket.socket) -> None:
        self._sel.unregister(conn)
        conn.close()

    def _control(self) -> bool:
        try:
            msg = recv_frame(self.control)
        except (OSError, ConnectionError):
            return False  # the parent is gone
        if msg[0] == "close":
            return False
        if msg[0] == "call":
            now = time.monotonic()
            with self._stats_lock:
                oldest = [q[0] for q in self._launched_at if q]
                stats = {"batches": self.batches, "rows": self.rows, "requests": self.requests,
                         "running_s": max((now - t for t in oldest), default=0.0)}
            send_frame(self.control, ("result", msg[1], stats if msg[2] == "stats"
                                      else {"error": f"unknown call {msg[2]!r}"}))
        return True

    def _launch_loop(self, index: int) -> None:
        """Engine ``index``'s launch thread: merge each job's batches and start them."""
        engine = self.engines[index]
        while (items := self._jobs[index].get()) is not None:
            with self._stats_lock:
                self._launched_at[index].append(time.monotonic())
            try:
                ids, mask = merge([(i, m) for _, i, m in items])
                if hasattr(engine, "launch"):
                    finish: Callable[[], np.ndarray] | Exception = engine.launch(ids, mask)
                else:
                    out = engine.infer(ids, mask)
                    finish = lambda out=out: out  # noqa: E731
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the callers
                finish = exc
            self._launched[index].put((items, finish))
        self._launched[index].put(None)

    def _finish_loop(self, index: int) -> None:
        """Engine ``index``'s finish thread: wait for each launched batch, in launch order,
        and hand its replies to the server loop."""
        while (job := self._launched[index].get()) is not None:
            items, finish = job
            replies = self._replies(items, finish)
            with self._stats_lock:
                self._launched_at[index].popleft()
            self._done.put((index, items, replies))
            self._wake_w.send(b"w")

    def _replies(self, items: list[tuple[socket.socket, np.ndarray, np.ndarray]],
                 finish: Callable[[], np.ndarray] | Exception) -> list[tuple]:
        """The reply to each caller of one merged batch (its rows, or the error)."""
        rows = sum(i.shape[0] for _, i, _ in items)
        try:
            if isinstance(finish, Exception):
                raise finish
            out = finish()
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the callers
            log.error("engine_server_batch_failed", rows=rows, error=str(exc))
            with self._stats_lock:
                self.requests += len(items)
            return [("err", f"{self.info['name']} in the engine server: {exc}")] * len(items)
        replies = []
        row = 0
        for _, i, _ in items:
            replies.append(("ok", out[row:row + i.shape[0]]))
            row += i.shape[0]
        with self._stats_lock:
            self.requests += len(items)
            self.batches += 1
            self.rows += rows
        return replies

    def _answer(self, items: list[tuple[socket.socket, np.ndarray, np.ndarray]], replies: list[tuple]) -> None:
        for (conn, _, _), reply in zip(items, replies):
            try:
                send_frame(conn, reply)
            except OSError:
                pass  # the worker is gone: its end of file is read next and the connection dropped


def load_engines(cfg: InferenceConfig, engines_dir: Path, device: int,
                 load: Callable[[InferenceConfig, Path, int], Engine] | None = None) -> list[Engine]:
    """``cfg.workers`` (at least 1) instances of the first GPU engine of ``cfg.engine_order``
    that loads on ``device`` (blocking; torch_cuda instances share the weights), or of what
    ``load(cfg, engines_dir, device)`` returns (tests).

    Raises:
        EngineError: none loads (the message lists each one's reason).
    """
    if load is None:
        gpu_order = [n for n in cfg.engine_order if n in GPU_ENGINES]
        factory = load_engine_factory(dataclasses.replace(cfg, engine_order=gpu_order, devices=[str(device)],
                                                          engine_socket=""), engines_dir)
        load = lambda _cfg, _dir, dev: factory(dev)  # noqa: E731
    return [load(cfg, engines_dir, device) for _ in range(max(1, cfg.workers))]


def _serve(control: socket.socket) -> int:
    _, init = recv_frame(control)
    cfg = child_config(init)
    device = int(init["device"])
    try:
        # tests: "module:function"
        engines = load_engines(cfg, Path(init["engines_dir"]), device,
                               import_hook(init["loader"]) if init.get("loader") else None)
        engine = engines[0]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(init["path"])  # left by a server that died (this one is its restart)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(init["path"])
        listener.listen(64)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises EngineError
        send_frame(control, ("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    info = {"name": engine.name, "engines": len(engines), "dim": int(engine.dim),
            "max_batch_size": int(engine.max_batch_size), "max_seq_len": int(engine.max_seq_len),
            "precision": engine_precision(engine),
            "gpu_memory_bytes": getattr(engine, "gpu_memory_bytes", None), "device": device, "pid": os.getpid()}
    apply_process_settings(cfg)  # the operator's GIL switch interval here too (engine thread + this one)
    server = EngineServer(engines, listener, control, cfg.gpu_max_batch_size, cfg.max_batch_tokens, info)
    send_frame(control, ("ready", info))
    log.info("engine_server_ready", **info, path=init["path"], max_rows=server.max_rows,
             max_tokens=server.max_tokens)
    try:
        server.serve()
    finally:
        listener.close()
        for e in engines:
            e.close()
        log.info("engine_server_stopped", batches=server.batches, rows=server.rows, requests=server.requests)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m inference.multiproc.engine_server --fd N`` (started by :class:`ProcessPoolEncoder`)."""
    ap = argparse.ArgumentParser(description="healthbot engine server (started by the server process)")
    ap.add_argument("--fd", type=int, required=True, help="the control socket to the parent process")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent drains first, then sends "close"
    return _serve(socket.socket(fileno=args.fd))


if __name__ == "__main__":
    sys.exit(main())
