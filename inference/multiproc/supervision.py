"""Supervision of the process pool's processes (worker processes and engine servers):
start and ``init``, reading their answers, resending the texts of one that exits, restarts
with back-off, killing one gone silent, and fetching their metrics (module doc of
:mod:`inference.multiproc.router`).

:class:`Supervision` is the process half of :class:`~inference.multiproc.router.ProcessPoolEncoder`
(which sets every attribute it uses in its ``__init__``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from inference import metrics
from inference.batching.errors import BatcherClosed, DeadlineExceeded
from inference.devices import device_label
from inference.engines.base import EngineError
from inference.multiproc.framing import ERRORS, frame, read_frame

log = structlog.get_logger("healthbot.inference.process_pool")

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

@dataclass(eq=False)
class Message:
    """Texts sent together; ``calls`` are ``(future, first row, rows)`` per ``encode`` call."""

    prefix: str
    texts: list[str]
    calls: list[tuple[asyncio.Future, int, int]]
    sent_at: float = 0.0


@dataclass(eq=False)
class WorkerProcess:
    index: int
    device: int | None
    process: asyncio.subprocess.Process | None = None
    writer: asyncio.StreamWriter | None = None
    reader_task: asyncio.Task | None = None
    alive: bool = False
    info: dict = field(default_factory=dict)
    engine_name: str = ""
    in_flight: dict[int, Message] = field(default_factory=dict)
    calls: dict[int, asyncio.Future] = field(default_factory=dict)
    restart_s: float = RESTART_S
    restarts: int = 0
    #: Non-empty for an engine server (inference/multiproc/engine_server.py): the Unix socket it listens on.
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


def fail_calls(msg: Message, exc: Exception) -> None:
    for fut, _, _ in msg.calls:
        if not fut.done():
            fut.set_exception(exc)


def child_env() -> dict[str, str]:
    """This environment, with this checkout first on ``PYTHONPATH`` (so ``-m inference.multiproc.worker``
    imports this code whatever the working directory)."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    # The fast tokenizer's thread pool (rayon, one thread per core in EVERY worker)
    # costs more than it saves on a few short queries per call, and several workers'
    # pools fight over the cores: on the 32-core H200 host an encode_batch of ~13
    # texts took 167 µs with it on (docs/benchmarks.md). An operator's setting wins.
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env



class Supervision:
    """Starting, watching and restarting the pool's processes."""

    async def _spawn(self, w: WorkerProcess) -> None:
        """Start ``w``'s process, send ``init``, wait for ``ready``. Raises EngineError."""
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            w.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "inference.multiproc.engine_server" if w.server_path else "inference.multiproc.worker",
                "--fd", str(child_sock.fileno()), pass_fds=(child_sock.fileno(),), env=child_env())
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
                "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel()),
                "log_setup": self.log_setup}
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

    async def _read_loop(self, w: WorkerProcess, reader: asyncio.StreamReader) -> None:
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
                        fail_calls(msg, ERRORS.get(m[2], EngineError)(m[3]))
                elif kind == "result":
                    fut = w.calls.pop(m[1], None)
                    if fut is not None and not fut.done():
                        fut.set_result(m[2])
        except Exception as exc:  # noqa: BLE001 - end of file, a broken socket or a garbled message
            if not self._closing:
                if w.process is not None and w.process.returncode is None:
                    w.process.kill()  # garbled: the worker cannot be trusted to answer in order
                await self._on_exit(w, exc)

    async def _on_exit(self, w: WorkerProcess, exc: BaseException) -> None:
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

    async def _restart(self, w: WorkerProcess) -> None:
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
                    fail_calls(w.in_flight.pop(mid),
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

    async def _stop(self, w: WorkerProcess) -> None:
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
            fail_calls(msg, BatcherClosed("inference is shutting down"))
        w.in_flight.clear()
