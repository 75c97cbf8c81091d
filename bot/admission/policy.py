"""The admission policy: per-address and per-user budgets, the window on long questions, and the
shutdown deadline (issue 21, "fair share and cost-aware admission"). Nothing here touches the store.

* **the HTTP API's callers** (per client address, ``POST /api/chat`` only: its
  ``user_id`` is chosen by the caller, so the address is the only identity):
  ``address_per_minute`` requests (burst ``address_burst``) and
  ``address_tokens_per_minute`` estimated tokens of questions (burst
  ``address_token_burst``); beyond, 429 with ``Retry-After``. WeChat and Telegram
  requests come from the platforms' own servers and are limited per user instead.
* **long questions** (:meth:`Admission.admit`, :func:`~bot.admission.windowing.window_text`):
  a question over ``max_question_tokens`` (estimated) is read as its beginning and its
  end (half the budget each), and the reply starts with a short note saying so
  (:data:`~bot.admission.windowing.LONG_NOTE`). Red-flag messages are never cut (the
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
:class:`Admission` also carries the shutdown deadline (:meth:`Admission.begin_drain`),
which the routes use to answer before the process stops (bot/app.py ``serve``). The
numbers are the ``[admission]`` section of the configuration (:class:`~bot.config.AdmissionConfig`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable

import structlog
from aiohttp import web

from bot.admission.budgets import TABLE_MAX, Buckets
from bot.admission.connections import ConnectionGate
from bot.admission.windowing import LONG_NOTE, estimate_tokens, window_text
from bot.config import AdmissionConfig
from bot.types import Inbound, Intent, MessageKind, Reply

log = structlog.get_logger("healthbot.admission")

__all__ = ["ADMISSION_KEY", "Admission", "Admitted", "WORK_NOTE"]

WORK_NOTE = {
    "zh": "您刚才发的内容比较多，我需要一点时间。请过一会儿再发，或者把问题缩短成一两句话，我会尽快回答您。",
    "en": "You've sent a lot of text in a short time. Please wait a little before sending more, or ask in a "
          "sentence or two, and I'll answer you.",
}
"""The reply when a user's work bucket is empty."""


@dataclass
class Admitted:
    """What :meth:`Admission.admit` decided: ``inbound`` to hand to the dispatcher (its text
    perhaps windowed, then ``windowed`` is True), or ``refusal``, the reply to send instead;
    ``charged``: the tokens taken from the user's work budget for it (:meth:`Admission.refund`)."""

    inbound: Inbound
    windowed: bool = False
    refusal: Reply | None = None
    charged: float = 0.0


class Admission:
    """The per-process admission state (module docstring); one per app, at :data:`ADMISSION_KEY`.

    Attributes:
        stats: counters (``windowed``, ``work_refused``, ``address_refused``,
            ``failures_held``, ``body_timeouts``, ``connections_*``, ...), logged at shutdown.
        in_flight: messages (non-GET requests) being handled now.
    """

    def __init__(self, limits: AdmissionConfig | None = None, *, safety: Any = None,
                 clock: Callable[[], float] = time.monotonic):
        self.limits = limits or AdmissionConfig()
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
            return Admitted(inbound, charged=cost)
        self._remember(key, True)
        self.stats["windowed"] += 1
        return replace(self._windowed(inbound), charged=cost)

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

    def refund(self, inbound: Inbound, admitted: Admitted) -> None:
        """Undo :meth:`admit`'s charge for ``inbound``, refused after it (a replayed WeChat request,
        :class:`bot.dedup.ReplayRefused`): a forged body naming someone never spends their budget."""
        if admitted.charged:
            self._admitted.pop(f"{inbound.channel}:{inbound.user_id}:{inbound.message_id}", None)
            self.users.give(f"{inbound.channel}:{inbound.user_id}", admitted.charged)

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
