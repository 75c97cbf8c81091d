"""A fake Telegram Bot API server on loopback (aiohttp), for python-telegram-bot's real client.

Speaks the part of https://core.telegram.org/bots/api the bot uses: getMe,
sendMessage, forwardMessage, copyMessage, answerCallbackQuery, editMessageReplyMarkup, setMyCommands,
createForumTopic, closeForumTopic, reopenForumTopic, deleteForumTopic,
setWebhook, deleteWebhook, getWebhookInfo and getUpdates. Requests are recorded
(:attr:`FakeBotAPI.calls`); answers follow the Bot API's envelope
(``{"ok": true, "result": ...}`` / ``{"ok": false, "error_code", "description",
"parameters"}``) so the client raises its real exceptions (RetryAfter, Forbidden,
BadRequest).

Behaviour that mirrors Telegram (descriptions as the Bot API returns them):

* sendMessage with ``parse_mode=HTML`` checks the markup: an unknown tag or a bare
  ``&`` → 400 "Bad Request: can't parse entities: ..."; a text longer than 4096
  characters after entity parsing → 400 "Bad Request: message is too long"; an
  empty text → 400 "Bad Request: message text is empty".
* a chat marked with :meth:`FakeBotAPI.block` → 403 "Forbidden: bot was blocked by
  the user".
* a topic marked with :meth:`FakeBotAPI.delete_topic` → 400 "Bad Request: message
  thread not found"; closing a closed topic / reopening an open one → 400
  "Bad Request: TOPIC_NOT_MODIFIED".

Scripted failures: :meth:`FakeBotAPI.fail` answers the next N calls of a method
(optionally only those matching a predicate) with a given status, e.g. 429 with
``retry_after``.

Also here: :class:`Updates`, builders of update JSON as Telegram sends it.
"""

from __future__ import annotations

import asyncio
import html
import itertools
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web
from aiohttp.test_utils import TestServer

MAX_TEXT = 4096  # Bot API sendMessage: "1-4096 characters after entities parsing"
_JSON_PARAMS = {"reply_parameters", "reply_markup", "link_preview_options", "allowed_updates", "commands",
                "entities", "scope"}
_INT_PARAMS = {"chat_id", "from_chat_id", "message_id", "message_thread_id", "offset", "limit", "timeout",
               "max_connections"}
_ALLOWED_TAGS = {"b", "strong", "i", "em", "u", "ins", "s", "strike", "del", "a", "code", "pre", "blockquote",
                 "tg-spoiler", "span", "tg-emoji"}
_TAG = re.compile(r"</?([a-zA-Z][\w-]*)(\s[^<>]*)?>")
_ENTITY = re.compile(r"&(lt|gt|amp|quot|#\d+|#x[0-9a-fA-F]+);")


@dataclass
class Call:
    """One recorded Bot API request: method name, decoded parameters, arrival time (monotonic s)."""

    method: str
    params: dict[str, Any]
    at: float


@dataclass
class _Script:
    method: str
    status: int
    description: str
    retry_after: int | float | None
    times: int
    match: Callable[[dict[str, Any]], bool] | None


def _html_to_text(text: str) -> str:
    """What Telegram would display for an HTML-mode text; raises ValueError like its parser."""
    pos = 0
    out = []
    while pos < len(text):
        ch = text[pos]
        if ch == "<":
            m = _TAG.match(text, pos)
            if not m or m.group(1).lower() not in _ALLOWED_TAGS:
                raise ValueError(f"Unsupported start tag at byte offset {pos}")
            pos = m.end()
            continue
        if ch == "&":
            m = _ENTITY.match(text, pos)
            if not m:
                raise ValueError(f"Character entity expected at byte offset {pos}")
            out.append(html.unescape(m.group(0)))
            pos = m.end()
            continue
        out.append(ch)
        pos += 1
    return "".join(out)


class FakeBotAPI:
    """The fake server. Start with ``await fake.start()``; point the bot at :attr:`api_base`.

    Args:
        token: the bot token the URLs must carry.
        bot_id / username: what getMe answers.
    """

    def __init__(self, token: str = "123456:TEST-token", bot_id: int = 123456,
                 username: str = "healthbot_test_bot"):
        self.token = token
        self.bot_user = {"id": bot_id, "is_bot": True, "first_name": "Healthbot", "username": username,
                         "can_join_groups": True, "can_read_all_group_messages": False,
                         "supports_inline_queries": False}
        self.calls: list[Call] = []
        self._scripts: list[_Script] = []
        self._ids = itertools.count(1000)
        self._threads = itertools.count(700)
        self.blocked: set[int] = set()
        self.topics: dict[int, dict[str, Any]] = {}  # thread id -> {"name", "closed", "deleted", "chat_id"}
        self.pending_updates: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.webhook: dict[str, Any] = {}
        self._changed = asyncio.Event()
        self.server: TestServer | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> "FakeBotAPI":
        app = web.Application()
        app.router.add_post("/bot{token}/{method}", self._handle)
        app.router.add_get("/bot{token}/{method}", self._handle)
        self.server = TestServer(app, host="127.0.0.1", port=0)
        await self.server.start_server()
        return self

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    @property
    def api_base(self) -> str:
        """The ``base_url`` for python-telegram-bot (it appends the token)."""
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}/bot"

    # ------------------------------------------------------------------ test controls

    def fail(self, method: str, status: int, description: str, *, retry_after: int | float | None = None,
             times: int = 1, match: Callable[[dict[str, Any]], bool] | None = None) -> None:
        """Answer the next ``times`` calls of ``method`` (matching ``match``) with an error."""
        self._scripts.append(_Script(method, status, description, retry_after, times, match))

    def block(self, chat_id: int) -> None:
        """Every send to ``chat_id`` answers 403 (the user blocked the bot)."""
        self.blocked.add(int(chat_id))

    def delete_topic(self, thread_id: int) -> None:
        """The topic is gone, as when an admin deletes it: posts into it answer 400."""
        self.topics.setdefault(thread_id, {})["deleted"] = True

    def push_update(self, update: dict[str, Any]) -> None:
        """Queue an update for getUpdates (polling)."""
        self.pending_updates.put_nowait(update)

    def calls_to(self, method: str, **where: Any) -> list[Call]:
        """Recorded calls of ``method`` whose params equal ``where`` (e.g. ``chat_id=42``)."""
        return [c for c in self.calls if c.method == method
                and all(c.params.get(k) == v for k, v in where.items())]

    def texts_to(self, chat_id: int, thread_id: int | None = None) -> list[str]:
        """Texts of sendMessage calls to ``chat_id`` (and topic) that succeeded, in order, as shown
        to the user (HTML unescaped)."""
        out = []
        for c in self.calls:
            if c.method == "sendMessage" and c.params.get("chat_id") == chat_id and c.params.get("_ok") \
                    and (thread_id is None or c.params.get("message_thread_id") == thread_id):
                out.append(c.params["_shown"])
        return out

    async def wait_for(self, predicate: Callable[[], Any], timeout: float = 5.0) -> Any:
        """Wait until ``predicate()`` is truthy (re-checked after every call); its value.

        Raises:
            AssertionError: not within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"condition not met within {timeout} s; calls: "
                                     f"{[(c.method, c.params.get('chat_id')) for c in self.calls]}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, 0.05))
            except TimeoutError:
                pass

    # ------------------------------------------------------------------ the API

    @staticmethod
    def _decode(form: dict[str, str]) -> dict[str, Any]:
        params: dict[str, Any] = {}
        for key, value in form.items():
            if key in _JSON_PARAMS:
                params[key] = json.loads(value)
            elif key in _INT_PARAMS:
                try:
                    params[key] = int(value)
                except ValueError:
                    params[key] = value
            else:
                params[key] = value
        return params

    def _scripted(self, method: str, params: dict[str, Any]) -> web.Response | None:
        for script in self._scripts:
            if script.method == method and script.times > 0 and (script.match is None or script.match(params)):
                script.times -= 1
                body: dict[str, Any] = {"ok": False, "error_code": script.status, "description": script.description}
                if script.retry_after is not None:
                    body["parameters"] = {"retry_after": script.retry_after}
                return web.json_response(body, status=script.status)
        return None

    @staticmethod
    def _error(status: int, description: str) -> web.Response:
        return web.json_response({"ok": False, "error_code": status, "description": description}, status=status)

    @staticmethod
    def _ok(result: Any) -> web.Response:
        return web.json_response({"ok": True, "result": result})

    def _message(self, chat_id: int, **fields: Any) -> dict[str, Any]:
        chat_type = "private" if chat_id > 0 else "supergroup"
        msg = {"message_id": next(self._ids), "date": int(time.time()), "chat": {"id": chat_id, "type": chat_type},
               "from": self.bot_user}
        msg.update({k: v for k, v in fields.items() if v is not None})
        return msg

    async def _handle(self, request: web.Request) -> web.Response:
        if request.match_info["token"] != self.token:
            return self._error(401, "Unauthorized")
        method = request.match_info["method"]
        form = dict(await request.post()) if request.method == "POST" else dict(request.query)
        params = self._decode({k: str(v) for k, v in form.items()})
        call = Call(method, params, time.monotonic())
        self.calls.append(call)
        try:
            if method == "getUpdates":
                return await self._get_updates(params)
            scripted = self._scripted(method, params)
            if scripted is not None:
                return scripted
            handler = getattr(self, "_m_" + method, None)
            if handler is None:
                return self._error(404, "Not Found: method not found")
            response = handler(params)
            params["_ok"] = response.status == 200
            return response
        finally:
            self._changed.set()

    def _m_getMe(self, p: dict[str, Any]) -> web.Response:
        return self._ok(self.bot_user)

    def _thread_error(self, chat_id: int, p: dict[str, Any]) -> web.Response | None:
        thread = p.get("message_thread_id")
        if thread is None:
            return None
        topic = self.topics.get(thread)
        if topic is None or topic.get("deleted"):
            return self._error(400, "Bad Request: message thread not found")
        return None

    def _m_sendMessage(self, p: dict[str, Any]) -> web.Response:
        chat_id = p["chat_id"]
        if chat_id in self.blocked:
            return self._error(403, "Forbidden: bot was blocked by the user")
        text = p.get("text", "")
        if p.get("parse_mode") == "HTML":
            try:
                shown = _html_to_text(text)
            except ValueError as exc:
                return self._error(400, f"Bad Request: can't parse entities: {exc}")
        elif p.get("parse_mode"):
            return self._error(400, f"Bad Request: unexpected parse_mode {p['parse_mode']} in this fake")
        else:
            shown = text
        if not shown.strip():
            return self._error(400, "Bad Request: message text is empty")
        if len(shown.encode("utf-16-le")) // 2 > MAX_TEXT:
            return self._error(400, "Bad Request: message is too long")
        thread_error = self._thread_error(chat_id, p)
        if thread_error is not None:
            return thread_error
        p["_shown"] = shown
        thread = p.get("message_thread_id")
        return self._ok(self._message(chat_id, text=shown, message_thread_id=thread,
                                      is_topic_message=True if thread else None))

    def _m_forwardMessage(self, p: dict[str, Any]) -> web.Response:
        if p["chat_id"] in self.blocked:
            return self._error(403, "Forbidden: bot was blocked by the user")
        return self._thread_error(p["chat_id"], p) or self._ok(self._message(p["chat_id"], text="(forwarded)"))

    def _m_copyMessage(self, p: dict[str, Any]) -> web.Response:
        if p["chat_id"] in self.blocked:
            return self._error(403, "Forbidden: bot was blocked by the user")
        return self._thread_error(p["chat_id"], p) or self._ok({"message_id": next(self._ids)})

    def _m_answerCallbackQuery(self, p: dict[str, Any]) -> web.Response:
        return self._ok(True)

    def _m_editMessageReplyMarkup(self, p: dict[str, Any]) -> web.Response:
        if "chat_id" not in p or "message_id" not in p:
            return self._error(400, "Bad Request: message identifier is not specified")
        return self._ok(True)

    def _m_setMyCommands(self, p: dict[str, Any]) -> web.Response:
        return self._ok(True)

    def _m_createForumTopic(self, p: dict[str, Any]) -> web.Response:
        thread = next(self._threads)
        self.topics[thread] = {"name": p["name"], "closed": False, "deleted": False, "chat_id": p["chat_id"]}
        return self._ok({"message_thread_id": thread, "name": p["name"], "icon_color": 7322096})

    def _topic_state(self, p: dict[str, Any], closed: bool) -> web.Response:
        topic = self.topics.get(p["message_thread_id"])
        if topic is None or topic.get("deleted"):
            return self._error(400, "Bad Request: message thread not found")
        if topic["closed"] == closed:
            return self._error(400, "Bad Request: TOPIC_NOT_MODIFIED")
        topic["closed"] = closed
        return self._ok(True)

    def _m_closeForumTopic(self, p: dict[str, Any]) -> web.Response:
        return self._topic_state(p, closed=True)

    def _m_reopenForumTopic(self, p: dict[str, Any]) -> web.Response:
        return self._topic_state(p, closed=False)

    def _m_deleteForumTopic(self, p: dict[str, Any]) -> web.Response:
        self.delete_topic(p["message_thread_id"])
        return self._ok(True)

    def _m_setWebhook(self, p: dict[str, Any]) -> web.Response:
        self.webhook = {"url": p["url"], "secret_token": p.get("secret_token"),
                        "allowed_updates": p.get("allowed_updates"), "max_connections": p.get("max_connections")}
        return self._ok(True)

    def _m_deleteWebhook(self, p: dict[str, Any]) -> web.Response:
        self.webhook = {}
        return self._ok(True)

    def _m_getWebhookInfo(self, p: dict[str, Any]) -> web.Response:
        info = {"url": self.webhook.get("url", ""), "has_custom_certificate": False,
                "pending_update_count": self.pending_updates.qsize()}
        if self.webhook.get("allowed_updates"):
            info["allowed_updates"] = self.webhook["allowed_updates"]
        if self.webhook.get("max_connections"):
            info["max_connections"] = self.webhook["max_connections"]
        return self._ok(info)

    async def _get_updates(self, p: dict[str, Any]) -> web.Response:
        if self.webhook.get("url"):
            return self._error(409, "Conflict: can't use getUpdates method while webhook is active")
        out = []
        try:
            first = await asyncio.wait_for(self.pending_updates.get(), timeout=min(float(p.get("timeout", 0)), 0.2))
            out.append(first)
            while not self.pending_updates.empty():
                out.append(self.pending_updates.get_nowait())
        except TimeoutError:
            pass
        return self._ok(out)


# --------------------------------------------------------------------------- update builders


@dataclass
class Updates:
    """Builds update JSON as Telegram sends it; update_ids and message ids count up.

    Args:
        bot_id / bot_username: the bot, for mentions and replies to it.
    """

    bot_id: int = 123456
    bot_username: str = "healthbot_test_bot"
    _update_ids: Any = field(default_factory=lambda: itertools.count(10_000))
    _message_ids: Any = field(default_factory=lambda: itertools.count(1))

    @staticmethod
    def user(user_id: int, language_code: str | None = "zh-hans", first_name: str = "小明") -> dict[str, Any]:
        u: dict[str, Any] = {"id": user_id, "is_bot": False, "first_name": first_name}
        if language_code:
            u["language_code"] = language_code
        return u

    def message(self, chat_id: int, user_id: int, text: str | None = None, *, chat_type: str | None = None,
                update_key: str = "message", entities: list[dict[str, Any]] | None = None,
                update_id: int | None = None, message_id: int | None = None, language_code: str | None = "zh-hans",
                **extra: Any) -> dict[str, Any]:
        """An update with one message (``text`` or the media in ``extra``)."""
        chat_type = chat_type or ("private" if chat_id > 0 else "supergroup")
        chat: dict[str, Any] = {"id": chat_id, "type": chat_type}
        if chat_type == "private":
            chat["first_name"] = "小明"
        else:
            chat["title"] = "group"
        msg: dict[str, Any] = {"message_id": message_id if message_id is not None else next(self._message_ids),
                               "date": int(time.time()), "chat": chat,
                               "from": self.user(user_id, language_code)}
        if text is not None:
            msg["text"] = text
            if entities is None and text.startswith("/"):
                command = text.split()[0]
                entities = [{"type": "bot_command", "offset": 0, "length": len(command)}]
            if entities:
                msg["entities"] = entities
        msg.update(extra)
        return {"update_id": update_id if update_id is not None else next(self._update_ids), update_key: msg}

    def text(self, user_id: int, text: str, **kw: Any) -> dict[str, Any]:
        """A private text message from ``user_id``."""
        return self.message(user_id, user_id, text, **kw)

    def command(self, user_id: int, command: str, chat_id: int | None = None, **kw: Any) -> dict[str, Any]:
        """``/command args`` (bot_command entity at offset 0)."""
        return self.message(chat_id if chat_id is not None else user_id, user_id, command, **kw)

    def sticker(self, user_id: int) -> dict[str, Any]:
        return self.message(user_id, user_id, None, sticker={
            "file_id": "CAACAgIAAxkBAAIB", "file_unique_id": "AgADAQAD", "type": "regular", "width": 512,
            "height": 512, "is_animated": False, "is_video": False, "emoji": "😀"})

    def photo(self, user_id: int, caption: str | None = None) -> dict[str, Any]:
        extra: dict[str, Any] = {"photo": [{"file_id": "AgACAgIAAxkBAAIC", "file_unique_id": "AQADAgAD",
                                            "width": 90, "height": 90}]}
        if caption:
            extra["caption"] = caption
        return self.message(user_id, user_id, None, **extra)

    def voice(self, user_id: int) -> dict[str, Any]:
        return self.message(user_id, user_id, None, voice={"file_id": "AwACAgIAAxkBAAID",
                                                           "file_unique_id": "AgADBAAD", "duration": 3})

    def edited(self, user_id: int, text: str, message_id: int) -> dict[str, Any]:
        """An ``edited_message`` update of the earlier message ``message_id``."""
        return self.message(user_id, user_id, text, update_key="edited_message", message_id=message_id,
                            edit_date=int(time.time()))

    def group_text(self, chat_id: int, user_id: int, text: str, *, mention: bool = False,
                   reply_to_bot: bool = False) -> dict[str, Any]:
        """A supergroup message; ``mention`` prefixes ``@bot``, ``reply_to_bot`` replies to a bot message."""
        entities = None
        if mention:
            handle = "@" + self.bot_username
            text = f"{handle} {text}"
            entities = [{"type": "mention", "offset": 0, "length": len(handle)}]
        extra: dict[str, Any] = {}
        if reply_to_bot:
            extra["reply_to_message"] = {"message_id": 1, "date": int(time.time()),
                                         "chat": {"id": chat_id, "type": "supergroup", "title": "group"},
                                         "from": {"id": self.bot_id, "is_bot": True, "first_name": "Healthbot",
                                                  "username": self.bot_username},
                                         "text": "earlier answer"}
        return self.message(chat_id, user_id, text, chat_type="supergroup", entities=entities, **extra)

    def topic_message(self, chat_id: int, user_id: int, thread_id: int, text: str | None, **extra: Any
                      ) -> dict[str, Any]:
        """A message an agent writes in forum topic ``thread_id`` of the agents' group."""
        entities = None
        if text is not None and text.startswith("/"):
            entities = [{"type": "bot_command", "offset": 0, "length": len(text.split()[0])}]
        reply = {"message_id": thread_id, "date": int(time.time()),
                 "chat": {"id": chat_id, "type": "supergroup", "title": "agents", "is_forum": True},
                 "from": {"id": self.bot_id, "is_bot": True, "first_name": "Healthbot", "username": self.bot_username},
                 "forum_topic_created": {"name": "topic", "icon_color": 7322096}}
        return self.message(chat_id, user_id, text, chat_type="supergroup", entities=entities,
                            message_thread_id=thread_id, is_topic_message=True, reply_to_message=reply,
                            **extra)

    def topic_closed(self, chat_id: int, user_id: int, thread_id: int) -> dict[str, Any]:
        """The ``forum_topic_closed`` service message an agent closing the topic produces."""
        return self.message(chat_id, user_id, None, chat_type="supergroup", message_thread_id=thread_id,
                            is_topic_message=True, forum_topic_closed={})

    def callback(self, user_id: int, data: str, message_chat: int | None = None) -> dict[str, Any]:
        """A button press (callback query) on a bot message in the user's chat."""
        chat_id = message_chat if message_chat is not None else user_id
        return {"update_id": next(self._update_ids), "callback_query": {
            "id": f"cb{next(self._message_ids)}", "from": self.user(user_id), "chat_instance": "ci",
            "data": data, "message": {"message_id": next(self._message_ids), "date": int(time.time()),
                                      "chat": {"id": chat_id, "type": "private", "first_name": "小明"},
                                      "from": {"id": self.bot_id, "is_bot": True, "first_name": "Healthbot",
                                               "username": self.bot_username},
                                      "text": "Choose a language:"}}}

    def my_chat_member(self, user_id: int, status: str) -> dict[str, Any]:
        """The bot's membership in the user's private chat changed (``kicked`` = blocked)."""
        bot = {"id": self.bot_id, "is_bot": True, "first_name": "Healthbot", "username": self.bot_username}
        old = "member" if status == "kicked" else "kicked"
        return {"update_id": next(self._update_ids), "my_chat_member": {
            "chat": {"id": user_id, "type": "private", "first_name": "小明"}, "from": self.user(user_id),
            "date": int(time.time()),
            "old_chat_member": {"user": bot, "status": old, **({"until_date": 0} if old == "kicked" else {})},
            "new_chat_member": {"user": bot, "status": status, **({"until_date": 0} if status == "kicked" else {})}}}
