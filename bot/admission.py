"""Admission control: who gets how much of this process (issue 21, "fair share and cost-aware admission").

One process answers on a few cores; a request's cost is mostly the encoder's work,
which grows with the question's length (a 2,000-character question took 1.4-1.8 s
of encoder time on the 2-core machine, a short one 26 ms). Cheap checks come
first and nothing here touches the store:

* **connections** (:class:`ConnectionGate`): at most ``max_connections`` open
  connections (by default what the file-descriptor limit leaves after a reserve
  for the store, the model and a knowledge-base reload) and
  ``max_connections_per_address`` from one address; beyond either, a new
  connection is closed at once, before aiohttp parses anything. A connection that
  has not sent a whole request header within ``header_timeout_s`` is closed (idle
  or slow-header connections cannot pile up); between requests aiohttp's own
  ``keepalive_timeout`` applies.
* **bodies** (:func:`make_middleware`): a body still arriving ``body_timeout_s``
  after its header gets 408; a declared ``Content-Length`` over the app's
  ``client_max_size`` gets 413 before anything is read.
* **failures** (per client address): every 4xx answer takes a token from the
  address's failure bucket (``failure_burst``, ``failure_per_minute``); once it is
  empty, each further 4xx is held ``failure_delay_s`` before it goes out. A client
  sending junk in a loop then sends about one request per ``failure_delay_s`` per
  connection, while good requests from the same address are never held.
* **the HTTP API's callers** (per client address, ``POST /api/chat`` only: its
  ``user_id`` is chosen by the caller, so the address is the only identity):
  ``address_per_minute`` requests (burst ``address_burst``) and
  ``address_tokens_per_minute`` estimated tokens of questions (burst
  ``address_token_burst``); beyond, 429 with ``Retry-After``. WeChat and Telegram
  requests come from the platforms' own servers and are limited per user instead.
* **long questions** (:meth:`Admission.admit`, :func:`window_text`): a question over
  ``max_question_tokens`` (estimated, :func:`estimate_tokens`) is read as its
  beginning and its end (half the budget each), and the reply starts with a short
  note saying so (:data:`LONG_NOTE`). Red-flag messages are never cut (the
  emergency rules read the whole text and cost no encoding), nor are messages
  of a user whom a person is helping (relayed whole, no encoding).
* **work per user** (:meth:`Admission.admit`): every question costs its estimated
  tokens from the user's bucket (``user_tokens_per_minute``, burst
  ``user_token_burst``); an empty bucket gets a polite "please wait / shorten"
  (:data:`WORK_NOTE`) without any encoding. Ordinary users never reach it (20
  short questions a minute are about 250 tokens); a user pasting long texts gets
  four or five at once and then about one every ten seconds. Emergencies always
  pass: the red-flag rules read the whole text of every admitted message, and the
  window of a refused one (what the dispatcher would have read). A re-delivery of an
  admitted message (WeChat's retry) passes free.

Everything is in memory, per process: each replica protects its own cores.
:class:`Admission` also carries the shutdown deadline (:meth:`begin_drain`), which
the routes use to answer before the process stops (bot/app.py ``serve``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import resource
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable

import structlog
from aiohttp import web

from bot.types import Inbound, Intent, MessageKind, Reply

log = structlog.get_logger("healthbot.admission")

__all__ = [
    "ADMISSION_KEY", "Admission", "AdmissionLimits", "ConnectionGate", "GatedTCPSite", "LONG_NOTE", "WORK_NOTE",
    "estimate_tokens", "install", "make_middleware", "raise_fd_limit", "window_text",
]

LONG_NOTE = {
    "zh": "（您的消息比较长，我先读了开头和结尾的部分来回答。如果没有答到您想问的，请用一两句话把最想问的问题再发给我。）",
    "en": "(Your message was long, so I read its beginning and its end to answer. If I missed your question, "
          "please send it again in a sentence or two.)",
}
"""Put before the reply to a question that was read as a window (:func:`window_text`)."""

WORK_NOTE = {
    "zh": "您刚才发的内容比较多，我需要一点时间。请过一会儿再发，或者把问题缩短成一两句话，我会尽快回答您。",
    "en": "You've sent a lot of text in a short time. Please wait a little before sending more, or ask in a "
          "sentence or two, and I'll answer you.",
}
"""The reply when a user's work bucket is empty."""

ELISION = " …… "
"""Joins the beginning and the end of a windowed question."""

#: Status codes that count as a client's failure (junk, bad signatures, unknown routes, our own 429).
FAILURE_STATUSES = frozenset({400, 401, 403, 404, 405, 408, 411, 413, 414, 415, 422, 429, 431})

#: File descriptors kept back from connections (store, model files, threads, a reload, logs).
FD_RESERVE = 256

#: Largest number of keys each in-memory table keeps (the least recently used are dropped).
TABLE_MAX = 100_000

#: Seconds between two warning lines about refused or timed-out connections (no log flood).
WARN_EVERY_S = 10.0


@dataclass
class AdmissionLimits:
    """The numbers (module docstring). ``max_connections`` 0 = derived from the
    file-descriptor limit (:func:`connection_cap`)."""

    #: 80 estimated tokens are at most about 60 real ones (Chinese, English; less with many
    #: digits): the encoder's 64-token bucket, about twice a short question's cost (a window in
    #: the 128 bucket cost 3-4 times as much, measured); 211 of 220 real public health
    #: questions are shorter and pass unchanged.
    max_question_tokens: int = 80
    user_tokens_per_minute: float = 480.0
    user_token_burst: float = 320.0
    address_per_minute: float = 300.0
    address_burst: float = 120.0
    address_tokens_per_minute: float = 3000.0
    address_token_burst: float = 2000.0
    failure_per_minute: float = 60.0
    failure_burst: float = 30.0
    failure_delay_s: float = 1.0
    max_connections: int = 0
    max_connections_per_address: int = 256
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    keepalive_timeout_s: float = 75.0
    #: Addresses whose ``X-Forwarded-For`` is believed (a reverse proxy in front); "" entries ignored.
    trusted_proxies: tuple[str, ...] = ()


# --------------------------------------------------------------------------- cost


_SPACES = b" \t\r\n\x0b\x0c"
_LETTERS = bytes(range(65, 91)) + bytes(range(97, 123))


def _char_cost(ch: str) -> float:
    if ord(ch) >= 0x80:
        return 1.0  # Chinese, full-width forms, emoji, accented letters: at most about a token each
    if ch.isascii() and ch.isalpha():
        return 1.0 / 3.0  # English words: 1.2-1.4 tokens for 4-5 letters
    return 0.0 if ch in " \t\r\n\x0b\x0c" else 1.0  # digits and punctuation: up to a token each


def estimate_tokens(text: str) -> int:
    """An upper estimate of the encoder's tokens for ``text``, without the tokenizer.

    Each non-ASCII character (Chinese, full-width forms, emoji, accented letters),
    digit and punctuation mark counts one, each ASCII letter a third (English words
    come to 1.2-1.4 tokens; the e5 tokenizer gave 0.69 tokens per Chinese character
    and 0.24 per English character on the project's sample questions), spaces
    nothing; plus 2 for the ``query:`` prefix.
    """
    ascii_ = text.encode("ascii", "ignore")
    letters = len(ascii_) - len(ascii_.translate(None, _LETTERS))
    others = len(ascii_.translate(None, _LETTERS + _SPACES))
    return 2 + (len(text) - len(ascii_)) + others + math.ceil(letters / 3)


def _cut_index(text: str, budget: int, from_end: bool = False) -> int:
    """How many characters from the start (or the end) of ``text`` fit ``budget`` estimated tokens."""
    used = 0.0
    n = 0
    for ch in (reversed(text) if from_end else iter(text)):
        cost = _char_cost(ch)
        if used + cost > budget:
            break
        used += cost
        n += 1
    return n


_ENDS = "。！？!?；;…\n."
_SOFT = "，,、：:"


def _snap(piece: str, backwards: bool) -> str:
    """``piece`` cut at a sentence end (else a comma) in its outer half: after the last one for a
    beginning (``backwards``), after the first one for an end."""
    n = len(piece)
    for marks in (_ENDS, _SOFT):
        span = range(n - 1, n // 2, -1) if backwards else range(0, n // 2)
        for i in span:
            if piece[i] in marks:
                return piece[: i + 1] if backwards else piece[i + 1:]
    return piece


def window_text(text: str, budget: int) -> tuple[str, bool]:
    """``text`` cut to at most ``budget`` estimated tokens: its beginning and its end (half the
    budget each), joined by :data:`ELISION`; ``(text, False)`` when it fits.

    The beginning ends after a sentence end (else a comma) in its second half; the end
    starts after one in its first half. The end matters: a consultation message usually
    ends with the question itself.
    """
    if estimate_tokens(text) <= budget:
        return text, False
    room = max(budget - 2 - estimate_tokens(ELISION.strip()), 8)
    head = _snap(text[: _cut_index(text, room // 2)], backwards=True).strip()
    tail_n = _cut_index(text, room - (estimate_tokens(head) - 2), from_end=True)
    tail = _snap(text[len(text) - tail_n:], backwards=False).strip() if tail_n else ""
    return head + ELISION + tail, True


# --------------------------------------------------------------------------- buckets


class Buckets:
    """Token buckets by key, in memory, least recently used dropped beyond ``TABLE_MAX``
    (a dropped key starts full again: an attacker gains nothing by evicting, since
    new keys start full anyway)."""

    def __init__(self, per_minute: float, burst: float, clock: Callable[[], float] = time.monotonic):
        self.rate = per_minute / 60.0
        self.burst = float(burst)
        self.clock = clock
        self._t: OrderedDict[Any, tuple[float, float]] = OrderedDict()

    def level(self, key: Any) -> float:
        now = self.clock()
        tokens, at = self._t.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.rate)

    def take(self, key: Any, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens if there are that many (a cost above the burst needs a full bucket)."""
        now = self.clock()
        tokens = self.level(key)
        ok = tokens >= min(cost, self.burst)
        if ok:
            tokens -= cost
        self._t[key] = (tokens, now)
        self._t.move_to_end(key)
        if len(self._t) > TABLE_MAX:
            self._t.popitem(last=False)
        return ok

    def retry_after(self, key: Any, cost: float = 1.0) -> float:
        """Seconds until ``cost`` tokens are there."""
        missing = min(cost, self.burst) - self.level(key)
        return max(0.0, missing / self.rate) if self.rate > 0 else 60.0


# --------------------------------------------------------------------------- connections


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


def connection_cap(limits: AdmissionLimits) -> int:
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

    def __init__(self, limits: AdmissionLimits, stats: Counter[str] | None = None):
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

    Like ``web.TCPSite(runner, host, port)``; :attr:`port` is the bound port (useful with port 0).
    """

    def __init__(self, runner: web.BaseRunner, host: str, port: int, gate: ConnectionGate, *,
                 backlog: int = 1024):
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._gate = host, port, gate

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
            reuse_address=True)


# --------------------------------------------------------------------------- the policy


@dataclass
class Admitted:
    """What :meth:`Admission.admit` decided: ``inbound`` to hand to the dispatcher (its text
    perhaps windowed, then ``windowed`` is True), or ``refusal``, the reply to send instead."""

    inbound: Inbound
    windowed: bool = False
    refusal: Reply | None = None


class Admission:
    """The per-process admission state (module docstring); one per app, at :data:`ADMISSION_KEY`.

    Attributes:
        stats: counters (``windowed``, ``work_refused``, ``address_refused``,
            ``failures_held``, ``body_timeouts``, ``connections_*``, ...), logged at shutdown.
        in_flight: messages (non-GET requests) being handled now.
    """

    def __init__(self, limits: AdmissionLimits | None = None, *, safety: Any = None,
                 clock: Callable[[], float] = time.monotonic):
        self.limits = limits or AdmissionLimits()
        self.safety = safety
        self.stats: Counter[str] = Counter()
        lim = self.limits
        self.users = Buckets(lim.user_tokens_per_minute, lim.user_token_burst, clock)
        self.addresses = Buckets(lim.address_per_minute, lim.address_burst, clock)
        self.address_work = Buckets(lim.address_tokens_per_minute, lim.address_token_burst, clock)
        self.failures = Buckets(lim.failure_per_minute, lim.failure_burst, clock)
        self._admitted: OrderedDict[str, bool] = OrderedDict()
        self._proxies = [ipaddress.ip_network(p, strict=False) for p in lim.trusted_proxies if p]
        self.gate = ConnectionGate(lim, self.stats)
        self.in_flight = 0
        self._idle: asyncio.Event | None = None
        self.drain_deadline: float | None = None
        self._deadline_waiters: set[asyncio.Future[None]] = set()
        self._deadline_handle: asyncio.TimerHandle | None = None

    # ---- addresses

    def client_address(self, request: web.BaseRequest) -> str:
        """The caller's address: the peer, or behind a trusted proxy the last untrusted
        ``X-Forwarded-For`` entry."""
        peer = request.remote or ""
        if not self._proxies or not self._trusted(peer):
            return peer
        hops = [h.strip() for h in request.headers.get("X-Forwarded-For", "").split(",") if h.strip()]
        for hop in reversed(hops):
            if not self._trusted(hop):
                return hop
        return peer

    def _trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self._proxies)

    def check_address(self, address: str) -> float | None:
        """One ``POST /api/chat`` from ``address``: None when admitted, else seconds to wait (429)."""
        if self.addresses.take(address):
            return None
        self.stats["address_refused"] += 1
        return self.addresses.retry_after(address)

    def check_address_work(self, address: str, text: str) -> float | None:
        """The question's estimated tokens (windowed) from ``address``'s work bucket; None or seconds to wait."""
        cost = min(estimate_tokens(text), self.limits.max_question_tokens)
        if self.address_work.take(address, cost):
            return None
        self.stats["address_work_refused"] += 1
        return self.address_work.retry_after(address, cost)

    def failure_delay(self, address: str) -> float:
        """A 4xx answer to ``address``: seconds to hold it (0 while its failure bucket has tokens)."""
        if self.failures.take(address):
            return 0.0
        self.stats["failures_held"] += 1
        return self.limits.failure_delay_s

    # ---- questions

    def _urgent(self, text: str, lang: str | None) -> bool:
        from safety.normalize import normalize
        from safety.triage import triage
        if self.safety is None:
            return False
        norm = normalize(text)
        return triage(norm.text, lang or norm.lang, self.safety) is not None

    async def admit(self, inbound: Inbound, in_handoff: Callable[[], Awaitable[bool]] | None = None) -> Admitted:
        """The per-user work budget and the question window for one message (module docstring).

        Args:
            inbound: the message as the channel built it.
            in_handoff: ``async () -> bool``, whether a person has the conversation (asked
                only for a long or over-budget message).
        """
        if inbound.kind is not MessageKind.TEXT or not inbound.text:
            return Admitted(inbound)
        key = f"{inbound.channel}:{inbound.user_id}:{inbound.message_id}"
        text = inbound.text
        long = estimate_tokens(text) > self.limits.max_question_tokens
        if key in self._admitted:  # a re-delivery: the same decision, no second charge
            self._admitted.move_to_end(key)
            return self._windowed(inbound) if long and self._admitted[key] else Admitted(inbound)
        cost = min(estimate_tokens(text), self.limits.max_question_tokens)
        user = f"{inbound.channel}:{inbound.user_id}"
        if not self.users.take(user, cost):
            # Over budget: the red-flag rules still read the whole text (about 10 µs a
            # character, 20-40 ms for 2,000 characters): an emergency buried in the middle of
            # a long message must never be refused; the per-address limits bound a flood.
            if self._urgent(text, inbound.lang) or (in_handoff is not None and await in_handoff()):
                self._remember(key, False)
                return Admitted(inbound)
            self.stats["work_refused"] += 1
            log.info("admission.work_refused", channel=inbound.channel, message_id=inbound.message_id,
                     cost=cost, retry_after_s=round(self.users.retry_after(user, cost), 1))
            lang = inbound.lang or ("zh" if any(ord(c) >= 0x2E80 for c in text) else "en")
            return Admitted(inbound, refusal=Reply(WORK_NOTE[lang], Intent.SYSTEM, lang))
        if not long or self._urgent(text, inbound.lang) or (in_handoff is not None and await in_handoff()):
            self._remember(key, False)
            return Admitted(inbound)
        self._remember(key, True)
        self.stats["windowed"] += 1
        return self._windowed(inbound)

    def _windowed(self, inbound: Inbound) -> Admitted:
        text, cut = window_text(inbound.text, self.limits.max_question_tokens)
        if not cut:
            return Admitted(inbound)
        log.info("admission.windowed", channel=inbound.channel, message_id=inbound.message_id,
                 input_chars=len(inbound.text), kept_chars=len(text))
        return Admitted(replace(inbound, text=text), windowed=True)

    def _remember(self, key: str, windowed: bool) -> None:
        self._admitted[key] = windowed
        if len(self._admitted) > TABLE_MAX:
            self._admitted.popitem(last=False)

    @staticmethod
    def noted(reply: Reply, original_text: str) -> Reply:
        """``reply`` with :data:`LONG_NOTE` before its text (in the user's script), when it has text
        and is not an emergency, a handoff or a system message."""
        if not reply.text.strip() or reply.intent in (Intent.EMERGENCY, Intent.HANDOFF, Intent.SYSTEM):
            return reply
        from safety.normalize import normalize, to_user_script
        norm = normalize(original_text[:200])
        note = to_user_script(LONG_NOTE.get(reply.lang, LONG_NOTE["en"]), norm.script, norm.variant)
        return replace(reply, text=f"{note}\n\n{reply.text}")

    # ---- shutdown

    def request_started(self) -> None:
        self.in_flight += 1

    def request_finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0 and self._idle is not None:
            self._idle.set()

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    def begin_drain(self, deadline: float) -> None:
        """Shutdown has begun; routes must answer by ``deadline`` (event-loop time)."""
        self.drain_deadline = deadline
        loop = asyncio.get_running_loop()
        self._deadline_handle = loop.call_at(deadline, self._deadline_passed)

    def _deadline_passed(self) -> None:
        for fut in self._deadline_waiters:
            if not fut.done():
                fut.set_result(None)
        self._deadline_waiters.clear()

    def seconds_left(self) -> float | None:
        """Seconds to the drain deadline (None when not draining)."""
        if self.drain_deadline is None:
            return None
        return self.drain_deadline - asyncio.get_running_loop().time()

    async def until_deadline(self, work: asyncio.Future[Any]) -> bool:
        """Wait for ``work``; False when the drain deadline came first (``work`` keeps running)."""
        if work.done():
            return True
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        if self.drain_deadline is not None and loop.time() >= self.drain_deadline:
            return work.done()
        self._deadline_waiters.add(waiter)
        try:
            await asyncio.wait((work, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._deadline_waiters.discard(waiter)
        return work.done()

    async def wait_idle(self) -> int:
        """Wait until no request is being handled, or the drain deadline; returns how many still are."""
        if self.in_flight > 0:
            self._idle = asyncio.Event()
            left = self.seconds_left()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=None if left is None else max(left, 0.0))
            except TimeoutError:
                pass
        return max(self.in_flight, 0)


ADMISSION_KEY = web.AppKey("admission", Admission)
"""Where bot/app.py keeps the app's :class:`Admission` (routes find it with ``request.app.get``)."""


def make_middleware(admission: Admission) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The aiohttp middleware: request counting (shutdown), the body timeout and size check,
    and holding 4xx answers of failing addresses (module docstring)."""

    @web.middleware
    async def admission_middleware(request: web.Request, handler) -> web.StreamResponse:
        admission.gate.request_started(request.transport)
        counted = request.method not in ("GET", "HEAD")  # messages, not long polls and probes
        if counted:
            admission.request_started()
        failed: web.HTTPException | None = None
        try:
            response = await _handle(request, handler)
        except web.HTTPException as exc:
            if exc.status not in FAILURE_STATUSES:
                raise
            failed, response = exc, exc
        finally:
            if counted:
                admission.request_finished()
        if response.status in FAILURE_STATUSES and not admission.draining:
            delay = admission.failure_delay(admission.client_address(request))
            if delay:
                await asyncio.sleep(delay)
        if failed is not None:
            raise failed
        return response

    async def _handle(request: web.Request, handler) -> web.StreamResponse:
        if request.body_exists and not request.content.is_eof():
            limit = request.client_max_size
            if request.content_length is not None and limit and request.content_length > limit:
                admission.stats["body_too_large"] += 1
                return _error(request, 413, f"body over {limit} bytes")
            try:
                await asyncio.wait_for(request.content.wait_eof(), admission.limits.body_timeout_s)
            except TimeoutError:
                admission.stats["body_timeouts"] += 1
                log.warning("admission.body_timeout", path=request.path, timeout_s=admission.limits.body_timeout_s)
                return _error(request, 408, "request body too slow")
        return await handler(request)

    def _error(request: web.Request, status: int, message: str) -> web.Response:
        headers = {"Connection": "close"}
        if request.path.startswith(("/api/", "/console/api/", "/telegram")):  # the routes that speak JSON
            return web.json_response({"error": message}, status=status, headers=headers)
        return web.Response(status=status, text=message, headers=headers)

    return admission_middleware


def install(app: web.Application, admission: Admission) -> Admission:
    """Put ``admission`` on ``app`` (not yet started): at :data:`ADMISSION_KEY`, its middleware
    after those already there, and, as the first shutdown step still to come, a wait for the
    messages being answered (:meth:`Admission.wait_idle`). Install it before the channel
    adapters (their shutdown steps follow)."""
    app[ADMISSION_KEY] = admission
    app.middlewares.append(make_middleware(admission))

    async def requests_done(_app: web.Application) -> None:
        left = await admission.wait_idle()
        if left:
            log.warning("shutdown.requests_unfinished", count=left)

    app.on_shutdown.append(requests_done)
    return admission
