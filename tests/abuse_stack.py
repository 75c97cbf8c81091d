"""One aiohttp server on loopback with every input route of the bot, for the issue-21 tests
(tests/test_input_regressions.py, tests/test_fuzz.py): ``/wechat`` (plaintext, safe or
compatible mode, real wechatpy crypto), ``/telegram`` (python-telegram-bot against the
fake Bot API of tests/fake_telegram.py), ``POST /api/chat``, ``GET /api/messages`` and
the agent console's API. The model is not needed: the dispatcher is :class:`EchoDispatcher`.

Also :class:`LogWatch`, which collects what would be a problem in production logs:
every structlog event at error level or above or carrying a traceback, and every
standard-library record at ERROR or with ``exc_info`` (aiohttp's "Error handling request").
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from aiohttp.test_utils import TestServer

from adapters.telegram import constants as tc
from adapters.console import handoff_ref, setup_console
from adapters.http import setup_http
from adapters.telegram import SendPolicy, TelegramAdapter, setup_telegram
from adapters.wechat import setup_wechat
from bot.config import Config, load_config
from bot.handoff import HandoffManager
from bot.logs import ClientErrorFilter
from bot.store import MemoryStore
from bot.types import Inbound, Intent, MessageKind, Reply

try:  # tests/ is a package or a rootdir-relative folder, depending on who adds __init__.py
    from tests import wechat_client as wx
    from tests.fake_telegram import FakeBotAPI, Updates
except ImportError:  # pragma: no cover
    import wechat_client as wx  # type: ignore[no-redef]
    from fake_telegram import FakeBotAPI, Updates  # type: ignore[no-redef]

WECHAT_TOKEN = "abuse_wechat_token"
APPID = "wx0123456789abcdef"
TG_TOKEN = "123456:TEST-token"
TG_SECRET = "abuse_Webhook-secret_0123"
CONSOLE_TOKEN = "console-token-for-abuse-tests-0123456789"
HANDOFF_USER = "http-user-in-handoff"
AGENT_CHAT = -1001234567890  # the agents' forum supergroup (adapters/telegram/handoff.py's relay is on)


class EchoDispatcher:
    """Answers ``"答：<text>"`` once per (channel, user, message id); records every Inbound.
    A text starting with "人工" starts a handoff (so the console has conversations)."""

    def __init__(self, handoff: HandoffManager):
        self.handoff = handoff
        self.calls: list[Inbound] = []
        self._done: dict[tuple[str, str, str], Reply] = {}

    async def handle(self, inbound: Inbound) -> Reply:
        self.calls.append(inbound)
        key = (inbound.channel, inbound.user_id, inbound.message_id)
        if key not in self._done:
            kept = await self.handoff.store.get(self.handoff.turns_key(inbound.channel, inbound.user_id))
            await self.handoff.store.set(*self.handoff.with_turns(inbound.channel, inbound.user_id, kept,
                                                                  ("user", inbound.text)))
            if inbound.kind is MessageKind.TEXT:
                reply = Reply("答：" + inbound.text, Intent.ANSWER, inbound.lang or "zh")
            elif inbound.kind is MessageKind.UNSUPPORTED:
                reply = Reply(f"暂不支持{inbound.raw.get('type')}消息，请发文字。", Intent.SYSTEM)
            else:
                reply = Reply("", Intent.SYSTEM)
            self._done[key] = reply
        return self._done[key]


class LogWatch:
    """Collects problem log lines (see the module docstring) while active: ``with LogWatch() as w``."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self._capture = structlog.testing.LogCapture()
        self._saved: dict[str, Any] = {}
        self._handler = _ListHandler(self.problems)

    def __enter__(self) -> LogWatch:
        self._saved = structlog.get_config()
        structlog.configure(processors=[self._capture])
        logging.getLogger().addHandler(self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        structlog.configure(**self._saved)
        logging.getLogger().removeHandler(self._handler)

    def found(self) -> list[str]:
        """Every problem line so far: structlog events and standard-library records."""
        out = list(self.problems)
        for entry in self._capture.entries:
            if entry.get("log_level") in ("error", "critical", "exception") or entry.get("exc_info"):
                out.append(f"{entry.get('log_level')}: {entry.get('event')} "
                           f"{ {k: v for k, v in entry.items() if k not in ('event', 'log_level')} }")
        return out

    def events(self) -> list[dict[str, Any]]:
        return list(self._capture.entries)


class _ListHandler(logging.Handler):
    """Records as production's handler sees them: after bot.logs' :class:`ClientErrorFilter`."""

    def __init__(self, sink: list[str]):
        super().__init__(level=logging.DEBUG)
        self.sink = sink
        self.addFilter(ClientErrorFilter())

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.sink.append(f"{record.name} {record.levelname}: {record.getMessage()} exc={record.exc_info!r}")


@dataclass
class Stack:
    """The running server and what a client needs to talk to it."""

    server: TestServer
    fake_telegram: FakeBotAPI
    dispatcher: EchoDispatcher
    handoff: HandoffManager
    telegram: TelegramAdapter
    signer: wx.WechatSigner
    http: aiohttp.ClientSession
    mode: str
    updates: Updates = field(default_factory=Updates)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    @property
    def ref(self) -> str:
        """The console ref of the HTTP user in a handoff."""
        return handoff_ref(CONSOLE_TOKEN, "http", HANDOFF_USER)

    async def request(self, method: str, path: str, **kw: Any) -> tuple[int, bytes]:
        async with self.http.request(method, self.base + path, **kw) as resp:
            return resp.status, await resp.read()

    async def raw(self, data: bytes) -> tuple[int, bytes]:
        """Send ``data`` as the whole request on a fresh connection: (status, body)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.server.port)
        try:
            writer.write(data)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body

    async def close(self) -> None:
        await self.telegram.idle()
        await self.http.close()
        await self.server.close()
        await self.fake_telegram.close()


async def start_stack(mode: str = "plaintext") -> Stack:
    """Start the server (``mode``: the WeChat mode) and the fake Bot API; one HTTP user in a handoff."""
    fake = await FakeBotAPI(token=TG_TOKEN).start()
    aes_key = wx.new_aes_key()
    cfg: Config = load_config(env={
        "HEALTHBOT_TELEGRAM_TOKEN": TG_TOKEN, "HEALTHBOT_TELEGRAM_SECRET": TG_SECRET,
        "HEALTHBOT_TELEGRAM_API_BASE": fake.api_base, "HEALTHBOT_TELEGRAM_AGENT_CHAT": str(AGENT_CHAT),
        "HEALTHBOT_CONSOLE_TOKEN": CONSOLE_TOKEN,
        "HEALTHBOT_WECHAT_TOKEN": WECHAT_TOKEN, "HEALTHBOT_WECHAT_APPID": APPID,
        "HEALTHBOT_WECHAT_MODE": mode, "HEALTHBOT_WECHAT_AES_KEY": aes_key if mode != "plaintext" else ""})
    handoff = HandoffManager(MemoryStore())
    dispatcher = EchoDispatcher(handoff)
    app = web.Application()
    setup_wechat(app, cfg, dispatcher, store=MemoryStore(), handoff=handoff)

    async def no_wait(seconds: float) -> None:
        await asyncio.sleep(0)

    telegram = setup_telegram(app, cfg, dispatcher, handoff, policy=SendPolicy(max_attempts=1, sleep=no_wait))
    setup_http(app, dispatcher)
    setup_console(app, cfg, handoff)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    for _ in range(200):  # the Telegram adapter connects to the fake Bot API in the background
        if telegram.accepting:
            break
        await asyncio.sleep(0.02)
    await handoff.start("http", HANDOFF_USER, HANDOFF_USER, "user_request")
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    signer = wx.WechatSigner(token=WECHAT_TOKEN, appid=APPID, aes_key=aes_key)
    return Stack(server, fake, dispatcher, handoff, telegram, signer, http, mode,
                 Updates(bot_id=fake.bot_user["id"], bot_username=fake.bot_user["username"]))


def telegram_headers() -> dict[str, str]:
    return {tc.SECRET_HEADER: TG_SECRET, "Content-Type": "application/json"}


def console_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {CONSOLE_TOKEN}"}
