"""The agent console end to end: a real `healthbot serve` process on loopback, an HTTP-API
user, and an agent in headless Chromium driven by Playwright.

Chromium is Debian's (``apt-get install -y chromium``; no browser download): Playwright
launches ``/usr/bin/chromium`` through ``executable_path``. Without it (or without the
``playwright`` package) the browser test skips, except under ``CI=true``, where it
must run (``.ci/run`` installs chromium). The API tests need no browser.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import pytest

from adapters.console import ENDED_TEXT, MAX_WAIT_S
from tests.conftest import requires_model
from tests.redis_server import in_ci

pytestmark = [pytest.mark.model, requires_model]

TOKEN = "console-token-for-tests-0123456789"
#: Launch flags for Debian's chromium as root in a sandbox with no network beyond loopback.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
START_TIMEOUT_S = 120.0
UI_TIMEOUT_MS = 15_000


def chromium_path() -> str | None:
    """Debian's chromium binary, or None."""
    found = shutil.which("chromium")
    if found:
        return found
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None


def require_browser() -> str:
    """The chromium path, with the playwright package importable; else skip (outside CI) or fail (CI=true)."""
    missing = []
    binary = chromium_path()
    if binary is None:
        missing.append("chromium not found: apt-get install -y chromium (.ci/run installs it)")
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        missing.append("the playwright package is not installed: pip install playwright (no browser download)")
    if missing:
        reason = "; ".join(missing)
        if in_ci():
            pytest.fail(f"{reason}; CI=true, so the console's browser test must run", pytrace=False)
        pytest.skip(reason)
    return binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``healthbot serve`` with the console on, SQLite state in a temporary folder; its base URL."""
    port = _free_port()
    env = {**os.environ, "HEALTHBOT_CONSOLE_TOKEN": TOKEN, "HEALTHBOT_DATA_DIR": str(tmp_path_factory.mktemp("data")),
           "HEALTHBOT_KNOWLEDGE_RELOAD_INTERVAL_S": "0"}
    env.pop("HEALTHBOT_STORE_URL", None)
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "bot.cli", "serve", "--port", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=out)
    base = f"http://127.0.0.1:{port}"
    import urllib.request
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server not ready within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.3)
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=MAX_WAIT_S + 10)) as session:
        yield session


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _chat(http, base: str, user: str, text: str) -> dict:
    async with http.post(base + "/api/chat", json={"text": text, "user_id": user}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _messages(http, base: str, user: str, wait_s: float = 0.0) -> dict:
    async with http.get(base + "/api/messages", params={"user_id": user, "wait": str(wait_s)}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _handoff_of(http, base: str, user: str) -> dict | None:
    async with http.get(base + "/console/api/handoffs", headers=AUTH) as resp:
        assert resp.status == 200
        found = [h for h in (await resp.json())["handoffs"] if h["channel"] == "http" and h["label"].endswith(user[-4:])]
    return found[0] if found else None


async def test_console_api_refuses_a_missing_or_wrong_token(server, http):
    async with http.get(server + "/console/api/handoffs") as resp:
        assert resp.status == 401
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    async with http.get(server + "/console/api/handoffs", headers={"Authorization": "Bearer " + TOKEN[:-1] + "x"}) as resp:
        assert resp.status == 401
    async with http.post(server + "/console/api/handoffs/0123/close", headers={"Authorization": TOKEN}) as resp:
        assert resp.status == 401  # the scheme is required
    async with http.get(server + "/console/api/handoffs", headers=AUTH) as resp:
        assert resp.status == 200
        assert isinstance((await resp.json())["handoffs"], list)


async def test_console_page_is_served_with_a_strict_content_security_policy(server, http):
    async with http.get(server + "/console") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/html"
        csp = resp.headers["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        page = await resp.text()
    assert 'src="/console/static/console.js"' in page
    assert "<script>" not in page  # no inline script: the policy would block it
    async with http.get(server + "/console/static/console.js") as resp:
        assert resp.status == 200
        js = await resp.text()
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "document.write" not in js
    async with http.get(server + "/console/static/..%2fconsole.py") as resp:
        assert resp.status == 404


async def test_api_messages_checks_its_arguments(server, http):
    async with http.get(server + "/api/messages") as resp:
        assert resp.status == 400
        assert "user_id" in (await resp.json())["error"]
    async with http.get(server + "/api/messages", params={"user_id": "u", "wait": str(MAX_WAIT_S + 1)}) as resp:
        assert resp.status == 400
    assert await _messages(http, server, "nobody-" + uuid.uuid4().hex) == {"messages": [], "handoff": False}


async def test_long_poll_answers_as_soon_as_the_agent_replies(server, http):
    user = "lp-" + uuid.uuid4().hex
    assert (await _chat(http, server, user, "转人工"))["intent"] == "handoff"
    handoff = await _handoff_of(http, server, user)
    assert handoff is not None and handoff["can_reply"] is True
    poll = asyncio.create_task(_messages(http, server, user, wait_s=10.0))
    await asyncio.sleep(0.5)
    assert not poll.done()
    start = time.monotonic()
    async with http.post(f"{server}/console/api/handoffs/{handoff['ref']}/reply", headers=AUTH,
                         json={"text": "您好，我在。"}) as resp:
        assert resp.status == 200, await resp.text()
    got = await asyncio.wait_for(poll, 10.0)
    assert time.monotonic() - start < 2.0
    assert [(m["from"], m["text"]) for m in got["messages"]] == [("agent", "您好，我在。")]
    assert got["handoff"] is True
    assert (await _messages(http, server, user))["messages"] == []  # delivered once
    async with http.post(f"{server}/console/api/handoffs/{handoff['ref']}/reply", headers=AUTH,
                         json={"text": "   "}) as resp:
        assert resp.status == 400
    async with http.post(f"{server}/console/api/handoffs/{handoff['ref']}/close", headers=AUTH) as resp:
        assert resp.status == 200
    async with http.post(f"{server}/console/api/handoffs/{handoff['ref']}/close", headers=AUTH) as resp:
        assert resp.status == 404  # already ended


async def test_an_http_user_ends_the_handoff_with_a_text_and_the_bot_answers_again(server, http):
    user = "end-" + uuid.uuid4().hex
    started = await _chat(http, server, user, "转人工")
    assert started["intent"] == "handoff" and "结束人工" in started["reply"]
    assert await _handoff_of(http, server, user) is not None
    assert (await _chat(http, server, user, "失眠怎么调理"))["reply"] == ""  # relayed to the agents
    back = await _chat(http, server, user, "结束人工")
    assert back["intent"] == "system" and "小助手" in back["reply"]
    assert await _handoff_of(http, server, user) is None  # gone from the agents' list
    assert (await _messages(http, server, user))["handoff"] is False
    answer = await _chat(http, server, user, "失眠怎么调理")
    assert answer["intent"] == "answer" and answer["reply"]


async def test_agent_answers_an_http_user_from_the_console_in_chromium(server, http, tmp_path):
    chromium = require_browser()
    from playwright.async_api import async_playwright, expect

    user = "web-" + uuid.uuid4().hex
    hostile = '<img src=x onerror="window.__xss=1">'
    first = await _chat(http, server, user, f"我最近总失眠，我的电话是13812345678 {hostile}")
    assert first["reply"]
    handing = await _chat(http, server, user, "转人工")
    assert handing["intent"] == "handoff" and "人工" in handing["reply"]

    errors: list[str] = []
    async with asyncio.timeout(120), async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            page.set_default_timeout(UI_TIMEOUT_MS)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: errors.append(msg.text) if "Content Security Policy" in msg.text else None)
            await page.goto(server + "/console")

            # A wrong token is refused and the sign-in form comes back.
            await page.fill("#token", "not-the-token-at-all")
            await page.click("#sign-in")
            await expect(page.locator("#status")).to_contain_text("令牌错误")
            await expect(page.locator("#login")).to_be_visible()

            await page.fill("#token", TOKEN)
            await page.click("#sign-in")
            entry = page.locator("#handoffs button[data-channel='http']", has_text=user[-4:])
            await expect(entry).to_have_count(1)
            await expect(entry).to_contain_text("用户请求")
            await entry.click()

            transcript = page.locator("#transcript")
            await expect(transcript).to_contain_text("失眠")
            text = await transcript.inner_text()
            assert "13812345678" not in text and "[PHONE]" in text  # masked
            assert hostile in text  # shown as text ...
            assert await transcript.locator("img").count() == 0  # ... never as markup
            assert await page.evaluate("window.__xss") is None

            await page.fill("#reply-text", "您好，我是值班护士小王。请问失眠多久了？")
            await page.click("#send")
            await expect(page.locator("#status")).to_contain_text("已发送")
            await expect(transcript.locator("li.agent")).to_contain_text("值班护士小王")

            # The agent's reply reaches the user through the HTTP API.
            got = await _messages(http, server, user, wait_s=10.0)
            assert [(m["from"], m["text"]) for m in got["messages"]] == [
                ("agent", "您好，我是值班护士小王。请问失眠多久了？")]
            assert got["handoff"] is True

            # While a person handles the chat the bot is silent, and the agent sees the message.
            during = await _chat(http, server, user, "大概三个月了，每天凌晨三点醒")
            assert during["intent"] == "handoff" and during["reply"] == ""
            await expect(transcript.locator("li.user").last).to_contain_text("三个月", timeout=10_000)
            await page.screenshot(path=str(tmp_path / "console.png"), full_page=True)

            await page.click("#close")
            await expect(page.locator("#conversation")).to_be_hidden()
            await expect(page.locator("#status")).to_contain_text("对话已结束")
            await expect(entry).to_have_count(0)
        finally:
            await browser.close()
    assert errors == []

    ended = await _messages(http, server, user, wait_s=5.0)
    assert [(m["from"], m["text"]) for m in ended["messages"]] == [("system", ENDED_TEXT["zh"])]
    assert ended["handoff"] is False
    after = await _chat(http, server, user, "失眠怎么调理")
    assert after["intent"] == "answer" and after["reply"]
