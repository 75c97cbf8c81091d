"""The agent console, and the HTTP API's way to receive an agent's replies.

Two parts, both on the same aiohttp app (:func:`setup_console`):

**The console** — a small web page for human agents (issue 10): ``GET /console``
serves plain HTML + a little vanilla JS (``adapters/console_static/``, no build
step). The page asks for the console token once (kept in the tab's
``sessionStorage``) and calls a JSON API with ``Authorization: Bearer <token>``,
compared in constant time (:func:`hmac.compare_digest`) with ``console.token``
(``HEALTHBOT_CONSOLE_TOKEN``). A bearer header rather than a cookie: a page on
another origin cannot make the browser send it, so there is nothing to forge (no
CSRF), and no CORS header is ever sent.

The JSON API is at ``/api/v1/console/…`` (the versioned HTTP API, described in
adapters/openapi.json) and, the same handlers, at ``/console/api/…`` (the page's own
paths, kept):

* ``GET  /console/api/handoffs`` — every active handoff of every channel, oldest
  first: ``{"handoffs": [{"ref", "channel", "label", "reason", "started_at",
  "last_activity", "turns", "last", "can_reply", "reply_note"}]}`` (times: UNIX s).
* ``GET  /console/api/handoffs/{ref}`` — one conversation: the same fields plus
  ``"transcript": [{"who": "user"|"bot"|"agent", "text"}]`` (masked by
  :class:`bot.handoff.HandoffManager`; the console adds nothing unmasked).
* ``POST /console/api/handoffs/{ref}/reply`` ``{"text"}`` — an agent's reply, through
  :meth:`HandoffManager.agent_message` (transcript, idle timer, the channel's notifier).
* ``POST /console/api/handoffs/{ref}/close`` — ends the handoff (``by="agent"``) and
  tells the user; the bot answers them again.

``ref`` is an opaque id, HMAC-SHA256(console token, channel + user id), so user ids
never travel to the browser; ``label`` is the channel and the last 4 characters of
the user id (as the Telegram relay names its topics). The page renders every text
with ``textContent`` (never ``innerHTML``), and its Content-Security-Policy allows
only its own script and style: a user's ``<script>`` is shown as text.

For the ``http`` channel (``POST /api/chat``, which has no agent tool of its own)
the console *is* the agents' tool: :class:`HttpAgentRelay` is that channel's
:class:`bot.handoff.AgentRelay`, and :class:`HttpOutbox` its notifier. Other
channels appear as an overview: a Telegram handoff can be answered here too (its
notifier sends the text with the bot; agents normally answer in their forum
topic), a WeChat one cannot (WeChat's own customer-service tools hold it after
``transfer_customer_service``; the reply box says so).

**Replies to HTTP-API users** — ``GET /api/v1/messages?user_id=U[&wait=S]`` (alias
``GET /api/messages``) returns and
removes what agents sent to ``U`` since the last call: ``{"messages": [{"id",
"from": "agent"|"system", "text", "at"}], "handoff": bool}`` (``handoff``: the user
is still with an agent, so keep polling). ``wait`` (seconds, 0 to
:data:`MAX_WAIT_S`, default 0) makes it a long poll: it answers as soon as a message
arrives or when ``wait`` has passed, whichever is first (and at once on shutdown).
Messages wait in the store (``outbox:http:<user_id>``, :data:`OUTBOX_TTL_S`), so the
replica that answers the poll need not be the one the agent used. Delivery is at
most once: a message is removed when a poll returns it. ``user_id`` is the only
credential, exactly as in ``POST /api/chat``: integrations should use unguessable
ids (a random UUID per user), not names or phone numbers.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from adapters.body import BodyTooLarge, read_limited
from bot.config import Config, ConfigError
from bot.handoff import HandoffManager, HandoffSession
from safety.normalize import normalize

log = structlog.get_logger("healthbot.console")

__all__ = ["setup_console", "HttpAgentRelay", "HttpOutbox", "handoff_ref", "CHANNEL", "CONSOLE_API_PREFIXES",
           "OUTBOX_KEY"]

CHANNEL = "http"
"""The channel whose agents' tool this console is (adapters/http.py's ``Inbound.channel``)."""

OUTBOX_KEY = "outbox:http:{user_id}"
"""Store list of messages waiting for an HTTP-API user (JSON items, oldest first)."""

OUTBOX_TTL_S = 24 * 3600.0
"""An unread outbox expires this long after its last message, seconds (a day: long
enough for a user to come back to the page; short, because it holds an agent's words)."""

MAX_WAIT_S = 25.0
"""Longest long poll of ``GET /api/messages``, seconds: below the 30 s at which common
proxies and load balancers give up on an idle response (nginx ``proxy_read_timeout``
is 60 s; many cloud load balancers idle out at 30 s)."""

POLL_INTERVAL_S = 0.2
"""How often a waiting long poll reads the store, seconds (the store has no
notifications): at most 5 reads a second per waiting client."""

MAX_AGENT_TEXT_CHARS = 2000
"""Longest agent reply, characters: as ``POST /api/chat`` accepts from users
(adapters/http.py ``MAX_TEXT_CHARS``); Telegram splits longer texts at 4096 itself."""

MIN_TOKEN_CHARS = 16
"""Shortest accepted ``console.token``, characters (e.g. ``openssl rand -hex 24`` gives 48)."""

MAX_USER_ID_CHARS = 128
"""Longest ``user_id`` of ``GET /api/messages``, characters (as ``POST /api/chat`` accepts)."""

MAX_REPLY_BODY_BYTES = 64 * 1024
"""Largest body of ``POST …/reply``, bytes: room for :data:`MAX_AGENT_TEXT_CHARS` characters
as JSON escapes (``\\uXXXX``, 6 bytes each) and more; a larger one is refused with 413."""

REF_RE = re.compile(r"[0-9a-f]{24}")
"""What :func:`handoff_ref` produces; any other ``ref`` is a 404 before any comparison."""

LAST_TURN_CHARS = 80
"""The list shows the last turn of each conversation cut to this many characters."""

CONSOLE_API_PREFIXES = ("/api/v1/console", "/console/api")
"""Where the console's JSON API answers: the versioned path, and the page's own (the same handlers)."""

STATIC_DIR = Path(__file__).with_name("console_static")
_STATIC_FILES = {"console.js": "text/javascript", "console.css": "text/css"}

#: Sent to every console response (page and API): no framing, no sniffing, no
#: referrer, and only this origin's own script and style.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

#: What the user is told when an agent closes the conversation (their language).
ENDED_TEXT = {
    "zh": "人工客服已结束本次对话。您可以继续向我提问；需要人工帮助时请回复“人工”。",
    "en": 'The agent has ended this conversation. You can keep asking me questions; reply "human" to reach a '
          "person again.",
}

#: Shown in the console instead of a reply box, per channel without a notifier.
REPLY_NOTES = {
    "wechat": "微信用户已转入公众号客服系统，请在微信客服工具中回复。/ WeChat users are transferred to the "
              "account's customer-service system: reply there.",
}
_DEFAULT_REPLY_NOTE = "此渠道不能从客服台回复。/ This channel cannot be answered from the console."

_OUTBOX_STOP = web.AppKey("console_outbox_stop", asyncio.Event)


def handoff_ref(token: str, channel: str, user_id: str) -> str:
    """The console's opaque id of a handoff: HMAC-SHA256(token, channel NUL user id), 24 hex characters.

    Keyed with the console token, so every replica computes the same ref and nobody
    without the token can link a ref to a user id.
    """
    return hmac.new(token.encode(), f"{channel}\0{user_id}".encode(), hashlib.sha256).hexdigest()[:24]


def _utf8(text: str) -> bytes:
    """``text`` as bytes for a comparison, whatever it holds: aiohttp keeps undecodable header
    bytes as lone surrogates, which a plain ``encode()`` refuses (UnicodeEncodeError)."""
    return text.encode("utf-8", "surrogatepass")


def _valid_user_id(user: str) -> bool:
    """1-:data:`MAX_USER_ID_CHARS` characters that UTF-8 can encode (no lone surrogates)."""
    if not 0 < len(user) <= MAX_USER_ID_CHARS:
        return False
    try:
        user.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def _json_body(request: web.Request) -> Any:
    """The request body as JSON, or None when it is not UTF-8 JSON (any declared charset is ignored:
    JSON is UTF-8, RFC 8259 section 8.1). Too deep or too large numbers count as not JSON.

    Raises:
        BodyTooLarge: over :data:`MAX_REPLY_BODY_BYTES`.
    """
    raw = await read_limited(request, MAX_REPLY_BODY_BYTES)
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None


def _label(s: HandoffSession) -> str:
    return f"{s.channel} …{s.user_id[-4:]}" if len(s.user_id) > 4 else f"{s.channel} {s.user_id}"


def _split_turn(turn: str) -> dict[str, str]:
    who, sep, text = turn.partition(": ")
    if not sep or who not in ("user", "bot", "agent"):
        return {"who": "bot", "text": turn}
    return {"who": who, "text": text}


def user_lang(s: HandoffSession) -> str:
    """``"zh"`` or ``"en"``: the language of the user's last turn in the transcript (``"zh"`` if none)."""
    for turn in reversed(s.transcript):
        item = _split_turn(turn)
        if item["who"] == "user" and item["text"].strip():
            return normalize(item["text"]).lang or "zh"
    return "zh"


def can_reply(handoff: HandoffManager, channel: str) -> bool:
    """True when ``channel`` registered a notifier, so an agent's text reaches the user.

    HandoffManager has no public accessor for this; its notifier table is read here.
    """
    return channel in getattr(handoff, "_notifiers", {})


class HttpOutbox:
    """Messages for HTTP-API users, kept in the handoff manager's store until polled.

    Args:
        handoff: the app's manager; its ``store`` is read at each call (the runtime
            replaces it with the configured store at start-up).
    """

    def __init__(self, handoff: HandoffManager):
        self.handoff = handoff

    async def push(self, user_id: str, sender: str, text: str) -> None:
        """Queue ``text`` from ``sender`` (``"agent"`` or ``"system"``) for ``user_id``."""
        item = {"id": uuid.uuid4().hex, "from": sender, "text": text, "at": round(time.time(), 3)}
        await self.handoff.store.push(OUTBOX_KEY.format(user_id=user_id), json.dumps(item, ensure_ascii=False),
                                      OUTBOX_TTL_S)

    async def take(self, user_id: str) -> list[dict[str, Any]]:
        """Remove and return every queued message of ``user_id``, oldest first."""
        out = []
        for raw in await self.handoff.store.pop_all(OUTBOX_KEY.format(user_id=user_id)):
            try:
                out.append(json.loads(raw))
            except ValueError:
                log.error("console.outbox_unreadable")
        return out

    async def notify_user(self, session: HandoffSession, text: str) -> None:
        """The ``http`` channel's notifier: an agent's ``text`` into the user's outbox."""
        await self.push(session.user_id, "agent", text)


class HttpAgentRelay:
    """The ``http`` channel's :class:`bot.handoff.AgentRelay`: agents are in the console.

    The console reads handoffs from the store, so opening and forwarding need no
    action here; an end by an agent or by timeout puts a notice in the user's outbox.
    """

    def __init__(self, outbox: HttpOutbox):
        self.outbox = outbox

    async def open(self, session: HandoffSession) -> None:
        log.info("console.handoff_waiting", channel=session.channel, reason=session.reason)

    async def forward(self, session: HandoffSession, text: str) -> None:
        return None  # already in session.transcript, which the console shows

    async def close(self, session: HandoffSession, by: str) -> None:
        if by != "user":  # the user knows they ended it
            await self.outbox.push(session.user_id, "system", ENDED_TEXT[user_lang(session)])


def _json(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, headers=SECURITY_HEADERS,
                             dumps=lambda o: json.dumps(o, ensure_ascii=False))


def setup_console(app: web.Application, cfg: Config, handoff: HandoffManager) -> None:
    """Add the console (``/console``, ``/console/api/*``) and ``GET /api/messages`` to ``app``,
    and register the ``http`` channel's relay and notifier with ``handoff``.

    With an empty ``console.token`` the console's routes answer 404 (it is off), no
    relay is registered and ``handoff.console`` stays False, so no HTTP handoff starts
    (nobody could answer it); ``GET /api/messages`` works either way.

    Raises:
        ConfigError: ``console.token`` is set but shorter than :data:`MIN_TOKEN_CHARS`.
        FileNotFoundError: the page's files are missing from the installation.
    """
    token = cfg.console.token
    if token and len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"config key 'console.token': at least {MIN_TOKEN_CHARS} characters "
                          "(e.g. openssl rand -hex 24)")
    outbox = HttpOutbox(handoff)
    # Without the console nobody can answer an HTTP handoff: no relay, so the dispatcher
    # tells the user no person is available instead of starting one (HandoffManager.reachable).
    handoff.console = bool(token)
    handoff.register(CHANNEL, HttpAgentRelay(outbox) if token else None, outbox.notify_user)
    page = (STATIC_DIR / "index.html").read_bytes()
    static = {name: (STATIC_DIR / name).read_bytes() for name in _STATIC_FILES}
    stop = app[_OUTBOX_STOP] = asyncio.Event()

    async def on_shutdown(_app: web.Application) -> None:
        stop.set()  # long polls answer now: graceful shutdown does not wait MAX_WAIT_S for them

    app.on_shutdown.append(on_shutdown)

    # ---- the HTTP API's side

    async def messages(request: web.Request) -> web.Response:
        user = request.query.get("user_id", "")
        if not user:
            return web.json_response({"error": "query parameter 'user_id' is required"}, status=400)
        if not _valid_user_id(user):
            return web.json_response({"error": f"query parameter 'user_id' must be 1-{MAX_USER_ID_CHARS} "
                                               "characters"}, status=400)
        try:
            wait_s = float(request.query.get("wait", "0"))
        except ValueError:
            wait_s = -1.0
        if not 0.0 <= wait_s <= MAX_WAIT_S:
            return web.json_response({"error": f"'wait' must be seconds between 0 and {MAX_WAIT_S:g}"}, status=400)
        deadline = time.monotonic() + wait_s
        found = await outbox.take(user)
        while not found and not stop.is_set() and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(stop.wait(), min(POLL_INTERVAL_S, max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                pass
            found = await outbox.take(user)
        in_handoff = await handoff.active(CHANNEL, user) is not None
        return web.json_response({"messages": found, "handoff": in_handoff},
                                 headers={"Cache-Control": "no-store"},
                                 dumps=lambda o: json.dumps(o, ensure_ascii=False))

    app.router.add_get("/api/v1/messages", messages)
    app.router.add_get("/api/messages", messages)  # the alias from before the version

    # ---- the console

    def authorized(request: web.Request) -> bool:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(_utf8(given.strip()), token.encode())
        if not ok:
            log.warning("console.unauthorized", remote=request.remote)
        return ok

    def guarded(handler):
        async def wrapper(request: web.Request) -> web.StreamResponse:
            if not token:
                return _json({"error": "the agent console is off: set HEALTHBOT_CONSOLE_TOKEN"}, 404)
            if not authorized(request):
                resp = _json({"error": "missing or wrong console token"}, 401)
                resp.headers["WWW-Authenticate"] = 'Bearer realm="healthbot-console"'
                return resp
            return await handler(request)
        return wrapper

    def summary(s: HandoffSession) -> dict[str, Any]:
        last = s.transcript[-1] if s.transcript else ""
        replies = can_reply(handoff, s.channel)
        return {"ref": handoff_ref(token, s.channel, s.user_id), "channel": s.channel, "label": _label(s),
                "reason": s.reason, "started_at": s.started_at, "last_activity": s.last_activity,
                "turns": len(s.transcript),
                "last": last if len(last) <= LAST_TURN_CHARS else last[:LAST_TURN_CHARS] + "…",
                "can_reply": replies,
                "reply_note": "" if replies else REPLY_NOTES.get(s.channel, _DEFAULT_REPLY_NOTE)}

    async def find(request: web.Request) -> HandoffSession | None:
        ref = request.match_info["ref"]
        if not REF_RE.fullmatch(ref):  # a ref handoff_ref could not have made (non-ASCII would fail the compare)
            return None
        for s in await handoff.sessions():
            if hmac.compare_digest(handoff_ref(token, s.channel, s.user_id), ref):
                return s
        return None

    gone = {"error": "this conversation has ended or does not exist"}

    async def index(request: web.Request) -> web.Response:
        if not token:
            return web.Response(status=404, text="the agent console is off: set HEALTHBOT_CONSOLE_TOKEN")
        return web.Response(body=page, content_type="text/html", charset="utf-8", headers=SECURITY_HEADERS)

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if not token or name not in static:
            raise web.HTTPNotFound()
        return web.Response(body=static[name], content_type=_STATIC_FILES[name], charset="utf-8",
                            headers=SECURITY_HEADERS)

    async def list_handoffs(request: web.Request) -> web.Response:
        return _json({"handoffs": [summary(s) for s in await handoff.sessions()]})

    async def show(request: web.Request) -> web.Response:
        s = await find(request)
        if s is None:
            return _json(gone, 404)
        return _json({**summary(s), "transcript": [_split_turn(t) for t in s.transcript]})

    async def reply(request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
        except BodyTooLarge:
            return _json({"error": f"body over {MAX_REPLY_BODY_BYTES} bytes"}, 413)
        text = body.get("text") if isinstance(body, dict) else None
        if not isinstance(text, str) or not text.strip():
            return _json({"error": "field 'text' (a non-empty string) is required"}, 400)
        if len(text) > MAX_AGENT_TEXT_CHARS:
            return _json({"error": f"text is longer than {MAX_AGENT_TEXT_CHARS} characters"}, 400)
        s = await find(request)
        if s is None:
            return _json(gone, 404)
        if not can_reply(handoff, s.channel):
            return _json({"error": REPLY_NOTES.get(s.channel, _DEFAULT_REPLY_NOTE)}, 409)
        try:
            await handoff.agent_message(s, text.strip())
        except Exception as exc:  # noqa: BLE001 - the channel's notifier failed: tell the agent
            log.warning("console.delivery_failed", channel=s.channel, error=type(exc).__name__)
            return _json({"error": f"not delivered to the user ({type(exc).__name__}); try again"}, 502)
        log.info("console.agent_reply", channel=s.channel, chars=len(text))
        return _json({"ok": True})

    async def close(request: web.Request) -> web.Response:
        s = await find(request)
        if s is None:
            return _json(gone, 404)
        ended = await handoff.end(s.channel, s.user_id, by="agent")
        if ended is None:
            return _json(gone, 404)
        if s.channel != CHANNEL and can_reply(handoff, s.channel):  # the http relay's close told the user
            try:
                await handoff.agent_message(ended, ENDED_TEXT[user_lang(ended)])
            except Exception as exc:  # noqa: BLE001 - ended all the same
                log.warning("console.end_notice_failed", channel=s.channel, error=type(exc).__name__)
        log.info("console.closed", channel=s.channel)
        return _json({"ok": True})

    app.router.add_get("/console", index)
    app.router.add_get("/console/static/{name}", asset)
    for api in CONSOLE_API_PREFIXES:
        app.router.add_get(f"{api}/handoffs", guarded(list_handoffs))
        app.router.add_get(f"{api}/handoffs/{{ref}}", guarded(show))
        app.router.add_post(f"{api}/handoffs/{{ref}}/reply", guarded(reply))
        app.router.add_post(f"{api}/handoffs/{{ref}}/close", guarded(close))
