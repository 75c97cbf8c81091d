"""``GET /metrics`` (Prometheus text, bot/metrics.py): on the API's port or its own, open or
behind a bearer token.

* ``server.metrics_port`` (``HEALTHBOT_SERVER_METRICS_PORT``): 0 (the default) serves
  ``/metrics`` on ``server.port`` beside the API, as before; any other port serves it
  there alone (``server.host``, a separate listener opened after the model has loaded and
  closed at shutdown), and the API's port answers ``/metrics`` with 404. A firewall or a
  Kubernetes NetworkPolicy can then keep the metrics off the public port.
* ``server.metrics_token`` (secret, ``HEALTHBOT_SERVER_METRICS_TOKEN``): empty (the
  default) = open; else every scrape must send ``Authorization: Bearer <token>``
  (Prometheus: ``authorization: {credentials: …}`` in the scrape config), compared in
  constant time; anything else gets 401 ``{"error": …}`` with ``WWW-Authenticate``.
* ``server.processes`` (bot/prefork.py): with several front-end processes, each serves the
  sum over all of them (prometheus-client's multiprocess mode, ``inference.metrics.render``),
  and they share the metrics port as they share ``server.port`` (``SO_REUSEPORT``).
"""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable

import structlog
from aiohttp import web

from bot import metrics
from bot.config import ServerConfig
from bot.http_errors import json_error, json_errors_middleware

log = structlog.get_logger("healthbot.metrics")

__all__ = ["METRICS_PATH", "bearer_ok", "metrics_handler", "setup_metrics"]

METRICS_PATH = "/metrics"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def bearer_ok(request: web.Request, token: str) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <token>``, compared in constant time."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    # surrogatepass: aiohttp keeps undecodable header bytes as lone surrogates
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "surrogatepass"),
                                                              token.encode("utf-8"))


def metrics_handler(token: str = "") -> Handler:
    """The ``GET /metrics`` handler: every metric in the Prometheus text format (OpenMetrics when
    the scraper's ``Accept`` asks for it); with a non-empty ``token``, only for
    ``Authorization: Bearer <token>`` (else 401 JSON)."""

    async def metrics_page(request: web.Request) -> web.Response:
        if token and not bearer_ok(request, token):
            log.warning("metrics.unauthorized", remote=request.remote)
            return json_error(401, "missing or wrong metrics token",
                              headers={"WWW-Authenticate": 'Bearer realm="healthbot-metrics"'})
        body, content_type = metrics.render(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    return metrics_page


def setup_metrics(app: web.Application, server: ServerConfig) -> None:
    """Serve ``GET /metrics`` for ``app`` as ``server.metrics_port`` and ``server.metrics_token`` say
    (module docstring). Call before ``app`` starts; with a port of its own, the listener is part
    of ``app``'s cleanup contexts (add this after the one that loads the model).

    Raises (at start-up):
        OSError: the metrics port cannot be bound (in use, no permission).
    """
    handler = metrics_handler(server.metrics_token)
    if not server.metrics_port:
        app.router.add_get(METRICS_PATH, handler)
        return

    async def metrics_listener(_app: web.Application):
        side = web.Application(middlewares=[json_errors_middleware])
        side.router.add_get(METRICS_PATH, handler)
        runner = web.AppRunner(side, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            # several front-end processes (server.processes) share the port: each serves the sum
            await web.TCPSite(runner, server.host, server.metrics_port,
                              reuse_port=server.processes != 1 or None).start()
        except BaseException:
            await runner.cleanup()
            raise
        log.info("metrics_serving", host=server.host, port=server.metrics_port,
                 token=bool(server.metrics_token))
        try:
            yield
        finally:
            await runner.cleanup()

    app.cleanup_ctx.append(metrics_listener)
