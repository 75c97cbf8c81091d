"""The aiohttp side of admission control: the middleware (request counting for shutdown, the
body timeout and size check, holding the 4xx answers of failing addresses) and :func:`install`.

* **bodies**: a declared ``Content-Length`` over the app's ``client_max_size`` gets 413
  before anything is read (also when the whole body has already arrived with the
  header); a chunked body (no ``Content-Length``) gets 413 as soon as more than the
  limit has arrived; a body still arriving ``body_timeout_s`` after its header gets
  408. Each is ``{"error": …}`` JSON (bot/http_errors.py) with ``Connection: close``,
  whatever the path.
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
from aiohttp import StreamReader, web

from bot.admission.policy import ADMISSION_KEY, Admission
from bot.http_errors import json_error

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
        limit = request.client_max_size
        if request.body_exists:
            if request.content_length is not None and limit and request.content_length > limit:
                return _too_large(limit)
            if not request.content.is_eof():
                chunked = request.content_length is None  # a declared length is already within the limit
                arrived = await _wait_body(request.content, limit if chunked else 0, admission.limits.body_timeout_s)
                if arrived is None:
                    admission.stats["body_timeouts"] += 1
                    log.warning("admission.body_timeout", path=request.path,
                                timeout_s=admission.limits.body_timeout_s)
                    return _error(408, "request body too slow")
            if limit and request.content.total_bytes > limit:
                return _too_large(limit)
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:  # aiohttp's read() found more than the limit after all
            return _too_large(limit)

    def _too_large(limit: int) -> web.Response:
        admission.stats["body_too_large"] += 1
        return _error(413, f"body over {limit} bytes")

    def _error(status: int, message: str) -> web.Response:
        return json_error(status, message, headers={"Connection": "close"})

    return admission_middleware


#: How often a chunked body still arriving is measured against the limit, seconds.
CHUNKED_CHECK_S = 0.1


async def _wait_body(content: StreamReader, limit: int, timeout_s: float) -> bool | None:
    """Wait for the rest of a body: True once it has all arrived, or (``limit`` > 0, for a chunked
    body) as soon as more than ``limit`` bytes have (the caller compares ``total_bytes``); None
    when ``timeout_s`` seconds pass first. A chunked body larger than aiohttp's read buffer
    (128 KiB) stops arriving until it is read, so with a limit above that it ends in None."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (limit and content.total_bytes > limit):
        left = deadline - loop.time()
        if left <= 0:
            return None
        try:
            await asyncio.wait_for(content.wait_eof(), min(left, CHUNKED_CHECK_S) if limit else left)
            return True
        except TimeoutError:
            pass
    return True


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
