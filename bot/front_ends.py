"""The master of ``healthbot serve --processes N``: its N front-end processes and, on GPUs, one
engine server per GPU; starting, restarting and draining them. The why and the rules are in
bot/prefork.py's module doc; :func:`bot.prefork.run_master` prepares the ports and the metrics
folder, then runs :class:`Master`."""

from __future__ import annotations

import asyncio
import copy
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import structlog
from prometheus_client.multiprocess import mark_process_dead

from bot import metrics
from bot.config import Config
from bot.logs import config_secrets, configure_logging
from inference.multiproc.router import ProcessPoolEncoder
from inference.multiproc.supervision import MAX_RESTART_S, REMOTE_BATCHES_IN_FLIGHT, RESTART_S

log = structlog.get_logger("healthbot.prefork")

__all__ = ["KILL_AFTER_S", "FrontEnd", "Master"]

#: Seconds past ``server.shutdown_timeout_s`` after which the master kills a front-end process still
#: running: its own watchdog ends it :data:`bot.app.WATCHDOG_GRACE_S` (1 s) after the timeout.
KILL_AFTER_S = 3.0


def _front_end(cfg: Config, conn: Any, log_level: str, log_format: str, restart: bool) -> None:
    """One front-end process (multiprocessing's spawn target): the whole server of bot/app.py on
    the shared port.

    SIGINT is ignored until the server runs (Ctrl-C reaches the whole process group; the master's
    SIGTERM ends a process still loading); ``"serving"`` goes to the master once the port is open;
    end of file from the master (it died) is taken as SIGTERM. Log lines carry the ``pid``. A
    ``restart`` counts itself in ``healthbot_server_process_restarts_total`` (here, not in the
    master, whose own metrics are not in the multiprocess folder: bot/prefork.py).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(log_level, log_format, secrets=config_secrets(cfg))
    structlog.contextvars.bind_contextvars(pid=os.getpid())
    if restart:
        metrics.SERVER_PROCESS_RESTARTS.inc()
    threading.Thread(target=_end_with_master, args=(conn,), name="master-watch", daemon=True).start()
    from bot.app import create_app, serve  # the process's own: the master never loads the app

    app = create_app(cfg)
    sys.exit(asyncio.run(serve(app, cfg, exit_watchdog=True, on_serving=lambda: conn.send("serving"))))


def _end_with_master(conn: Any) -> None:
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


@dataclass(eq=False)
class FrontEnd:
    """One place of the master's N: its config, the process in it now, and its restart state."""

    index: int
    cfg: Config
    restart_s: float = RESTART_S
    process: Any = None
    conn: Any = None
    serving: bool = False
    restarts: int = 0
    exited: asyncio.Future | None = None


class Master:
    """The master's loop (bot/prefork.py's module doc); :meth:`run` returns the exit status.

    Args:
        cfg: the effective config: ``server.processes`` front-end processes (≥ 2) on ``server.port``
            (the reserved port).
        threads: ONNX Runtime threads per session in each process.
        gpu: start one engine server per GPU (:func:`bot.prefork.engine_servers_wanted`).
        log_level, log_format: the processes' logging (bot/logs.py).
        metrics_dir: prometheus-client's multiprocess folder.
        server_loader: ``"module:function"`` the engine servers load their engine with (tests).
    """

    def __init__(self, cfg: Config, threads: int, gpu: bool, log_level: str, log_format: str, metrics_dir: str,
                 server_loader: str = "") -> None:
        self.cfg, self.processes, self.threads, self.gpu = cfg, cfg.server.processes, threads, gpu
        self.log_level, self.log_format = log_level, log_format
        self.metrics_dir, self.server_loader = metrics_dir, server_loader
        self.front_ends: list[FrontEnd] = []
        self.engine_servers: ProcessPoolEncoder | None = None
        self._ctx = multiprocessing.get_context("spawn")
        self._stop = asyncio.Event()
        self._signal = ""
        self._stopping = self._ready = self._failed = False
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> int:
        """Start the engine servers and the processes, serve until a signal, shut down; the exit status."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        sockets: dict[int, str] = {}
        if self.gpu:
            self.engine_servers = await ProcessPoolEncoder.engine_servers(
                self.cfg.inference, self.cfg.engines_path, server_loader=self.server_loader,
                log_setup="bot.logs:configure_logging")
            sockets = {d: s.server_path for d, s in self.engine_servers.servers.items()}
        self.front_ends = [FrontEnd(i, self._front_end_cfg(i, sockets)) for i in range(self.processes)]
        if not self._stop.is_set():  # no signal while the engine servers started
            for fe in self.front_ends:
                self._start(fe)
            log.info("processes.started", processes=self.processes, host=self.cfg.server.host,
                     port=self.cfg.server.port, pids=[fe.process.pid for fe in self.front_ends],
                     engine_servers=sockets or None, intra_op_threads=self.threads, metrics_dir=self.metrics_dir)
            await self._stop.wait()
        return await self._shut_down()

    def _front_end_cfg(self, index: int, sockets: dict[int, str]) -> Config:
        cfg = copy.deepcopy(self.cfg)
        cfg.inference.intra_op_threads = self.threads
        if sockets:  # GPU i mod G through its engine server; the CPU fallback stays in the process
            device = sorted(sockets)[index % len(sockets)]
            cfg.inference.devices = [str(device)]
            cfg.inference.engine_socket = sockets[device]
            cfg.inference.workers = REMOTE_BATCHES_IN_FLIGHT
        return cfg

    def _on_signal(self, sig: signal.Signals) -> None:
        if not self._signal:
            self._signal = sig.name
            self._stop.set()

    def _start(self, fe: FrontEnd) -> None:
        loop = asyncio.get_running_loop()
        parent, child = self._ctx.Pipe()
        fe.process = self._ctx.Process(target=_front_end, name=f"healthbot-front-end-{fe.index}",
                                       args=(fe.cfg, child, self.log_level, self.log_format, fe.restarts > 0))
        fe.process.start()
        child.close()
        fe.conn, fe.serving, fe.exited = parent, False, loop.create_future()
        loop.add_reader(fe.process.sentinel, self._on_exit, fe)
        loop.add_reader(parent.fileno(), self._on_message, fe)

    def _on_message(self, fe: FrontEnd) -> None:
        try:
            message = fe.conn.recv()
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(fe.conn.fileno())
            return
        if message != "serving":
            return
        fe.serving, fe.restart_s = True, RESTART_S
        if fe.restarts:
            log.warning("processes.process_restarted", index=fe.index, pid=fe.process.pid, restarts=fe.restarts)
        if not self._ready and all(f.serving for f in self.front_ends):
            self._ready = True
            log.info("processes.serving", processes=self.processes, pids=[f.process.pid for f in self.front_ends])
            from bot.app import ready_line  # the one line a single server prints once it answers
            print(ready_line(self.cfg), file=sys.stderr, flush=True)

    def _on_exit(self, fe: FrontEnd) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(fe.process.sentinel)
        loop.remove_reader(fe.conn.fileno())
        fe.conn.close()
        fe.process.join()
        code = fe.process.exitcode
        mark_process_dead(fe.process.pid, self.metrics_dir)  # its live gauges leave the sum
        fe.exited.set_result(code)
        if self._stopping:
            return
        if not self._ready:
            log.error("processes.start_failed", index=fe.index, pid=fe.process.pid, exit_code=code,
                      hint="a front-end process exited before every process was serving: see its log above")
            self._failed = True
            self._stop.set()
            return
        log.error("processes.process_exited", index=fe.index, pid=fe.process.pid, exit_code=code,
                  was_serving=fe.serving, restart_in_s=fe.restart_s)
        task = loop.create_task(self._restart(fe))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, fe: FrontEnd) -> None:
        await asyncio.sleep(fe.restart_s)
        if self._stopping:
            return
        fe.restart_s = min(fe.restart_s * 2, MAX_RESTART_S)  # back to RESTART_S once it serves
        fe.restarts += 1
        self._start(fe)
        log.info("processes.process_started", index=fe.index, pid=fe.process.pid, restarts=fe.restarts)

    async def _shut_down(self) -> int:
        self._stopping = True
        timeout_s = self.cfg.server.shutdown_timeout_s
        started = time.monotonic()
        log.info("processes.shutdown_started", signal=self._signal or None, timeout_s=timeout_s)
        for task in list(self._tasks):
            task.cancel()
        live = [fe for fe in self.front_ends if fe.exited is not None and not fe.exited.done()]
        was_serving = {fe: fe.serving for fe in live}
        for fe in live:
            fe.process.terminate()  # SIGTERM: the process drains (bot/app.py shut_down)
        if live:
            await asyncio.wait([fe.exited for fe in live], timeout=timeout_s + KILL_AFTER_S)
        killed = [fe.process.pid for fe in live if not fe.exited.done()]
        for fe in live:
            if not fe.exited.done():
                fe.process.kill()
        if killed:
            await asyncio.wait([fe.exited for fe in live if not fe.exited.done()], timeout=5.0)
        if self.engine_servers is not None:
            await self.engine_servers.close()
        unclean = [fe.process.pid for fe in live if not _clean_exit(fe, was_serving[fe])]
        event = log.error if unclean or self._failed else log.info
        event("processes.shutdown_complete", seconds=round(time.monotonic() - started, 3), killed=killed or None,
              unclean=unclean or None, start_failed=self._failed or None)
        return 1 if unclean or self._failed else 0


def _clean_exit(fe: FrontEnd, was_serving: bool) -> bool:
    """A serving process that exited 0, or one still loading that the SIGTERM ended."""
    if not fe.exited.done():
        return False
    code = fe.exited.result()
    return code == 0 or (not was_serving and code == -signal.SIGTERM)
