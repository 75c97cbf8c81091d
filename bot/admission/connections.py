"""Connection and read-timeout guards (issue 21: "read timeouts for headers and bodies, a cap
on open connections"), before aiohttp parses anything.

At most ``max_connections`` open connections (by default what the file-descriptor
limit leaves after :data:`FD_RESERVE` for the store, the model and a knowledge-base
reload) and ``max_connections_per_address`` from one address; beyond either, a new
connection is closed at once. A connection that has not sent a whole request header
within ``header_timeout_s`` is closed (idle or slow-header connections cannot pile
up); between requests aiohttp's own ``keepalive_timeout`` applies. The limits are
the ``[admission]`` section of the configuration (:class:`~bot.config.AdmissionConfig`).
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections import Counter
from typing import Callable

import structlog
from aiohttp import web

from bot.config import AdmissionConfig

log = structlog.get_logger("healthbot.admission")

__all__ = ["ConnectionGate", "FD_RESERVE", "GatedTCPSite", "connection_cap", "raise_fd_limit"]

#: File descriptors kept back from connections (store, model files, threads, a reload, logs).
FD_RESERVE = 256

#: Seconds between two warning lines about refused or timed-out connections (no log flood).
WARN_EVERY_S = 10.0


def raise_fd_limit(target: int = 65536) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` towards its hard limit (at most ``target``);
    returns the soft limit in force afterwards."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = min(target, hard) if hard != resource.RLIM_INFINITY else target
        if want > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ValueError, OSError):
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_cap(limits: AdmissionConfig) -> int:
    """``limits.max_connections``, never more than the soft file-descriptor limit minus :data:`FD_RESERVE`."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    fd_room = max(16, soft - FD_RESERVE) if soft != resource.RLIM_INFINITY else 1 << 20
    return min(limits.max_connections, fd_room) if limits.max_connections > 0 else fd_room


class ConnectionGate:
    """Counts open connections (in all, per address) and closes what is over the caps.

    :meth:`protocol_factory` wraps aiohttp's protocol factory (``runner.server``) for
    ``loop.create_server``; the wrapper protocol (:class:`_GatedProtocol`) forwards
    every callback to aiohttp's own handler, which it creates only for an admitted
    connection.
    """

    def __init__(self, limits: AdmissionConfig, stats: Counter[str] | None = None):
        self.limits = limits
        self.cap = connection_cap(limits)
        self.per_address = limits.max_connections_per_address
        self.open = 0
        self.by_address: Counter[str] = Counter()
        self.stats = stats if stats is not None else Counter()
        self._started: dict[asyncio.BaseTransport, bool] = {}
        self._warned_at = -WARN_EVERY_S

    def _warn(self) -> None:
        """One warning line per :data:`WARN_EVERY_S` at most while connections are refused or cut."""
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("admission.connections_limited", open=self.open, cap=self.cap, per_address=self.per_address,
                        **{k: v for k, v in self.stats.items() if k.startswith("connections_")})

    def refresh_cap(self) -> None:
        """Recompute :attr:`cap` (after the file-descriptor limit changed)."""
        self.cap = connection_cap(self.limits)

    def protocol_factory(self, inner_factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _GatedProtocol(self, inner_factory)

    def try_open(self, address: str) -> bool:
        if self.open >= self.cap:
            self.stats["connections_refused_total_cap"] += 1
            self._warn()
            return False
        if self.per_address and self.by_address.get(address, 0) >= self.per_address:
            self.stats["connections_refused_address_cap"] += 1
            self._warn()
            return False
        self.open += 1
        self.by_address[address] += 1
        return True

    def closed(self, address: str) -> None:
        self.open -= 1
        left = self.by_address[address] - 1
        if left > 0:
            self.by_address[address] = left
        else:
            del self.by_address[address]

    def request_started(self, transport: asyncio.BaseTransport | None) -> None:
        """A whole request header arrived on ``transport`` (the middleware says so)."""
        if transport is not None and transport in self._started:
            self._started[transport] = True


class _GatedProtocol(asyncio.Protocol):
    """Admits or closes one connection; then forwards to aiohttp's handler."""

    __slots__ = ("gate", "factory", "inner", "address", "transport", "timer")

    def __init__(self, gate: ConnectionGate, factory: Callable[[], asyncio.Protocol]):
        self.gate = gate
        self.factory = factory
        self.inner: asyncio.Protocol | None = None
        self.address = ""
        self.transport: asyncio.BaseTransport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self.gate.try_open(self.address):
            transport.abort()  # type: ignore[attr-defined]
            return
        self.transport = transport
        self.gate._started[transport] = False
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.gate.limits.header_timeout_s, self._header_deadline)
        self.inner = self.factory()
        self.inner.connection_made(transport)

    def _header_deadline(self) -> None:
        self.timer = None
        transport = self.transport
        if transport is not None and not self.gate._started.get(transport, True):
            self.gate.stats["connections_header_timeout"] += 1
            self.gate._warn()
            transport.abort()  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is None:
            return
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.gate._started.pop(self.transport, None)  # type: ignore[arg-type]
        self.gate.closed(self.address)
        self.transport = None
        inner, self.inner = self.inner, None
        inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


class GatedTCPSite(web.BaseSite):
    """aiohttp's TCP site with every accepted connection passed through a :class:`ConnectionGate`.

    Like ``web.TCPSite(runner, host, port, reuse_port=…)``; :attr:`port` is the bound port (useful
    with port 0). ``reuse_port``: bind with ``SO_REUSEPORT``, so that several processes listen on
    the same port and the kernel spreads the connections over them (bot/prefork.py).
    """

    def __init__(self, runner: web.BaseRunner, host: str, port: int, gate: ConnectionGate, *,
                 backlog: int = 1024, reuse_port: bool = False):
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._gate, self._reuse_port = host, port, gate, reuse_port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        if self._server is not None and self._server.sockets:
            return int(self._server.sockets[0].getsockname()[1])
        return self._port

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None, "runner.setup() first"
        self._server = await asyncio.get_running_loop().create_server(
            self._gate.protocol_factory(server), self._host, self._port, backlog=self._backlog,
            reuse_address=True, reuse_port=self._reuse_port or None)
