"""The WeChat access token from the stable endpoint (issue 25), with /cgi-bin/token as its fallback:
adapters/wechat/api.py against the fake WeChat API on loopback (tests/fake_wechat_api.py, ``stable=True``)."""

from __future__ import annotations

import time
import urllib.parse

import pytest
from aiohttp import ClientSession
from structlog.testing import capture_logs

from adapters.wechat import constants as wc
from adapters.wechat.api import STABLE_TOKEN_PATH, TOKEN_KEY, SendOutcome, WechatApi, WechatApiError
from bot.config import WechatConfig
from bot.store import MemoryStore

try:
    from tests.fake_wechat_api import SEND, STABLE_TOKEN, TOKEN, FakeWechatApi
except ImportError:  # pragma: no cover
    from fake_wechat_api import SEND, STABLE_TOKEN, TOKEN, FakeWechatApi  # type: ignore[no-redef]

APPID, SECRET = "wx0123456789abcdef", "app-secret-for-tests"
OPENID = "oUSER_openid_0123456789abcd"


@pytest.fixture
async def fake():
    server = FakeWechatApi(APPID, SECRET, stable=True)
    server.url = await server.start()
    yield server
    await server.close()


@pytest.fixture
async def apis():
    """``make(fake, store, **wechat)`` → a WechatApi on ``fake``, closed after the test."""
    made: list[WechatApi] = []

    def make(fake: FakeWechatApi, store, **kw) -> WechatApi:
        cfg = WechatConfig(appid=APPID, appsecret=SECRET, api_base=fake.url, api_timeout_s=2.0)
        for key, value in kw.items():
            setattr(cfg, key, value)
        api = WechatApi(cfg, store)
        made.append(api)
        return api

    yield make
    for api in made:
        await api.close()


def test_the_client_names_the_documented_stable_endpoint():
    assert STABLE_TOKEN_PATH == STABLE_TOKEN == "/cgi-bin/stable_token"


async def test_the_token_comes_from_the_stable_endpoint_by_default_with_the_secret_out_of_the_url(fake, apis):
    store = MemoryStore()
    api = apis(fake, store)
    with capture_logs() as logs:
        assert await api.access_token() == "stable-1"
    assert fake.stable_requests == [{"grant_type": "client_credential", "appid": APPID, "secret": SECRET,
                                     "force_refresh": False}]
    assert fake.queries[STABLE_TOKEN] == [{}]  # the AppSecret travels in the JSON body only
    assert (fake.calls[STABLE_TOKEN], fake.calls[TOKEN]) == (1, 0)
    assert await store.get(TOKEN_KEY) == "stable-1"
    ttl = store._values[TOKEN_KEY][1] - time.time()  # shared for expires_in minus the refresh margin
    assert 7200 - wc.TOKEN_REFRESH_MARGIN_S - 5 < ttl <= 7200 - wc.TOKEN_REFRESH_MARGIN_S
    (fetched,) = [e for e in logs if e["event"] == "wechat_api.token_fetched"]
    assert fetched["endpoint"] == STABLE_TOKEN
    assert api.stats["token_fetches"] == 1 and api.stats["stable_token_fallbacks"] == 0
    assert await api.send_text(OPENID, "多喝温水。") is SendOutcome.SENT
    assert fake.contents == ["多喝温水。"] and fake.queries[SEND][-1]["access_token"] == "stable-1"


async def test_another_system_fetching_tokens_does_not_knock_ours_out(fake, apis):
    """What the stable endpoint is for: a second deployment with its own store asks for the token
    (normal mode) and gets the same one, and a third system's classic /cgi-bin/token call leaves it
    valid; our next message goes out with no token error and no refetch."""
    ours, theirs = apis(fake, MemoryStore()), apis(fake, MemoryStore())
    assert await ours.access_token() == await theirs.access_token() == "stable-1"
    async with ClientSession() as http:
        query = urllib.parse.urlencode({"grant_type": "client_credential", "appid": APPID, "secret": SECRET})
        async with http.get(f"{fake.url}{TOKEN}?{query}") as resp:
            assert (await resp.json())["access_token"] == "tok-1"
    assert await ours.send_text(OPENID, "x") is SendOutcome.SENT
    assert await theirs.send_text(OPENID, "y") is SendOutcome.SENT
    assert ours.stats["token_rejected"] == theirs.stats["token_rejected"] == 0
    assert fake.calls[STABLE_TOKEN] == 2 and fake.contents == ["x", "y"]


async def test_a_stable_token_answers_what_is_left_of_its_lifetime(fake, apis):
    fake.expires_in = 700  # the current token has 700 s left: shared for 400 s (700 - 300)
    store = MemoryStore()
    await apis(fake, store).access_token()
    ttl = store._values[TOKEN_KEY][1] - time.time()
    assert 400 - 5 < ttl <= 400


async def test_a_force_refreshed_token_is_replaced_through_the_normal_mode(fake, apis):
    """Someone force-refreshed the stable token: ours gets 40001; the client drops it, asks again
    without force_refresh (WeChat then answers the new current token) and the send succeeds."""
    store = MemoryStore()
    api = apis(fake, store)
    assert await api.access_token() == "stable-1"
    fake.revoke_tokens()
    assert await api.send_text(OPENID, "x") is SendOutcome.SENT
    assert await store.get(TOKEN_KEY) == "stable-2" and api.stats["token_rejected"] == 1
    assert all(body["force_refresh"] is False for body in fake.stable_requests)
    assert fake.calls[TOKEN] == 0


@pytest.mark.parametrize("failure", ["errcode -1", "http 502", "http 404", "no token", "timeout"])
async def test_a_failing_stable_endpoint_falls_back_to_the_classic_one(fake, apis, failure):
    if failure == "errcode -1":
        fake.fail(STABLE_TOKEN, -1)  # system busy
    elif failure.startswith("http"):
        fake.fail_http(STABLE_TOKEN, int(failure.split()[1]))
    elif failure == "no token":
        fake.fail(STABLE_TOKEN, 0)  # {"errcode": 0, "errmsg": ...} and no access_token
    else:
        fake.delays[STABLE_TOKEN] = 1.0
    store = MemoryStore()
    api = apis(fake, store, api_timeout_s=0.4)
    with capture_logs() as logs:
        assert await api.send_text(OPENID, "x") is SendOutcome.SENT
    assert (fake.calls[STABLE_TOKEN], fake.calls[TOKEN]) == (1, 1)
    assert await store.get(TOKEN_KEY) == "tok-1" and fake.contents == ["x"]
    assert api.stats["stable_token_fallbacks"] == 1
    (warning,) = [e for e in logs if e["event"] == "wechat_api.stable_token_failed"]
    assert warning["log_level"] == "warning" and TOKEN in warning["hint"]
    assert SECRET not in repr(logs)
    (fetched,) = [e for e in logs if e["event"] == "wechat_api.token_fetched"]
    assert fetched["endpoint"] == TOKEN


async def test_a_gateway_without_the_stable_endpoint_still_gets_a_token():
    """The fake without ``stable``: /cgi-bin/stable_token is a 404, every fetch falls back."""
    fake = FakeWechatApi(APPID, SECRET)
    url = await fake.start()
    api = WechatApi(WechatConfig(appid=APPID, appsecret=SECRET, api_base=url, api_timeout_s=2.0), MemoryStore())
    try:
        assert await api.access_token() == "tok-1"
        assert api.stats["stable_token_fallbacks"] == 1 and fake.calls[TOKEN] == 1
    finally:
        await api.close()
        await fake.close()


@pytest.mark.parametrize("errcode", [40013, 40125, 40164, 45009])
async def test_an_answer_about_the_account_itself_is_not_retried_on_the_classic_endpoint(fake, apis, errcode):
    """Wrong AppID or AppSecret, IP not whitelisted, quota spent: /cgi-bin/token would say the same
    (and a classic fetch would invalidate other systems' tokens)."""
    fake.fail(STABLE_TOKEN, errcode)
    api = apis(fake, MemoryStore())
    with pytest.raises(WechatApiError) as err:
        await api.access_token()
    assert err.value.errcode == errcode and err.value.path == STABLE_TOKEN
    assert fake.calls[TOKEN] == 0 and api.stats["stable_token_fallbacks"] == 0


async def test_a_wrong_appsecret_is_refused_by_the_stable_endpoint_without_leaking_it(fake, apis):
    api = apis(fake, MemoryStore(), appsecret="definitely-wrong-secret")
    with capture_logs() as logs:
        with pytest.raises(WechatApiError) as err:
            await api.access_token()
    assert err.value.errcode == 40125 and fake.calls[TOKEN] == 0
    assert "definitely-wrong-secret" not in repr(logs) + str(err.value) + repr(api)
