"""The aiohttp application: every route, the lifecycle of the core in one cleanup context,
and :func:`serve`, which runs it until SIGTERM and shuts it down gracefully."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

import structlog
from aiohttp import web

from adapters.console import setup_console
from adapters.http import setup_http
from adapters.wechat import setup_wechat
from bot import metrics
from bot.config import Config
from bot.handoff import HandoffManager
from bot.logs import REQUEST_ID_HEADER, request_id_from_header
from bot.reload import watch_knowledge_base
from bot.runtime import open_dispatcher

log = structlog.get_logger("healthbot.app")

CONFIG_KEY = web.AppKey("config", Config)
HANDOFF_KEY = web.AppKey("handoff", HandoffManager)

#: Longest wait for the store's ping in ``/readyz``, seconds (Kubernetes' default
#: probe ``timeoutSeconds`` is 1 s: the probe must answer well within it).
STORE_PING_TIMEOUT_S = 0.5

#: After ``server.shutdown_timeout_s`` has passed without the process exiting (a hung
#: engine call on a worker thread, a blocked event loop), :func:`serve`'s watchdog
#: ends it this many seconds later, with exit status 1.
WATCHDOG_GRACE_S = 1.0


class ServerState:
    """What a running app knows about itself (the app mapping is frozen once started).

    Attributes:
        shutting_down: set by :func:`serve` when SIGTERM/SIGINT arrives; ``/readyz``
            answers 503 from then on.
    """

    def __init__(self) -> None:
        self.shutting_down = False


STATE_KEY = web.AppKey("state", ServerState)


@web.middleware
async def request_id_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Bind ``request_id`` to every log line written while handling the request, and echo it.

    The id is the caller's ``X-Request-Id`` when well formed (a load balancer's), else
    a new one (bot/logs.py); it goes back in the response's ``X-Request-Id``. Work the
    request starts (the dispatcher's computation) inherits it through contextvars.
    """
    rid = request_id_from_header(request.headers.get(REQUEST_ID_HEADER))
    start = time.perf_counter()
    with structlog.contextvars.bound_contextvars(request_id=rid):
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            exc.headers[REQUEST_ID_HEADER] = rid
            raise
        if not response.prepared:
            response.headers[REQUEST_ID_HEADER] = rid
        log.debug("http_request", method=request.method, path=request.path, status=response.status,
                  latency_ms=round((time.perf_counter() - start) * 1000.0, 2))
        return response


class _LateDispatcher:
    """Routes are added before start-up; this forwards to the dispatcher once it exists."""

    def __init__(self) -> None:
        self.target = None

    async def handle(self, inbound):
        return await self.target.handle(inbound)

    async def forget_user(self, channel: str, user_id: str) -> None:
        await self.target.forget_user(channel, user_id)


async def readiness(dispatcher, state: ServerState) -> tuple[int, dict]:
    """``/readyz``: ``(HTTP status, body)``.

    200 when the model is loaded (the dispatcher exists) and, if the dispatcher has a
    store, the store answers its ping within :data:`STORE_PING_TIMEOUT_S`; 503 before
    start-up is done, when the store does not answer, while no inference worker process
    runs (``inference.device_processes``; they are being restarted), and once shutdown
    has begun. The body says which: ``ready``, ``model_loaded``, ``shutting_down``, and
    once loaded ``engine`` (e.g. ``"onnxruntime"``), ``topics`` (count), ``store`` (``ok`` |
    ``unreachable``) and with worker processes ``inference_processes`` (``"alive/all"``).
    """
    body: dict = {"ready": False, "model_loaded": dispatcher is not None, "shutting_down": state.shutting_down}
    if dispatcher is None:
        return 503, body
    encoder = dispatcher.retriever.encoder
    body["engine"] = encoder.engine_name
    body["topics"] = len(dispatcher.kb)
    if hasattr(encoder, "alive"):  # worker processes (inference.device_processes)
        body["inference_processes"] = f"{len(encoder.alive)}/{len(encoder.workers)}"
        if not encoder.alive:
            return 503, body
    store = getattr(dispatcher, "store", None)
    if store is not None:
        try:
            reachable = bool(await asyncio.wait_for(store.ping(), STORE_PING_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - any failure means "not reachable"
            reachable = False
        body["store"] = "ok" if reachable else "unreachable"
        if not reachable:
            return 503, body
    if state.shutting_down:
        return 503, body
    body["ready"] = True
    return 200, body


def create_app(cfg: Config) -> web.Application:
    """Build the app: ``GET/POST /wechat``, ``POST /api/chat``, ``GET /healthz``, ``GET /readyz``,
    ``GET /metrics`` (Prometheus, bot/metrics.py), and ``POST /telegram`` when
    ``telegram.token`` is set. Every response carries ``X-Request-Id``.

    The model, knowledge base and inference pool are loaded in the app's cleanup
    context (start-up) and drained on shutdown.
    """
    app = web.Application(client_max_size=cfg.server.max_body_bytes, middlewares=[request_id_middleware])
    app[CONFIG_KEY] = cfg
    state = app[STATE_KEY] = ServerState()
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
        """The process is alive and its event loop answers (liveness): always 200."""
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        """Ready for traffic (readiness): see :func:`readiness`."""
        status, body = await readiness(dispatcher.target, state)
        return web.json_response(body, status=status)

    async def metrics_page(request: web.Request) -> web.Response:
        """Every metric of bot/metrics.py in the Prometheus text format."""
        body, content_type = metrics.render(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_page)
    setup_http(app, dispatcher)
    setup_console(app, cfg, handoff)  # /console (agents), GET /api/messages, the http channel's relay
    setup_wechat(app, cfg, dispatcher, handoff=handoff)
    if cfg.telegram.token:  # POST /telegram and the bot's lifecycle (adapters/telegram.py)
        from adapters.telegram import setup_telegram
        setup_telegram(app, cfg, dispatcher, handoff)
    return app


async def serve(app: web.Application, cfg: Config, *, exit_watchdog: bool = False) -> int:
    """Serve ``app`` on ``server.host:server.port`` until SIGTERM or SIGINT, then shut down gracefully.

    Start-up loads the model before the port opens. aiohttp's access log is off (its
    request line would carry WeChat's ``openid`` and signature query); each message's
    ``reply`` line, and ``http_request`` lines at DEBUG, take its place.

    On the signal, within ``server.shutdown_timeout_s`` seconds in all:

    1. ``/readyz`` answers 503; the listening socket closes (no new connections) and
       idle keep-alive connections close;
    2. ``on_shutdown``: the WeChat adapter waits for replies still being computed;
    3. requests in flight finish and get their answers (aiohttp waits for their handlers);
    4. cleanup: Telegram finishes its queued updates, the dispatcher its computations,
       the batcher runs what is pending, the inference pool stops.

    Args:
        app: from :func:`create_app`.
        cfg: the effective config (``server.host``, ``server.port``, ``server.shutdown_timeout_s``).
        exit_watchdog: for the ``healthbot serve`` process only: if the process is still
            alive :data:`WATCHDOG_GRACE_S` after the timeout (a hung engine call, a blocked
            loop), end it with ``os._exit(1)``.

    Returns:
        0 after a clean shutdown; 1 when it took longer than the timeout (what was left is
        logged and abandoned).
    """
    timeout_s = cfg.server.shutdown_timeout_s
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=timeout_s)
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.server.host, cfg.server.port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        log.info("serving", host=cfg.server.host, port=cfg.server.port, shutdown_timeout_s=timeout_s)
        await stop.wait()
        app[STATE_KEY].shutting_down = True
        started = loop.time()
        log.info("shutdown_started", signal=received[0], timeout_s=timeout_s)
        if exit_watchdog:
            _start_exit_watchdog(timeout_s + WATCHDOG_GRACE_S)
        try:
            async with asyncio.timeout(timeout_s):
                await runner.cleanup()
        except TimeoutError:
            log.error("shutdown_timed_out", timeout_s=timeout_s,
                      hint="work still running was abandoned: raise server.shutdown_timeout_s, "
                           "or look for a hung engine or Bot API call")
            return 1
        log.info("shutdown_complete", seconds=round(loop.time() - started, 3))
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def _start_exit_watchdog(after_s: float) -> None:
    def force_exit() -> None:
        print(f"healthbot: still running {after_s:.1f} s after the shutdown signal: exiting now",
              file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(after_s, force_exit)
    timer.daemon = True
    timer.start()
