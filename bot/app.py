"""The aiohttp application: every route, and the lifecycle of the core in one cleanup context."""

from __future__ import annotations

import asyncio

from aiohttp import web

from adapters.http import setup_http
from adapters.wechat import setup_wechat
from bot.config import Config
from bot.handoff import HandoffManager
from bot.reload import watch_knowledge_base
from bot.runtime import open_dispatcher

CONFIG_KEY = web.AppKey("config", Config)
HANDOFF_KEY = web.AppKey("handoff", HandoffManager)


class _LateDispatcher:
    """Routes are added before start-up; this forwards to the dispatcher once it exists."""

    def __init__(self) -> None:
        self.target = None

    async def handle(self, inbound):
        return await self.target.handle(inbound)


def create_app(cfg: Config) -> web.Application:
    """Build the app: ``GET/POST /wechat``, ``POST /api/chat``, ``GET /healthz``, ``GET /readyz``,
    and ``POST /telegram`` when ``telegram.token`` is set.

    The model, knowledge base and inference pool are loaded in the app's cleanup
    context (start-up) and drained on shutdown.
    """
    app = web.Application(client_max_size=cfg.server.max_body_bytes)
    app[CONFIG_KEY] = cfg
    handoff = app[HANDOFF_KEY] = HandoffManager()
    dispatcher = _LateDispatcher()

    async def lifecycle(app: web.Application):
        async with open_dispatcher(cfg, handoff) as real:
            dispatcher.target = real
            watcher = None
            if cfg.knowledge.reload_interval_s > 0:
                watcher = asyncio.create_task(watch_knowledge_base(real, cfg.kb_path, cfg.knowledge.reload_interval_s))
            yield
            if watcher is not None:
                watcher.cancel()
            dispatcher.target = None

    app.cleanup_ctx.append(lifecycle)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        d = dispatcher.target
        if d is None:
            return web.json_response({"ready": False}, status=503)
        return web.json_response({"ready": True, "engine": d.retriever.encoder.engine_name, "topics": len(d.kb)})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    setup_http(app, dispatcher)
    setup_wechat(app, cfg, dispatcher)
    if cfg.telegram.token:  # POST /telegram and the bot's lifecycle (adapters/telegram.py)
        from adapters.telegram import setup_telegram
        setup_telegram(app, cfg, dispatcher, handoff)
    return app
