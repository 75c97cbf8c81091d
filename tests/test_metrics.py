"""Prometheus metrics: real traffic through the real app (HTTP, signed WeChat, Telegram against a
fake Bot API that answers one 429), then ``GET /metrics`` has every metric of bot/metrics.py with
the values that traffic implies.

The registry is the process's (bot.metrics.REGISTRY): other tests in the session add to it too,
so every count is compared as the difference between a scrape before and a scrape after.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from adapters.telegram import constants as tc
from bot import metrics
from bot.config import REPO_ROOT, load_config
from inference.engines import loader as manager
from inference.engines.base import EngineError
from tests.conftest import requires_model
from tests.fake_telegram import FakeBotAPI, Updates
from tests.wechat_client import WechatSigner, parse_reply, text_xml

pytestmark = [pytest.mark.model, requires_model]

WECHAT_TOKEN = "metrics-wechat-token"
TG_TOKEN = "123456:METRICS-token"
TG_SECRET = "metrics_Webhook-secret_0123"

#: HTTP questions and the outcome label each must be counted under.
HTTP_QUESTIONS = [
    ("失眠怎么调理", "answer"),
    ("how much water should I drink a day", "answer"),
    ("我爸胸口像压了块石头，一直出冷汗", "emergency"),
    ("我不想活了", "emergency"),          # a crisis: intent emergency, safety outcome crisis
    ("降压药吃多少片合适", "refer_doctor"),
    ("你好", "greeting"),
]
WECHAT_QUESTIONS = ["手脚冰凉怎么办", "我这是什么病，帮我诊断一下"]

#: ARCHITECTURE.md "Operations" and issue 8: every family /metrics must serve.
EXPECTED_FAMILIES = {
    "healthbot_store_unavailable", "healthbot_request_latency_seconds", "healthbot_requests_in_flight", "healthbot_dedup_hits",
    "healthbot_safety_outcomes", "healthbot_inference_queue_seconds", "healthbot_inference_batch_size",
    "healthbot_inference_batch_tokens", "healthbot_inference_pending", "healthbot_inference_dropped",
    "healthbot_inference_engine_seconds", "healthbot_inference_workers", "healthbot_inference_worker_exits",
    "healthbot_inference_worker_restarts", "healthbot_engine_fallbacks",
    "healthbot_engine_circuit_state", "healthbot_wechat_token_refreshes", "healthbot_wechat_api_errors",
    "healthbot_telegram_retry_after", "healthbot_embedding_cache_hits", "healthbot_embedding_cache_misses",
    "healthbot_embedding_cache_entries", "healthbot_model_info", "healthbot_model_reloads",
    "healthbot_server_process_restarts", "healthbot_feedback", "healthbot_offers",
}

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> tuple[Samples, set[str]]:
    """(every sample by (name, labels), the names of every family with a HELP line)."""
    samples: Samples = {}
    families = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, families


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def _unavailable(cfg, engines_dir):
    raise EngineError("tensorrt unavailable in this test")


@dataclass
class Traffic:
    before: Samples
    after: Samples
    families: set[str]
    content_type: str
    telegram_texts: list[str]

    def delta(self, name: str, **labels: str) -> float:
        return total(self.after, name, **labels) - total(self.before, name, **labels)


@pytest.fixture(scope="module")
async def traffic(cfg, dispatcher) -> Traffic:
    """One app (create_app: its own model, pool and batcher) on 127.0.0.1, driven once for the module.

    ``dispatcher`` is requested only so that the session's retrieval cache exists in the data
    directory this app shares (start-up then takes seconds, not minutes).
    """
    fake = await FakeBotAPI(token=TG_TOKEN).start()
    app_cfg = load_config(env={
        "HEALTHBOT_DATA_DIR": cfg.data_dir,
        "HEALTHBOT_WECHAT_TOKEN": WECHAT_TOKEN, "HEALTHBOT_WECHAT_APPID": "wx0123456789abcdef",
        "HEALTHBOT_TELEGRAM_TOKEN": TG_TOKEN, "HEALTHBOT_TELEGRAM_SECRET": TG_SECRET,
        "HEALTHBOT_TELEGRAM_API_BASE": fake.api_base,
        "HEALTHBOT_INFERENCE_ENGINE_ORDER": "tensorrt,onnxruntime",
    })
    from bot.app import create_app  # noqa: PLC0415
    before = parse(metrics.render()[0].decode())[0]
    server = TestServer(create_app(app_cfg), host="127.0.0.1", port=0)
    with pytest.MonkeyPatch.context() as mp:  # tensorrt fails to load, GPU or not: a fallback to onnxruntime
        mp.setitem(manager.LOADERS, "tensorrt", _unavailable)
        await server.start_server()
    base = f"http://127.0.0.1:{server.port}"
    signer = WechatSigner(WECHAT_TOKEN)
    tg_user = random.randint(10**8, 10**9)
    try:
        async with aiohttp.ClientSession() as http:
            async def chat(text: str, message_id: str) -> dict:
                # one user per question: a retry is the same user and message id (the dedup key holds both)
                async with http.post(base + "/api/chat", json={"text": text, "message_id": message_id,
                                                                "user_id": f"u-{message_id}"}) as r:
                    assert r.status == 200
                    return await r.json()

            async def wechat(text: str, msg_id: int) -> dict:
                path, body = signer.plain_post(text_xml(text, msg_id=msg_id))
                async with http.post(base + path, data=body) as r:
                    assert r.status == 200
                    return parse_reply(await r.text())

            ids = [f"metrics-{random.getrandbits(48)}-{n}" for n in range(len(HTTP_QUESTIONS))]
            replies = await asyncio.gather(*(chat(q, i) for (q, _), i in zip(HTTP_QUESTIONS, ids)))
            assert [r["intent"] for r in replies] == [o for _, o in HTTP_QUESTIONS]
            assert (await chat(HTTP_QUESTIONS[0][0], ids[0]))["reply"] == replies[0]["reply"]  # a retry
            wids = [random.randint(10**15, 10**16) for _ in WECHAT_QUESTIONS]
            for text, msg_id in zip(WECHAT_QUESTIONS, wids):
                assert (await wechat(text, msg_id))["MsgType"] == "text"
            await wechat(WECHAT_QUESTIONS[0], wids[0])  # WeChat's re-delivery of the same MsgId
            fake.fail("sendMessage", 429, "Too Many Requests: retry after 1", retry_after=1,
                      match=lambda p: p["chat_id"] == tg_user)
            async with http.post(base + tc.WEBHOOK_PATH, json=Updates().text(tg_user, "失眠怎么调理"),
                                 headers={tc.SECRET_HEADER: TG_SECRET}) as r:
                assert r.status == 200
            telegram_texts = await fake.wait_for(lambda: fake.texts_to(tg_user), timeout=15)
            async with http.get(base + "/metrics") as r:
                assert r.status == 200
                content_type = r.headers["Content-Type"]
                after, families = parse(await r.text())
    finally:
        await server.close()
        await fake.close()
    return Traffic(before, after, families, content_type, telegram_texts)


def test_metrics_page_is_prometheus_text(traffic: Traffic):
    assert traffic.content_type.startswith("text/plain; version=0.0.4")


def test_openmetrics_is_served_when_the_scraper_asks_for_it():
    body, content_type = metrics.render("application/openmetrics-text; version=1.0.0,text/plain;q=0.5")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


def test_request_latency_is_counted_once_per_computed_message_by_channel_and_outcome(traffic: Traffic):
    name = "healthbot_request_latency_seconds"
    assert traffic.delta(name + "_count", channel="http") == len(HTTP_QUESTIONS)  # the retry is not computed
    assert traffic.delta(name + "_count", channel="wechat") == len(WECHAT_QUESTIONS)
    assert traffic.delta(name + "_count", channel="telegram") == 1
    for outcome in ("answer", "emergency", "refer_doctor", "greeting"):
        expected = sum(1 for _, o in HTTP_QUESTIONS if o == outcome)
        assert traffic.delta(name + "_count", channel="http", outcome=outcome) == expected, outcome
    answers = traffic.delta(name + "_count", channel="http", outcome="answer")
    assert traffic.delta(name + "_bucket", channel="http", outcome="answer", le="+Inf") == answers
    assert traffic.delta(name + "_bucket", channel="http", outcome="answer", le="10.0") == answers  # non-empty
    assert 0 < traffic.delta(name + "_sum", channel="http") < 10 * len(HTTP_QUESTIONS)
    assert total(traffic.after, "healthbot_requests_in_flight") == 0


def test_retries_are_dedup_hits_by_channel(traffic: Traffic):
    assert traffic.delta("healthbot_dedup_hits_total", channel="http") == 1
    assert traffic.delta("healthbot_dedup_hits_total", channel="wechat") == 1
    assert traffic.delta("healthbot_dedup_hits_total", channel="telegram") == 0


def test_safety_outcomes_are_counted_by_rule(traffic: Traffic):
    name = "healthbot_safety_outcomes_total"
    assert traffic.delta(name, outcome="emergency") == 1
    assert traffic.delta(name, outcome="emergency", rule="heart_attack.chest_pain_zh") == 1
    assert traffic.delta(name, outcome="crisis") == 1
    assert traffic.delta(name, outcome="refer_doctor", rule="dose") == 1
    assert traffic.delta(name, outcome="refer_doctor", rule="diagnosis") == 1  # the WeChat one


def test_inference_queue_batches_and_engine_time(traffic: Traffic):
    # answer-type questions reach the encoder: 2 HTTP + 1 WeChat + 1 Telegram at least
    # (greetings, emergencies and scope refusals are decided before retrieval).
    windows = traffic.delta("healthbot_inference_queue_seconds_count")
    assert windows >= 4
    assert traffic.delta("healthbot_inference_queue_seconds_bucket", le="+Inf") == windows
    assert 0 <= traffic.delta("healthbot_inference_queue_seconds_sum") < 2.0 * windows  # each within the deadline
    batches = traffic.delta("healthbot_inference_batch_size_count")
    assert 1 <= batches <= windows
    assert traffic.delta("healthbot_inference_batch_size_sum") == windows  # every batch holds >= 1 window
    # padded tokens >= 3 a window ([bos] + content + [eos]), <= 512 a window (the largest bucket)
    assert 3 * windows <= traffic.delta("healthbot_inference_batch_tokens_sum") <= 512 * windows
    engine_batches = traffic.delta("healthbot_inference_engine_seconds_count", engine="onnxruntime")
    assert engine_batches == batches
    assert 0 < traffic.delta("healthbot_inference_engine_seconds_sum", engine="onnxruntime") < 60
    assert total(traffic.after, "healthbot_inference_pending") == 0
    assert total(traffic.after, "healthbot_inference_workers", engine="onnxruntime") >= 1
    assert "healthbot_inference_dropped" in traffic.families
    assert traffic.delta("healthbot_inference_dropped_total", reason="failed") == 0


def test_engine_fallback_and_circuit_state(traffic: Traffic):
    assert traffic.delta("healthbot_engine_fallbacks_total", from_engine="tensorrt", to_engine="onnxruntime") == 1
    assert total(traffic.after, "healthbot_engine_circuit_state", engine="tensorrt") == metrics.CircuitState.OPEN
    assert total(traffic.after, "healthbot_engine_circuit_state", engine="onnxruntime") == metrics.CircuitState.CLOSED


def test_telegram_retry_after_is_counted_and_the_answer_still_arrives_once(traffic: Traffic):
    assert traffic.delta("healthbot_telegram_retry_after_total", method="sendMessage") == 1
    assert len(traffic.telegram_texts) == 1 and "睡" in traffic.telegram_texts[0]


def test_wechat_token_and_api_error_metrics_are_exposed(traffic: Traffic):
    # Passive replies use no access_token: no refresh, no API error in this traffic.
    assert "healthbot_wechat_token_refreshes" in traffic.families
    assert "healthbot_wechat_api_errors" in traffic.families
    assert traffic.delta("healthbot_wechat_token_refreshes_total") == 0
    assert traffic.delta("healthbot_wechat_api_errors_total") == 0


def test_process_metrics_are_exposed(traffic: Traffic):
    assert total(traffic.after, "process_resident_memory_bytes") > 0


def test_every_metric_defined_has_a_help_text_and_is_served(traffic: Traffic):
    ours = {f.name for f in metrics.REGISTRY.collect() if f.name.startswith("healthbot_")}
    assert ours == EXPECTED_FAMILIES
    assert ours <= traffic.families
    for family in metrics.REGISTRY.collect():
        assert family.documentation.strip(), family.name


def test_outcome_label_separates_overload_and_errors_from_intents():
    assert metrics.request_outcome("answer", {}) == "answer"
    assert metrics.request_outcome("system", {"error": "BusyError"}) == "busy"
    assert metrics.request_outcome("system", {"error": "DeadlineExceeded"}) == "busy"
    assert metrics.request_outcome("system", {"unsupported": "voice"}) == "system"
    assert metrics.request_outcome(None) == "error"


def test_the_grafana_dashboard_queries_only_metrics_that_exist_and_shows_every_one():
    dashboard = json.loads((REPO_ROOT / "deploy" / "grafana-dashboard.json").read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = set(re.findall(r"\b((?:healthbot|process)_[a-z_]+)", " ".join(exprs)))
    served = {s.name for f in metrics.REGISTRY.collect() for s in f.samples} | {
        f.name + suffix for f in metrics.REGISTRY.collect() for suffix in ("", "_total", "_bucket", "_sum", "_count")}
    assert used <= served, used - served
    for family in EXPECTED_FAMILIES:
        assert any(name.startswith(family) for name in used), f"{family} is not on the dashboard"
