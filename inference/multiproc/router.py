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

Worker processes are :mod:`inference.multiproc.worker` run as ``python -m inference.multiproc.worker --fd N``
(a fresh interpreter: CUDA is never initialised before a fork). Messages, each a
framed by :mod:`inference.multiproc.framing`:

- parent → worker: ``("init", {...})`` once; ``("encode", id, prefix, texts)``;
  ``("call", id, name, kwargs)`` (``stats``, ``engine_only``: the bench);
  ``("close",)``.
- worker → parent: ``("ready", info)`` or ``("failed", message)`` once;
  ``("ok", id, engine_name, float32[N, D])``; ``("err", id, kind, message)``;
  ``("result", id, value)``.

With ``inference.engine_server`` on GPUs, one more process per GPU, the engine
server (inference/multiproc/engine_server.py), owns the GPU engine; the workers of that GPU
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
:data:`~inference.multiproc.supervision.METRICS_POLL_S` s); the server itself records ``healthbot_inference_workers``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import structlog

from inference import metrics
from inference.batching.errors import BatcherClosed
from inference.batching.merge import pack_messages
from inference.config import InferenceConfig
from inference.devices import GPU_ENGINES, resolve_devices, visible_gpu_count
from inference.engines.base import EngineError
from inference.multiproc.framing import frame
from inference.model_files import require_prepared
from inference.multiproc.supervision import Message, Supervision, WorkerProcess, fail_calls
from inference.multiproc.worker_metrics import WorkerMetrics

log = structlog.get_logger("healthbot.inference.process_pool")

def plan_devices(cfg: InferenceConfig, count: Callable[[], int] | None = None) -> list[int | None]:
    """The device of each worker process: ``cfg.device_processes`` per visible GPU of
    ``cfg.devices`` when a GPU engine is in ``cfg.engine_order`` and a GPU is visible,
    else that many on the CPU (``None``).

    ``count``: the visible GPU count (default :func:`~inference.devices.visible_gpu_count`; tests pass a fake).

    Raises:
        EngineError: ``cfg.devices`` names a GPU that is not visible.
    """
    count = count or visible_gpu_count
    gpu = next((e for e in cfg.engine_order if e in GPU_ENGINES), None)
    devices: list[int | None] = [None]
    if gpu is not None and count() > 0:
        devices = list(resolve_devices(cfg.devices, gpu, count))
    return [d for d in devices for _ in range(cfg.device_processes)]


class ProcessPoolEncoder(Supervision):
    """Embeds texts in worker processes (module doc); the interface of
    :class:`~inference.encoder.Encoder` that serving uses: :meth:`encode`,
    :meth:`close`, ``engine_name``, ``variant``, ``dim``.

    Build with :meth:`create`. Attributes: ``workers`` (the processes), ``info``
    (the first worker's ``ready`` report: engine, precision, dim, variant,
    engines per process, device, GPU memory).
    """

    def __init__(self, cfg: InferenceConfig, engines_dir: Path, encoder_factory: str = "",
                 server_loader: str = "", log_setup: str = "") -> None:
        self.cfg = cfg
        self.log_setup = log_setup
        self.encoder_factory = encoder_factory
        self.server_loader = server_loader
        self.engines_dir = Path(engines_dir).resolve()
        self.workers = [WorkerProcess(i, d) for i, d in enumerate(plan_devices(cfg))]
        gpus = sorted({w.device for w in self.workers if w.device is not None})
        #: One engine server per GPU (``inference.engine_server``), by device index.
        self.servers: dict[int, WorkerProcess] = {}
        self._socket_dir = ""
        if cfg.engine_server and gpus:
            self._socket_dir = tempfile.mkdtemp(prefix="healthbot-engines-")  # mode 0700
            self.servers = {d: WorkerProcess(-1, d, server_path=os.path.join(self._socket_dir, f"cuda{d}.sock"))
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
                     server_loader: str = "", log_setup: str = "") -> ProcessPoolEncoder:
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
        :func:`inference.multiproc.engine_server.load_engines` (tests).
        ``log_setup``: ``"module:function"``, ``function(level)`` the processes set up their
        logging with (``bot.logs:configure_logging``; default
        :func:`inference.multiproc.child.configure_child_logging`).

        Raises:
            FileNotFoundError: the model is not prepared (``healthbot prepare-model``).
            EngineError: a worker could not load an engine (its message), or the devices are invalid.
        """
        require_prepared(engines_dir)
        self = cls(cfg, engines_dir, encoder_factory, server_loader, log_setup)
        await self._start_servers()
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

    @classmethod
    async def engine_servers(cls, cfg: InferenceConfig, engines_dir: Path, server_loader: str = "",
                             log_setup: str = "") -> ProcessPoolEncoder:
        """Only the engine servers, one per GPU of ``cfg.devices`` (``cfg.engine_server`` on, a GPU
        engine in ``cfg.engine_order`` and a GPU visible; else none), and no worker processes: for
        ``healthbot serve --processes N`` (bot/prefork.py), whose front-end processes reach them
        at ``servers[device].server_path``. Watched and restarted as with :meth:`create`; a server
        that cannot load its engine is logged (its front ends load the next engine of
        ``inference.engine_order``). :meth:`close` stops them; :meth:`encode` has no worker to use.

        Raises:
            FileNotFoundError: the model is not prepared (``healthbot prepare-model``).
        """
        require_prepared(engines_dir)
        self = cls(dataclasses.replace(cfg, device_processes=1), engines_dir, server_loader=server_loader,
                   log_setup=log_setup)
        self.workers = []
        await self._start_servers()
        if self.servers:
            self._background(self._watch_servers())
        return self

    async def _start_servers(self) -> None:
        for server, result in zip(self.servers.values(),
                                  await asyncio.gather(*(self._spawn(s) for s in self.servers.values()),
                                                       return_exceptions=True)):
            if isinstance(result, BaseException):
                log.error("engine_server_failed", server=server.label, error=str(result),
                          action="the processes that use it load the next engine of inference.engine_order")

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
    def alive(self) -> list[WorkerProcess]:
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
        workers in messages of at most :data:`~inference.batching.merge.MAX_TEXTS_PER_MESSAGE` texts, each to the
        live worker with the fewest texts in flight."""
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        by_prefix: dict[str, list[tuple[list[str], asyncio.Future]]] = {}
        for prefix, texts, fut in pending:
            if not fut.done():
                by_prefix.setdefault(prefix, []).append((texts, fut))
        for prefix, items in by_prefix.items():
            for group in pack_messages([len(texts) for texts, _ in items], len(self.alive)):
                msg = Message(prefix, [], [])
                for texts, fut in (items[i] for i in group):
                    msg.calls.append((fut, len(msg.texts), len(texts)))
                    msg.texts += texts
                self._send(msg)

    def _send(self, msg: Message) -> None:
        live = self.alive
        if not live:
            fail_calls(msg, EngineError("no inference worker process is running (restarting; see the log)"))
            return
        w = min(live, key=lambda x: x.texts_in_flight)
        self._next_id += 1
        msg.sent_at = time.monotonic()
        w.in_flight[self._next_id] = msg
        w.writer.write(frame(("encode", self._next_id, msg.prefix, msg.texts)))

    # ------------------------------------------------------------------ calls
    async def call(self, worker: WorkerProcess, name: str, **kwargs: Any) -> Any:
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
        if self.workers:  # not for the engine servers alone (engine_servers)
            metrics.INFERENCE_WORKERS.labels(engine=self.info["engine"]).dec(self._engines)
            metrics.REGISTRY.unregister(self._worker_metrics)

