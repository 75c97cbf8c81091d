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
here; whatever batches arrived while the GPU was busy run as one. Measured on one
H200 at c = 256: 42-48k encodes/s against 33-38k/s with an engine per worker
process on the same machine instances (docs/benchmarks.md, fifth session).

The server holds ``inference.workers`` engines of the GPU (each on its own
thread; torch_cuda instances share the weights); 1 measured best.

Started by :class:`~inference.process_pool.ProcessPoolEncoder` as ``python -m
inference.engine_server --fd N`` (a fresh interpreter), with a control socket
(``N``) and a Unix socket path that worker processes connect to. Messages on
both are framed by :mod:`inference.framing` (processes of this user only: the
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

from bot.config import InferenceConfig
from inference.engines.base import Engine
from inference.framing import recv_frame, send_frame

log = structlog.get_logger("healthbot.inference.engine_server")

def merge_plan(shapes: Sequence[tuple[int, int]], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Which waiting batches run together (first fit, in arrival order).

    A batch joins the first open group where, with it, the rows stay ≤ ``max_rows``,
    the padded cost (rows × longest window) stays ≤ ``max_tokens`` (the batcher's
    ``inference.max_batch_tokens``, TEI's padded budget) and at most 2× the tokens
    the batches would cost run apart (the batcher's own bound on padding waste, its
    power-of-two length buckets): queries of 12 and 27 tokens merge, one 512-token
    passage does not drag 8 queries to its length.

    Args:
        shapes: ``(B, T)`` of each waiting batch, oldest first (a batch beyond the limits runs alone).
        max_rows / max_tokens: limits of one merged batch.

    Returns:
        Groups of indices into ``shapes``, ordered by their oldest batch.
    """
    groups: list[list[int]] = []
    state: list[tuple[int, int, int]] = []  # per group: rows, longest, tokens apart
    for i, (rows, seq) in enumerate(shapes):
        for k, (g_rows, g_seq, g_apart) in enumerate(state):
            n, t, apart = g_rows + rows, max(g_seq, seq), g_apart + rows * seq
            if n <= max_rows and n * t <= min(max_tokens, 2 * apart):
                groups[k].append(i)
                state[k] = (n, t, apart)
                break
        else:
            groups.append([i])
            state.append((rows, seq, rows * seq))
    return groups


def merge(batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Stack padded batches ``[(int64[B_i, T_i] ids, int64[B_i, T_i] mask)]`` into one
    int64[sum B_i, max T_i] pair; added columns are id 0, mask 0."""
    if len(batches) == 1:
        return batches[0]
    rows = sum(ids.shape[0] for ids, _ in batches)
    seq = max(ids.shape[1] for ids, _ in batches)
    ids_out = np.zeros((rows, seq), dtype=np.int64)
    mask_out = np.zeros((rows, seq), dtype=np.int64)
    row = 0
    for ids, mask in batches:
        b, t = ids.shape
        ids_out[row:row + b, :t] = ids
        mask_out[row:row + b, :t] = mask
        row += b
    return ids_out, mask_out


#: Host time (s) from a launch thread taking a merged batch to its kernels being queued
#: on the GPU (merge, pinned copy, launch calls; ~0.1-0.3 ms on the H200 host's vCPUs).
#: A batch is launched behind the running one once that one is expected to end within
#: this, so it holds every batch that arrived until then (docs/benchmarks.md, sixth session).
LAUNCH_LEAD_S = 0.0003
#: Weight of the newest batch in each engine's running mean of GPU time per batch.
BATCH_TIME_EMA = 0.2


class EngineServer:
    """The server over one or more loaded engines of one GPU (module doc).

    Three kinds of threads, so that neither the GPU nor the sockets wait for each other:

    - this thread (:meth:`serve`) reads the workers' batches into one pending list and
      answers each caller when its batch is done;
    - each engine's **launch thread** takes the pending batches as one merged batch
      (:func:`merge_plan`) and starts it: :meth:`TorchCudaEngine.launch` queues it on
      the engine's stream and returns. It launches at once when the engine is idle; while
      a batch runs it launches the next one (``launch_slots`` = 2: it waits on the
      GPU behind the running one) when the running one is expected to end within
      :data:`LAUNCH_LEAD_S` (from a running mean of the engine's GPU time per batch),
      so the GPU goes from batch to batch without waiting for this process's Python,
      and each batch still holds everything that arrived while the last one ran. An
      engine without ``launch`` runs each batch to the end (one at a time);
    - each engine's **finish thread** waits for its launched batches in order and
      hands their rows back.

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
        n = len(self.engines)
        #: Guards what the launch and finish threads share: the pending batches and, per
        #: engine, its unfinished batches, the time its GPU is expected to be free, its mean batch time.
        self._cond = threading.Condition()
        self._pending: list[tuple[socket.socket, np.ndarray, np.ndarray]] = []
        self._stopping = False
        self._slots = [int(getattr(e, "launch_slots", 1)) if hasattr(e, "launch") else 1 for e in self.engines]
        self._in_flight = [0] * n
        self._free_at = [0.0] * n  # time.monotonic()
        self._batch_s: list[float | None] = [None] * n
        #: Per engine, time.monotonic() of each unfinished batch's launch, oldest first.
        self._launched_at: list[collections.deque[float]] = [collections.deque() for _ in range(n)]
        self._done: queue.SimpleQueue[tuple[list, list]] = queue.SimpleQueue()
        self._launched: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(n)]
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, "listen")
        self._sel.register(control, selectors.EVENT_READ, "control")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._threads = [threading.Thread(target=loop, args=(i,), name=f"engine-{i}-{loop.__name__[1:-5]}", daemon=True)
                         for i in range(n) for loop in (self._launch_loop, self._finish_loop)]

    def serve(self) -> None:
        """Serve until ``close`` or end of file on the control socket; then let the engine
        threads finish their batches and stop them (the engines stay open)."""
        for t in self._threads:
            t.start()
        try:
            self._loop()
        finally:
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            for t in self._threads:
                t.join()
            self._wake_r.close()
            self._wake_w.close()

    def _loop(self) -> None:
        while True:
            for key, _ in self._sel.select():
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
                        with self._cond:
                            self._pending.append((key.fileobj, msg[1], msg[2]))
                            self._cond.notify_all()
            while not self._done.empty():
                self._answer(*self._done.get())

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
            with self._cond:
                oldest = [q[0] for q in self._launched_at if q]
                stats = {"batches": self.batches, "rows": self.rows, "requests": self.requests,
                         "running_s": max((now - t for t in oldest), default=0.0)}
            send_frame(self.control, ("result", msg[1], stats if msg[2] == "stats"
                                      else {"error": f"unknown call {msg[2]!r}"}))
        return True

    def _launch_wait(self, index: int, now: float) -> float | None:
        """Seconds engine ``index`` should wait before launching the pending batches: 0 = now,
        None = nothing to launch or no free slot (wait to be notified). Under ``_cond``."""
        if not self._pending or self._in_flight[index] >= self._slots[index]:
            return None
        if self._in_flight[index] == 0 or self._batch_s[index] is None:
            return 0.0
        return max(0.0, self._free_at[index] - LAUNCH_LEAD_S - now)

    def _launch_loop(self, index: int) -> None:
        """Engine ``index``'s launch thread: take the pending batches as one merged batch when
        the engine can run it (:meth:`_launch_wait`) and start it."""
        engine = self.engines[index]
        while True:
            with self._cond:
                while (wait := self._launch_wait(index, time.monotonic())) != 0.0:
                    if self._stopping:
                        self._launched[index].put(None)
                        return
                    self._cond.wait(wait)
                groups = merge_plan([ids.shape for _, ids, _ in self._pending], self.max_rows, self.max_tokens)
                items = [self._pending[i] for i in groups[0]]
                self._pending = [self._pending[i] for g in groups[1:] for i in g]
                now = time.monotonic()
                start = max(now, self._free_at[index]) if self._in_flight[index] else now
                self._free_at[index] = start + (self._batch_s[index] or 0.0)
                self._in_flight[index] += 1
                self._launched_at[index].append(now)
            try:
                ids, mask = merge([(i, m) for _, i, m in items])
                if hasattr(engine, "launch"):
                    finish: Callable[[], np.ndarray] | Exception = engine.launch(ids, mask)
                else:
                    out = engine.infer(ids, mask)
                    finish = lambda out=out: out  # noqa: E731
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the callers
                finish = exc
            self._launched[index].put((items, finish, time.monotonic()))

    def _finish_loop(self, index: int) -> None:
        """Engine ``index``'s finish thread: wait for each launched batch, in launch order,
        update the engine's mean batch time, and hand the replies to the server loop."""
        last_end = 0.0
        while (job := self._launched[index].get()) is not None:
            items, finish, launched = job
            replies = self._replies(items, finish)
            end = time.monotonic()
            took = end - max(launched, last_end)  # the GPU's time on it: it started when launched or when the last ended
            last_end = end
            with self._cond:
                self._launched_at[index].popleft()
                self._in_flight[index] -= 1
                mean = self._batch_s[index]
                self._batch_s[index] = took if mean is None else mean + BATCH_TIME_EMA * (took - mean)
                if not self._in_flight[index]:
                    self._free_at[index] = end
                self._cond.notify_all()
            self._done.put((items, replies))
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
            with self._cond:
                self.requests += len(items)
            return [("err", f"{self.info['name']} in the engine server: {exc}")] * len(items)
        replies = []
        row = 0
        for _, i, _ in items:
            replies.append(("ok", out[row:row + i.shape[0]]))
            row += i.shape[0]
        with self._cond:
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
        from inference.manager import GPU_ENGINES, load_engine_factory

        gpu_order = [n for n in cfg.engine_order if n in GPU_ENGINES]
        factory = load_engine_factory(dataclasses.replace(cfg, engine_order=gpu_order, devices=[str(device)],
                                                          engine_socket=""), engines_dir)
        load = lambda _cfg, _dir, dev: factory(dev)  # noqa: E731
    return [load(cfg, engines_dir, device) for _ in range(max(1, cfg.workers))]


def _serve(control: socket.socket) -> int:
    from inference.encoder import apply_process_settings
    from inference.pool import engine_precision
    from inference.process_pool import child_config, import_hook

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
    """``python -m inference.engine_server --fd N`` (started by :class:`ProcessPoolEncoder`)."""
    ap = argparse.ArgumentParser(description="healthbot engine server (started by the server process)")
    ap.add_argument("--fd", type=int, required=True, help="the control socket to the parent process")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent drains first, then sends "close"
    return _serve(socket.socket(fileno=args.fd))


if __name__ == "__main__":
    sys.exit(main())
