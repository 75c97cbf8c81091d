"""adapters/wechat/api.py against the fake WeChat API server on loopback (tests/fake_wechat_api.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from structlog.testing import capture_logs

from adapters.wechat import constants as wc
from adapters.wechat.api import TOKEN_KEY, TOKEN_LOCK_KEY, SendOutcome, WechatApi, WechatApiError, load_menu, \
    validate_menu
from bot.config import WechatConfig
from bot.store import MemoryStore

try:
    from tests.fake_wechat_api import MENU, SEND, TOKEN, FakeWechatApi
except ImportError:  # pragma: no cover
    from fake_wechat_api import MENU, SEND, TOKEN, FakeWechatApi  # type: ignore[no-redef]

APPID, SECRET = "wx0123456789abcdef", "app-secret-for-tests"
OPENID = "oUSER_openid_0123456789abcd"


@pytest.fixture
async def fake():
    server = FakeWechatApi(APPID, SECRET)
    server.url = await server.start()
    yield server
    await server.close()


def _cfg(fake: FakeWechatApi, **kw) -> WechatConfig:
    cfg = WechatConfig(appid=APPID, appsecret=SECRET, api_base=fake.url, api_timeout_s=2.0)
    for key, value in kw.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture
async def apis():
    """``make(cfg, store)`` → a WechatApi closed after the test."""
    made: list[WechatApi] = []

    def make(cfg: WechatConfig, store, **kw) -> WechatApi:
        api = WechatApi(cfg, store, **kw)
        made.append(api)
        return api

    yield make
    for api in made:
        await api.close()


def _stores():
    yield pytest.param(MemoryStore, id="memory")
    yield pytest.param("sqlite", id="sqlite")


async def _open(kind, tmp_path):
    if kind is MemoryStore:
        return MemoryStore()
    try:
        from bot.store import open_store
        return await open_store(f"sqlite:///{tmp_path / 'shared.db'}")
    except ImportError:
        pytest.skip("bot.store.sqlite not available yet")


# --------------------------------------------------------------------------- the shared token


@pytest.mark.parametrize("store_kind", list(_stores()))
async def test_eight_concurrent_workers_needing_a_token_fetch_it_once(fake, apis, store_kind, tmp_path):
    fake.delays[TOKEN] = 0.2  # the fetch is slow: the others must wait for it, not fetch too
    store = await _open(store_kind, tmp_path)
    try:
        workers = [apis(_cfg(fake), store) for _ in range(8)]  # 8 workers = 8 clients, one shared store
        tokens = await asyncio.gather(*(w.access_token() for w in workers))
        assert fake.calls[TOKEN] == 1
        assert set(tokens) == {"tok-1"}
        assert await store.get(TOKEN_KEY) == "tok-1"
        assert await store.get(TOKEN_LOCK_KEY) is None  # released by its holder
        assert sum(w.stats["token_fetches"] for w in workers) == 1
        assert sum(w.stats["token_waits"] for w in workers) == 7
        # ...and they all send with it, without another fetch.
        outcomes = await asyncio.gather(*(w.send_text(OPENID, f"第{i}条") for i, w in enumerate(workers)))
        assert outcomes == [SendOutcome.SENT] * 8 and fake.calls[TOKEN] == 1
    finally:
        await store.close()


async def test_token_is_shared_for_expires_in_minus_the_refresh_margin(fake, apis):
    store = MemoryStore()
    await apis(_cfg(fake), store).access_token()
    ttl = store._values[TOKEN_KEY][1] - time.time()
    assert 7200 - wc.TOKEN_REFRESH_MARGIN_S - 5 < ttl <= 7200 - wc.TOKEN_REFRESH_MARGIN_S


async def test_expired_shared_token_is_fetched_again(fake, apis):
    store = MemoryStore()
    api = apis(_cfg(fake), store)
    assert await api.access_token() == "tok-1"
    await store.delete(TOKEN_KEY)  # what the TTL does 300 s before WeChat's expiry
    assert await api.access_token() == "tok-2"
    assert fake.calls[TOKEN] == 2


async def test_waiters_take_over_when_the_lock_holder_died(fake, apis):
    store = MemoryStore()
    await store.set_if_absent(TOKEN_LOCK_KEY, "a-crashed-worker", 0.3)  # held, never released
    t0 = time.monotonic()
    token = await apis(_cfg(fake), store, lock_ttl_s=2.0).access_token()
    assert token == "tok-1" and fake.calls[TOKEN] == 1
    assert 0.25 <= time.monotonic() - t0 < 1.5


@pytest.mark.parametrize("errcode", [40001, 40014, 42001])
async def test_token_errcode_refetches_once_and_the_send_succeeds(fake, apis, errcode):
    store = MemoryStore()
    api = apis(_cfg(fake), store)
    await api.access_token()
    fake.fail(SEND, errcode)
    with capture_logs() as logs:
        assert await api.send_text(OPENID, "多喝温水。") is SendOutcome.SENT
    assert fake.calls[TOKEN] == 2 and fake.calls[SEND] == 2
    assert fake.contents == ["多喝温水。"]
    assert await store.get(TOKEN_KEY) == "tok-2"
    assert api.stats["token_rejected"] == 1
    assert any(e["event"] == "wechat_api.token_rejected" and e["errcode"] == errcode for e in logs)


async def test_40001_from_a_token_someone_else_replaced(fake, apis):
    """Another process fetched a token with the same AppSecret: ours is now invalid (40001)."""
    store = MemoryStore()
    await store.set(TOKEN_KEY, "stale-token", 6000)
    api = apis(_cfg(fake), store)
    assert await api.send_text(OPENID, "你好") is SendOutcome.SENT
    assert (fake.calls[TOKEN], fake.calls[SEND]) == (1, 2)


async def test_a_second_token_error_is_not_retried_for_ever(fake, apis):
    api = apis(_cfg(fake), MemoryStore())
    fake.fail(SEND, 40001, times=5)
    assert await api.send_text(OPENID, "x") is SendOutcome.FAILED
    assert fake.calls[SEND] == 2 and fake.calls[TOKEN] == 2


async def test_concurrent_40001_drop_only_the_bad_token_and_refetch_once(fake, apis):
    store = MemoryStore()
    await store.set(TOKEN_KEY, "stale-token", 6000)
    workers = [apis(_cfg(fake), store) for _ in range(8)]
    outcomes = await asyncio.gather(*(w.send_text(OPENID, str(i)) for i, w in enumerate(workers)))
    assert outcomes == [SendOutcome.SENT] * 8
    assert fake.calls[TOKEN] == 1  # a newer token stored by one worker is not deleted by the others


# --------------------------------------------------------------------------- quota and limits


async def test_45009_quota_is_a_logged_event_and_a_counter_not_a_crash(fake, apis):
    api = apis(_cfg(fake), MemoryStore())
    fake.fail(SEND, wc.ERR_API_QUOTA)
    with capture_logs() as logs:
        assert await api.send_text(OPENID, "x") is SendOutcome.FAILED
    assert api.stats["quota_exceeded"] == 1 and api.errors[45009] == 1
    (event,) = [e for e in logs if e["event"] == "wechat_api.quota_exceeded"]
    assert event["log_level"] == "error" and event["path"] == SEND and "quota" in event["hint"]
    assert fake.calls[SEND] == 1  # not retried: that would spend more quota


async def test_45047_customer_service_limit_is_a_logged_event_not_a_crash(fake, apis):
    api = apis(_cfg(fake), MemoryStore())
    fake.fail(SEND, wc.ERR_KF_OUT_OF_LIMIT)
    with capture_logs() as logs:
        assert await api.send_text(OPENID, "x") is SendOutcome.FAILED
    assert api.stats["kf_limit"] == 1
    (event,) = [e for e in logs if e["event"] == "wechat_api.kf_limit"]
    assert event["user"] == OPENID[:6] + "…"  # masked


async def test_45009_on_the_token_endpoint_raises_a_clear_error(fake, apis):
    api = apis(_cfg(fake), MemoryStore())
    fake.fail(TOKEN, wc.ERR_API_QUOTA)
    with pytest.raises(WechatApiError) as err:
        await api.access_token()
    assert err.value.errcode == 45009 and api.stats["quota_exceeded"] == 1
    assert await api.send_text(OPENID, "x") is SendOutcome.SENT  # next time it works


async def test_wrong_appsecret_fails_without_leaking_it(fake, apis):
    api = apis(_cfg(fake, appsecret="definitely-wrong-secret"), MemoryStore())
    with capture_logs() as logs:
        with pytest.raises(WechatApiError) as err:
            await api.access_token()
        assert await api.send_text(OPENID, "x") is SendOutcome.FAILED
    assert err.value.errcode == 40125
    assert "definitely-wrong-secret" not in repr(logs) + str(err.value) + repr(api)


async def test_timeout_is_unknown_and_refused_connection_is_failed(fake, apis):
    api = apis(_cfg(fake, api_timeout_s=0.3), MemoryStore())
    await api.access_token()
    fake.delays[SEND] = 1.0
    assert await api.send_text(OPENID, "x") is SendOutcome.UNKNOWN  # it may have arrived
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    gone = apis(_cfg(fake, api_base=f"http://127.0.0.1:{closed}"), MemoryStore())
    await gone.store.set(TOKEN_KEY, "tok-x", 100)
    assert await gone.send_text(OPENID, "x") is SendOutcome.FAILED


async def test_send_body_is_utf8_json_and_over_long_text_is_refused(fake, apis):
    api = apis(_cfg(fake), MemoryStore())
    assert await api.send_text(OPENID, "手脚冰凉怎么办", kf_account="nurse1@gh_test") is SendOutcome.SENT
    assert "手脚冰凉怎么办".encode() in fake.raw_bodies[-1]  # not \\u escapes
    assert fake.sent[-1]["customservice"] == {"kf_account": "nurse1@gh_test"}
    with pytest.raises(ValueError, match="2048"):
        await api.send_text(OPENID, "中" * 683)


# --------------------------------------------------------------------------- the menu

MENU_JSON = {"button": [
    {"type": "click", "name": "今日养生", "key": "V1001_TIPS"},
    {"name": "健康问答", "sub_button": [
        {"type": "click", "name": "常见问题", "key": "V2001_FAQ"},
        {"type": "view", "name": "使用说明", "url": "https://example.com/help"},
    ]},
    {"type": "click", "name": "转人工", "key": "V3001_HUMAN"},
]}
MENU_TOML = '''
[[button]]
type = "click"
name = "今日养生"
key = "V1001_TIPS"

[[button]]
name = "健康问答"

[[button.sub_button]]
type = "click"
name = "常见问题"
key = "V2001_FAQ"

[[button.sub_button]]
type = "view"
name = "使用说明"
url = "https://example.com/help"

[[button]]
type = "click"
name = "转人工"
key = "V3001_HUMAN"
'''


def test_menu_files_json_and_toml_read_the_same(tmp_path):
    (tmp_path / "menu.json").write_text(json.dumps(MENU_JSON, ensure_ascii=False), encoding="utf-8")
    (tmp_path / "menu.toml").write_text(MENU_TOML, encoding="utf-8")
    assert load_menu(tmp_path / "menu.json") == load_menu(tmp_path / "menu.toml") == MENU_JSON


@pytest.mark.parametrize("menu,match", [
    ({"button": []}, "non-empty"),
    ({"button": [{"type": "click", "name": "a", "key": "k"}] * 4}, "3"),
    ({"button": [{"type": "click", "name": "六个汉字的名字", "key": "k"}]}, "16 bytes"),
    ({"button": [{"type": "view", "name": "a"}]}, "url"),
    ({"button": [{"type": "nope", "name": "a", "key": "k"}]}, "type"),
    ({"button": [{"name": "a", "sub_button": [{"type": "click", "name": "b", "key": "k"}] * 6}]}, "sub_button"),
])
def test_menu_limits_are_checked_before_calling_wechat(menu, match):
    with pytest.raises(ValueError, match=match):
        validate_menu(menu)


async def test_create_menu_posts_it_with_the_shared_token(fake, apis):
    store = MemoryStore()
    api = apis(_cfg(fake), store)
    await api.access_token()
    fake.revoke_tokens()  # someone else fetched a token meanwhile: 40001, refetch, retry
    await api.create_menu(MENU_JSON)
    assert fake.menus == [MENU_JSON] and fake.calls[MENU] == 2 and fake.calls[TOKEN] == 2
    fake.fail(MENU, 40016)
    with pytest.raises(WechatApiError) as err:
        await api.create_menu(MENU_JSON)
    assert err.value.errcode == 40016


# --------------------------------------------------------------------------- healthbot wechat menu


def test_cli_menu_dry_run_prints_the_json(tmp_path, capsys, cli_main):
    main = cli_main
    (tmp_path / "menu.toml").write_text(MENU_TOML, encoding="utf-8")
    assert main(["wechat", "menu", "--config", str(tmp_path / "menu.toml"), "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out) == MENU_JSON
    (tmp_path / "bad.json").write_text('{"button": []}', encoding="utf-8")
    assert main(["wechat", "menu", "--config", str(tmp_path / "bad.json")]) == 2


async def test_cli_menu_creates_it_through_the_api(fake, tmp_path, capsys):
    import argparse

    from bot.cli import _wechat
    from bot.config import load_config
    (tmp_path / "menu.json").write_text(json.dumps(MENU_JSON, ensure_ascii=False), encoding="utf-8")
    cfg = load_config(env={"HEALTHBOT_WECHAT_APPID": APPID, "HEALTHBOT_WECHAT_APPSECRET": SECRET,
                           "HEALTHBOT_WECHAT_API_BASE": fake.url, "HEALTHBOT_STORE_URL": "memory://"})
    assert await _wechat(cfg, argparse.Namespace(menu_file=str(tmp_path / "menu.json"), dry_run=False)) == 0
    assert fake.menus == [MENU_JSON] and "menu created" in capsys.readouterr().out
    fake.fail(MENU, 48001)  # api unauthorized (an unverified account)
    assert await _wechat(cfg, argparse.Namespace(menu_file=str(tmp_path / "menu.json"), dry_run=False)) == 1
    assert "48001" in capsys.readouterr().err


async def test_prometheus_counters_follow_fetches_and_errors(fake, apis):
    from bot import metrics

    def value(name: str, **labels: str) -> float:
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    before = (value("healthbot_wechat_token_refreshes_total"),
              value("healthbot_wechat_api_errors_total", code="45047"),
              value("healthbot_wechat_api_errors_total", code="40001"))
    api = apis(_cfg(fake), MemoryStore())
    fake.fail(SEND, 40001)
    assert await api.send_text(OPENID, "x") is SendOutcome.SENT
    fake.fail(SEND, 45047)
    assert await api.send_text(OPENID, "x") is SendOutcome.FAILED
    after = (value("healthbot_wechat_token_refreshes_total"),
             value("healthbot_wechat_api_errors_total", code="45047"),
             value("healthbot_wechat_api_errors_total", code="40001"))
    assert [a - b for a, b in zip(after, before)] == [2, 1, 1]


@pytest.mark.parametrize("answer", [
    b'{"errcode": "not a number", "errmsg": "x"}',
    b'{"errcode": [1], "errmsg": {"a": 1}}',
    b'{"errcode": ' + b"9" * 5000 + b"}",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"access_token": "t", "expires_in": 1e999}',
    b'{"access_token": "t", "expires_in": ' + b"9" * 100 + b"}",
    b"\xff\xfe",
])
async def test_nonsense_from_the_api_is_a_failed_call_not_a_crash(apis, answer):
    """Issue 21: whatever the server API answers, the client fails the call cleanly (or stores a token
    with a sane lifetime); it never raises anything but WechatApiError."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def reply(request: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_get(TOKEN, reply)
    app.router.add_post(SEND, reply)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        store = MemoryStore()
        api = apis(WechatConfig(appid=APPID, appsecret=SECRET, api_base=str(server.make_url("")).rstrip("/"),
                                api_timeout_s=2.0), store)
        try:
            token = await api.access_token()
        except WechatApiError:
            token = None
        if token is not None:  # the answers with an access_token: stored for the documented lifetime at most
            expires_at = store._values[TOKEN_KEY][1]  # MemoryStore's (value, expiry) pair
            assert token == "t" and expires_at is not None and 0 < expires_at - time.time() <= wc.ACCESS_TOKEN_TTL_S
        outcome = await api.send_text(OPENID, "x")  # (an answer without errcode is WeChat's success)
        assert outcome in ((SendOutcome.SENT,) if token else (SendOutcome.FAILED, SendOutcome.UNKNOWN))
    finally:
        await server.close()
