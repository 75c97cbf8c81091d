"""``/metrics`` on its own port and behind a bearer token (issue 25; bot/metrics_endpoint.py, the
``server.metrics_port`` / ``server.metrics_token`` settings of bot/config.py), on real HTTP on loopback:
the endpoint's app alone (no model), then a real ``healthbot serve`` configured through the environment."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from bot.config import ConfigError, ServerConfig, load_config, redacted
from bot.http_errors import json_errors_middleware
from bot.logs import config_secrets
from bot.metrics_endpoint import setup_metrics
from tests.conftest import requires_model
from tests.servers import ServeProcess, free_port

TOKEN = "metrics-token-for-tests-0123456789"


async def _start(server: ServerConfig) -> tuple[web.AppRunner, str]:
    """An app with ``/healthz`` and the metrics endpoint as ``server`` says, started on ``server.port``."""
    app = web.Application(middlewares=[json_errors_middleware])

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.router.add_get("/healthz", healthz)
    setup_metrics(app, server)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", server.port).start()
    return runner, f"http://127.0.0.1:{server.port}"


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


async def _unauthorized(resp: aiohttp.ClientResponse) -> None:
    assert resp.status == 401 and resp.content_type == "application/json"
    assert resp.headers["WWW-Authenticate"] == 'Bearer realm="healthbot-metrics"'
    assert (await resp.json()) == {"error": "missing or wrong metrics token"}


async def test_default_metrics_are_open_on_the_api_port():
    runner, url = await _start(ServerConfig(port=free_port()))
    try:
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
            assert resp.status == 200 and resp.content_type == "text/plain"
            assert "healthbot_requests_in_flight" in await resp.text()
    finally:
        await runner.cleanup()


async def test_a_metrics_port_of_its_own_with_a_token():
    server = ServerConfig(host="127.0.0.1", port=free_port(), metrics_port=free_port(), metrics_token=TOKEN)
    metrics_url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    assert _refused(server.metrics_port)
    runner, url = await _start(server)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                assert resp.status == 404 and resp.content_type == "application/json"  # not on the API's port
            async with http.get(url + "/healthz") as resp:
                assert resp.status == 200
            async with http.get(metrics_url) as resp:
                await _unauthorized(resp)
            for header in (f"Bearer {TOKEN[:-1]}x", f"Basic {TOKEN}", TOKEN, "Bearer ", f"Bearer {TOKEN}0"):
                async with http.get(metrics_url, headers={"Authorization": header}) as resp:
                    await _unauthorized(resp)
            async with http.get(metrics_url, headers={"Authorization": b"Bearer \xff\xfe".decode("latin-1")}) as resp:
                await _unauthorized(resp)  # undecodable bytes are a wrong token, not a 500
            for header in (f"Bearer {TOKEN}", f"bearer  {TOKEN} "):
                async with http.get(metrics_url, headers={"Authorization": header}) as resp:
                    assert resp.status == 200 and "healthbot_requests_in_flight" in await resp.text()
            async with http.get(metrics_url, headers={"Authorization": f"Bearer {TOKEN}",
                                                      "Accept": "application/openmetrics-text"}) as resp:
                assert resp.status == 200 and resp.content_type == "application/openmetrics-text"
            async with http.get(metrics_url.replace("/metrics", "/healthz")) as resp:
                assert resp.status == 404  # the metrics port serves /metrics alone
            async with http.post(metrics_url, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                assert resp.status == 405 and resp.content_type == "application/json"
    finally:
        await runner.cleanup()
    assert _refused(server.metrics_port)  # closed with the app


async def test_a_token_on_the_api_port():
    runner, url = await _start(ServerConfig(port=free_port(), metrics_token=TOKEN))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/metrics") as resp:
                await _unauthorized(resp)
            async with http.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                assert resp.status == 200
    finally:
        await runner.cleanup()


async def test_a_metrics_port_in_use_fails_the_start():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(OSError):
            await _start(ServerConfig(port=free_port(), metrics_port=busy))


# --------------------------------------------------------------------------- configuration


def test_the_settings_come_from_the_environment_and_the_token_is_a_secret(tmp_path: Path):
    cfg = load_config(env={"HEALTHBOT_SERVER_METRICS_PORT": "9464", "HEALTHBOT_SERVER_METRICS_TOKEN": TOKEN})
    assert (cfg.server.metrics_port, cfg.server.metrics_token) == (9464, TOKEN)
    assert redacted(cfg)["server"]["metrics_token"] == "***" and TOKEN in config_secrets(cfg)
    assert load_config(env={}).server.metrics_port == 0 and load_config(env={}).server.metrics_token == ""
    toml = tmp_path / "c.toml"
    toml.write_text("[server]\nmetrics_port = 9464\n", encoding="utf-8")
    assert load_config(toml, env={}).server.metrics_port == 9464
    toml.write_text(f'[server]\nmetrics_token = "{TOKEN}"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="secret"):
        load_config(toml, env={})


@pytest.mark.parametrize("env,match", [
    ({"HEALTHBOT_SERVER_METRICS_TOKEN": "short"}, "metrics_token"),
    ({"HEALTHBOT_SERVER_METRICS_PORT": "8080"}, "metrics_port"),  # the API's port
    ({"HEALTHBOT_SERVER_METRICS_PORT": "70000"}, "metrics_port"),
    ({"HEALTHBOT_SERVER_METRICS_PORT": "-1"}, "metrics_port"),
    ({"HEALTHBOT_SERVER_METRICS_PORT": "nine"}, "metrics_port"),
])
def test_bad_metrics_settings_fail_at_start_naming_the_key(env, match):
    with pytest.raises(ConfigError, match=match):
        load_config(env=env)


# --------------------------------------------------------------------------- the real server


@pytest.mark.model
@requires_model
async def test_healthbot_serve_with_a_metrics_port_and_token(tmp_path_factory):
    metrics_port = free_port()
    env = {**os.environ, "HEALTHBOT_DATA_DIR": str(tmp_path_factory.mktemp("data")),
           "HEALTHBOT_KNOWLEDGE_RELOAD_INTERVAL_S": "0",
           "HEALTHBOT_SERVER_METRICS_PORT": str(metrics_port), "HEALTHBOT_SERVER_METRICS_TOKEN": TOKEN}
    env.pop("HEALTHBOT_STORE_URL", None)
    server = ServeProcess(env, tmp_path_factory.mktemp("log") / "serve.log", name="metrics server")
    try:
        server.wait_ready(180.0)
        async with aiohttp.ClientSession() as http:
            async with http.post(server.base + "/api/v1/chat", json={"text": "手脚冰凉怎么办"}) as resp:
                assert resp.status == 200
            async with http.get(server.base + "/metrics") as resp:
                assert resp.status == 404 and resp.content_type == "application/json"
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            async with http.get(metrics_url) as resp:
                await _unauthorized(resp)
            async with http.get(metrics_url, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                assert resp.status == 200
                text = await resp.text()
        assert 'healthbot_request_latency_seconds_count{channel="http"' in text  # the serving process's registry
        assert TOKEN not in server.log.read_text(errors="replace")
    finally:
        server.stop()
    assert _refused(metrics_port)
