"""Two replicas behind one Redis: two real `healthbot serve` processes on different loopback
ports, sharing ``redis://127.0.0.1:PORT/2`` (issue 10, "Several replicas").

What must hold when a load balancer spreads traffic over both:

* a WeChat retry (same MsgId, correctly signed) that lands on the other replica gets the
  same reply and is computed once over both (``/metrics``: one
  ``healthbot_request_latency_seconds`` observation in all, one dedup hit on the other);
* a handoff started on one replica is honoured by the other: the bot stays silent there,
  the message is relayed, an agent on either replica's console answers, and the user
  reads the answer through either replica;
* the WeChat access token (adapters/wechat/api.py) is fetched once for both, against
  tests/fake_wechat_api.py (run on its own thread and event loop, so it answers
  whatever this test's loop is doing).

Redis is Debian's redis-server started by tests/redis_server.py (skipped without it,
except under CI=true). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
import uuid

import aiohttp
import pytest

from tests.conftest import requires_model
from tests.fake_wechat_api import SEND, TOKEN as TOKEN_PATH, FakeWechatApi
from tests.redis_server import redis_server  # noqa: F401  (pytest fixture)
from tests.servers import ServeProcess
from tests.wechat_client import WechatSigner, parse_reply, text_xml

pytestmark = [pytest.mark.model, requires_model]

WECHAT_TOKEN = "replica-token"
APPID = "wx0123456789abcdef"
APPSECRET = "app-secret-for-tests"
CONSOLE_TOKEN = "console-token-for-replica-tests"
REDIS_DB = 2  # 0 and 1 belong to the store suite
START_TIMEOUT_S = 180.0


class ThreadedFakeWechat:
    """:class:`FakeWechatApi` served from its own thread and event loop."""

    def __init__(self) -> None:
        self.api = FakeWechatApi(appid=APPID, secret=APPSECRET)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-wechat", daemon=True)

    def start(self) -> str:
        self.thread.start()
        return asyncio.run_coroutine_threadsafe(self.api.start(), self.loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.api.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def fake_wechat():
    fake = ThreadedFakeWechat()
    url = fake.start()
    fake.url = url
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def replicas(redis_server, fake_wechat, tmp_path_factory):  # noqa: F811
    """Replicas A and B: same Redis db, same WeChat service account, each its own data folder.

    Started one after the other: the second finds the knowledge-base vectors the first
    cached, as a rolling start does, and the two do not compete for 2 cores while loading.
    """
    import redis
    redis.Redis(host=redis_server.host, port=redis_server.port, db=REDIS_DB).flushdb()
    store_url = redis_server.url_for_db(REDIS_DB)
    started: list[ServeProcess] = []
    try:
        for name in ("a", "b"):
            env = {**os.environ,
                   "HEALTHBOT_STORE_URL": store_url,
                   "HEALTHBOT_DATA_DIR": str(tmp_path_factory.mktemp(f"data-{name}")),
                   "HEALTHBOT_WECHAT_TOKEN": WECHAT_TOKEN,
                   "HEALTHBOT_WECHAT_APPID": APPID,
                   "HEALTHBOT_WECHAT_APPSECRET": APPSECRET,
                   "HEALTHBOT_WECHAT_ACCOUNT_TYPE": "service",
                   "HEALTHBOT_WECHAT_API_BASE": fake_wechat.url,
                   "HEALTHBOT_CONSOLE_TOKEN": CONSOLE_TOKEN,
                   "HEALTHBOT_KNOWLEDGE_RELOAD_INTERVAL_S": "0"}
            replica = ServeProcess(env, tmp_path_factory.mktemp(f"log-{name}") / "serve.log", name=f"replica {name}")
            started.append(replica)
            replica.wait_ready(START_TIMEOUT_S)
        yield started
    finally:
        for replica in started:
            replica.stop()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$')


async def metric(http, base: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` on ``base``'s /metrics whose labels include ``labels``."""
    async with http.get(base + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m["name"] != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m["labels"] or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m["value"])
    return total


async def metric_both(http, replicas, name: str, **labels: str) -> list[float]:
    return [await metric(http, r.base, name, **labels) for r in replicas]


async def wechat_post(http, base: str, path: str, body: bytes) -> dict[str, str]:
    async with http.post(base + path, data=body, headers={"Content-Type": "text/xml"}) as resp:
        text = await resp.text()
        assert resp.status == 200, text
    assert text.startswith("<xml>"), text
    return parse_reply(text)


def assert_same_reply(a: dict[str, str], b: dict[str, str]) -> None:
    """The same passive reply, sent by two replicas: equal but for ``CreateTime``, which
    each sets when it sends (whole seconds: two sends can straddle a second)."""
    assert {k: v for k, v in a.items() if k != "CreateTime"} == {k: v for k, v in b.items() if k != "CreateTime"}
    assert abs(int(a["CreateTime"]) - int(b["CreateTime"])) <= 2


async def chat(http, base: str, user: str, text: str) -> dict:
    async with http.post(base + "/api/chat", json={"text": text, "user_id": user}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


CONSOLE = {"Authorization": f"Bearer {CONSOLE_TOKEN}"}


async def console_handoff(http, base: str, user: str) -> dict | None:
    async with http.get(base + "/console/api/handoffs", headers=CONSOLE) as resp:
        assert resp.status == 200
        listed = [h for h in (await resp.json())["handoffs"] if h["channel"] == "http"]
    for h in listed:
        async with http.get(f"{base}/console/api/handoffs/{h['ref']}", headers=CONSOLE) as resp:
            if resp.status == 200 and h["label"].endswith(user[-4:]):
                return await resp.json()
    return None


def _openid() -> str:
    return "oREPLICA_" + uuid.uuid4().hex[:18]


async def test_wechat_retry_on_the_other_replica_is_computed_once(replicas, http):
    a, b = replicas
    computed = await metric_both(http, replicas, "healthbot_request_latency_seconds_count", channel="wechat")
    hits_b = await metric(http, b.base, "healthbot_dedup_hits_total", channel="wechat")
    path, body = WechatSigner(WECHAT_TOKEN, appid=APPID).plain_post(
        text_xml("手脚冰凉怎么办", msg_id=7100000000000001, user=_openid()))

    first = await wechat_post(http, a.base, path, body)
    retry = await wechat_post(http, b.base, path, body)  # WeChat's retry, routed to the other replica

    assert first["MsgType"] == "text" and ("手脚" in first["Content"] or "手足" in first["Content"])
    assert_same_reply(retry, first)
    after = await metric_both(http, replicas, "healthbot_request_latency_seconds_count", channel="wechat")
    assert sum(after) - sum(computed) == 1, (computed, after)
    assert after[1] == computed[1]  # B answered from the shared reply, computing nothing
    assert await metric(http, b.base, "healthbot_dedup_hits_total", channel="wechat") == hits_b + 1


async def test_simultaneous_deliveries_to_both_replicas_are_computed_once(replicas, http):
    computed = await metric_both(http, replicas, "healthbot_request_latency_seconds_count", channel="wechat")
    path, body = WechatSigner(WECHAT_TOKEN, appid=APPID).plain_post(
        text_xml("失眠怎么调理", msg_id=7100000000000002, user=_openid()))

    replies = await asyncio.gather(*(wechat_post(http, r.base, path, body) for r in replicas))

    assert_same_reply(replies[0], replies[1])
    assert replies[0]["MsgType"] == "text" and ("失眠" in replies[0]["Content"] or "睡" in replies[0]["Content"])
    after = await metric_both(http, replicas, "healthbot_request_latency_seconds_count", channel="wechat")
    assert sum(after) - sum(computed) == 1, (computed, after)


async def test_handoff_started_on_one_replica_is_honoured_by_the_other(replicas, http):
    a, b = replicas
    user = "replica-user-" + uuid.uuid4().hex
    started = await chat(http, a.base, user, "转人工")
    assert started["intent"] == "handoff"

    relayed = await chat(http, b.base, user, "我晚上总是睡不着")
    assert relayed["intent"] == "handoff" and relayed["reply"] == ""  # no bot answer on B either

    seen = await console_handoff(http, b.base, user)  # B's console shows the handoff A started
    assert seen is not None
    assert seen["transcript"][-1] == {"who": "user", "text": "我晚上总是睡不着"}
    async with http.post(f"{b.base}/console/api/handoffs/{seen['ref']}/reply", headers=CONSOLE,
                         json={"text": "您好，我是客服，请问持续多久了？"}) as resp:
        assert resp.status == 200, await resp.text()
    async with http.get(a.base + "/api/messages", params={"user_id": user, "wait": "5"}) as resp:
        got = await resp.json()
    assert [(m["from"], m["text"]) for m in got["messages"]] == [("agent", "您好，我是客服，请问持续多久了？")]

    async with http.post(f"{a.base}/console/api/handoffs/{seen['ref']}/close", headers=CONSOLE) as resp:
        assert resp.status == 200  # the same ref on A: refs do not depend on the replica
    answered = await chat(http, b.base, user, "失眠怎么调理")
    assert answered["intent"] == "answer" and answered["reply"]


async def test_wechat_handoff_on_one_replica_transfers_the_next_message_on_the_other(replicas, http):
    a, b = replicas
    signer = WechatSigner(WECHAT_TOKEN, appid=APPID)
    openid = _openid()
    first = await wechat_post(http, a.base, *signer.plain_post(text_xml("转人工", msg_id=7100000000000003, user=openid)))
    assert first["MsgType"] == "transfer_customer_service"
    second = await wechat_post(http, b.base, *signer.plain_post(text_xml("还在吗", msg_id=7100000000000004,
                                                                        user=openid)))
    assert second["MsgType"] == "transfer_customer_service"  # B knows: to WeChat's agents, no bot answer


async def test_access_token_is_fetched_once_for_both_replicas(replicas, http, fake_wechat, redis_server):  # noqa: F811
    """Both replicas need a token at the same moment (a service account's handoff text
    goes out through /cgi-bin/message/custom/send): one fetch serves both."""
    import redis
    from adapters.wechat.api import TOKEN_KEY
    api = fake_wechat.api
    assert api.calls[TOKEN_PATH] <= 1, api.calls  # the earlier tests' messages shared one token
    before = api.calls[TOKEN_PATH]
    # As when the shared token expires: neither replica has one.
    redis.Redis(host=redis_server.host, port=redis_server.port, db=REDIS_DB).delete(TOKEN_KEY)
    signer = WechatSigner(WECHAT_TOKEN, appid=APPID)
    users = [_openid(), _openid()]
    replies = await asyncio.gather(*(
        wechat_post(http, r.base, *signer.plain_post(text_xml("人工客服", msg_id=7100000000000010 + i, user=u)))
        for i, (r, u) in enumerate(zip(replicas, users))))
    assert [r["MsgType"] for r in replies] == ["transfer_customer_service"] * 2

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        reached = {m["touser"] for m in api.sent}
        if all(u in reached for u in users):  # users[0] through A, users[1] through B
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail(f"customer-service messages not sent: {api.calls}")

    assert api.calls[TOKEN_PATH] == before + 1, api.calls
    assert api.calls[SEND] == len(api.sent)  # no call refused for a stale token (40001)
    refreshes = await metric_both(http, replicas, "healthbot_wechat_token_refreshes_total")
    assert sum(refreshes) == before + 1, refreshes
