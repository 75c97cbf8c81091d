"""``healthbot loadtest --rate R``: an open-loop load test, and ``--ramp``.

Messages are sent at a fixed arrival rate, whatever the server does: arrival ``i`` is
scheduled at ``t_i`` (``--arrivals constant``: every ``1/R`` s; ``poisson``: exponential
gaps of mean ``1/R``, as independent users write) and sent then, however many earlier
messages are still unanswered. Latency is measured from ``t_i``, not from the moment the
request left, so a late client or a queue in front of the server counts against the
latency (no coordinated omission: a closed loop sends less when the server is slow and
reports the latency of the messages it managed to send). ``lag`` is how late the client
sent (it should stay well under the latencies measured; if not, the client was the
bottleneck).

Who sends: a pool of ``ceil(R × USER_INTERVAL_S)`` OpenIDs taken in turn, so each
simulated user writes about every :data:`USER_INTERVAL_S` seconds (under the per-user rate
limit), each OpenID replaced after :data:`~bot.loadtest.traffic.MESSAGES_PER_USER_ID`
messages; the questions are the closed loop's mix (:data:`~bot.loadtest.traffic.QUESTIONS`).

Reported per run (:meth:`OpenLoopResult.summary`): p50/p95/p99/p99.9 and max latency,
errors (transport, timeout, HTTP status, malformed reply, over WeChat's 5 s), deferred
answers (``success``: the reply budget was missed and the answer goes out later), late
answers (a reply that carries an earlier message's answer), paged answers ("回复 1 查看更多"),
replies that are not a real answer (busy, slow down), and the server's CPU per message
(bot/loadtest/cpu.py).

``--ramp`` (:func:`run_ramp`) runs one open-loop step per rate, ``start, start + step, ...``,
until a step's p99 exceeds the bound (``--p99-ms``) or it has errors, then halves the
interval between the last rate that passed and the first that failed ``refine`` times:
the highest rate that passed is the answer.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Iterator

import aiohttp

from bot.loadtest.cpu import CpuMeter, CpuUsage
from bot.loadtest.messages import REPLY_DEADLINE_S, TelegramRequests, WechatRequests, answer_kind
from bot.loadtest.traffic import (MESSAGES_PER_USER_ID, OK_OUTCOMES, QUESTIONS, check_ready, percentile_ms,
                                  validate_run)

__all__ = ["ARRIVALS", "MAX_RATE", "NOT_ANSWER_KINDS", "OpenLoopConfig", "OpenLoopResult", "OpenSample",
           "RampResult", "arrival_offsets", "passes", "run_open_loop", "run_ramp"]

ARRIVALS = ("poisson", "constant")
MAX_RATE = 20_000.0
"""Highest arrival rate, messages/s (a loopback test, not a flood)."""
USER_INTERVAL_S = 10.0
"""Seconds between two messages of one simulated user (sets the size of the OpenID pool)."""
CONNECTIONS = 250
"""Client connections at most (the server's ``admission.max_connections_per_address`` is 256);
messages beyond wait in the client, and their wait counts in their latency."""
NOT_ANSWER_KINDS = frozenset({"busy", "slow_down"})
RAMP_PAUSE_S = 3.0
"""Pause between two ramp steps, for the server to finish what the last step left; after a step
that failed (the server may still be working off its queue and late answers), :data:`RAMP_RECOVER_S`."""
RAMP_RECOVER_S = 20.0


@dataclass
class OpenLoopConfig:
    """One open-loop run at ``rate`` messages/s for ``seconds``; ``warmup_s``: the first seconds
    are sent but left out of the latency figures. ``server_pid``: the server's process id, for
    its CPU (else ``/metrics``)."""

    url: str
    rate: float = 100.0
    seconds: float = 60.0
    arrivals: str = "poisson"
    warmup_s: float = 0.0
    channel: str = "wechat"
    timeout_s: float = 10.0
    token: str = ""
    appid: str = ""
    aes_key: str = ""
    mode: str = "plaintext"
    telegram_secret: str = ""
    seed: int = 1
    server_pid: int | None = None
    #: Unix time (s) of the first scheduled send, for generators started apart (bot/loadtest/generators.py).
    start_at: float | None = None


@dataclass
class OpenSample:
    """One message: ``at_s`` (scheduled, seconds from the start), ``latency_s`` (from then to the
    whole answer), ``outcome`` (as the closed loop's), ``kind`` (:func:`~bot.loadtest.messages.answer_kind`),
    ``lag_s`` (how late it was sent)."""

    at_s: float
    latency_s: float
    outcome: str
    kind: str = ""
    lag_s: float = 0.0


@dataclass
class OpenLoopResult:
    """Every sample of one open-loop run, the server's CPU over it, and its summary."""

    config: OpenLoopConfig
    samples: list[OpenSample] = field(default_factory=list)
    duration_s: float = 0.0
    cpu: CpuUsage | None = None
    max_in_flight: int = 0

    @property
    def measured(self) -> list[OpenSample]:
        """The samples after the warm-up."""
        return [s for s in self.samples if s.at_s >= self.config.warmup_s]

    def summary(self) -> dict[str, Any]:
        cfg, ms = self.config, self.measured
        seconds = [s.latency_s for s in ms]
        outcomes = Counter(s.outcome for s in ms)
        kinds = Counter(s.kind for s in ms if s.kind)
        errors = Counter(s.outcome for s in ms if s.outcome not in OK_OUTCOMES)
        window = max(cfg.seconds - cfg.warmup_s, 1e-9)
        out: dict[str, Any] = {
            "mode": "open", "channel": cfg.channel, "arrivals": cfg.arrivals, "offered_rps": cfg.rate,
            "seconds": round(self.duration_s, 1), "warmup_s": cfg.warmup_s, "sent": len(self.samples),
            "requests": len(ms), "sent_rps": round(len(ms) / window, 1),
            "answered_rps": round(sum(1 for s in ms if s.outcome in OK_OUTCOMES) / window, 1),
            "p50_ms": percentile_ms(seconds, 50), "p95_ms": percentile_ms(seconds, 95),
            "p99_ms": percentile_ms(seconds, 99), "p99_9_ms": percentile_ms(seconds, 99.9),
            "max_ms": round(max(seconds) * 1000.0, 1) if seconds else math.nan,
            "mean_ms": round(sum(seconds) * 1000.0 / len(seconds), 1) if seconds else math.nan,
            "outcomes": dict(sorted(outcomes.items())), "errors": sum(errors.values()),
            "errors_by_kind": dict(sorted(errors.items())),
            "deferred": outcomes.get("deferred", 0), "late": kinds.get("late", 0), "paged": kinds.get("paged", 0),
            "not_answers": sum(kinds[k] for k in NOT_ANSWER_KINDS), "not_answers_by_kind":
                {k: kinds[k] for k in sorted(NOT_ANSWER_KINDS) if kinds[k]},
            "send_lag_p99_ms": percentile_ms([s.lag_s for s in ms], 99), "max_in_flight": self.max_in_flight,
        }
        out.update(self.cpu.per_message_ms(len(self.samples)) if self.cpu else
                   {"cpu_ms_per_msg": None, "front_end_cpu_ms_per_msg": None, "encoder_cpu_ms_per_msg": None,
                    "event_loop_cpu_ms_per_msg": None, "client_cpu_ms_per_msg": None, "other_processes_cores": None})
        out["cpu_source"] = self.cpu.source if self.cpu else "not measured"
        return out


def passes(summary: dict[str, Any], p99_ms: float) -> bool:
    """A ramp step passes: no error and p99 within ``p99_ms``."""
    return summary["errors"] == 0 and summary["requests"] > 0 and summary["p99_ms"] <= p99_ms


def arrival_offsets(rate: float, seconds: float, arrivals: str, rng: random.Random) -> Iterator[float]:
    """Scheduled send times, seconds from the start, in ``[0, seconds)``."""
    if arrivals == "constant":
        n = math.ceil(seconds * rate - 1e-9)  # i / rate < seconds, without float drift
        yield from (i / rate for i in range(n))
        return
    t = rng.expovariate(rate)
    while t < seconds:
        yield t
        t += rng.expovariate(rate)


def validate_open(cfg: OpenLoopConfig) -> str:
    """The server's base URL, once every bound of ``cfg`` is checked.

    Raises:
        ValueError: a bound is broken or a secret is missing.
    """
    base = validate_run(cfg)
    if not 0 < cfg.rate <= MAX_RATE:
        raise ValueError(f"--rate must be in (0, {MAX_RATE:.0f}] messages/s, not {cfg.rate}")
    if cfg.arrivals not in ARRIVALS:
        raise ValueError(f"--arrivals must be poisson or constant, not {cfg.arrivals!r}")
    if not 0 <= cfg.warmup_s < cfg.seconds:
        raise ValueError(f"--warmup must be in [0, --seconds), not {cfg.warmup_s}")
    return base


async def run_open_loop(cfg: OpenLoopConfig, progress: Any = None) -> OpenLoopResult:
    """Run one open-loop test (module doc) against the server at ``cfg.url``.

    Raises:
        ValueError: a bound is broken or a secret is missing; RuntimeError: no server, not
            ready, or ``server_pid`` not a process.
    """
    base = validate_open(cfg)
    rng = random.Random(cfg.seed)
    run_id = uuid.uuid4().hex[:8]
    wechat = WechatRequests(cfg.token, cfg.appid, cfg.aes_key, cfg.mode) if cfg.channel == "wechat" else None
    telegram = TelegramRequests(cfg.telegram_secret) if cfg.channel == "telegram" else None
    users = max(1, math.ceil(cfg.rate * USER_INTERVAL_S))
    result = OpenLoopResult(cfg, duration_s=cfg.seconds)
    connector = aiohttp.TCPConnector(limit=CONNECTIONS)
    async with aiohttp.ClientSession(base_url=base, timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
                                     connector=connector) as http:
        await check_ready(http, base)
        meter = CpuMeter(cfg.server_pid, http)
        loop = asyncio.get_running_loop()
        in_flight = 0

        async def one(seq: int, due: float, text: str) -> None:
            nonlocal in_flight
            n = seq % users
            generation = seq // users // MESSAGES_PER_USER_ID
            if wechat is not None:
                who: Any = f"oLOADOPEN_{run_id}_{n:05d}_{generation}"
                path, body, headers = wechat.build(who, seq, text)
            else:
                who = 8_000_000_000 + n * 1000 + generation
                path, body, headers = telegram.build(who, seq, text)  # type: ignore[union-attr]
            sent = loop.time()
            in_flight += 1
            result.max_in_flight = max(result.max_in_flight, in_flight)
            kind = ""
            try:
                async with http.post(path, data=body, headers=headers) as resp:
                    answer = await resp.text()
                    status = resp.status
                latency = loop.time() - due
                if status != 200:
                    outcome = f"http_{status}"
                elif wechat is not None:
                    outcome, content = wechat.answer(answer, who)
                    kind = answer_kind(content) if content else ""
                    if outcome in OK_OUTCOMES and latency > REPLY_DEADLINE_S:
                        outcome = "over_5s"
                else:
                    outcome = "ok"
            except TimeoutError:
                latency, outcome = loop.time() - due, "timeout"
            except aiohttp.ClientError as exc:
                latency, outcome = loop.time() - due, f"transport_{type(exc).__name__}"
            finally:
                in_flight -= 1
            result.samples.append(OpenSample(due - start, latency, outcome, kind, sent - due))

        async def report() -> None:
            while True:
                await asyncio.sleep(10.0)
                if progress is not None:
                    done = [s.latency_s for s in result.samples]
                    progress(f"  {loop.time() - start:5.0f} s  {len(done)} answered  in flight {in_flight}  "
                             f"p99 so far {percentile_ms(done, 99)} ms")

        tasks: set[asyncio.Task] = set()
        await meter.start()
        start = loop.time() + max(0.05, (cfg.start_at or 0.0) - time.time())
        reporter = loop.create_task(report())
        try:
            for seq, offset in enumerate(arrival_offsets(cfg.rate, cfg.seconds, cfg.arrivals, rng)):
                due = start + offset
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = loop.create_task(one(seq, due, rng.choice(QUESTIONS)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*list(tasks))
        finally:
            reporter.cancel()
            for task in list(tasks):
                task.cancel()
        result.cpu = await meter.stop()
    result.samples.sort(key=lambda s: s.at_s)
    return result


@dataclass
class RampResult:
    """The steps of a ramp (in the order run), the bound, and the highest rate that passed."""

    steps: list[OpenLoopResult]
    p99_ms: float
    best_rate: float | None


async def run_ramp(cfg: OpenLoopConfig, *, step: float, max_rate: float, p99_ms: float = 200.0,
                   refine: int = 2, progress: Any = None, pause_s: float = RAMP_PAUSE_S,
                   recover_s: float = RAMP_RECOVER_S,
                   run: Callable[[OpenLoopConfig], Awaitable[OpenLoopResult]] | None = None) -> RampResult:
    """Step the rate up from ``cfg.rate`` by ``step`` to at most ``max_rate`` (module doc), each step
    ``cfg.seconds`` long; returns every step and the highest rate whose p99 was within ``p99_ms``
    with no error (None if even the lowest rate tried failed). ``run``: how one step is sent
    (default :func:`run_open_loop`; several processes: bot/loadtest/generators.py)."""
    run = run or run_open_loop
    if step <= 0 or max_rate < cfg.rate:
        raise ValueError("--ramp needs --ramp-step > 0 and --ramp-max >= --rate")
    steps: list[OpenLoopResult] = []
    good: float | None = None
    bad: float | None = None

    async def measure(rate: float) -> bool:
        if steps:
            await asyncio.sleep(pause_s if passes(steps[-1].summary(), p99_ms) else max(pause_s, recover_s))
        r = await run(replace(cfg, rate=rate, seed=cfg.seed + len(steps)))
        steps.append(r)
        ok = passes(r.summary(), p99_ms)
        if progress is not None:
            s = r.summary()
            progress(f"  ramp {rate:g}/s: p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms, {s['errors']} errors, "
                     f"CPU {s['cpu_ms_per_msg']} ms/msg -> {'pass' if ok else 'FAIL'}")
        return ok

    rate = cfg.rate
    while rate <= max_rate + 1e-9:
        if await measure(rate):
            good, rate = rate, rate + step
        else:
            bad = rate
            break
    if bad is not None:
        lo = good or 0.0
        for _ in range(refine):
            mid = round((lo + bad) / 2.0, 1)
            if mid <= lo or mid >= bad:
                break
            if await measure(mid):
                good = lo = mid
            else:
                bad = mid
    return RampResult(steps, p99_ms, good)
