"""The abuse tests (issue 21, :func:`run_abuse`, ``python -m bot.loadtest --abuse junk|long``):
good WeChat users as in :func:`bot.loadtest.traffic.run_loadtest`, plus either **junk senders** (closed loops of cheap
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
import json
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bot.loadtest.messages import WechatRequests
from bot.loadtest.traffic import MESSAGES_PER_USER_ID, QUESTIONS, Sample, check_loopback, percentile_ms

__all__ = ["AbuseConfig", "AbuseResult", "format_abuse", "main", "run_abuse"]


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
        good_lat = [x.latency_s for x in self.good]
        within = sum(1 for x in self.good if x.outcome in ("text", "transfer") and x.latency_s <= ANSWER_WINDOW_S)
        d = self.duration_s or 1.0
        return {
            "seconds": round(self.duration_s, 1),
            "good": {"users": self.config.good_users, "requests": len(self.good),
                     "answered_within_4s": round(within / len(self.good), 4) if self.good else 0.0,
                     "p50_ms": percentile_ms(good_lat, 50), "p95_ms": percentile_ms(good_lat, 95), "p99_ms": percentile_ms(good_lat, 99),
                     "outcomes": dict(sorted(Counter(x.outcome for x in self.good).items()))},
            "junk": {"senders": self.config.junk_senders, "requests": sum(self.junk.values()),
                     "rps": round(sum(self.junk.values()) / d, 1), "statuses": dict(sorted(self.junk.items()))},
            "long": {"rate": self.config.long_rate, "channel": self.config.long_channel, "sent": len(self.long),
                     "p50_ms": percentile_ms([x.latency_s for x in self.long], 50),
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
    wechat = WechatRequests(cfg.token, cfg.appid, cfg.aes_key, cfg.mode)
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


def main(argv: list[str] | None = None) -> int:
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
