"""Plain HTTP JSON API, version 1: ``POST /api/v1/chat`` (for the local web chat, tests and
integrations), ``POST /api/v1/feedback`` (a vote on an answer), and their description,
``GET /api/v1/openapi.json``.

Paths: ``/api/v1/…`` is the versioned API; ``POST /api/chat`` (and ``GET /api/messages``,
adapters/console.py) are aliases of the same handlers, kept for clients written before
the version. The OpenAPI 3.1 document :data:`OPENAPI_FILE` (``adapters/openapi.json``,
served as it is in the repository) describes the chat, feedback and messages API, the agent
console's JSON API, ``/healthz``, ``/readyz``, ``/metrics`` and every error body;
tests/test_api_v1.py validates it and checks the real server's answers against it.

Request: ``{"text": str, "user_id": str (optional), "message_id": str (optional,
a retry with the same id gets the same reply), "lang": "zh"|"en" (optional)}``.
Response: the JSON of :meth:`bot.types.Reply.as_dict` plus ``user_id`` and ``message_id``
(a new random one when none was sent): the two ids ``POST /api/v1/feedback`` names an
answer by (:func:`feedback_handler`; intent ``answer`` only). A request
without ``user_id`` gets a new random one (``anon-<32 hex>``), so callers who send
none are never one shared user (one of them asking for a person would otherwise
hand every other to that person); send it back to continue the conversation
(follow-ups, a handoff, ``GET /api/messages``). A body that is not such a JSON
object gets 400 with an ``error`` message; a body over ``server.max_body_bytes`` gets
413 (bot/admission/middleware.py). Every error is ``{"error": str}`` JSON
(bot/http_errors.py), plus the fields named below.

Admission (bot/admission/, when the app has one): the caller's address may send
``address_per_minute`` requests and ``address_tokens_per_minute`` estimated tokens
of questions; beyond either, 429 with ``Retry-After`` and an ``error``. While the
server shuts down, a question not answered by the drain deadline gets 503 with
``Retry-After``, ``retry: true`` and its ``user_id`` and ``message_id``: sent again
with the same ids (to any replica), it gets the answer computed meanwhile or a new one.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from pathlib import Path

from aiohttp import web

from bot.admission import ADMISSION_KEY
from bot.feedback import VOTES, FeedbackBook, Outcome
from bot.store import StoreError
from bot.store.health import store_unavailable
from bot.types import Inbound, MessageKind, without_lone_surrogates

MAX_TEXT_CHARS = 2000  # longer questions are refused with 400; no channel sends more in one message
MAX_ID_CHARS = 128  # user_id and message_id: longer ones are refused with 400

API_V1 = "/api/v1"
"""The versioned API's path prefix."""

OPENAPI_FILE = Path(__file__).with_name("openapi.json")
"""The OpenAPI 3.1 document of the HTTP API, served at ``GET /api/v1/openapi.json``."""


def _dumps(obj) -> str:
    """JSON with Chinese kept readable (not \\uXXXX escapes)."""
    return json.dumps(obj, ensure_ascii=False)


def _is_id(value) -> bool:
    """A ``user_id`` / ``message_id``: a string or an integer of 1-:data:`MAX_ID_CHARS` characters."""
    return isinstance(value, (str, int)) and not isinstance(value, bool) and 0 < len(str(value)) <= MAX_ID_CHARS


def _bad_id(field: str) -> web.Response:
    return web.json_response(
        {"error": f"field '{field}' must be a string or integer of 1-{MAX_ID_CHARS} characters"}, status=400)


async def _json_object(request: web.Request) -> dict | web.Response:
    """The request's body as a JSON object, or the 400 that says why it is not one."""
    # Bytes, not request.json(): a declared charset such as ``charset=foo`` is not trusted
    # (LookupError), and JSON is UTF-8 (RFC 8259 section 8.1).
    raw = await request.read()
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return web.json_response({"error": "body is not valid UTF-8"}, status=400)
    except json.JSONDecodeError as exc:
        return web.json_response({"error": f"body is not valid JSON: {exc.msg} (character {exc.pos})"},
                                 status=400)
    except (ValueError, RecursionError):  # a 5,000-digit number; nesting deeper than the parser's stack
        return web.json_response({"error": "body is not valid JSON (a number or nesting too large)"},
                                 status=400)
    if not isinstance(body, dict):
        return web.json_response({"error": "body must be a JSON object"}, status=400)
    return body


def _too_many(what: str, wait_s: float) -> web.Response:
    seconds = max(1, math.ceil(wait_s))
    return web.json_response({"error": f"{what}: try again in {seconds} s"}, status=429,
                             headers={"Retry-After": str(seconds)})


def setup_http(app: web.Application, dispatcher, feedback: FeedbackBook | None = None) -> None:
    """Add ``POST /api/v1/chat`` (and its alias ``POST /api/chat``), answering through
    ``dispatcher.handle``, ``GET /api/v1/openapi.json`` and, with ``feedback``,
    ``POST /api/v1/feedback`` (votes on answers, :func:`feedback_handler`) to ``app``.

    Raises:
        FileNotFoundError: :data:`OPENAPI_FILE` is missing from the installation.
    """
    document = OPENAPI_FILE.read_bytes()

    async def chat(request: web.Request) -> web.Response:
        admission = request.app.get(ADMISSION_KEY)
        address = admission.client_address(request) if admission is not None else ""
        if admission is not None:
            wait = admission.check_address(address)
            if wait is not None:
                return _too_many("too many requests from this address", wait)
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body.get("text"), str):
            return web.json_response({"error": "field 'text' (string) is required"}, status=400)
        text = body["text"]
        if len(text) > MAX_TEXT_CHARS:
            return web.json_response({"error": f"text is longer than {MAX_TEXT_CHARS} characters"}, status=400)
        lang = body.get("lang")
        if lang not in (None, "zh", "en"):
            return web.json_response({"error": "field 'lang' must be 'zh' or 'en'"}, status=400)
        for field in ("user_id", "message_id"):
            if body.get(field) is not None and not _is_id(body[field]):
                return _bad_id(field)
        if admission is not None:
            wait = admission.check_address_work(address, text)
            if wait is not None:
                return _too_many("too much text from this address in the last minute", wait)
        user = str(body.get("user_id") or f"anon-{uuid.uuid4().hex}")
        inbound = Inbound(channel="http", user_id=user, chat_id=user,
                          message_id=str(body.get("message_id") or uuid.uuid4()),
                          kind=MessageKind.TEXT, text=text, lang=lang)
        if admission is None:
            reply = await dispatcher.handle(inbound)
        else:
            work = asyncio.ensure_future(dispatcher.handle(inbound))
            if not await admission.until_deadline(work):
                # Shutting down and not done: the computation goes on (its reply is kept by
                # message id if it ends before the store closes); the caller sends it again.
                admission.stats["http_retry_at_shutdown"] += 1
                return web.json_response(
                    {"error": "the server is restarting: send the same message again", "retry": True,
                     "user_id": inbound.user_id, "message_id": inbound.message_id},
                    status=503, headers={"Retry-After": "1"}, dumps=_dumps)
            reply = work.result()
        if feedback is not None:
            await feedback.offer(inbound.channel, inbound.user_id, inbound.message_id, reply)  # answers only
        return web.json_response({**reply.as_dict(), "user_id": inbound.user_id, "message_id": inbound.message_id},
                                 dumps=_dumps)

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=document, content_type="application/json", charset="utf-8")

    app.router.add_post(f"{API_V1}/chat", chat)
    app.router.add_post("/api/chat", chat)  # the alias from before the version
    app.router.add_get(f"{API_V1}/openapi.json", openapi)
    if feedback is not None:
        app.router.add_post(f"{API_V1}/feedback", feedback_handler(feedback))


def feedback_handler(feedback: FeedbackBook):
    """The handler of ``POST /api/v1/feedback``: ``{"user_id", "message_id", "vote"}`` — the ids the
    chat reply came with, ``vote`` ``"helpful"`` or ``"not_helpful"``.

    Answers 200 ``{"recorded": true, "topic", "vote"}`` for the first vote on the answer, 200
    ``{"recorded": false, "topic", "vote"}`` (the first vote, which stays) for any later one; 400 for a
    body that is not such an object; 404 when no answer of this user has this message id (only
    answers take votes, for 7 days: bot/feedback.py); 503 when the store cannot record it now.
    """

    async def vote(request: web.Request) -> web.Response:
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
        for field in ("user_id", "message_id"):
            if not _is_id(body.get(field)):
                return _bad_id(field)
        if body.get("vote") not in VOTES:
            return web.json_response({"error": f"field 'vote' must be one of: {', '.join(VOTES)}"}, status=400)
        user, message = (without_lone_surrogates(str(body[f])) for f in ("user_id", "message_id"))
        try:
            result = await feedback.vote("http", user, message, body["vote"])
        except StoreError as exc:
            store_unavailable("feedback", exc)
            return web.json_response({"error": "the vote cannot be saved right now: send it again later"},
                                     status=503, headers={"Retry-After": "5"})
        if result.outcome is Outcome.UNKNOWN:
            return web.json_response({"error": "no answer with this user_id and message_id takes a vote (only "
                                               "answers do, for 7 days after them)"}, status=404)
        return web.json_response({"recorded": result.outcome is Outcome.RECORDED, "topic": result.topic,
                                  "vote": result.vote})

    return vote
