"""Encoder over worker processes: one process (or more) per device, each with its own
tokenizer, dynamic batcher and engine pool (``inference.device_processes``, issues 6 and 9).

Why: one Python process tops out at 35-38k short texts/s in its front end (event
loop, batcher, tokenizer; measured on the H200 with an engine that does nothing,
docs/benchmarks.md), below what one H200 computes; a second GPU driven from the
same process added 17 %. Here this process only routes: texts submitted during
one event-loop iteration travel as ONE message (pickle, protocol 5, over a Unix
socket pair) to the worker process with the fewest texts in flight, which
embeds them with a full :class:`~inference.encoder.Encoder` pinned to its
device (its own model manager, so its own CPU fallback and circuit breaker) and
answers float32[N, 384] in one message.

Worker processes are this module run as ``python -m inference.process_pool --fd N``
(a fresh interpreter: CUDA is never initialised before a fork). Messages, each a
framed by :mod:`inference.framing`:

- parent → worker: ``("init", {...})`` once; ``("encode", id, prefix, texts)``;
  ``("call", id, name, kwargs)`` (``stats``, ``engine_only``: the bench);
  ``("close",)``.
- worker → parent: ``("ready", info)`` or ``("failed", message)`` once;
  ``("ok", id, engine_name, float32[N, D])``; ``("err", id, kind, message)``;
  ``("result", id, value)``.

With ``inference.engine_server`` on GPUs, one more process per GPU, the engine
server (inference/engine_server.py), owns the GPU engine; the workers of that GPU
send it their padded batches (``inference.engine_socket``). It is restarted like a
worker when it exits, and killed and restarted when a batch on it runs past the
deadline; meanwhile its workers serve on their CPU fallback engine.

A worker that exits or breaks its socket is logged, its texts in flight are sent
again to a live worker (none lost while one is left), and it is started again
after 1 s, doubling up to 30 s while it keeps failing. A worker gone silent (no
answer within ``inference.deadline_ms`` + 1 s, although its own batcher answers
by the deadline) fails those texts with DeadlineExceeded and is killed, then
restarted the same way. A worker whose parent dies reads end-of-file and exits.

Metrics: the server's ``/metrics`` re-exports each worker's own metrics as
``healthbot_worker_*{worker="cuda:0#1"}`` (:class:`WorkerMetrics`, fetched every
:data:`METRICS_POLL_S` s); the server itself records ``healthbot_inference_workers``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import structlog

from bot import metrics
from inference.config import InferenceConfig
from inference.batcher import BatcherClosed, BusyError, DeadlineExceeded
from inference.engines.base import EngineError
from inference.framing import frame, read_frame
from inference.pool import device_label

log = structlog.get_logger("healthbot.inference.process_pool")

#: Texts per message at most: a flush with more pending spreads them over workers.
MAX_TEXTS_PER_MESSAGE = 128
#: Texts per message at least when more are pending: a flush is not cut into a message
#: per worker smaller than this. Each message costs every process it passes a fixed
#: amount of Python: on the H200 host, 6 workers' messages of ~5 texts cost the workers
#: 127 us of CPU per text; at least 32 per message, 56 us, and c = 256 went from
#: 45.0k to 53.6k encodes/s (docs/benchmarks.md, sixth session).
MIN_TEXTS_PER_MESSAGE = 32
#: Messages a worker embeds with one ``encode`` call at most (≤ 4 × 128 texts, so a
#: group stays well inside ``inference.max_queue_size``'s default 1024 windows).
MAX_MESSAGES_PER_ENCODE = 4
#: Batches a worker process keeps in flight to its GPU's engine server (``inference.engine_server``):
#: 1 left its texts waiting a whole round trip (24k/s on the H200); 4 and 8 measured
#: alike (docs/benchmarks.md, 2026-11-29 fifth session).
REMOTE_BATCHES_IN_FLIGHT = 4
#: Seconds a worker may take to load its engines (graph capture, engine files).
START_TIMEOUT_S = 600.0
#: Restart back-off of a worker that exited (seconds; doubles up to the max).
RESTART_S, MAX_RESTART_S = 1.0, 30.0
#: How often the server process fetches each worker's Prometheus metrics (seconds).
METRICS_POLL_S = 5.0
#: How often the engine servers are asked whether a batch is stuck (seconds).
SERVER_CHECK_S = 1.0
#: Extra wait beyond ``deadline_ms`` before the parent gives up on a silent worker (seconds).
SILENT_GRACE_S = 1.0

_ERRORS: dict[str, type[Exception]] = {"BusyError": BusyError, "BatcherClosed": BatcherClosed,
                                       "DeadlineExceeded": DeadlineExceeded, "EngineError": EngineError}


@dataclass(eq=False)
class _Message:
    """Texts sent together; ``calls`` are ``(future, first row, rows)`` per ``encode`` call."""

    prefix: str
    texts: list[str]
    calls: list[tuple[asyncio.Future, int, int]]
    sent_at: float = 0.0


@dataclass(eq=False)
class _Worker:
    index: int
    device: int | None
    process: asyncio.subprocess.Process | None = None
    writer: asyncio.StreamWriter | None = None
    reader_task: asyncio.Task | None = None
    alive: bool = False
    info: dict = field(default_factory=dict)
    engine_name: str = ""
    in_flight: dict[int, _Message] = field(default_factory=dict)
    calls: dict[int, asyncio.Future] = field(default_factory=dict)
    restart_s: float = RESTART_S
    restarts: int = 0
    #: Non-empty for an engine server (inference/engine_server.py): the Unix socket it listens on.
    server_path: str = ""

    @property
    def label(self) -> str:
        if self.server_path:
            return f"engine-server:{device_label(self.device)}"
        return f"{device_label(self.device)}#{self.index}"

    @property
    def texts_in_flight(self) -> int:
        """Texts sent to this worker and not yet answered (routing picks the fewest)."""
        return sum(len(msg.texts) for msg in self.in_flight.values())


def plan_devices(cfg: InferenceConfig, count: Callable[[], int] | None = None) -> list[int | None]:
    """The device of each worker process: ``cfg.device_processes`` per visible GPU of
    ``cfg.devices`` when a GPU engine is in ``cfg.engine_order`` and a GPU is visible,
    else that many on the CPU (``None``).

    ``count``: the visible GPU count (default :func:`~inference.manager.visible_gpu_count`; tests pass a fake).

    Raises:
        EngineError: ``cfg.devices`` names a GPU that is not visible.
    """
    from inference.manager import GPU_ENGINES, resolve_devices, visible_gpu_count

    count = count or visible_gpu_count
    gpu = next((e for e in cfg.engine_order if e in GPU_ENGINES), None)
    devices: list[int | None] = [None]
    if gpu is not None and count() > 0:
        devices = list(resolve_devices(cfg.devices, gpu, count))
    return [d for d in devices for _ in range(cfg.device_processes)]


class ProcessPoolEncoder:
    """Embeds texts in worker processes (module doc); the interface of
    :class:`~inference.encoder.Encoder` that serving uses: :meth:`encode`,
    :meth:`close`, ``engine_name``, ``variant``, ``dim``.

    Build with :meth:`create`. Attributes: ``workers`` (the processes), ``info``
    (the first worker's ``ready`` report: engine, precision, dim, variant,
    engines per process, device, GPU memory).
    """

    def __init__(self, cfg: InferenceConfig, engines_dir: Path, encoder_factory: str = "",
                 server_loader: str = "") -> None:
        self.cfg = cfg
        self.encoder_factory = encoder_factory
        self.server_loader = server_loader
        self.engines_dir = Path(engines_dir).resolve()
        self.workers = [_Worker(i, d) for i, d in enumerate(plan_devices(cfg))]
        gpus = sorted({w.device for w in self.workers if w.device is not None})
        #: One engine server per GPU (``inference.engine_server``), by device index.
        self.servers: dict[int, _Worker] = {}
        self._socket_dir = ""
        if cfg.engine_server and gpus:
            self._socket_dir = tempfile.mkdtemp(prefix="healthbot-engines-")  # mode 0700
            self.servers = {d: _Worker(-1, d, server_path=os.path.join(self._socket_dir, f"cuda{d}.sock"))
                            for d in gpus}
        self.info: dict = {}
        self.dim = 0
        self._pending: list[tuple[str, list[str], asyncio.Future]] = []
        self._flush_scheduled = False
        self._next_id = 0
        self._closing = False
        self._tasks: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None
        self._engines = 0
        self._worker_metrics = WorkerMetrics(self)

    # ------------------------------------------------------------------ start
    @classmethod
    async def create(cls, cfg: InferenceConfig, engines_dir: Path, encoder_factory: str = "",
                     server_loader: str = "") -> ProcessPoolEncoder:
        """Start the engine servers (``cfg.engine_server``, one per GPU), then
        ``cfg.device_processes`` worker processes per device, and wait until each is ready.

        An engine server that cannot load its engine is logged; the worker processes of
        its GPU then cannot reach it and load the next engine of ``inference.engine_order``
        themselves (the CPU engine), as a worker does whose GPU engine fails to load.

        ``encoder_factory``: ``"module:function"``, an async ``function(cfg, engines_dir)``
        the workers build their encoder with instead of :meth:`Encoder.create` (tests,
        and the bench of this process's own cost with an engine that does nothing).
        ``server_loader``: ``"module:function"``, ``function(cfg, engines_dir, device) -> Engine``
        the engine servers load each engine with instead of
        :func:`inference.engine_server.load_engines` (tests).

        Raises:
            FileNotFoundError: the model is not prepared (``healthbot prepare-model``).
            EngineError: a worker could not load an engine (its message), or the devices are invalid.
        """
        from inference.encoder import require_prepared

        require_prepared(engines_dir)
        self = cls(cfg, engines_dir, encoder_factory, server_loader)
        for server, result in zip(self.servers.values(),
                                  await asyncio.gather(*(self._spawn(s) for s in self.servers.values()),
                                                       return_exceptions=True)):
            if isinstance(result, BaseException):
                log.error("engine_server_failed", server=server.label, error=str(result),
                          action="its worker processes load the next engine of inference.engine_order")
        results = await asyncio.gather(*(self._spawn(w) for w in self.workers), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(self._stop(w) for w in self.workers))
            raise failed[0] if isinstance(failed[0], EngineError) else EngineError(str(failed[0]))
        self.info = self.workers[0].info
        self.dim = int(self.info["dim"])
        self._engines = sum(int(w.info.get("engines", 1)) for w in self.workers)
        metrics.INFERENCE_WORKERS.labels(engine=self.info["engine"]).inc(self._engines)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        if self.servers:
            self._background(self._watch_servers())
        metrics.REGISTRY.register(self._worker_metrics)
        self._background(self._poll_metrics())
        log.info("process_pool_ready", processes=len(self.workers), engine=self.info["engine"],
                 devices=[w.label for w in self.workers], pids=[w.info.get("pid") for w in self.workers])
        return self

    async def _spawn(self, w: _Worker) -> None:
        """Start ``w``'s process, send ``init``, wait for ``ready``. Raises EngineError."""
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            w.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "inference.engine_server" if w.server_path else "inference.process_pool",
                "--fd", str(child_sock.fileno()), pass_fds=(child_sock.fileno(),), env=_child_env())
        finally:
            child_sock.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent_sock)
        w.writer = writer
        server = self.servers.get(w.device)
        cfg = dataclasses.replace(self.cfg, devices=[str(w.device)] if w.device is not None else self.cfg.devices,
                                  device_processes=0)
        if server is not None and not w.server_path:  # a worker whose GPU engine is the engine server
            cfg = dataclasses.replace(cfg, engine_socket=server.server_path, workers=REMOTE_BATCHES_IN_FLIGHT)
        init = {"cfg": dataclasses.asdict(cfg), "engines_dir": str(self.engines_dir), "worker": w.label,
                "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel())}
        if w.server_path:
            init.update(device=w.device, path=w.server_path, loader=self.server_loader)
        else:
            init.update(encoder_factory=self.encoder_factory)
        writer.write(frame(("init", init)))
        try:
            msg = await asyncio.wait_for(read_frame(reader), START_TIMEOUT_S)
        except (asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
            await self._stop(w)
            raise EngineError(f"inference process {w.label} did not start "
                              f"(exit code {w.process.returncode}; see its log above): {exc!r}") from None
        if msg[0] != "ready":
            await self._stop(w)
            raise EngineError(f"inference process {w.label}: {msg[1]}")
        w.info, w.engine_name, w.alive = msg[1], msg[1].get("engine", ""), True
        w.restart_s = RESTART_S
        w.reader_task = asyncio.get_running_loop().create_task(self._read_loop(w, reader))

    # ------------------------------------------------------------------ state
    @property
    def engine_name(self) -> str:
        """The engine the first live worker served its last batch with (its CPU fallback's
        name while its circuit is open)."""
        return next((w.engine_name for w in self.workers if w.alive), self.info["engine"])

    @property
    def variant(self) -> str:
        """``"<engine>/<precision>"`` of the workers' primary engine (cache key of stored vectors)."""
        return str(self.info["variant"])

    @property
    def alive(self) -> list[_Worker]:
        return [w for w in self.workers if w.alive]

    # ------------------------------------------------------------------ encode
    async def encode(self, texts: list[str], prefix: str = "query: ") -> np.ndarray:
        """Embed ``texts`` in a worker process.

        Returns:
            float32[N, D] (D = 384), rows L2-normalized; float32[0, D] for no texts.

        Raises:
            BatcherClosed: the encoder is closing.
            BusyError / DeadlineExceeded / EngineError: as the worker's
                :meth:`Encoder.encode` raised them; EngineError also when no worker
                process is alive.
        """
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        if self._closing:
            raise BatcherClosed("inference is shutting down: retry on another replica or after restart")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((prefix, list(texts), fut))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return await fut

    def _flush(self) -> None:
        """Send everything submitted since the last flush, spread evenly over the live
        workers in messages of at most :data:`MAX_TEXTS_PER_MESSAGE` texts, each to the
        live worker with the fewest texts in flight."""
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        by_prefix: dict[str, list[tuple[list[str], asyncio.Future]]] = {}
        for prefix, texts, fut in pending:
            if not fut.done():
                by_prefix.setdefault(prefix, []).append((texts, fut))
        live = max(1, len(self.alive))
        for prefix, items in by_prefix.items():
            total = sum(len(texts) for texts, _ in items)
            per = min(MAX_TEXTS_PER_MESSAGE, max(MIN_TEXTS_PER_MESSAGE, -(-total // live)))
            msg = _Message(prefix, [], [])
            for texts, fut in items:
                if msg.texts and len(msg.texts) + len(texts) > per:
                    self._send(msg)
                    msg = _Message(prefix, [], [])
                msg.calls.append((fut, len(msg.texts), len(texts)))
                msg.texts += texts
            self._send(msg)

    def _send(self, msg: _Message) -> None:
        live = self.alive
        if not live:
            _fail(msg, EngineError("no inference worker process is running (restarting; see the log)"))
            return
        w = min(live, key=lambda x: x.texts_in_flight)
        self._next_id += 1
        msg.sent_at = time.monotonic()
        w.in_flight[self._next_id] = msg
        w.writer.write(frame(("encode", self._next_id, msg.prefix, msg.texts)))

    async def _read_loop(self, w: _Worker, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                m = await read_frame(reader)
                kind = m[0]
                if kind == "ok":
                    msg = w.in_flight.pop(m[1], None)
                    if msg is None:
                        continue
                    w.engine_name = m[2]
                    vectors = m[3]
                    for fut, start, n in msg.calls:
                        if not fut.done():
                            fut.set_result(vectors[start:start + n])
                elif kind == "err":
                    msg = w.in_flight.pop(m[1], None)
                    if msg is not None:
                        _fail(msg, _ERRORS.get(m[2], EngineError)(m[3]))
                elif kind == "result":
                    fut = w.calls.pop(m[1], None)
                    if fut is not None and not fut.done():
                        fut.set_result(m[2])
        except Exception as exc:  # noqa: BLE001 - end of file, a broken socket or a garbled message
            if not self._closing:
                if w.process is not None and w.process.returncode is None:
                    w.process.kill()  # garbled: the worker cannot be trusted to answer in order
                await self._on_exit(w, exc)

    async def _on_exit(self, w: _Worker, exc: BaseException) -> None:
        """``w`` broke: resend its texts, fail its calls, restart it in the background."""
        w.alive = False
        code = None
        if w.process is not None:
            try:
                code = await asyncio.wait_for(w.process.wait(), 2.0)
            except TimeoutError:
                w.process.kill()
        metrics.INFERENCE_WORKER_EXITS.labels(worker=w.label).inc()
        log.error("inference_worker_exited", worker=w.label, exit_code=code, error=repr(exc),
                  resent_texts=w.texts_in_flight, restart_in_s=w.restart_s, alive=[x.label for x in self.alive])
        lost, w.in_flight = list(w.in_flight.values()), {}
        for msg in lost:
            self._send(msg)
        for fut in w.calls.values():
            if not fut.done():
                fut.set_exception(EngineError(f"inference worker {w.label} exited"))
        w.calls.clear()
        self._background(self._restart(w))

    async def _restart(self, w: _Worker) -> None:
        while not self._closing and not w.alive:
            await asyncio.sleep(w.restart_s)
            if self._closing:
                return
            try:
                await self._spawn(w)
            except EngineError as exc:
                w.restart_s = min(w.restart_s * 2, MAX_RESTART_S)
                log.error("inference_worker_restart_failed", worker=w.label, error=str(exc), retry_in_s=w.restart_s)
                continue
            w.restarts += 1
            metrics.INFERENCE_WORKER_RESTARTS.labels(worker=w.label).inc()
            log.warning("inference_worker_restarted", worker=w.label, pid=w.info.get("pid"), restarts=w.restarts)

    async def _sweep(self) -> None:
        """Fail texts a live worker has not answered within ``deadline_ms`` + :data:`SILENT_GRACE_S`
        and kill that worker: its own batcher answers every request by its deadline, so
        silence means it hangs (a stuck GPU call, a blocked loop); it is restarted as after any exit."""
        limit = self.cfg.deadline_ms / 1000.0 + SILENT_GRACE_S
        while not self._closing:
            await asyncio.sleep(min(0.25, limit / 4))
            now = time.monotonic()
            for w in self.alive:
                late = [mid for mid, msg in w.in_flight.items() if now - msg.sent_at > limit]
                for mid in late:
                    _fail(w.in_flight.pop(mid),
                          DeadlineExceeded(f"inference worker {w.label} did not answer within {limit:.1f} s"))
                if late and w.process is not None and w.process.returncode is None:
                    log.error("inference_worker_silent", worker=w.label, messages=len(late), waited_s=round(limit, 2),
                              action="killed; restarted like any exited worker")
                    w.process.kill()

    async def _watch_servers(self) -> None:
        """Every :data:`SERVER_CHECK_S`, ask each live engine server how long its oldest batch
        has been running; one past ``inference.deadline_ms`` + :data:`SILENT_GRACE_S` (a stuck
        GPU call), or no answer within that long, gets it killed and restarted like any exited
        server (its workers serve on their CPU engine meanwhile: their batches time out)."""
        limit = self.cfg.deadline_ms / 1000.0 + SILENT_GRACE_S
        while not self._closing:
            await asyncio.sleep(SERVER_CHECK_S)
            for s in [s for s in self.servers.values() if s.alive]:
                try:
                    running_s = (await asyncio.wait_for(self.call(s, "stats"), limit))["running_s"]
                except TimeoutError:
                    running_s = limit
                except EngineError:
                    continue  # it exited meanwhile: restarted by _on_exit
                if running_s >= limit and s.process is not None and s.process.returncode is None:
                    log.error("engine_server_silent", server=s.label, batch_running_s=round(running_s, 2),
                              action="killed; restarted like any exited engine server")
                    s.process.kill()

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _poll_metrics(self) -> None:
        """Every :data:`METRICS_POLL_S`, fetch each live worker's metrics for :class:`WorkerMetrics`."""
        while not self._closing:
            for w in self.alive:
                try:
                    self._worker_metrics.update(w.label, await asyncio.wait_for(self.call(w, "metrics"), 5.0))
                except (EngineError, TimeoutError) as exc:
                    log.warning("inference_worker_metrics_unavailable", worker=w.label, error=str(exc))
            await asyncio.sleep(METRICS_POLL_S)

    # ------------------------------------------------------------------ calls
    async def call(self, worker: _Worker, name: str, **kwargs: Any) -> Any:
        """Run ``name`` (``stats`` | ``engine_only``) in ``worker`` and return its result.

        Raises:
            EngineError: the worker is not running or exited meanwhile; whatever the call raised.
        """
        if not worker.alive:
            raise EngineError(f"inference worker {worker.label} is not running")
        self._next_id += 1
        fut = asyncio.get_running_loop().create_future()
        worker.calls[self._next_id] = fut
        worker.writer.write(frame(("call", self._next_id, name, kwargs)))
        result = await fut
        if isinstance(result, dict) and "error" in result:
            raise EngineError(f"{name} in {worker.label}: {result['error']}")
        return result

    async def batch_stats(self) -> tuple[int, int]:
        """``(batches run, windows run)`` summed over the live workers' batchers."""
        got = await asyncio.gather(*(self.call(w, "stats") for w in self.alive))
        return sum(g[0] for g in got), sum(g[1] for g in got)

    async def server_stats(self) -> tuple[int, int]:
        """``(merged batches run, rows run)`` summed over the live engine servers; (0, 0) without."""
        got = await asyncio.gather(*(self.call(s, "stats") for s in self.servers.values() if s.alive))
        return sum(g["batches"] for g in got), sum(g["rows"] for g in got)

    # ------------------------------------------------------------------ close
    async def close(self) -> None:
        """Answer the texts in flight, then stop every worker (``close``; killed after 30 s). Idempotent."""
        if self._closing:
            return
        self._flush()
        for _ in range(int(self.cfg.deadline_ms / 10) + 100):
            if not any(w.in_flight for w in self.alive):
                break
            await asyncio.sleep(0.01)
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(self._stop(w) for w in self.workers))
        await asyncio.gather(*(self._stop(s) for s in self.servers.values()))
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        metrics.INFERENCE_WORKERS.labels(engine=self.info["engine"]).dec(self._engines)
        metrics.REGISTRY.unregister(self._worker_metrics)

    async def _stop(self, w: _Worker) -> None:
        w.alive = False
        if w.writer is not None:
            try:
                w.writer.write(frame(("close",)))
                await w.writer.drain()
            except (ConnectionError, OSError, RuntimeError):
                pass
        if w.process is not None and w.process.returncode is None:
            try:
                await asyncio.wait_for(w.process.wait(), 30.0)
            except TimeoutError:
                log.error("inference_worker_killed", worker=w.label, reason="no exit 30 s after close")
                w.process.kill()
                await w.process.wait()
        if w.writer is not None:
            w.writer.close()
        if w.reader_task is not None:
            w.reader_task.cancel()
        for msg in w.in_flight.values():
            _fail(msg, BatcherClosed("inference is shutting down"))
        w.in_flight.clear()


class WorkerMetrics:
    """A Prometheus collector on the server's registry that re-exports each worker
    process's own metrics (``healthbot_inference_*``, ``healthbot_engine_*`` and
    ``process_*``: its batcher, pool, model manager and the process itself), as
    last fetched (every :data:`METRICS_POLL_S` s): every family ``healthbot_X`` or
    ``X`` becomes ``healthbot_worker_X`` with a ``worker`` label (``"cuda:0#1"``).
    Worker families keep their own names apart from the server's, whose
    ``healthbot_inference_*`` stay (the server runs no batcher in this mode)."""

    def __init__(self, pool: ProcessPoolEncoder) -> None:
        self._pool = pool
        self._latest: dict[str, list[Any]] = {}

    def update(self, worker: str, text: str) -> None:
        """Keep ``text`` (the worker's exposition, text format 0.0.4) as its latest metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        self._latest[worker] = list(text_string_to_metric_families(text))

    def describe(self) -> list:
        return []  # names vary with the workers; nothing to check against the server's own

    def collect(self):
        from prometheus_client.metrics_core import Metric

        merged: dict[str, Metric] = {}
        alive = {w.label for w in self._pool.alive}
        for worker, families in self._latest.items():
            if worker not in alive:
                continue
            for fam in families:
                if not fam.name.startswith(_WORKER_FAMILIES):
                    continue  # a worker serves no channel: its request and channel families stay empty
                name = _worker_name(fam.name)
                out = merged.get(name)
                if out is None:
                    out = merged[name] = Metric(name, f"Worker processes: {fam.documentation}", fam.type, fam.unit)
                for smp in fam.samples:
                    out.add_sample(name + smp.name[len(fam.name):], {**smp.labels, "worker": worker},
                                   smp.value, smp.timestamp, smp.exemplar)
        yield from merged.values()


#: The families a worker process records (its batcher, pool, model manager and the process itself).
_WORKER_FAMILIES = ("healthbot_inference_", "healthbot_engine_", "process_")


def _worker_name(name: str) -> str:
    return "healthbot_worker_" + name.removeprefix("healthbot_")


def _child_env() -> dict[str, str]:
    """This environment, with this checkout first on ``PYTHONPATH`` (so ``-m inference.process_pool``
    imports this code whatever the working directory)."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    # The fast tokenizer's thread pool (rayon, one thread per core in EVERY worker)
    # costs more than it saves on a few short queries per call, and several workers'
    # pools fight over the cores: on the 32-core H200 host an encode_batch of ~13
    # texts took 167 µs with it on (docs/benchmarks.md). An operator's setting wins.
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _fail(msg: _Message, exc: Exception) -> None:
    for fut, _, _ in msg.calls:
        if not fut.done():
            fut.set_exception(exc)


# --------------------------------------------------------------------------- child processes
def child_config(init: dict) -> InferenceConfig:
    """What a process started by the pool (worker or engine server) does first with its
    ``init``: log at the parent's level with its label (``init["worker"]``) on every line,
    and rebuild its :class:`InferenceConfig` (keys this code does not know are ignored)."""
    from bot.logs import configure_logging

    configure_logging(init.get("log_level") or "INFO")
    structlog.contextvars.bind_contextvars(worker=init.get("worker"))  # which process each log line is from
    fields = {f.name for f in dataclasses.fields(InferenceConfig)}
    return InferenceConfig(**{k: v for k, v in init["cfg"].items() if k in fields})


def import_hook(spec: str) -> Any:
    """The function named by a ``"module:function"`` test or bench hook."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


# --------------------------------------------------------------------------- worker process
async def _serve(sock: socket.socket) -> int:
    """The worker: load an :class:`Encoder` from ``init``, then answer messages until
    ``close`` or end of file. Exit code 0, or 1 when the encoder could not load."""
    from inference.bench import ceiling_run
    from inference.encoder import Encoder

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
            kind = type(exc).__name__ if type(exc).__name__ in _ERRORS else "EngineError"
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
    """``python -m inference.process_pool --fd N``: a worker process (started by :class:`ProcessPoolEncoder`)."""
    ap = argparse.ArgumentParser(description="healthbot inference worker process (started by the server)")
    ap.add_argument("--fd", type=int, required=True, help="the socket to the parent process")
    args = ap.parse_args(argv)
    from inference.bench import loop_factory, run_async

    # Ctrl-C in a terminal reaches the whole process group: the parent drains and then
    # sends "close"; a worker that died on SIGINT first would lose its texts in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    return run_async(_serve(sock), loop_factory("auto"))


if __name__ == "__main__":
    sys.exit(main())
