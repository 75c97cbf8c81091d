"""``healthbot loadtest``: drive a running server's webhooks on loopback and measure them.

Each simulated user is one concurrent client that sends a question, waits for the
webhook's answer and sends the next (a closed loop, ``--think-ms`` between
messages). Requests are what the channel itself would send:

* WeChat (``POST /wechat``): a text message XML with a unique MsgId, signed with
  ``wechat.token`` (``signature``, and in safe/compatible mode the body encrypted
  with the EncodingAESKey and ``msg_signature`` — wechatpy, as WeChat does), to
  whichever mode ``wechat.mode`` of the loaded config says;
* Telegram (``POST /telegram``): an Update JSON with a unique ``update_id`` and the
  ``X-Telegram-Bot-Api-Secret-Token`` header (``telegram.secret``). Its latency is
  the webhook's acknowledgement only: Telegram answers are sent afterwards through
  the Bot API, which the server must be able to reach.

Every simulated user rotates to a fresh OpenID / Telegram user after
:data:`MESSAGES_PER_USER_ID` messages, so the per-user rate limit (a polite "slow
down" reply that costs no inference) is not what gets measured.

Bounded: only loopback hosts (127.0.0.0/8, ::1, a ``localhost`` that resolves only
to loopback); at most :data:`MAX_USERS` users, :data:`MAX_SECONDS` seconds and
``--max-requests`` requests.

Counted as errors: a transport failure or timeout, an HTTP status other than 200,
a WeChat answer that is neither ``success`` nor a well-formed passive reply to the
right user, and a WeChat answer slower than WeChat's 5 s deadline (WeChat would
have dropped it). ``success`` answers (the reply budget was missed; the answer goes
out later) are counted apart as ``deferred``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import random
import socket
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from bot.loadtest.messages import AES_KEY_CHARS, REPLY_DEADLINE_S, TelegramRequests, WechatRequests

__all__ = ["LoadtestConfig", "LoadtestResult", "MESSAGES_PER_USER_ID", "OK_OUTCOMES", "QUESTIONS", "Sample",
           "check_loopback", "check_ready", "percentile_ms", "run_loadtest", "validate_run"]

MAX_USERS = 2000
"""Most concurrent simulated users (a loopback test, not a flood)."""
MAX_SECONDS = 3600.0
"""Longest run, seconds."""
MESSAGES_PER_USER_ID = 5
"""Messages sent under one OpenID / Telegram user before a simulated user takes a new
one: under the default per-user burst (8, ``server.user_burst``)."""

QUESTIONS: tuple[str, ...] = (
    # everyday 养生 questions, the bot's bread and butter
    "手脚冰凉怎么办", "失眠怎么调理", "晚上总是睡不着，有什么办法", "口腔溃疡反复发作怎么办", "秋天干燥怎么养生",
    "经常熬夜怎么补救", "颈椎不舒服怎么缓解", "每天喝多少水合适", "便秘吃什么好", "胃胀气怎么办",
    "上火了怎么调理", "湿气重有什么表现", "春天怎么养肝", "夏天怎么防中暑", "老人冬天怎么保暖",
    "久坐腰酸怎么办", "眼睛干涩怎么缓解", "怎么提高免疫力", "空腹喝牛奶好吗", "饭后散步有好处吗",
    "孩子不爱吃饭怎么办", "更年期潮热怎么缓解", "脚后跟干裂怎么办", "头发掉得厉害怎么办", "感冒了吃什么好得快",
    "嗓子干痒怎么办", "血压有点高饮食要注意什么", "那饮食上呢", "泡脚有什么好处", "晨跑好还是夜跑好",
    # English
    "how much water should I drink a day", "how can I sleep better", "what helps with cold hands and feet",
    "is it ok to exercise right after eating", "tips for dry eyes from screens",
    # greetings, out of scope, scope rules, emergencies
    "你好", "谢谢", "今天天气怎么样", "帮我推荐一只股票", "我这个检查报告正常吗", "布洛芬一次吃几片",
    "胸口像压了块石头，一直出冷汗", "突然说话不清楚，一边手没力气",
)


@dataclass
class LoadtestConfig:
    """One run. ``url``: the server's base URL (``http://127.0.0.1:PORT``, loopback only)."""

    url: str
    users: int = 200
    seconds: float = 60.0
    channel: str = "wechat"
    max_requests: int = 1_000_000
    timeout_s: float = 10.0
    think_ms: float = 0.0
    token: str = ""
    appid: str = ""
    aes_key: str = ""
    mode: str = "plaintext"
    telegram_secret: str = ""
    seed: int = 1


@dataclass
class Sample:
    """One request: ``at_s`` (sent, seconds from the start), ``latency_s``, ``outcome``
    (``text``, ``transfer``, ``deferred``, ``ok``, or an error kind)."""

    at_s: float
    latency_s: float
    outcome: str


OK_OUTCOMES = frozenset({"text", "transfer", "deferred", "ok"})


def percentile_ms(seconds: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``seconds``, in milliseconds to 0.1 ms; NaN when empty."""
    if not seconds:
        return math.nan
    values = sorted(seconds)
    return round(values[min(len(values) - 1, max(0, math.ceil(q / 100.0 * len(values)) - 1))] * 1000.0, 1)


@dataclass
class LoadtestResult:
    """Every sample of one run, and its summary."""

    config: LoadtestConfig
    samples: list[Sample] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def errors(self) -> Counter[str]:
        return Counter(s.outcome for s in self.samples if s.outcome not in OK_OUTCOMES)

    def summary(self) -> dict[str, Any]:
        """Counts, throughput (requests/s), latency percentiles (ms) and errors by kind."""
        lat = sorted(s.latency_s * 1000.0 for s in self.samples)
        seconds = [s.latency_s for s in self.samples]
        outcomes = Counter(s.outcome for s in self.samples)
        return {
            "channel": self.config.channel,
            "users": self.config.users,
            "seconds": round(self.duration_s, 1),
            "requests": len(self.samples),
            "throughput_rps": round(len(self.samples) / self.duration_s, 1) if self.duration_s else 0.0,
            "p50_ms": percentile_ms(seconds, 50), "p95_ms": percentile_ms(seconds, 95),
            "p99_ms": percentile_ms(seconds, 99), "max_ms": round(lat[-1], 1) if lat else math.nan,
            "mean_ms": round(sum(lat) / len(lat), 1) if lat else math.nan,
            "outcomes": dict(sorted(outcomes.items())),
            "errors": sum(self.errors.values()),
            "errors_by_kind": dict(sorted(self.errors.items())),
        }


# --------------------------------------------------------------------------- safety bounds


def check_loopback(url: str) -> str:
    """The base URL (scheme://host:port) of ``url`` if its host is loopback.

    Raises:
        ValueError: not http(s), no host, or a host that is not (only) loopback.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url {url!r}: give http://127.0.0.1:PORT")
    host = parts.hostname
    try:
        addresses = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, parts.port or 80, proto=socket.IPPROTO_TCP)
        except OSError as exc:
            raise ValueError(f"--url {url!r}: cannot resolve {host!r} ({exc})") from None
        addresses = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
    if not addresses or not all(a.is_loopback for a in addresses):
        raise ValueError(f"--url {url!r}: the load test only runs against loopback (127.0.0.1, ::1), "
                         f"not {host!r}")
    return f"{parts.scheme}://{parts.netloc}"


def validate_run(cfg: Any) -> str:
    """The base URL of a run's server, after checking its bounds and secrets (a
    :class:`LoadtestConfig`, or any config with the same fields; ``users`` and
    ``max_requests`` are checked where present).

    Raises:
        ValueError: what is wrong, naming the option.
    """
    base = check_loopback(cfg.url)
    if not 1 <= getattr(cfg, "users", 1) <= MAX_USERS:
        raise ValueError(f"--users must be 1..{MAX_USERS}, not {cfg.users}")
    if not 0 < cfg.seconds <= MAX_SECONDS:
        raise ValueError(f"--seconds must be in (0, {MAX_SECONDS:.0f}], not {cfg.seconds}")
    if getattr(cfg, "max_requests", 1) < 1:
        raise ValueError("--max-requests must be >= 1")
    if cfg.channel == "wechat":
        if not cfg.token:
            raise ValueError("the WeChat token is needed to sign requests: set HEALTHBOT_WECHAT_TOKEN "
                             "(the same as the server's)")
        if cfg.mode != "plaintext" and (len(cfg.aes_key) != AES_KEY_CHARS or not cfg.appid):
            raise ValueError(f"wechat.mode {cfg.mode!r} needs HEALTHBOT_WECHAT_AES_KEY and wechat.appid")
    elif cfg.channel == "telegram":
        if not cfg.telegram_secret:
            raise ValueError("the Telegram webhook secret is needed: set HEALTHBOT_TELEGRAM_SECRET "
                             "(the same as the server's)")
    else:
        raise ValueError(f"--channel must be wechat or telegram, not {cfg.channel!r}")
    return base


async def check_ready(http: aiohttp.ClientSession, base: str) -> None:
    """Raise RuntimeError unless the server at ``base`` answers ``GET /readyz`` (and not 503)."""
    try:
        async with http.get("/readyz") as resp:
            if resp.status == 503:
                raise RuntimeError(f"{base} is not ready (GET /readyz answered 503): wait for the model to load")
    except aiohttp.ClientError as exc:
        raise RuntimeError(f"no server at {base} ({type(exc).__name__}): start 'healthbot serve' first") from None


async def run_loadtest(cfg: LoadtestConfig, progress: Any = None) -> LoadtestResult:
    """Run the load test described by ``cfg`` against the server at ``cfg.url``.

    Args:
        cfg: the run (see :class:`LoadtestConfig`).
        progress: optional ``callable(str)`` for one line of progress about every 10 s.

    Returns:
        The samples and the measured duration (seconds).

    Raises:
        ValueError: a bound is broken (non-loopback host, too many users, …) or a secret is missing.
        RuntimeError: the server is not there or not ready (``GET /readyz`` 503).
    """
    base = validate_run(cfg)
    rng = random.Random(cfg.seed)
    run_id = uuid.uuid4().hex[:8]
    wechat = WechatRequests(cfg.token, cfg.appid, cfg.aes_key, cfg.mode) if cfg.channel == "wechat" else None
    telegram = TelegramRequests(cfg.telegram_secret) if cfg.channel == "telegram" else None
    result = LoadtestResult(cfg)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    connector = aiohttp.TCPConnector(limit=cfg.users + 4, force_close=False)
    async with aiohttp.ClientSession(base_url=base, timeout=timeout, connector=connector) as http:
        await check_ready(http, base)
        loop = asyncio.get_running_loop()
        start = loop.time()
        stop_at = start + cfg.seconds
        sent = 0

        async def user(n: int) -> None:
            nonlocal sent
            k = 0
            while loop.time() < stop_at and sent < cfg.max_requests:
                seq = sent
                sent += 1
                generation = k // MESSAGES_PER_USER_ID
                text = rng.choice(QUESTIONS)
                if wechat is not None:
                    who: Any = f"oLOADTEST_{run_id}_{n:04d}_{generation}"
                    path, body, headers = wechat.build(who, seq, text)
                else:
                    who = 7_000_000_000 + n * 100_000 + generation
                    path, body, headers = telegram.build(who, seq, text)  # type: ignore[union-attr]
                k += 1
                t0 = loop.time()
                try:
                    async with http.post(path, data=body, headers=headers) as resp:
                        answer = await resp.text()
                        status = resp.status
                    latency = loop.time() - t0
                    if status != 200:
                        outcome = f"http_{status}"
                    elif wechat is not None:
                        outcome = wechat.outcome(answer, who)
                        if outcome in OK_OUTCOMES and latency > REPLY_DEADLINE_S:
                            outcome = "over_5s"
                    else:
                        outcome = "ok"
                except TimeoutError:
                    latency, outcome = loop.time() - t0, "timeout"
                except aiohttp.ClientError as exc:
                    latency, outcome = loop.time() - t0, f"transport_{type(exc).__name__}"
                result.samples.append(Sample(t0 - start, latency, outcome))
                if cfg.think_ms > 0:
                    await asyncio.sleep(cfg.think_ms / 1000.0)

        async def report() -> None:
            while True:
                await asyncio.sleep(10.0)
                if progress is not None:
                    s = result.summary() if result.samples else {}
                    progress(f"  {loop.time() - start:5.0f} s  {len(result.samples)} requests  "
                             f"p50 {s.get('p50_ms')} ms  errors {s.get('errors', 0)}")

        reporter = asyncio.create_task(report())
        try:
            await asyncio.gather(*(user(n) for n in range(cfg.users)))
        finally:
            reporter.cancel()
        result.duration_s = loop.time() - start
    return result
