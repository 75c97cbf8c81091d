"""bot/loadtest/ against small servers on loopback (the real-model run is in docs/loadtest.md)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from adapters.wechat import setup_wechat
from bot.config import Config
from bot.loadtest import LoadtestConfig, check_loopback, format_markdown, run_loadtest, write_plot
from bot.store import MemoryStore
from bot.types import Inbound, Intent, Reply

try:
    from tests import wechat_client as wx
except ImportError:  # pragma: no cover
    import wechat_client as wx  # type: ignore[no-redef]

TOKEN = "loadtest_token"
APPID = "wx0123456789abcdef"


class CountingDispatcher:
    """Answers every message after ``delay_s``; remembers each (user, message id)."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.seen: list[tuple[str, str]] = []

    async def handle(self, inbound: Inbound) -> Reply:
        self.seen.append((inbound.user_id, inbound.message_id))
        await asyncio.sleep(self.delay_s)
        return Reply(f"答：{inbound.text}", Intent.ANSWER)


@pytest.fixture
async def server():
    """``await server(dispatcher, **wechat)`` → base URL of a WeChat webhook on 127.0.0.1."""
    started: list[TestServer] = []

    async def _start(dispatcher, app: web.Application | None = None, **wechat) -> str:
        if app is None:
            cfg = Config()
            cfg.wechat.token, cfg.wechat.appid = TOKEN, APPID
            for key, value in wechat.items():
                setattr(cfg.wechat, key, value)
            app = web.Application()
            setup_wechat(app, cfg, dispatcher, store=MemoryStore())
        srv = TestServer(app, host="127.0.0.1", port=0)
        await srv.start_server()
        started.append(srv)
        return str(srv.make_url("")).rstrip("/")

    yield _start
    for srv in started:
        await srv.close()


@pytest.mark.parametrize("url", ["http://127.0.0.1:8080", "http://localhost:1/x", "http://[::1]:9", "http://127.9.9.9"])
def test_loopback_urls_are_accepted(url):
    assert check_loopback(url).startswith("http://")


@pytest.mark.parametrize("url", ["http://10.0.0.1:8080", "http://0.0.0.0:8080", "http://192.168.1.2",
                                 "ftp://127.0.0.1", "127.0.0.1:8080", "http://example.invalid:80"])
def test_non_loopback_urls_are_refused(url):
    with pytest.raises(ValueError):
        check_loopback(url)


async def test_signed_requests_with_unique_msgids_get_answers_and_no_errors(server):
    dispatcher = CountingDispatcher(delay_s=0.005)
    url = await server(dispatcher)
    result = await run_loadtest(LoadtestConfig(url=url, users=20, seconds=1.0, token=TOKEN))
    s = result.summary()
    assert s["requests"] > 50 and s["errors"] == 0, s
    assert s["outcomes"] == {"text": s["requests"]}
    assert len({m for _, m in dispatcher.seen}) == len(dispatcher.seen) == s["requests"]  # unique MsgIds
    assert s["p50_ms"] <= s["p95_ms"] <= s["p99_ms"] <= s["max_ms"]
    assert s["throughput_rps"] > 0
    per_openid = {}
    for user, _ in dispatcher.seen:
        per_openid[user] = per_openid.get(user, 0) + 1
    assert max(per_openid.values()) <= 5  # rotated before the per-user rate limit


async def test_safe_mode_requests_are_encrypted_and_replies_decrypted(server):
    aes_key = wx.new_aes_key()
    url = await server(CountingDispatcher(), mode="safe", aes_key=aes_key)
    result = await run_loadtest(LoadtestConfig(url=url, users=5, seconds=0.5, token=TOKEN, appid=APPID,
                                               aes_key=aes_key, mode="safe"))
    assert result.summary()["errors"] == 0 and result.summary()["outcomes"].keys() == {"text"}


async def test_bounded_in_count(server):
    url = await server(CountingDispatcher())
    result = await run_loadtest(LoadtestConfig(url=url, users=10, seconds=30, max_requests=7, token=TOKEN))
    assert len(result.samples) == 7 and result.duration_s < 5


async def test_wrong_token_shows_as_errors_and_late_answers_as_deferred(server):
    url = await server(CountingDispatcher(delay_s=0.3), reply_budget_s=0.1)
    bad = await run_loadtest(LoadtestConfig(url=url, users=2, seconds=0.3, token="not-the-token"))
    assert bad.summary()["errors_by_kind"].keys() == {"http_403"}
    late = await run_loadtest(LoadtestConfig(url=url, users=2, seconds=0.3, token=TOKEN))
    assert late.summary()["errors"] == 0 and "deferred" in late.summary()["outcomes"]


async def test_telegram_webhook_gets_the_secret_header_and_unique_updates(server):
    seen: list[int] = []

    async def telegram(request: web.Request) -> web.Response:
        if request.headers.get("X-Telegram-Bot-Api-Secret-Token") != "s3cret":
            return web.Response(status=403, text="forbidden")
        update = json.loads(await request.read())
        seen.append(update["update_id"])
        assert update["message"]["text"] and update["message"]["chat"]["id"] == update["message"]["from"]["id"]
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/telegram", telegram)
    url = await server(None, app=app)
    result = await run_loadtest(LoadtestConfig(url=url, users=4, seconds=0.4, channel="telegram",
                                               telegram_secret="s3cret"))
    assert result.summary()["errors"] == 0 and len(set(seen)) == len(seen) == len(result.samples) > 0


@pytest.mark.parametrize("kw,match", [({"users": 0}, "users"), ({"users": 100_000}, "users"),
                                      ({"seconds": 0}, "seconds"), ({"token": ""}, "TOKEN"),
                                      ({"channel": "sms"}, "channel")])
async def test_out_of_bounds_runs_are_refused(kw, match):
    cfg = LoadtestConfig(url="http://127.0.0.1:9", token=TOKEN)
    for key, value in kw.items():
        setattr(cfg, key, value)
    with pytest.raises(ValueError, match=match):
        await run_loadtest(cfg)


async def test_no_server_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no server"):
        await run_loadtest(LoadtestConfig(url="http://127.0.0.1:9", token=TOKEN, seconds=0.1))


async def test_plot_and_markdown(server, tmp_path):
    pytest.importorskip("matplotlib")
    url = await server(CountingDispatcher())
    result = await run_loadtest(LoadtestConfig(url=url, users=3, seconds=0.5, token=TOKEN))
    png = write_plot(result, tmp_path / "plot.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_markdown(result)
    assert "| throughput |" in table and "| p99 |" in table and "| errors | 0 |" in table


def test_cli_refuses_a_non_loopback_url(capsys, monkeypatch, cli_main):
    monkeypatch.setenv("HEALTHBOT_WECHAT_TOKEN", TOKEN)
    assert cli_main(["loadtest", "--url", "http://203.0.113.5:8080", "--seconds", "1"]) == 2
    assert "loopback" in capsys.readouterr().err


# --------------------------------------------------------------------------- open loop (--rate)

import os  # noqa: E402
import random  # noqa: E402
import threading  # noqa: E402

from bot.loadtest import cpu as cpu_mod  # noqa: E402
from bot.loadtest import messages as msgs  # noqa: E402
from bot.loadtest import openloop  # noqa: E402
from bot.loadtest.open_report import format_open, format_open_markdown, format_ramp, write_ramp_plot  # noqa: E402
from bot.loadtest.openloop import OpenLoopConfig, arrival_offsets, run_open_loop, run_ramp  # noqa: E402


class GatedDispatcher(CountingDispatcher):
    """Holds every message until ``gate`` is set, then answers at once."""

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()

    async def handle(self, inbound: Inbound) -> Reply:
        await self.gate.wait()
        return await super().handle(inbound)


class SerialDispatcher(CountingDispatcher):
    """One message at a time, ``delay_s`` each: a server of 1 / delay_s messages/s."""

    def __init__(self, delay_s: float):
        super().__init__(delay_s)
        self.lock = asyncio.Lock()

    async def handle(self, inbound: Inbound) -> Reply:
        async with self.lock:
            return await super().handle(inbound)


def test_arrivals_constant_and_poisson():
    assert list(arrival_offsets(4, 1.0, "constant", random.Random(1))) == [0.0, 0.25, 0.5, 0.75]
    poisson = list(arrival_offsets(1000, 20.0, "poisson", random.Random(1)))
    assert 19_000 < len(poisson) < 21_000 and all(0 <= t < 20 for t in poisson)
    gaps = [b - a for a, b in zip(poisson, poisson[1:])]
    assert abs(sum(gaps) / len(gaps) - 0.001) < 0.0001 and poisson == sorted(poisson)
    assert poisson == list(arrival_offsets(1000, 20.0, "poisson", random.Random(1)))  # seeded


async def test_open_loop_sends_at_the_rate_with_no_errors_and_measures_cpu_of_a_pid(server):
    dispatcher = CountingDispatcher(delay_s=0.002)
    url = await server(dispatcher)
    result = await run_open_loop(OpenLoopConfig(url=url, rate=50, seconds=1.0, arrivals="constant", token=TOKEN,
                                                server_pid=os.getpid()))
    s = result.summary()
    assert s["requests"] == s["sent"] == 50 and s["errors"] == 0 and s["outcomes"] == {"text": 50}, s
    assert s["deferred"] == s["late"] == s["not_answers"] == 0
    assert s["p50_ms"] <= s["p95_ms"] <= s["p99_ms"] <= s["p99_9_ms"] <= s["max_ms"] < 1000
    assert len({m for _, m in dispatcher.seen}) == 50  # unique MsgIds
    assert s["cpu_source"].startswith("psutil") and s["cpu_ms_per_msg"] > 0 and s["event_loop_cpu_ms_per_msg"] > 0
    assert s["encoder_cpu_ms_per_msg"] == 0 and s["front_end_cpu_ms_per_msg"] == s["cpu_ms_per_msg"]  # no encoder process
    per_openid: dict[str, int] = {}
    for user, _ in dispatcher.seen:
        per_openid[user] = per_openid.get(user, 0) + 1
    assert max(per_openid.values()) == 1  # a pool of rate x 10 s users: one message each in a second
    text = format_open(result)
    assert "p99.9" in text and "server CPU" in text
    assert "| p50 / p95 / p99 / p99.9 |" in format_open_markdown(result)


async def test_open_loop_keeps_sending_while_the_server_stalls_and_counts_the_wait(server):
    """No coordinated omission: a server that answers nothing for 0.5 s still gets every message
    on schedule, and the first message's latency is the whole stall, from its scheduled time."""
    dispatcher = GatedDispatcher()
    url = await server(dispatcher)
    loop = asyncio.get_running_loop()
    loop.call_later(0.55, dispatcher.gate.set)  # the run starts 0.05 s after the call
    result = await run_open_loop(OpenLoopConfig(url=url, rate=20, seconds=1.0, arrivals="constant", token=TOKEN))
    s = result.summary()
    assert s["requests"] == 20 and s["errors"] == 0 and s["max_in_flight"] >= 9
    first = result.samples[0]
    assert first.at_s == 0.0 and 0.45 <= first.latency_s < 0.8
    assert result.samples[-1].latency_s < 0.2  # sent after the stall: answered at once
    assert s["send_lag_p99_ms"] < 100  # the client kept to the schedule
    assert s["p99_ms"] >= 450


async def test_open_loop_tells_deferred_late_and_not_real_answers(server, monkeypatch):
    """Two OpenIDs (USER_INTERVAL_S shrunk): each first message is slower than the reply budget
    (deferred), and the same user's next reply carries it (late)."""
    monkeypatch.setattr(openloop, "USER_INTERVAL_S", 0.2)

    class FirstSlow(CountingDispatcher):
        async def handle(self, inbound: Inbound) -> Reply:
            first = all(u != inbound.user_id for u, _ in self.seen)
            self.seen.append((inbound.user_id, inbound.message_id))
            await asyncio.sleep(0.3 if first else 0.0)
            return Reply(f"答：{inbound.text}", Intent.ANSWER)

    url = await server(FirstSlow(), reply_budget_s=0.1)
    result = await run_open_loop(OpenLoopConfig(url=url, rate=10, seconds=1.0, arrivals="constant", token=TOKEN))
    s = result.summary()
    assert s["errors"] == 0 and s["deferred"] == 2 and s["late"] >= 1, s
    assert s["outcomes"]["deferred"] == 2


def test_answer_kinds_and_the_servers_texts_they_copy():
    from adapters.wechat.pages import MORE_HINT
    from adapters.wechat.store_state import PENDING_HEADER
    from bot.dispatcher import BUSY_REPLY, SLOW_DOWN_REPLY
    for lang in ("zh", "en"):
        assert msgs.answer_kind(BUSY_REPLY[lang]) == "busy"
        assert msgs.answer_kind(SLOW_DOWN_REPLY[lang]) == "slow_down"
        assert msgs.answer_kind(PENDING_HEADER[lang].format(q="失眠怎么调理") + "\n答") == "late"
        assert msgs.answer_kind("第一页\n" + MORE_HINT[lang]) == "paged"
    assert msgs.answer_kind("手脚冰凉可以多泡脚。") == ""


async def test_ramp_finds_the_highest_rate_under_the_bound(server, tmp_path):
    url = await server(SerialDispatcher(delay_s=0.01))  # ~100 messages/s at most
    ramp = await run_ramp(OpenLoopConfig(url=url, rate=20, seconds=0.8, arrivals="constant", token=TOKEN),
                          step=60, max_rate=400, p99_ms=100, refine=1, pause_s=0.2,
                          recover_s=0.5)
    rates = [r.config.rate for r in ramp.steps]
    assert rates[:2] == [20, 80] and ramp.best_rate is not None and 20 <= ramp.best_rate < 140, rates
    assert all(r.summary()["p99_ms"] > 100 or r.summary()["errors"] for r in ramp.steps
               if r.config.rate > ramp.best_rate)
    table = format_ramp(ramp)
    assert "p99.9" in table and f"{ramp.best_rate:g} messages/s" in table
    assert "|---|" in format_ramp(ramp, markdown=True)
    csv_file = write_ramp_plot(ramp, tmp_path / "ramp.csv")
    assert csv_file.read_text().splitlines()[0].startswith("offered_rps,sent_rps")
    assert len(csv_file.read_text().splitlines()) == len(ramp.steps) + 1
    pytest.importorskip("matplotlib")
    assert write_ramp_plot(ramp, tmp_path / "ramp.png").read_bytes()[:4] == b"\x89PNG"


async def test_cpu_from_metrics_without_a_pid(server):
    cpu = {"s": 10.0}

    async def metrics_route(request: web.Request) -> web.Response:
        cpu["s"] += 0.5
        return web.Response(text=f"# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total {cpu['s']}\n")

    cfg = Config()
    cfg.wechat.token = TOKEN
    app = web.Application()
    setup_wechat(app, cfg, CountingDispatcher(), store=MemoryStore())
    app.router.add_get("/metrics", metrics_route)

    async def readyz(request: web.Request) -> web.Response:
        return web.json_response({"ready": True})

    app.router.add_get("/readyz", readyz)
    url = await server(None, app=app)
    result = await run_open_loop(OpenLoopConfig(url=url, rate=20, seconds=0.5, arrivals="constant", token=TOKEN))
    s = result.summary()
    assert s["cpu_source"].startswith("/metrics") and s["cpu_ms_per_msg"] == 50.0  # 0.5 s over 10 messages


@pytest.mark.parametrize("kw,match", [({"rate": 0}, "rate"), ({"rate": 1e9}, "rate"), ({"arrivals": "burst"}, "arrivals"),
                                      ({"warmup_s": 5}, "warmup"), ({"url": "http://10.1.1.1:80"}, "loopback")])
async def test_open_loop_bounds(kw, match):
    cfg = OpenLoopConfig(url="http://127.0.0.1:9", token=TOKEN, seconds=1)
    for key, value in kw.items():
        setattr(cfg, key, value)
    with pytest.raises(ValueError, match=match):
        await run_open_loop(cfg)


async def test_a_started_server_that_fails_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="exited with status"):
        await cpu_mod.start_server(["--config", str(tmp_path / "missing.toml")], timeout_s=60)


def test_cli_open_loop_with_json_and_markdown(capsys, monkeypatch, cli_main, tmp_path):
    """``healthbot loadtest --rate`` end to end against a webhook served from another thread."""
    ready, stop = threading.Event(), None
    box: dict = {}

    def serve() -> None:
        nonlocal stop
        loop = asyncio.new_event_loop()
        stop = loop.create_future()

        async def main() -> None:
            cfg = Config()
            cfg.wechat.token = TOKEN
            app = web.Application()
            setup_wechat(app, cfg, CountingDispatcher(), store=MemoryStore())
            srv = TestServer(app, host="127.0.0.1", port=0)
            await srv.start_server()
            box["url"] = str(srv.make_url("")).rstrip("/")
            ready.set()
            await stop
            await srv.close()
        loop.run_until_complete(main())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        monkeypatch.setenv("HEALTHBOT_WECHAT_TOKEN", TOKEN)
        md = tmp_path / "open.md"
        code = cli_main(["loadtest", "--url", box["url"], "--rate", "40", "--seconds", "0.5", "--arrivals",
                         "constant", "--json", "--markdown", str(md), "--server-pid", str(os.getpid())])
        out = json.loads(capsys.readouterr().out)
        assert code == 0 and out["mode"] == "open" and out["requests"] == 20 and out["errors"] == 0
        assert out["cpu_ms_per_msg"] is not None and "| offered rate | 40 msg/s |" in md.read_text()
    finally:
        stop.get_loop().call_soon_threadsafe(stop.set_result, None)
        thread.join(10)


async def test_generators_send_the_whole_rate_from_several_processes_and_merge_their_samples(server):
    from bot.loadtest.generators import run_generators
    dispatcher = CountingDispatcher(delay_s=0.002)
    url = await server(dispatcher)
    result = await run_generators(OpenLoopConfig(url=url, rate=60, seconds=1.0, arrivals="constant", token=TOKEN,
                                                 server_pid=os.getpid()), 3)
    s = result.summary()
    assert s["requests"] == s["sent"] == 60 and s["errors"] == 0 and s["outcomes"] == {"text": 60}, s
    assert len(set(dispatcher.seen)) == 60  # every (OpenID, MsgId) once: no generator repeats another's
    assert len({user.rsplit("_", 2)[0] for user, _ in dispatcher.seen}) == 3  # three run ids, one a process
    assert [x.at_s for x in result.samples] == sorted(x.at_s for x in result.samples)
    assert s["cpu_source"].endswith("client: 3 generator processes") and s["client_cpu_ms_per_msg"] > 0


async def test_generators_out_of_bounds_are_refused():
    from bot.loadtest.generators import run_generators
    with pytest.raises(ValueError, match="--generators must be in"):
        await run_generators(OpenLoopConfig(url="http://127.0.0.1:1", token=TOKEN), 0)
