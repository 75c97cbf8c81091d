"""Every error the HTTP server sends is JSON (issue 25), 413 included: bot/http_errors.py and the body
limits of bot/admission/middleware.py, on real HTTP on loopback, without the model (the app is the
real middleware stack and HTTP API around a stand-in dispatcher).

Before: a body of 60-200 KB over ``client_max_size`` arrived whole with its header, so the
admission middleware skipped its declared-length check and aiohttp's ``read()`` answered a
plain-text 413; aiohttp's 404 and 405 were plain text too.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from adapters.http import setup_http
from adapters.wechat import setup_wechat
from bot.admission import Admission, AdmissionConfig, GatedTCPSite, install
from bot.app import _LateDispatcher, request_id_middleware
from bot.config import Config
from bot.http_errors import json_error, json_errors_middleware
from bot.store import MemoryStore
from bot.types import Intent, Reply

LIMIT = 64 * 1024


class EchoDispatcher:
    async def handle(self, inbound):
        return Reply(f"答：{inbound.text[:10]}", Intent.ANSWER, "zh")


async def _server(body_timeout_s: float = 2.0) -> tuple[web.AppRunner, str, Admission]:
    """The app's middleware stack (request id, JSON errors, admission) with the HTTP API, WeChat's
    webhook and a few routes that fail in different ways."""
    app = web.Application(client_max_size=LIMIT, middlewares=[request_id_middleware, json_errors_middleware])
    adm = install(app, Admission(AdmissionConfig(body_timeout_s=body_timeout_s, failure_burst=1e6)))
    late = _LateDispatcher(adm)
    late.target = EchoDispatcher()
    setup_http(app, late)
    cfg = Config()
    cfg.wechat.token, cfg.wechat.appid = "tok", "wx0123456789abcdef"
    setup_wechat(app, cfg, late, store=MemoryStore())

    async def crash(request: web.Request) -> web.Response:
        raise RuntimeError("a bug")

    async def slow(request: web.Request) -> web.Response:
        raise TimeoutError

    async def plain(request: web.Request) -> web.Response:
        return web.Response(status=403, text="forbidden", headers={"X-Extra": "kept"})

    async def own_json(request: web.Request) -> web.Response:
        return json_error(409, "taken", retry=False)

    async def text_ok(request: web.Request) -> web.Response:
        return web.Response(text="fine")

    for path, handler in (("/crash", crash), ("/slow", slow), ("/plain", plain), ("/own", own_json),
                          ("/ok", text_ok)):
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = GatedTCPSite(runner, "127.0.0.1", 0, adm.gate)
    await site.start()
    return runner, f"http://127.0.0.1:{site.port}", adm


@pytest.fixture
async def served():
    runner, url, adm = await _server()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
            yield http, url, adm
    finally:
        await runner.cleanup()


async def _error(resp: aiohttp.ClientResponse, status: int) -> str:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    assert resp.headers.get("X-Request-Id")
    body = await resp.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    return body["error"]


@pytest.mark.parametrize("kilobytes", [60, 65, 100, 150, 200, 1000])
@pytest.mark.parametrize("path", ["/api/v1/chat", "/api/chat", "/wechat", "/nowhere"])
async def test_a_declared_body_over_the_limit_is_a_json_413_on_every_path(served, kilobytes, path):
    http, url, adm = served
    body = b'{"text": "' + b"a" * (kilobytes * 1024 - 12) + b'"}'
    async with http.post(url + path, data=body, headers={"Content-Type": "application/json"}) as resp:
        if len(body) <= LIMIT:  # 60 KB: within the limit, read (and refused or answered by the route)
            assert resp.status != 413
            return
        assert "65536 bytes" in await _error(resp, 413)
        assert resp.headers["Connection"] == "close"
    assert adm.stats["body_too_large"] == 1


@pytest.mark.parametrize("kilobytes", [100, 200, 3000])
async def test_a_chunked_body_over_the_limit_is_a_json_413_without_waiting_for_the_rest(served, kilobytes):
    http, url, adm = served
    body = b"a" * (kilobytes * 1024)

    async def chunks():
        for i in range(0, len(body), 8 * 1024):
            yield body[i:i + 8 * 1024]

    t0 = time.perf_counter()
    try:
        async with http.post(url + "/api/v1/chat", data=chunks()) as resp:
            assert "65536 bytes" in await _error(resp, 413)
    except aiohttp.ClientOSError:  # the server closed while a large body was still being sent
        pytest.fail("the connection was closed before the 413 came back")
    assert time.perf_counter() - t0 < 1.5  # not the 2 s body timeout
    assert adm.stats["body_too_large"] == 1


async def test_a_small_chunked_body_is_answered(served):
    http, url, _ = served

    async def chunks():
        yield b'{"text": '
        yield '"手脚冰凉"}'.encode()

    async with http.post(url + "/api/v1/chat", data=chunks()) as resp:
        assert resp.status == 200 and (await resp.json())["reply"] == "答：手脚冰凉"


async def test_a_slow_body_is_a_json_408():
    runner, url, adm = await _server(body_timeout_s=0.3)
    port = int(url.rsplit(":", 1)[1])
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /api/v1/chat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"text\":")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), 3)
        writer.close()
    finally:
        await runner.cleanup()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"application/json" in head
    assert body == b'{"error": "request body too slow"}'
    assert adm.stats["body_timeouts"] == 1


async def test_unknown_paths_and_wrong_methods_are_json_with_allow(served):
    http, url, _ = served
    async with http.get(url + "/api/v1/nothing") as resp:
        assert await _error(resp, 404) == "not found"
    async with http.put(url + "/api/v1/chat") as resp:
        assert "PUT" in await _error(resp, 405)
        assert resp.headers["Allow"] == "POST"
    async with http.get(url + "/api/v1/openapi.json") as resp:
        assert resp.status == 200 and (await resp.json())["openapi"].startswith("3.1")


async def test_handler_failures_and_plain_text_errors_become_json(served):
    http, url, _ = served
    async with http.get(url + "/crash") as resp:
        assert await _error(resp, 500) == "internal server error"  # no traceback to the client
    async with http.get(url + "/slow") as resp:
        await _error(resp, 504)
    async with http.get(url + "/plain") as resp:
        assert await _error(resp, 403) == "forbidden"
        assert resp.headers["X-Extra"] == "kept"
    async with http.get(url + "/own") as resp:
        assert resp.status == 409 and await resp.json() == {"error": "taken", "retry": False}
    async with http.get(url + "/ok") as resp:  # successes are left alone
        assert resp.status == 200 and resp.content_type == "text/plain" and await resp.text() == "fine"


async def test_a_bad_wechat_signature_is_json_too(served):
    http, url, _ = served
    async with http.post(url + "/wechat?signature=x&timestamp=1&nonce=2", data=b"<xml></xml>") as resp:
        assert resp.status in (400, 403)
        assert resp.content_type == "application/json" and (await resp.json())["error"]
