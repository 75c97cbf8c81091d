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
here; whatever batches arrived while the GPU was busy run as one.

Started by :class:`~inference.process_pool.ProcessPoolEncoder` as ``python -m
inference.engine_server --fd N`` (a fresh interpreter), with a control socket
(``N``) and a Unix socket path that worker processes connect to. Messages on
both are framed by :mod:`inference.framing` (processes of this user only: the
socket's folder is created mode 0700 by the pool).

- control, parent → server: ``("init", {cfg, engines_dir, device, path})`` once,
  ``("call", id, "stats")``, ``("close",)``; server → parent: ``("ready", info)``
  or ``("failed", message)`` once, ``("result", id, value)``. End of file on the
  control socket (the parent died) stops the server.
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
tokens per call, padded to the group's longest window. Added columns get id 0
with mask 0: masked positions do not change the output (attention ignores them
as keys, mean pooling skips them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import pickle
import selectors
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import structlog

from bot.config import InferenceConfig
from inference.engines.base import Engine, EngineError
from inference.framing import recv_frame, send_frame

log = structlog.get_logger("healthbot.inference.engine_server")

def merge_plan(shapes: Sequence[tuple[int, int]], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Which waiting batches run together (first fit, in arrival order).

    A batch joins the first open group where the rows stay ≤ ``max_rows`` and the
    padded cost, rows × longest window, stays ≤ ``max_tokens`` (the batcher's
    ``inference.max_batch_tokens``, TEI's padded budget): short queries of any
    length merge, a 400-token passage does not drag 200 queries to its length.

    Args:
        shapes: ``(B, T)`` of each waiting batch, oldest first (each alone within both limits,
            or alone in its group).
        max_rows / max_tokens: limits of one merged batch.

    Returns:
        Groups of indices into ``shapes``, ordered by their oldest batch.
    """
    groups: list[tuple[list[int], int, int]] = []  # (indices, rows, longest)
    for i, (rows, seq) in enumerate(shapes):
        for k, (idx, g_rows, g_seq) in enumerate(groups):
            n, t = g_rows + rows, max(g_seq, seq)
            if n <= max_rows and n * t <= max_tokens:
                idx.append(i)
                groups[k] = (idx, n, t)
                break
        else:
            groups.append(([i], rows, seq))
    return [idx for idx, _, _ in groups]


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


class EngineServer:
    """The server loop over one loaded engine (module doc). Single-threaded: the
    engine runs on this thread, batches that arrive meanwhile wait in the sockets.

    Attributes:
        batches: merged batches run; ``rows``: rows run; ``requests``: worker batches served.
    """

    def __init__(self, engine: Engine, listener: socket.socket, control: socket.socket, max_rows: int,
                 max_tokens: int, info: dict[str, Any]) -> None:
        self.engine = engine
        self.listener = listener
        self.control = control
        self.max_rows = max(1, min(int(engine.max_batch_size), max_rows))
        self.max_tokens = max_tokens
        self.info = info
        self.batches = self.rows = self.requests = 0
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, "listen")
        self._sel.register(control, selectors.EVENT_READ, "control")

    def serve(self) -> None:
        """Serve until ``close`` or end of file on the control socket."""
        pending: list[tuple[socket.socket, np.ndarray, np.ndarray]] = []
        while True:
            for key, _ in self._sel.select(timeout=0 if pending else None):
                if key.data == "listen":
                    self._accept()
                elif key.data == "control":
                    if not self._control():
                        return
                else:
                    try:
                        msg = recv_frame(key.fileobj)
                    except (OSError, ConnectionError, pickle.UnpicklingError, EOFError):
                        self._drop(key.fileobj)
                        continue
                    if msg[0] == "infer":
                        pending.append((key.fileobj, msg[1], msg[2]))
            if pending:
                self._run(pending)
                pending = []

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
            value = ({"batches": self.batches, "rows": self.rows, "requests": self.requests}
                     if msg[2] == "stats" else {"error": f"unknown call {msg[2]!r}"})
            send_frame(self.control, ("result", msg[1], value))
        return True

    def _run(self, pending: list[tuple[socket.socket, np.ndarray, np.ndarray]]) -> None:
        for group in merge_plan([ids.shape for _, ids, _ in pending], self.max_rows, self.max_tokens):
            items = [pending[i] for i in group]
            try:
                ids, mask = merge([(i, m) for _, i, m in items])
                out = self.engine.infer(ids, mask)
                replies = []
                row = 0
                for _, i, _ in items:
                    replies.append(("ok", out[row:row + i.shape[0]]))
                    row += i.shape[0]
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the callers
                log.error("engine_server_batch_failed", rows=sum(i.shape[0] for _, i, _ in items), error=str(exc))
                replies = [("err", f"{self.info['name']} in the engine server: {exc}")] * len(items)
            else:
                self.batches += 1
                self.rows += ids.shape[0]
            self.requests += len(items)
            for (conn, _, _), reply in zip(items, replies):
                try:
                    send_frame(conn, reply)
                except OSError:
                    if conn.fileno() >= 0:
                        self._drop(conn)


def load_engine(cfg: InferenceConfig, engines_dir: Path, device: int) -> Engine:
    """The first GPU engine of ``cfg.engine_order`` that loads on ``device`` (blocking).

    Raises:
        EngineError: none loads (the message lists each one's reason).
    """
    from inference.manager import GPU_ENGINES, load_engine_factory

    gpu_order = [n for n in cfg.engine_order if n in GPU_ENGINES]
    scfg = dataclasses.replace(cfg, engine_order=gpu_order, devices=[str(device)], engine_socket="")
    return load_engine_factory(scfg, engines_dir)(device)


def _serve(control: socket.socket) -> int:
    from bot.logs import configure_logging
    from inference.pool import device_label, engine_precision

    _, init = recv_frame(control)
    configure_logging(init.get("log_level") or "INFO")
    device = int(init["device"])
    structlog.contextvars.bind_contextvars(worker=f"engine-server:{device_label(device)}")
    fields = {f.name for f in dataclasses.fields(InferenceConfig)}
    cfg = InferenceConfig(**{k: v for k, v in init["cfg"].items() if k in fields})
    try:
        if init.get("loader"):  # tests: "module:function"
            module, _, name = init["loader"].partition(":")
            engine = getattr(importlib.import_module(module), name)(cfg, Path(init["engines_dir"]), device)
        else:
            engine = load_engine(cfg, Path(init["engines_dir"]), device)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(init["path"])  # left by a server that died (this one is its restart)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(init["path"])
        listener.listen(64)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises EngineError
        send_frame(control, ("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    info = {"name": engine.name, "dim": int(engine.dim), "max_batch_size": int(engine.max_batch_size),
            "max_seq_len": int(engine.max_seq_len), "precision": engine_precision(engine),
            "gpu_memory_bytes": getattr(engine, "gpu_memory_bytes", None), "device": device, "pid": os.getpid()}
    server = EngineServer(engine, listener, control, cfg.gpu_max_batch_size, cfg.max_batch_tokens, info)
    send_frame(control, ("ready", info))
    log.info("engine_server_ready", **info, path=init["path"], max_rows=server.max_rows, max_tokens=server.max_tokens)
    try:
        server.serve()
    finally:
        listener.close()
        engine.close()
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
