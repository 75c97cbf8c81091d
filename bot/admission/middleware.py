"""The aiohttp side of admission control: the middleware (request counting for shutdown, the
body timeout and size check, holding the 4xx answers of failing addresses) and :func:`install`.

* **bodies**: a body still arriving ``body_timeout_s`` after its header gets 408; a
  declared ``Content-Length`` over the app's ``client_max_size`` gets 413 before
  anything is read.
* **failures** (per client address): every 4xx answer takes a token from the
  address's failure bucket (``failure_burst``, ``failure_per_minute``); once it is
  empty, each further 4xx is held ``failure_delay_s`` before it goes out. A client
  sending junk in a loop then sends about one request per ``failure_delay_s`` per
  connection, while good requests from the same address are never held.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import structlog
from aiohttp import web

from bot.admission.policy import ADMISSION_KEY, Admission

log = structlog.get_logger("healthbot.admission")

__all__ = ["FAILURE_STATUSES", "install", "make_middleware"]

#: Status codes that count as a client's failure (junk, bad signatures, unknown routes, our own 429).
FAILURE_STATUSES = frozenset({400, 401, 403, 404, 405, 408, 411, 413, 414, 415, 422, 429, 431})


def make_middleware(admission: Admission) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The aiohttp middleware: request counting (shutdown), the body timeout and size check,
    and holding 4xx answers of failing addresses (module docstring)."""

    @web.middleware
    async def admission_middleware(request: web.Request, handler) -> web.StreamResponse:
        admission.gate.request_started(request.transport)
        counted = request.method not in ("GET", "HEAD")  # messages, not long polls and probes
        if counted:
            admission.request_started()
        failed: web.HTTPException | None = None
        try:
            response = await _handle(request, handler)
        except web.HTTPException as exc:
            if exc.status not in FAILURE_STATUSES:
                raise
            failed, response = exc, exc
        finally:
            if counted:
                admission.request_finished()
        if response.status in FAILURE_STATUSES and not admission.draining:
            delay = admission.failure_delay(admission.client_address(request))
            if delay:
                await asyncio.sleep(delay)
        if failed is not None:
            raise failed
        return response

    async def _handle(request: web.Request, handler) -> web.StreamResponse:
        if request.body_exists and not request.content.is_eof():
            limit = request.client_max_size
            if request.content_length is not None and limit and request.content_length > limit:
                admission.stats["body_too_large"] += 1
                return _error(request, 413, f"body over {limit} bytes")
            try:
                await asyncio.wait_for(request.content.wait_eof(), admission.limits.body_timeout_s)
            except TimeoutError:
                admission.stats["body_timeouts"] += 1
                log.warning("admission.body_timeout", path=request.path, timeout_s=admission.limits.body_timeout_s)
                return _error(request, 408, "request body too slow")
        return await handler(request)

    def _error(request: web.Request, status: int, message: str) -> web.Response:
        headers = {"Connection": "close"}
        if request.path.startswith(("/api/", "/console/api/", "/telegram")):  # the routes that speak JSON
            return web.json_response({"error": message}, status=status, headers=headers)
        return web.Response(status=status, text=message, headers=headers)

    return admission_middleware


def install(app: web.Application, admission: Admission) -> Admission:
    """Put ``admission`` on ``app`` (not yet started): at :data:`ADMISSION_KEY`, its middleware
    after those already there, and, as the first shutdown step still to come, a wait for the
    messages being answered (:meth:`Admission.wait_idle`). Install it before the channel
    adapters (their shutdown steps follow)."""
    app[ADMISSION_KEY] = admission
    app.middlewares.append(make_middleware(admission))

    async def requests_done(_app: web.Application) -> None:
        left = await admission.wait_idle()
        if left:
            log.warning("shutdown.requests_unfinished", count=left)

    app.on_shutdown.append(requests_done)
    return admission
