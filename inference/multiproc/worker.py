"""A worker process of :class:`~inference.multiproc.router.ProcessPoolEncoder`: ``python -m
inference.multiproc.worker --fd N``. It loads an :class:`~inference.encoder.Encoder` pinned to its
device from the parent's ``init`` message and answers the parent's messages (protocol in
:mod:`inference.multiproc.router`) until ``close`` or end of file."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from inference import metrics
from inference.batching.windows import pad_batch
from inference.multiproc.child import child_config, import_hook, loop_factory, run_async
from inference.devices import device_label
from inference.encoder import Encoder
from inference.multiproc.framing import ERRORS, frame, read_frame


#: Messages a worker embeds with one ``encode`` call at most (≤ 4 × 128 texts, so a
#: group stays well inside ``inference.max_queue_size``'s default 1024 windows).
MAX_MESSAGES_PER_ENCODE = 4


def ceiling_run(batches: list[list[Sequence[int]]], pad_id: int, seconds: float) -> Callable[[Any], dict[str, Any]]:
    """A function for a pool worker's thread: ``engine.infer`` over ``batches``
    (padded once, beforehand) in a loop for ``seconds``; returns ``{"batch_size",
    "seq_len", "calls", "median_ms" (per batch), "throughput" (windows/s), "gpu_memory_mib"}``."""
    padded = [pad_batch(b, pad_id) for b in batches]
    windows = sum(ids.shape[0] for ids, _ in padded)

    def run(engine: Any) -> dict[str, Any]:
        for ids, mask in padded[:3]:
            engine.infer(ids, mask)
        rounds = 0
        t0 = time.perf_counter()
        stop = t0 + seconds
        while time.perf_counter() < stop or rounds < 1:
            for ids, mask in padded:
                engine.infer(ids, mask)
            rounds += 1
        elapsed = time.perf_counter() - t0
        return {"batch_size": max(ids.shape[0] for ids, _ in padded),
                "seq_len": "/".join(sorted({str(ids.shape[1]) for ids, _ in padded}, key=int)),
                "calls": rounds * len(padded), "median_ms": round(elapsed / (rounds * len(padded)) * 1000.0, 3),
                "throughput": round(rounds * windows / elapsed, 1),
                "gpu_memory_mib": (round(engine.gpu_memory_bytes / 2**20, 1)
                                   if getattr(engine, "gpu_memory_bytes", None) else None)}

    return run


async def _serve(sock: socket.socket) -> int:
    """The worker: load an :class:`Encoder` from ``init``, then answer messages until
    ``close`` or end of file. Exit code 0, or 1 when the encoder could not load."""
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    _, init = await read_frame(reader)
    cfg = child_config(init)
    # tests and the front-end bench: "module:function"
    create = import_hook(init["encoder_factory"]) if init.get("encoder_factory") else Encoder.create
    try:
        encoder = await create(cfg, Path(init["engines_dir"]))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises EngineError
        writer.write(frame(("failed", f"{type(exc).__name__}: {exc}")))
        await writer.drain()
        return 1
    if getattr(encoder, "batcher", None) is not None:
        # This loop serves nothing but the encoder: a message's texts are tokenized on it,
        # not handed to the tokenizer thread and back (0.82 ms per 32-text message on the
        # H200 host, of which 0.27 ms the two hops; docs/benchmarks.md, ninth session).
        encoder.batcher.inline_tokenize_max = sys.maxsize
    primary = getattr(encoder.pool, "primary", encoder.pool)  # a ModelManager, or a bare pool
    writer.write(frame(("ready", {
        "engine": encoder.engine_name, "precision": primary.precision, "variant": encoder.variant,
        "dim": encoder.dim, "engines": primary.workers, "pid": os.getpid(),
        "devices": [device_label(d) for d in primary.devices],
        "max_batch_size": encoder.batcher.max_batch_size})))
    tasks: set[asyncio.Task] = set()
    loop = asyncio.get_running_loop()
    inbox: list[tuple[int, str, list[str]]] = []

    def spawn(coro: Any) -> None:
        task = loop.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def drain() -> None:
        # Every message read since the last drain (all that were buffered while this
        # loop was busy) is embedded with ONE encode per prefix: one tokenizer call.
        groups: dict[str, list[tuple[int, list[str]]]] = {}
        for mid, prefix, texts in inbox:
            groups.setdefault(prefix, []).append((mid, texts))
        inbox.clear()
        for prefix, items in groups.items():
            for start in range(0, len(items), MAX_MESSAGES_PER_ENCODE):
                spawn(encode(prefix, items[start:start + MAX_MESSAGES_PER_ENCODE]))

    async def encode(prefix: str, items: list[tuple[int, list[str]]]) -> None:
        texts = [t for _, ts in items for t in ts]
        try:
            vectors = await encoder.encode(texts, prefix)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
            kind = type(exc).__name__ if type(exc).__name__ in ERRORS else "EngineError"
            for mid, _ in items:
                writer.write(frame(("err", mid, kind, str(exc))))
            return
        row = 0
        for mid, ts in items:
            writer.write(frame(("ok", mid, encoder.engine_name, vectors[row:row + len(ts)])))
            row += len(ts)

    async def call(mid: int, name: str, kwargs: dict) -> None:
        try:
            if name == "stats":
                result: Any = (encoder.batcher.stats.batches_run, encoder.batcher.stats.requests_run)
            elif name == "engine_only":
                result = await encoder.pool.call_on_worker(ceiling_run(**kwargs))
            elif name == "metrics":
                result = metrics.render()[0].decode("utf-8")
            else:
                result = {"error": f"unknown call {name!r}"}
        except Exception as exc:  # noqa: BLE001
            result = {"error": f"{type(exc).__name__}: {exc}"}
        writer.write(frame(("result", mid, result)))

    try:
        while True:
            try:
                m = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break  # the parent is gone
            if m[0] == "close":
                break
            if m[0] == "encode":
                if not inbox:
                    loop.call_soon(drain)
                inbox.append(m[1:])
            else:
                spawn(call(*m[1:]))
    finally:
        await encoder.close()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await writer.drain()
            writer.close()
        except (ConnectionError, OSError):
            pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m inference.multiproc.worker --fd N``: a worker process (started by :class:`ProcessPoolEncoder`)."""
    ap = argparse.ArgumentParser(description="healthbot inference worker process (started by the server)")
    ap.add_argument("--fd", type=int, required=True, help="the socket to the parent process")
    args = ap.parse_args(argv)
    # Ctrl-C in a terminal reaches the whole process group: the parent drains and then
    # sends "close"; a worker that died on SIGINT first would lose its texts in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    return run_async(_serve(sock), loop_factory("auto"))


if __name__ == "__main__":
    sys.exit(main())
