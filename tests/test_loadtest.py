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
