"""The server's CPU over a load run, and a server the load test starts itself.

:class:`CpuMeter` reads CPU time (user + system) at the start and the end of a run:

* with the server's process id (``--server-pid``, or the server the load test started with
  ``--start-server``): psutil, that process and all its children, and apart (a) the
  encoder's processes (inference worker processes and engine servers, ``python -m
  inference.multiproc.*``: :data:`ENCODER_MODULES`) and (b) the main thread of every other
  process, which runs its event loop (HTTP, dispatcher, store calls, logging; ONNX Runtime's
  threads, an in-process encoder, are the others). ``front_end_cpu_ms_per_msg`` is the
  server without the encoder's processes: issue 23's "CPU per message in the serving
  process, encoder excluded" for the GPU layout, where the encoder has processes of its own;
* without one: the server's own ``process_cpu_seconds_total`` from ``GET /metrics``
  (that process only, children not counted).

The load generator's own CPU is read too, to show it was not the bottleneck, and (with
psutil) the whole machine's, so that other processes' load during the run shows
(``others_cores``: cores busy on average with neither the server nor the load generator).

:func:`start_server` runs ``healthbot serve`` on a free loopback port (the same config file,
environment and log level) and waits until ``GET /readyz`` answers 200.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

__all__ = ["CpuMeter", "CpuUsage", "ServerProcess", "own_cpu_s", "start_server"]


#: Command-line modules of the encoder's own processes (inference/multiproc/supervision.py starts them).
ENCODER_MODULES = ("inference.multiproc.engine_server", "inference.multiproc.worker")


@dataclass
class CpuUsage:
    """CPU seconds over a run: ``server_s`` (process and children, or the process alone),
    ``main_thread_s`` (the event-loop threads: the main thread of the server and of each child
    that is not the encoder's; None without psutil and a pid), ``client_s`` (the load generator),
    ``processes`` (server processes counted), ``source`` (how it was read) and ``encoder_s`` (the
    encoder's processes, :data:`ENCODER_MODULES`; None without psutil and a pid)."""

    server_s: float
    main_thread_s: float | None
    client_s: float
    processes: int
    source: str
    others_cores: float | None = None
    encoder_s: float | None = None

    def per_message_ms(self, messages: int) -> dict[str, float | None]:
        """CPU milliseconds per message (None where not measured or no messages)."""
        def ms(x: float | None) -> float | None:
            return round(x * 1000.0 / messages, 2) if x is not None and messages else None
        front = None if self.encoder_s is None else self.server_s - self.encoder_s
        return {"cpu_ms_per_msg": ms(self.server_s), "front_end_cpu_ms_per_msg": ms(front),
                "encoder_cpu_ms_per_msg": ms(self.encoder_s), "event_loop_cpu_ms_per_msg": ms(self.main_thread_s),
                "client_cpu_ms_per_msg": ms(self.client_s),
                "other_processes_cores": None if self.others_cores is None else round(self.others_cores, 2)}


def own_cpu_s() -> float:
    """CPU seconds (user + system) this process has used so far."""
    t = os.times()
    return t.user + t.system


def _machine_busy() -> float | None:
    """CPU seconds the whole machine has been busy (all cores), None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


class CpuMeter:
    """Start with :meth:`start`, read with :meth:`stop` (module doc). ``pid``: the server's
    process id (None: read ``/metrics`` through ``http``)."""

    def __init__(self, pid: int | None = None, http: aiohttp.ClientSession | None = None) -> None:
        self.pid = pid
        self.http = http
        self._start: dict[int, float] = {}
        self._main0: dict[int, float] = {}
        self._client0 = 0.0
        self._machine0: tuple[float | None, float] = (None, 0.0)
        self._metrics0: float | None = None
        if pid is not None:
            try:
                import psutil
            except ImportError:
                raise RuntimeError("--server-pid / --start-server need psutil: pip install psutil") from None
            try:
                self._proc = psutil.Process(pid)
            except psutil.Error as exc:
                raise RuntimeError(f"--server-pid {pid}: {exc}") from None

    def _snapshot(self) -> tuple[dict[int, float], dict[int, float], set[int]]:
        """CPU seconds so far of each server process and of each front end's main thread, by pid,
        and which pids are the encoder's."""
        import psutil
        times: dict[int, float] = {}
        mains: dict[int, float] = {}
        encoder: set[int] = set()
        for p in [self._proc, *self._proc.children(recursive=True)]:
            try:
                t = p.cpu_times()
                times[p.pid] = t.user + t.system
                if p.pid != self.pid and any(m in p.cmdline() for m in ENCODER_MODULES):
                    encoder.add(p.pid)
                    continue
                main = next((t.user_time + t.system_time for t in p.threads() if t.id == p.pid), None)
                if main is not None:
                    mains[p.pid] = main
            except psutil.Error:  # exited meanwhile
                continue
        return times, mains, encoder

    async def _metrics_cpu(self) -> float | None:
        if self.http is None:
            return None
        try:
            async with self.http.get("/metrics") as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        for line in text.splitlines():
            if line.startswith("process_cpu_seconds_total "):
                return float(line.split()[1])
        return None

    def _others(self, server_s: float, client_s: float) -> float | None:
        busy0, wall0 = self._machine0
        busy = _machine_busy()
        if busy is None or busy0 is None or time.monotonic() <= wall0:
            return None
        return max(0.0, busy - busy0 - server_s - client_s) / (time.monotonic() - wall0)

    async def start(self) -> None:
        self._machine0 = (_machine_busy(), time.monotonic())
        self._client0 = own_cpu_s()
        if self.pid is not None:
            self._start, self._main0, _ = self._snapshot()
        else:
            self._metrics0 = await self._metrics_cpu()

    async def stop(self) -> CpuUsage | None:
        """The CPU used since :meth:`start`; None when it could not be read."""
        client = own_cpu_s() - self._client0
        if self.pid is not None:
            end, mains, encoder = self._snapshot()
            server = sum(t - self._start.get(pid, 0.0) for pid, t in end.items())
            encoder_s = sum(end[pid] - self._start.get(pid, 0.0) for pid in encoder)
            main_s = (sum(t - self._main0.get(pid, 0.0) for pid, t in mains.items())
                      if self.pid in mains and self.pid in self._main0 else None)
            return CpuUsage(server, main_s, client, len(end), f"psutil: pid {self.pid} and {len(end) - 1} children "
                            f"({len(encoder)} of them the encoder's)", self._others(server, client), encoder_s)
        end_metrics = await self._metrics_cpu()
        if end_metrics is None or self._metrics0 is None:
            return None
        server = end_metrics - self._metrics0
        return CpuUsage(server, None, client, 1, "/metrics process_cpu_seconds_total", self._others(server, client))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A ``healthbot serve`` started by the load test: ``url``, ``pid``, ``log`` (its output)."""

    proc: subprocess.Popen
    url: str
    log: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (a graceful shutdown), then SIGKILL after ``timeout_s``; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if self.proc.poll() is None:
                self.proc.kill()
        return self.proc.wait()


async def start_server(global_args: list[str], env: dict[str, str] | None = None,
                       timeout_s: float = 900.0, progress: Any = None) -> ServerProcess:
    """Start ``healthbot serve`` (``python -m bot.cli <global_args> serve``) on a free port of
    127.0.0.1 and wait for ``GET /readyz`` to answer 200 (model and knowledge base loaded).

    Raises:
        RuntimeError: it exited, or was not ready within ``timeout_s`` (the message names its log).
    """
    port = _free_port()
    fd, log = tempfile.mkstemp(prefix="healthbot-serve-", suffix=".log")
    cmd = [sys.executable, "-m", "bot.cli", *global_args, "serve", "--host", "127.0.0.1", "--port", str(port)]
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log)
    if progress is not None:
        progress(f"  started healthbot serve (pid {proc.pid}) on {server.url}; log {log}")
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"healthbot serve exited with status {proc.returncode}: see {log}")
            try:
                async with http.get(server.url + "/readyz") as resp:
                    if resp.status == 200:
                        return server
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.5)
    await server.stop()
    raise RuntimeError(f"healthbot serve was not ready within {timeout_s:.0f} s: see {log}")
