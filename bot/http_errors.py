"""Every error the HTTP server sends is JSON: ``{"error": "<what went wrong>"}``.

The shape of the HTTP API's own errors (adapters/http.py, adapters/console.py; a few add
fields, e.g. ``retry``, ``user_id`` and ``message_id`` on the chat API's 503), and the
``Error`` schema of the OpenAPI document (adapters/openapi.json). :func:`json_error` builds
one; :data:`json_errors_middleware` makes the rest the same: aiohttp's own answers (404 for
an unknown path, 405 with ``Allow`` for a wrong method, 413 for a body over
``client_max_size``), a channel's plain-text error (a webhook's 403) and an unhandled
exception (500, logged with its traceback; a handler's ``TimeoutError`` is a 504) become
``{"error": text}`` with the same status and headers.

Not covered: a request aiohttp cannot parse as HTTP at all (a malformed request line or
header) is answered by aiohttp's protocol before any middleware runs (plain text 400),
and a response already being streamed keeps its body.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable, Mapping

import structlog
from aiohttp import web

log = structlog.get_logger("healthbot.http")

__all__ = ["JSON_TYPE", "json_error", "json_errors_middleware"]

JSON_TYPE = "application/json"

#: Headers of an error that describe its old body and must not be copied to the JSON one.
_BODY_HEADERS = frozenset({"content-type", "content-length", "content-encoding", "transfer-encoding"})


def json_error(status: int, message: str, *, headers: Mapping[str, str] | None = None,
               **extra: Any) -> web.Response:
    """A ``status`` response with body ``{"error": message, **extra}`` (UTF-8 JSON, Chinese kept
    readable) and ``headers`` (e.g. ``Retry-After``, ``WWW-Authenticate``)."""
    return web.json_response({"error": message, **extra}, status=status, headers=headers,
                             dumps=lambda o: json.dumps(o, ensure_ascii=False))


def _message(response: web.Response) -> str:
    """The error text of a plain response: its body, without aiohttp's ``"404: Not Found"`` form."""
    if isinstance(response, web.HTTPMethodNotAllowed):
        return f"method {response.method} not allowed here (allowed: {', '.join(sorted(response.allowed_methods))})"
    try:
        text = (response.text or "").strip()
    except (AttributeError, UnicodeDecodeError):  # a streamed or binary payload
        text = ""
    if text == f"{response.status}: {response.reason}":
        text = ""
    return text or (response.reason or "error").lower()


def _as_json(response: web.Response) -> web.Response:
    """``response`` (status >= 400, not JSON) as a JSON error with its status and other headers."""
    headers = {k: v for k, v in response.headers.items() if k.lower() not in _BODY_HEADERS}
    out = json_error(response.status, _message(response), headers=headers)
    out.set_status(response.status, response.reason)
    return out


@web.middleware
async def json_errors_middleware(request: web.Request,
                                 handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                                 ) -> web.StreamResponse:
    """The aiohttp middleware of this module (its docstring): an error response or raised
    ``HTTPException`` that is not JSON is returned as a JSON error; other exceptions give 500."""
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects and the like
        return exc if exc.content_type == JSON_TYPE else _as_json(exc)
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client went away: nothing to answer
    except TimeoutError:
        log.warning("http.handler_timeout", method=request.method, path=request.path)
        return json_error(504, "the server did not answer in time")
    except Exception:  # noqa: BLE001 - answered as a JSON 500 and logged with its traceback
        log.exception("http.unhandled_error", method=request.method, path=request.path)
        return json_error(500, "internal server error")
    if (response.status >= 400 and isinstance(response, web.Response) and not response.prepared
            and response.content_type != JSON_TYPE):
        return _as_json(response)
    return response
