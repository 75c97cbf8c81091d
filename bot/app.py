"""The aiohttp application: every route, the lifecycle of the core in one cleanup context,
and :func:`serve`, which runs it until SIGTERM and shuts it down gracefully."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from typing import Callable

import structlog
from aiohttp import web

from adapters.console import setup_console
from adapters.http import setup_http
from adapters.wechat import setup_wechat
from bot.admission import ADMISSION_KEY, Admission, GatedTCPSite, install, raise_fd_limit
from bot.config import Config
from bot.dedup import ReplayRefused
from bot.feedback import FeedbackBook
from bot.handoff import HandoffManager
from bot.http_errors import json_errors_middleware
from bot.logs import REQUEST_ID_HEADER, request_id_from_header
from bot.metrics_endpoint import setup_metrics
from bot.model_reload import ModelReloader, read_manifest, setup_admin
from bot.reload import watch_knowledge_base
from bot.runtime import open_dispatcher
from bot.store.health import check_store

log = structlog.get_logger("healthbot.app")

CONFIG_KEY = web.AppKey("config", Config)
HANDOFF_KEY = web.AppKey("handoff", HandoffManager)
MODEL_RELOADER_KEY = web.AppKey("model_reloader", ModelReloader)

#: Longest wait for the store's ping in ``/readyz``, seconds (Kubernetes' default
#: probe ``timeoutSeconds`` is 1 s: the probe must answer well within it).
STORE_PING_TIMEOUT_S = 0.5

#: After ``server.shutdown_timeout_s`` has passed without the process exiting (a hung
#: engine call on a worker thread, a blocked event loop), :func:`serve`'s watchdog
#: ends it this many seconds later, with exit status 1.
WATCHDOG_GRACE_S = 1.0

#: Seconds of ``server.shutdown_timeout_s`` kept for the last steps of a shutdown (unfinished
#: WeChat answers handed to the store, the store and the inference pool closed): routes and
#: deliveries must be done by ``shutdown_timeout_s - SHUTDOWN_RESERVE_S`` after the signal
#: (at most half of the timeout is kept back).
SHUTDOWN_RESERVE_S = 1.5


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
    """Routes are added before start-up; this forwards to the dispatcher once it exists,
    through the app's admission control (bot/admission/policy.py: the per-user work budget and
    the window on long questions, whose reply then says so)."""

    def __init__(self, admission: Admission | None = None) -> None:
        self.target = None
        self.admission = admission

    @property
    def replay_store(self):
        """The store where the dispatcher records ``Inbound.replay_record`` with its claim (bot/dedup.py)."""
        return getattr(self.target, "replay_store", None)

    async def handle(self, inbound):
        target = self.target
        if self.admission is None:
            return await target.handle(inbound)
        handoff = getattr(target, "handoff", None)

        async def in_handoff() -> bool:
            try:
                return await handoff.active(inbound.channel, inbound.user_id) is not None
            except Exception:  # noqa: BLE001 - the store is down: treat as no handoff
                return False

        decision = await self.admission.admit(inbound, in_handoff if handoff is not None else None)
        if decision.refusal is not None:
            if inbound.replay_record is not None:  # refused before the claim that records it: recorded now
                await target.exactly_once.check_record(inbound)
            return decision.refusal
        try:
            reply = await target.handle(decision.inbound)
        except ReplayRefused:
            self.admission.refund(inbound, decision)
            raise
        return Admission.noted(reply, inbound.text) if decision.windowed else reply

    async def forget_user(self, channel: str, user_id: str) -> None:
        await self.target.forget_user(channel, user_id)


async def readiness(dispatcher, state: ServerState, model: dict | None = None) -> tuple[int, dict]:
    """``/readyz``: ``(HTTP status, body)``.

    200 when the model is loaded (the dispatcher exists) and, if the dispatcher has a
    store, the store reads and writes within :data:`STORE_PING_TIMEOUT_S`
    (:func:`bot.store.health.check_store`: its ``health()`` probe, else its ping); 503 before
    start-up is done, when the store does not answer or cannot write (disk full, read-only
    database: replies still go out, without the store), while no inference worker process
    runs (``inference.device_processes``; they are being restarted), and once shutdown
    has begun. The body says which: ``ready``, ``model_loaded``, ``shutting_down``, and
    once loaded ``engine`` (e.g. ``"onnxruntime"``), ``topics`` (count), ``store`` (``ok`` |
    ``unwritable`` | ``unreachable``), with worker processes ``inference_processes`` (``"alive/all"``),
    and ``model`` when given: the version serving (bot/model_reload.py ``ModelVersion``).
    """
    body: dict = {"ready": False, "model_loaded": dispatcher is not None, "shutting_down": state.shutting_down}
    if dispatcher is None:
        return 503, body
    encoder = dispatcher.retriever.encoder
    body["engine"] = encoder.engine_name
    body["topics"] = len(dispatcher.kb)
    if model is not None:
        body["model"] = model
    if hasattr(encoder, "alive"):  # worker processes (inference.device_processes)
        body["inference_processes"] = f"{len(encoder.alive)}/{len(encoder.workers)}"
        if not encoder.alive:
            return 503, body
    store = getattr(dispatcher, "store", None)
    if store is not None:
        body["store"] = await check_store(store, STORE_PING_TIMEOUT_S)
        if body["store"] != "ok":
            return 503, body
    if state.shutting_down:
        return 503, body
    body["ready"] = True
    return 200, body


def create_app(cfg: Config) -> web.Application:
    """Build the app: ``GET/POST /wechat``, the HTTP API (``POST /api/v1/chat``, ``POST /api/v1/feedback``,
    ``GET /api/v1/messages``, ``GET /api/v1/openapi.json``; ``/api/chat`` and ``/api/messages`` are
    aliases: adapters/http.py), the agent console (adapters/console.py), ``GET /healthz``,
    ``GET /readyz``, ``GET /metrics`` (Prometheus, bot/metrics.py; on ``server.metrics_port``
    when set, behind ``server.metrics_token`` when set: bot/metrics_endpoint.py), and
    ``POST /telegram`` when ``telegram.token`` is set. Every response carries ``X-Request-Id``;
    every error is JSON, ``{"error": …}`` (bot/http_errors.py).

    The model, knowledge base and inference pool are loaded in the app's cleanup
    context (start-up) and drained on shutdown. Admission control (bot/admission/,
    at :data:`~bot.admission.ADMISSION_KEY`) is in front of the dispatcher and in the
    middleware: the window on long questions, per-user and per-address budgets, held
    4xx answers for failing addresses, the body timeout, and the shutdown's drain deadline.
    """
    app = web.Application(client_max_size=cfg.server.max_body_bytes,
                          middlewares=[request_id_middleware, json_errors_middleware])
    app[CONFIG_KEY] = cfg
    # Admission control (bot/admission/) before the channels: its middleware, and its wait
    # for the messages being answered as the first shutdown step.
    admission = install(app, Admission(cfg.admission, safety=cfg.safety))
    state = app[STATE_KEY] = ServerState()
    handoff = app[HANDOFF_KEY] = HandoffManager()
    feedback = FeedbackBook()  # votes on answers (bot/feedback.py), on the core's store once it starts
    dispatcher = _LateDispatcher(admission)
    reloader = app[MODEL_RELOADER_KEY] = ModelReloader(cfg)  # new model versions (bot/model_reload.py)

    async def lifecycle(app: web.Application):
        loaded = read_manifest(cfg.engines_path)  # the version open_dispatcher loads
        async with open_dispatcher(cfg, handoff, drain_deadline=lambda: admission.drain_deadline) as real:
            dispatcher.target, feedback.store = real, real.store
            reloader.attach(real, loaded)
            watchers = []
            if cfg.knowledge.reload_interval_s > 0:
                watchers.append(asyncio.create_task(watch_knowledge_base(real, cfg.kb_path,
                                                                         cfg.knowledge.reload_interval_s, reloader.lock)))
            if cfg.inference.reload_interval_s > 0:
                watchers.append(asyncio.create_task(reloader.watch(cfg.inference.reload_interval_s)))
            yield
            for watcher in watchers:
                watcher.cancel()
            await reloader.close()
            dispatcher.target = None

    app.cleanup_ctx.append(lifecycle)

    async def healthz(request: web.Request) -> web.Response:
        """The process is alive and its event loop answers (liveness): always 200."""
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        """Ready for traffic (readiness): see :func:`readiness`."""
        serving = reloader.serving
        status, body = await readiness(dispatcher.target, state, serving.as_dict() if serving else None)
        return web.json_response(body, status=status)

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    setup_metrics(app, cfg.server)  # after the model's cleanup context: a port of its own opens once loaded
    setup_http(app, dispatcher, feedback)
    setup_admin(app, cfg.server.admin_token, reloader)  # POST /api/v1/admin/engine/reload
    setup_console(app, cfg, handoff)  # /console (agents), GET /api/messages, the http channel's relay
    setup_wechat(app, cfg, dispatcher, handoff=handoff, feedback=feedback)
    if cfg.telegram.token:  # POST /telegram and the bot's lifecycle (adapters/telegram/adapter.py)
        from adapters.telegram import setup_telegram
        setup_telegram(app, cfg, dispatcher, handoff, feedback=feedback)
    return app


async def start_server(app: web.Application, cfg: Config) -> tuple[web.AppRunner, web.BaseSite]:
    """Start ``app`` (its cleanup contexts: the model loads) and open ``server.host:server.port``.

    The server's limits: aiohttp's ``keepalive_timeout`` (idle time between requests),
    ``client_max_size`` (``server.max_body_bytes``, set by :func:`create_app`) and a 2 s
    lingering close; this process's soft file-descriptor limit raised to its hard limit;
    with the app's :class:`~bot.admission.Admission`, every connection passes its
    :class:`~bot.admission.ConnectionGate` (a cap on open connections, in all and per
    address, and a header timeout). The site's ``port`` is the bound port (``server.port``
    0 picks a free one). With ``server.processes`` other than 1 (a front-end process of
    bot/prefork.py) the port is bound with ``SO_REUSEPORT``, shared with the other processes.
    """
    timeout_s = cfg.server.shutdown_timeout_s
    admission = app.get(ADMISSION_KEY)
    limits = admission.limits if admission is not None else cfg.admission
    shared = cfg.server.processes != 1
    raise_fd_limit()
    # Handlers still running after the drain (long polls) get a third of the reserve
    # before aiohttp cancels them (bot/app.py shut_down).
    runner = web.AppRunner(app, handle_signals=False, access_log=None,
                           shutdown_timeout=_reserve(timeout_s) / 3 if admission is not None else timeout_s,
                           keepalive_timeout=limits.keepalive_timeout_s, lingering_time=2.0)
    await runner.setup()
    try:
        if admission is not None:
            admission.gate.refresh_cap()  # the file-descriptor limit was just raised
            site: web.BaseSite = GatedTCPSite(runner, cfg.server.host, cfg.server.port, admission.gate,
                                              reuse_port=shared)
        else:
            site = web.TCPSite(runner, cfg.server.host, cfg.server.port, reuse_port=shared or None)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site


def _reserve(timeout_s: float) -> float:
    return min(SHUTDOWN_RESERVE_S, timeout_s / 2)


async def shut_down(app: web.Application, runner: web.AppRunner, timeout_s: float) -> bool:
    """The graceful shutdown of a server from :func:`start_server`, within ``timeout_s`` seconds.

    In order (the drain deadline is ``timeout_s`` - :data:`SHUTDOWN_RESERVE_S` from now):

    1. ``/readyz`` answers 503; the listening socket closes (no new connections) and
       idle keep-alive connections close;
    2. ``on_shutdown``: messages being answered (POST requests) finish, until the drain
       deadline: WeChat webhooks answer by then (``success`` when late), an HTTP-API
       question not answered by then gets 503 "send it again" with its ids
       (adapters/http.py); then the WeChat adapter delivers late answers until the
       deadline and hands what is left to the store: messages still computing to
       ``wechat:unfinished`` (the next process answers them), unsent pages to the
       user's pending queue;
    3. handlers still open (long polls) get a moment, then are cancelled;
    4. cleanup, in reverse order of start-up: Telegram finishes its queued updates,
       the WeChat adapter closes its store, the dispatcher waits for its computations
       until the deadline, the batcher runs what is pending, the inference pool stops
       and, last, the store closes.

    Returns:
        True after a clean shutdown; False when it took longer than ``timeout_s`` (what
        was left is logged and abandoned).
    """
    loop = asyncio.get_running_loop()
    admission = app.get(ADMISSION_KEY)
    state = app.get(STATE_KEY)
    if state is not None:
        state.shutting_down = True
    started = loop.time()
    if admission is not None:
        admission.begin_drain(started + timeout_s - _reserve(timeout_s))
    try:
        async with asyncio.timeout(timeout_s):
            await runner.cleanup()
    except TimeoutError:
        log.error("shutdown_timed_out", timeout_s=timeout_s,
                  hint="work still running was abandoned: raise server.shutdown_timeout_s, "
                       "or look for a hung engine or Bot API call")
        return False
    log.info("shutdown_complete", seconds=round(loop.time() - started, 3),
             admission=dict(admission.stats) if admission is not None else None)
    return True


def ready_line(cfg: Config) -> str:
    """The line ``healthbot serve`` prints once it answers (the model loaded, the port open): its
    address, the routes open, and the channels left off for want of their secrets, e.g.
    ``healthbot ready: http://127.0.0.1:8080 (POST /api/v1/chat, …; not configured: WeChat, …)``."""
    routes = ["POST /api/v1/chat", "API document /api/v1/openapi.json"]
    off = []
    for name, secret, route in (("WeChat", cfg.wechat.token, "/wechat"), ("Telegram", cfg.telegram.token, "/telegram"),
                                ("agent console", cfg.console.token, "/console")):
        if secret:
            routes.append(f"{name} {route}")
        else:
            off.append(name)
    metrics = f"/metrics on port {cfg.server.metrics_port}" if cfg.server.metrics_port else "/metrics"
    left = f"; not configured: {', '.join(off)}" if off else ""
    return f"healthbot ready: http://{cfg.server.host}:{cfg.server.port} ({', '.join(routes)}, /healthz, /readyz, {metrics}{left})"


async def serve(app: web.Application, cfg: Config, *, exit_watchdog: bool = False,
                on_serving: Callable[[], None] | None = None) -> int:
    """Serve ``app`` on ``server.host:server.port`` until SIGTERM or SIGINT, then shut down gracefully.

    Start-up loads the model before the port opens (:func:`start_server`). aiohttp's
    access log is off (its request line would carry WeChat's ``openid`` and signature
    query); each message's ``reply`` line, and ``http_request`` lines at DEBUG, take its
    place. On the signal: :func:`shut_down`, within ``server.shutdown_timeout_s`` seconds.

    Args:
        app: from :func:`create_app`.
        cfg: the effective config (``server.host``, ``server.port``, ``server.shutdown_timeout_s``).
        exit_watchdog: for the ``healthbot serve`` process only: if the process is still
            alive :data:`WATCHDOG_GRACE_S` after the timeout (a hung engine call, a blocked
            loop), end it with ``os._exit(1)``.
        on_serving: called once the port is open (a front-end process of bot/prefork.py tells
            its master).

    Returns:
        0 after a clean shutdown; 1 when it took longer than the timeout (what was left is
        logged and abandoned).
    """
    timeout_s = cfg.server.shutdown_timeout_s
    runner, _site = await start_server(app, cfg)
    admission = app.get(ADMISSION_KEY)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        log.info("serving", host=cfg.server.host, port=cfg.server.port, shutdown_timeout_s=timeout_s,
                 max_connections=admission.gate.cap if admission is not None else None,
                 metrics_port=cfg.server.metrics_port or cfg.server.port)
        if on_serving is not None:  # a front end of several: its master prints the ready line
            on_serving()
        else:
            print(ready_line(cfg), file=sys.stderr, flush=True)
        await stop.wait()
        log.info("shutdown_started", signal=received[0], timeout_s=timeout_s)
        if exit_watchdog:
            _start_exit_watchdog(timeout_s + WATCHDOG_GRACE_S)
        return 0 if await shut_down(app, runner, timeout_s) else 1
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
