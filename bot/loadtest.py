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

The abuse tests (issue 21, :func:`run_abuse`, ``python -m bot.loadtest --abuse junk|long``):
good WeChat users as above, plus either **junk senders** (closed loops of cheap
requests that get a 4xx: bad signatures, unsigned and malformed bodies, unknown
routes, broken JSON to ``/api/chat``), or an open loop of **long questions**
(valid 2,000-character questions at ``long_rate`` per second, signed WeChat
messages from ``long_senders`` users, or ``/api/chat`` with a new ``user_id`` each).
The attackers connect from their own loopback address (``127.0.0.2``/``127.0.0.3``
by default; "" = the good users' address). The figure that counts: the share of
good users' messages answered (a passive reply, not ``success``) within 4 s.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import random
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import aiohttp
import defusedxml.ElementTree as safe_et
from wechatpy.crypto import WeChatCrypto
from wechatpy.utils import WeChatSigner

from adapters import wechat_constants as wc

__all__ = ["AbuseConfig", "AbuseResult", "LoadtestConfig", "LoadtestResult", "Sample", "check_loopback",
           "format_abuse", "format_markdown", "format_report", "run_abuse", "run_loadtest", "write_plot"]

MAX_USERS = 2000
"""Most concurrent simulated users (a loopback test, not a flood)."""
MAX_SECONDS = 3600.0
"""Longest run, seconds."""
MESSAGES_PER_USER_ID = 5
"""Messages sent under one OpenID / Telegram user before a simulated user takes a new
one: under the default per-user burst (8, ``server.user_burst``)."""
TELEGRAM_PATH = "/telegram"

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

        def pct(q: float) -> float:
            if not lat:
                return math.nan
            return round(lat[min(len(lat) - 1, max(0, math.ceil(q / 100.0 * len(lat)) - 1))], 1)

        outcomes = Counter(s.outcome for s in self.samples)
        return {
            "channel": self.config.channel,
            "users": self.config.users,
            "seconds": round(self.duration_s, 1),
            "requests": len(self.samples),
            "throughput_rps": round(len(self.samples) / self.duration_s, 1) if self.duration_s else 0.0,
            "p50_ms": pct(50), "p95_ms": pct(95), "p99_ms": pct(99), "max_ms": round(lat[-1], 1) if lat else math.nan,
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


def _validate(cfg: LoadtestConfig) -> str:
    base = check_loopback(cfg.url)
    if not 1 <= cfg.users <= MAX_USERS:
        raise ValueError(f"--users must be 1..{MAX_USERS}, not {cfg.users}")
    if not 0 < cfg.seconds <= MAX_SECONDS:
        raise ValueError(f"--seconds must be in (0, {MAX_SECONDS:.0f}], not {cfg.seconds}")
    if cfg.max_requests < 1:
        raise ValueError("--max-requests must be >= 1")
    if cfg.channel == "wechat":
        if not cfg.token:
            raise ValueError("the WeChat token is needed to sign requests: set HEALTHBOT_WECHAT_TOKEN "
                             "(the same as the server's)")
        if cfg.mode != "plaintext" and (len(cfg.aes_key) != wc.AES_KEY_CHARS or not cfg.appid):
            raise ValueError(f"wechat.mode {cfg.mode!r} needs HEALTHBOT_WECHAT_AES_KEY and wechat.appid")
    elif cfg.channel == "telegram":
        if not cfg.telegram_secret:
            raise ValueError("the Telegram webhook secret is needed: set HEALTHBOT_TELEGRAM_SECRET "
                             "(the same as the server's)")
    else:
        raise ValueError(f"--channel must be wechat or telegram, not {cfg.channel!r}")
    return base


# --------------------------------------------------------------------------- requests


def _cdata(value: str) -> str:
    return "<![CDATA[" + value.replace("]]>", "]]]]><![CDATA[>") + "]]>"


class _WechatRequests:
    """Builds signed (and in safe mode encrypted) WeChat deliveries; checks their answers."""

    ACCOUNT = "gh_loadtest_account"

    def __init__(self, cfg: LoadtestConfig):
        self.token = cfg.token
        self.encrypted = cfg.mode == "safe"  # compatible mode: plaintext requests are accepted too
        self.crypto = WeChatCrypto(cfg.token, cfg.aes_key, cfg.appid) if self.encrypted else None
        self.msg_base = (int(time.time() * 1000) << 20) % (1 << 62)  # unique MsgIds per run (64-bit)

    def _sign(self, *parts: str) -> str:
        signer = WeChatSigner()
        signer.add_data(self.token, *parts)
        return signer.signature

    def build(self, openid: str, seq: int, text: str) -> tuple[str, bytes, dict[str, str]]:
        now = int(time.time())
        xml = ("<xml>" f"<ToUserName>{_cdata(self.ACCOUNT)}</ToUserName><FromUserName>{_cdata(openid)}</FromUserName>"
               f"<CreateTime>{now}</CreateTime><MsgType>{_cdata('text')}</MsgType>"
               f"<Content>{_cdata(text)}</Content><MsgId>{self.msg_base + seq}</MsgId></xml>")
        ts, nonce = str(now), str(random.randint(10**8, 10**10))
        query = {"signature": self._sign(ts, nonce), "timestamp": ts, "nonce": nonce, "openid": openid}
        if self.crypto is not None:
            envelope = safe_et.fromstring(self.crypto.encrypt_message(xml, nonce, ts))
            encrypt = envelope.findtext("Encrypt") or ""
            query.update(encrypt_type="aes", msg_signature=envelope.findtext("MsgSignature") or "")
            xml = (f"<xml><ToUserName>{_cdata(self.ACCOUNT)}</ToUserName>"
                   f"<Encrypt>{_cdata(encrypt)}</Encrypt></xml>")
        return "/wechat?" + urlencode(query), xml.encode("utf-8"), {"Content-Type": "text/xml"}

    def outcome(self, body: str, openid: str) -> str:
        if body == wc.NO_REPLY:
            return "deferred"
        try:
            root = safe_et.fromstring(body)
            if self.crypto is not None:
                root = safe_et.fromstring(self.crypto.decrypt_message(
                    body, root.findtext("MsgSignature"), root.findtext("TimeStamp"), root.findtext("Nonce")))
        except Exception:  # noqa: BLE001 — any unreadable answer is an error of the server
            return "bad_reply"
        if root.findtext("ToUserName") != openid:
            return "wrong_user"
        kind = root.findtext("MsgType")
        if kind == "text" and (root.findtext("Content") or "").strip():
            return "text"
        if kind == wc.TRANSFER_MSG_TYPE:
            return "transfer"
        return "bad_reply"


class _TelegramRequests:
    def __init__(self, cfg: LoadtestConfig):
        self.secret = cfg.telegram_secret
        self.update_base = int(time.time()) % 10**6 * 10**3

    def build(self, user: int, seq: int, text: str) -> tuple[str, bytes, dict[str, str]]:
        update = {"update_id": self.update_base + seq, "message": {
            "message_id": seq + 1, "date": int(time.time()), "text": text,
            "chat": {"id": user, "type": "private", "first_name": "Load"},
            "from": {"id": user, "is_bot": False, "first_name": "Load", "language_code": "zh-hans"}}}
        headers = {"Content-Type": "application/json", "X-Telegram-Bot-Api-Secret-Token": self.secret}
        return TELEGRAM_PATH, json.dumps(update, ensure_ascii=False).encode("utf-8"), headers


# --------------------------------------------------------------------------- the run


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
    base = _validate(cfg)
    rng = random.Random(cfg.seed)
    run_id = uuid.uuid4().hex[:8]
    wechat = _WechatRequests(cfg) if cfg.channel == "wechat" else None
    telegram = _TelegramRequests(cfg) if cfg.channel == "telegram" else None
    result = LoadtestResult(cfg)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    connector = aiohttp.TCPConnector(limit=cfg.users + 4, force_close=False)
    async with aiohttp.ClientSession(base_url=base, timeout=timeout, connector=connector) as http:
        try:
            async with http.get("/readyz") as resp:
                if resp.status == 503:
                    raise RuntimeError(f"{base} is not ready (GET /readyz answered 503): wait for the model to load")
        except aiohttp.ClientError as exc:
            raise RuntimeError(f"no server at {base} ({type(exc).__name__}): start 'healthbot serve' first") from None
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
                        if outcome in OK_OUTCOMES and latency > wc.REPLY_DEADLINE_S:
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


# --------------------------------------------------------------------------- abuse: junk and long questions


LONG_QUESTION = (
    "我今年45岁，最近三个月总是失眠，晚上躺下两三个小时都睡不着，早上五点就醒了，白天没精神，头也昏昏沉沉的。"
    "我平时工作压力比较大，经常加班到很晚，吃饭也不规律，有时候一天只吃两顿，晚上还喜欢喝点浓茶提神。"
    "去医院检查过，医生说没什么大问题，让我注意休息，可是我试了很多办法都没有用，数羊、听音乐、泡脚都试过。"
)
"""A consultation-style paragraph; repeated and cut to ``long_chars`` with a question at its end."""

ANSWER_WINDOW_S = 4.0
"""A good user's message counts as answered when its passive reply came within this (WeChat's budget)."""


@dataclass
class AbuseConfig:
    """One abuse run (module docstring). ``junk_from`` / ``long_from``: the attackers' local
    address ("" = the good users' own)."""

    url: str
    token: str = ""
    appid: str = ""
    aes_key: str = ""
    mode: str = "plaintext"
    good_users: int = 160
    seconds: float = 60.0
    junk_senders: int = 0
    junk_from: str = "127.0.0.2"
    long_rate: float = 0.0
    long_chars: int = 2000
    long_channel: str = "wechat"
    long_senders: int = 8
    long_from: str = "127.0.0.3"
    timeout_s: float = 10.0
    seed: int = 1


@dataclass
class AbuseResult:
    config: AbuseConfig
    good: list[Sample] = field(default_factory=list)
    junk: Counter[str] = field(default_factory=Counter)
    long: list[Sample] = field(default_factory=list)
    duration_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        """Good users: requests, share answered within 4 s, p50/p95/p99; junk: requests and statuses;
        long questions: sent and what they got."""
        def pct(values: list[float], q: float) -> float:
            if not values:
                return math.nan
            values = sorted(values)
            return round(values[min(len(values) - 1, max(0, math.ceil(q / 100.0 * len(values)) - 1))] * 1000.0, 1)

        good_lat = [x.latency_s for x in self.good]
        within = sum(1 for x in self.good if x.outcome in ("text", "transfer") and x.latency_s <= ANSWER_WINDOW_S)
        d = self.duration_s or 1.0
        return {
            "seconds": round(self.duration_s, 1),
            "good": {"users": self.config.good_users, "requests": len(self.good),
                     "answered_within_4s": round(within / len(self.good), 4) if self.good else 0.0,
                     "p50_ms": pct(good_lat, 50), "p95_ms": pct(good_lat, 95), "p99_ms": pct(good_lat, 99),
                     "outcomes": dict(sorted(Counter(x.outcome for x in self.good).items()))},
            "junk": {"senders": self.config.junk_senders, "requests": sum(self.junk.values()),
                     "rps": round(sum(self.junk.values()) / d, 1), "statuses": dict(sorted(self.junk.items()))},
            "long": {"rate": self.config.long_rate, "channel": self.config.long_channel, "sent": len(self.long),
                     "p50_ms": pct([x.latency_s for x in self.long], 50),
                     "outcomes": dict(sorted(Counter(x.outcome for x in self.long).items()))},
        }


def _junk_requests(token: str, rng: random.Random) -> tuple[str, str, bytes, dict[str, str]]:
    """One cheap request that must get a 4xx: (method, path, body, headers)."""
    now = str(int(time.time()))
    kind = rng.randrange(6)
    if kind == 0:  # a WeChat POST with a wrong signature
        return "POST", f"/wechat?signature={'0' * 40}&timestamp={now}&nonce=1&openid=x", b"<xml><a>1</a></xml>", {}
    if kind == 1:  # no signature at all
        return "POST", "/wechat", b"<xml/>", {"Content-Type": "text/xml"}
    if kind == 2:  # a URL verification with a wrong signature
        return "GET", f"/wechat?signature=x&timestamp={now}&nonce=1&echostr=hello", b"", {}
    if kind == 3:  # broken JSON to the HTTP API
        return "POST", "/api/chat", b'{"text": ', {"Content-Type": "application/json"}
    if kind == 4:  # an unknown route
        return "GET", f"/wp-login.php?{rng.randrange(10**6)}", b"", {}
    return "POST", "/telegram", b'{"update_id": 1}', {"Content-Type": "application/json",
                                                       "X-Telegram-Bot-Api-Secret-Token": "wrong"}


def _long_text(chars: int, n: int) -> str:
    body = (LONG_QUESTION * (chars // len(LONG_QUESTION) + 1))
    question = f"请问第{n}种情况，有没有什么食疗或者生活上的方法可以改善睡眠？"
    return body[: max(0, chars - len(question))] + question


def _connector(limit: int, local: str) -> aiohttp.TCPConnector:
    return aiohttp.TCPConnector(limit=limit, local_addr=(local, 0) if local else None)


async def run_abuse(cfg: AbuseConfig, progress: Any = None) -> AbuseResult:
    """Good WeChat users with junk senders and/or long questions against ``cfg.url`` (loopback only).

    Raises:
        ValueError: a non-loopback URL or a missing token.
    """
    base = check_loopback(cfg.url)
    if not cfg.token:
        raise ValueError("the WeChat token is needed to sign requests: set HEALTHBOT_WECHAT_TOKEN")
    rng = random.Random(cfg.seed)
    run_id = uuid.uuid4().hex[:8]
    wechat = _WechatRequests(LoadtestConfig(url=cfg.url, token=cfg.token, appid=cfg.appid, aes_key=cfg.aes_key,
                                            mode=cfg.mode))
    result = AbuseResult(cfg)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    loop = asyncio.get_running_loop()
    seq = 0

    def next_seq() -> int:
        nonlocal seq
        seq += 1
        return seq

    async with aiohttp.ClientSession(base_url=base, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=cfg.good_users + 4)) as good_http, \
            aiohttp.ClientSession(base_url=base, timeout=timeout,
                                  connector=_connector(max(cfg.junk_senders, 1), cfg.junk_from)) as junk_http, \
            aiohttp.ClientSession(base_url=base, timeout=timeout,
                                  connector=_connector(256, cfg.long_from)) as long_http:
        start = loop.time()
        stop_at = start + cfg.seconds

        async def good(n: int) -> None:
            k = 0
            while loop.time() < stop_at:
                who = f"oGOOD_{run_id}_{n:04d}_{k // MESSAGES_PER_USER_ID}"
                path, body, headers = wechat.build(who, next_seq(), rng.choice(QUESTIONS))
                k += 1
                t0 = loop.time()
                try:
                    async with good_http.post(path, data=body, headers=headers) as resp:
                        answer, status = await resp.text(), resp.status
                    outcome = wechat.outcome(answer, who) if status == 200 else f"http_{status}"
                except TimeoutError:
                    outcome = "timeout"
                except aiohttp.ClientError as exc:
                    outcome = f"transport_{type(exc).__name__}"
                result.good.append(Sample(t0 - start, loop.time() - t0, outcome))

        async def junk(n: int) -> None:
            local = random.Random(cfg.seed * 1000 + n)
            while loop.time() < stop_at:
                method, path, body, headers = _junk_requests(cfg.token, local)
                try:
                    async with junk_http.request(method, path, data=body or None, headers=headers) as resp:
                        await resp.read()
                        result.junk[str(resp.status)] += 1
                except TimeoutError:
                    result.junk["timeout"] += 1
                except aiohttp.ClientError as exc:
                    result.junk[type(exc).__name__] += 1
                    await asyncio.sleep(0.01)

        async def one_long(n: int) -> None:
            text = _long_text(cfg.long_chars, n)
            t0 = loop.time()
            try:
                if cfg.long_channel == "wechat":
                    who = f"oLONG_{run_id}_{n % max(cfg.long_senders, 1):03d}"
                    path, body, headers = wechat.build(who, next_seq(), text)
                    async with long_http.post(path, data=body, headers=headers) as resp:
                        answer, status = await resp.text(), resp.status
                    outcome = wechat.outcome(answer, who) if status == 200 else f"http_{status}"
                    if outcome == "text" and "您刚才发的内容比较多" in answer:
                        outcome = "work_refused"
                else:
                    async with long_http.post("/api/chat", json={"text": text, "user_id": f"long-{run_id}-{n}"}) as resp:
                        data = await resp.json(content_type=None)
                        status = resp.status
                    outcome = (f"http_{status}" if status != 200 else
                               "busy" if data.get("intent") == "system" else "answered")
            except TimeoutError:
                outcome = "timeout"
            except aiohttp.ClientError as exc:
                outcome = f"transport_{type(exc).__name__}"
            result.long.append(Sample(t0 - start, loop.time() - t0, outcome))

        async def long_loop() -> None:
            tasks = []
            n = 0
            while cfg.long_rate > 0 and loop.time() < stop_at:
                tasks.append(asyncio.ensure_future(one_long(n)))
                n += 1
                await asyncio.sleep(1.0 / cfg.long_rate)
            if tasks:
                await asyncio.gather(*tasks)

        async def report() -> None:
            while True:
                await asyncio.sleep(10.0)
                if progress is not None and result.good:
                    progress(f"  {loop.time() - start:5.0f} s  good {len(result.good)}  junk "
                             f"{sum(result.junk.values())}  long {len(result.long)}")

        reporter = asyncio.create_task(report())
        try:
            await asyncio.gather(*(good(n) for n in range(cfg.good_users)),
                                 *(junk(n) for n in range(cfg.junk_senders)), long_loop())
        finally:
            reporter.cancel()
        result.duration_s = loop.time() - start
    return result


def format_abuse(result: AbuseResult) -> str:
    """A plain-text report of :func:`run_abuse`."""
    s = result.summary()
    g, j, lq = s["good"], s["junk"], s["long"]
    lines = [f"healthbot abuse test: {g['users']} good WeChat users, {s['seconds']} s",
             f"  good   {g['requests']} requests, answered within 4 s {g['answered_within_4s']:.1%}, "
             f"p50 {g['p50_ms']} ms, p95 {g['p95_ms']} ms, p99 {g['p99_ms']} ms; {g['outcomes']}"]
    if j["senders"]:
        lines.append(f"  junk   {j['senders']} senders from {result.config.junk_from or 'the same address'}: "
                     f"{j['requests']} requests ({j['rps']}/s), {j['statuses']}")
    if lq["rate"]:
        lines.append(f"  long   {lq['sent']} questions of {result.config.long_chars} characters at {lq['rate']}/s "
                     f"({lq['channel']}), p50 {lq['p50_ms']} ms, {lq['outcomes']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- reports


def format_report(result: LoadtestResult) -> str:
    """A plain-text report for the terminal."""
    s = result.summary()
    lines = [
        f"healthbot loadtest: {s['channel']} {result.config.url}, {s['users']} users, {s['seconds']} s",
        f"  requests    {s['requests']}   throughput {s['throughput_rps']} req/s",
        f"  latency ms  p50 {s['p50_ms']}   p95 {s['p95_ms']}   p99 {s['p99_ms']}   max {s['max_ms']}",
        f"  outcomes    {', '.join(f'{k} {v}' for k, v in s['outcomes'].items())}",
        f"  errors      {s['errors']}" + (f"  ({s['errors_by_kind']})" if s["errors"] else ""),
    ]
    return "\n".join(lines)


def format_markdown(result: LoadtestResult) -> str:
    """The summary as a Markdown table (for docs/loadtest.md and the README)."""
    s = result.summary()
    rows = [("channel", s["channel"]), ("simulated users", s["users"]), ("duration", f"{s['seconds']} s"),
            ("requests", s["requests"]), ("throughput", f"{s['throughput_rps']} req/s"),
            ("p50", f"{s['p50_ms']} ms"), ("p95", f"{s['p95_ms']} ms"), ("p99", f"{s['p99_ms']} ms"),
            ("max", f"{s['max_ms']} ms"),
            ("outcomes", ", ".join(f"{k} {v}" for k, v in s["outcomes"].items())),
            ("errors", s["errors"] if not s["errors"] else f"{s['errors']} {s['errors_by_kind']}")]
    return "| measure | value |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def write_plot(result: LoadtestResult, path: str | Path) -> Path:
    """A PNG: latency of every request over time (with p50/p99 per second), and requests per second.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install matplotlib``).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
    import numpy as np

    s = result.summary()
    at = np.array([x.at_s for x in result.samples])
    lat = np.array([x.latency_s * 1000.0 for x in result.samples])
    bad = np.array([x.outcome not in OK_OUTCOMES for x in result.samples], dtype=bool)
    seconds = int(math.ceil(result.duration_s)) or 1
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax1.scatter(at[~bad], lat[~bad], s=2, alpha=0.25, color="tab:blue", label="request")
    if bad.any():
        ax1.scatter(at[bad], lat[bad], s=8, color="tab:red", label="error")
    buckets = at.astype(int) if len(at) else np.array([], dtype=int)
    xs, p50, p99, rps = [], [], [], []
    for sec in range(seconds):
        sel = lat[buckets == sec]
        rps.append(len(sel))
        if len(sel):
            xs.append(sec + 0.5)
            p50.append(np.percentile(sel, 50))
            p99.append(np.percentile(sel, 99))
    ax1.plot(xs, p50, color="tab:green", lw=1.5, label="p50 per second")
    ax1.plot(xs, p99, color="tab:orange", lw=1.5, label="p99 per second")
    ax1.axhline(wc.REPLY_DEADLINE_S * 1000.0, color="tab:red", ls="--", lw=1, label="WeChat deadline (5 s)")
    ax1.set_yscale("log")
    ax1.set_ylabel("latency (ms)")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title(f"healthbot loadtest — {s['channel']}, {s['users']} users, {s['requests']} requests, "
                  f"{s['throughput_rps']} req/s; p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms, {s['errors']} errors",
                  fontsize=9)
    ax2.bar(np.arange(seconds) + 0.5, rps, width=0.9, color="tab:gray")
    ax2.set_ylabel("requests/s")
    ax2.set_xlabel("seconds since start")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _main(argv: list[str] | None = None) -> int:
    """``python -m bot.loadtest --abuse junk|long [--url ...] [--seconds 60] [--users 160]``:
    the issue-21 abuse tests against a running server (token from the effective config)."""
    import argparse
    import sys

    from bot.config import load_config

    p = argparse.ArgumentParser(prog="python -m bot.loadtest")
    p.add_argument("--abuse", choices=["junk", "long", "both", "none"], required=True)
    p.add_argument("--url", default="")
    p.add_argument("--config")
    p.add_argument("--users", type=int, default=160)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--junk-senders", type=int, default=40)
    p.add_argument("--junk-from", default="127.0.0.2")
    p.add_argument("--long-rate", type=float, default=7.0)
    p.add_argument("--long-channel", choices=["wechat", "http"], default="wechat")
    p.add_argument("--long-from", default="127.0.0.3")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    cfg = load_config(a.config)
    run = AbuseConfig(url=a.url or f"http://{cfg.server.host}:{cfg.server.port}", token=cfg.wechat.token,
                      appid=cfg.wechat.appid, aes_key=cfg.wechat.aes_key, mode=cfg.wechat.mode,
                      good_users=a.users, seconds=a.seconds,
                      junk_senders=a.junk_senders if a.abuse in ("junk", "both") else 0, junk_from=a.junk_from,
                      long_rate=a.long_rate if a.abuse in ("long", "both") else 0.0,
                      long_channel=a.long_channel, long_from=a.long_from)
    result = asyncio.run(run_abuse(run, progress=lambda line: print(line, file=sys.stderr)))
    print(json.dumps(result.summary(), ensure_ascii=False) if a.json else format_abuse(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
