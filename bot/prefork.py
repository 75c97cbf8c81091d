"""``healthbot serve --processes N`` (``server.processes``): a master process and N front-end
processes on one host (issue 23).

Why: one serving process runs at about one core, its event loop holding the GIL for HTTP,
admission, the dispatcher, safety rules, retrieval and store calls, so a 16-core host answered
about 110-160 messages/s with one. Here each front-end process is a whole server (bot/app.py:
HTTP, admission control, dispatcher, safety, retrieval, its own inference pool and embedding
cache), and the kernel spreads the connections over them.

The master:

- reserves ``server.host:server.port`` (and ``server.metrics_port``) with a socket bound with
  ``SO_REUSEPORT`` that never listens: a port already in use stops the start at once, port 0
  becomes one real port that every process binds, and no other program takes the port while a
  process restarts;
- with a GPU engine in ``inference.engine_order``, ``inference.engine_server`` on and a GPU
  visible, starts ONE engine server per GPU (inference/multiproc/engine_server.py, through
  :meth:`ProcessPoolEncoder.engine_servers`, which watches and restarts them as the process pool
  does); front-end process i sends its padded batches to GPU ``i mod G``'s server
  (``inference.engine_socket``) and keeps its own CPU fallback engine;
- starts N front-end processes (multiprocessing's ``spawn``: fresh interpreters, no CUDA or
  threads inherited through a fork), each binding the same port with ``SO_REUSEPORT`` (Linux
  spreads new connections over the listening processes by a hash of their addresses);
- restarts a process that exits while the group serves, after 1 s, doubling up to 30 s while it
  keeps failing before it serves again (the process pool's back-off, inference/multiproc/
  supervision.py), logged and counted (``healthbot_server_process_restarts_total``); a process
  that fails before the group has ever served stops the start (exit status 1: the same error
  would stop every process);
- on SIGTERM or SIGINT sends SIGTERM to every process, each of which drains as one server does
  (bot/app.py ``shut_down``, within ``server.shutdown_timeout_s``), waits for them (one still
  running :data:`~bot.front_ends.KILL_AFTER_S` seconds after the timeout is
  killed), stops the engine servers and exits 0, or 1 when a process did not shut down cleanly.

A front-end process whose master dies (its end of the pipe to the master closes) shuts down as on
SIGTERM. Its log lines carry its ``pid``.

**CPU threads.** With ``inference.intra_op_threads`` at 0 (ONNX Runtime's default, a thread per
core in every session), each process gets ``max(1, min(2, cores // N))`` threads, so N sessions
do not oversubscribe the cores: one core each is taken by the processes' event loops already, and
a session of a few short questions gains little from more than two threads. An operator's
setting wins.

**State.** The processes share the store: the SQLite file (WAL, a busy timeout: bot/store/
sqlite_connection.py) or Redis. ``memory://`` and ``sqlite:///:memory:`` are refused with N ≥ 2:
each process would keep its own dedup claims, sessions, handoffs, rate limits and pending
answers, so a WeChat retry reaching another process would be answered twice and a conversation
an agent has taken would be answered by the bot.

**Metrics.** prometheus-client's multiprocess mode: the master points ``PROMETHEUS_MULTIPROC_DIR``
at a fresh folder (removed at exit) before it starts any process; every front-end process keeps its
values there, and ``/metrics`` (in any process, on ``server.port`` or the shared
``server.metrics_port``) serves their sum (:func:`inference.metrics.render`; no ``process_*``).
The master marks each exited process dead (its live gauges leave the sum; its counters stay). The
master's own metrics are not in the folder (it imported prometheus-client before setting it): a
restarted process counts its restart itself, and the engine servers' exits and restarts are in
the master's log (``inference_worker_exited``, ``inference_worker_restarted``).
"""

from __future__ import annotations

import asyncio
import copy
import os
import shutil
import socket
import sys
import tempfile

from bot.config import Config, ConfigError
from bot.front_ends import Master
from inference.devices import GPU_ENGINES, visible_gpu_count
from inference.metrics import MULTIPROC_DIR_ENV

__all__ = ["check_config", "engine_servers_wanted", "front_end_count", "front_end_threads", "run_master"]

#: Stores that live inside one process.
_PRIVATE_STORES = ("memory://", "sqlite:///:memory:")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def engine_servers_wanted(cfg: Config) -> bool:
    """True when the master starts one engine server per GPU: ``inference.engine_server`` on, a GPU
    engine in ``inference.engine_order``, and a GPU visible."""
    inf = cfg.inference
    return inf.engine_server and any(e in GPU_ENGINES for e in inf.engine_order) and visible_gpu_count() > 0


def front_end_count(cfg: Config, gpu: bool | None = None) -> int:
    """The front-end processes ``server.processes`` asks for: itself when ≥ 1; for 0 (auto) the CPU
    cores this process may use, minus one when a GPU engine server runs (``gpu``; default
    :func:`engine_servers_wanted`), and at least 1."""
    if cfg.server.processes >= 1:
        return cfg.server.processes
    if gpu is None:
        gpu = engine_servers_wanted(cfg)
    return max(1, _cores() - (1 if gpu else 0))


def front_end_threads(cfg: Config, processes: int) -> int:
    """ONNX Runtime threads per session in each of ``processes`` front ends: ``inference.intra_op_threads``
    when set, else ``max(1, min(2, cores // processes))`` (module doc, "CPU threads")."""
    if cfg.inference.intra_op_threads:
        return cfg.inference.intra_op_threads
    return max(1, min(2, _cores() // processes))


def check_config(cfg: Config, telegram_polling: bool = False) -> None:
    """Refuse what several front-end processes cannot do.

    Raises:
        ConfigError: a store that lives inside one process (``memory://``), ``inference.device_processes``
            ≥ 1 (worker processes under every front end: use one or the other), or Telegram long polling
            (getUpdates allows one consumer per bot).
    """
    if cfg.effective_store_url.startswith(_PRIVATE_STORES):
        raise ConfigError(f"store_url {cfg.effective_store_url!r} keeps state inside one process: with "
                          "server.processes other than 1 each process would have its own dedup, sessions, handoffs "
                          "and rate limits; use the SQLite default (sqlite:///path.db) or Redis (redis://host:6379/0)")
    if cfg.inference.device_processes:
        raise ConfigError("config keys 'server.processes' and 'inference.device_processes': choose one: several "
                          "front-end processes each run their own inference (and share one engine server per GPU)")
    if telegram_polling:
        raise ConfigError("--telegram-polling needs one process (Telegram's getUpdates allows one consumer): "
                          "use the webhook, or server.processes = 1")


def _reserve(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT``, never listening (module doc)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def run_master(cfg: Config, log_level: str = "INFO", log_format: str = "auto", server_loader: str = "") -> int:
    """Run ``server.processes`` front-end processes under a master until SIGTERM or SIGINT (module doc).

    Args:
        cfg: the effective config, checked with :func:`check_config`; ``server.processes`` ≥ 2, as
            :func:`front_end_count` resolves it.
        log_level, log_format: the processes' logging (bot/logs.py).
        server_loader: ``"module:function"`` the engine servers load their engine with (tests).

    Returns:
        The exit status: 0 after a clean shutdown, 1 when a process failed to start or did not
        shut down cleanly, 2 when a port cannot be bound (the message says which).
    """
    reserved: list[socket.socket] = []
    try:
        for port in (cfg.server.port, cfg.server.metrics_port) if cfg.server.metrics_port else (cfg.server.port,):
            reserved.append(_reserve(cfg.server.host, port))
    except OSError as exc:
        for sock in reserved:
            sock.close()
        print(f"healthbot: cannot listen on {cfg.server.host}:{port}: {exc}", file=sys.stderr)
        return 2
    cfg = copy.deepcopy(cfg)
    cfg.server.port = reserved[0].getsockname()[1]  # server.port 0: the port the system chose
    gpu = engine_servers_wanted(cfg)
    metrics_dir = tempfile.mkdtemp(prefix="healthbot-metrics-")
    os.environ[MULTIPROC_DIR_ENV] = metrics_dir  # inherited by every process started from here on
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # N tokenizer thread pools would fight for the cores
    try:
        return asyncio.run(Master(cfg, front_end_threads(cfg, cfg.server.processes), gpu, log_level, log_format,
                                  metrics_dir, server_loader).run())
    finally:
        for sock in reserved:
            sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
