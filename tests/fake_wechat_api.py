"""A fake WeChat server API on loopback, for tests of adapters/wechat/api.py and the adapter.

Endpoints, with WeChat's documented request and answer shapes (获取 Access token,
客服接口-发消息, 自定义菜单 / 创建接口; errcodes from 全局返回码说明):

* ``GET /cgi-bin/token?grant_type=client_credential&appid=&secret=`` →
  ``{"access_token": "tok-N", "expires_in": 7200}``; a wrong appid/secret → 40013 /
  40125. Each fetch makes the new token the only valid one, as WeChat does once its
  5-minute overlap is over.
* ``POST /cgi-bin/stable_token`` with ``{"grant_type": "client_credential", "appid",
  "secret", "force_refresh": bool}`` (获取稳定版接口调用凭据), only with ``stable=True``
  (else 404, as from a gateway without it: the client falls back to /cgi-bin/token,
  which the tests written before the stable endpoint count) →
  ``{"access_token": "stable-N", "expires_in": <seconds left>}``. Without
  ``force_refresh`` the current stable token is answered again while it is valid; with
  it, a new one that replaces it (as once WeChat's 5-minute overlap is over). Stable and
  classic tokens are independent: fetching one does not invalidate the other. Another
  method → 43002; a body that is not a JSON object → 47001; a bad grant_type → 40002;
  a wrong appid/secret → 40013 / 40125.
* ``POST /cgi-bin/message/custom/send?access_token=`` (``msgtype`` ``text``, or ``msgmenu`` with
  ``head_content``, a ``list`` of 1-10 ``{"id", "content"}`` and ``tail_content``) and
  ``POST /cgi-bin/menu/create`` → ``{"errcode": 0, "errmsg": "ok"}``; a token that is not
  valid → 40001; another message type or a malformed menu → 40008.

Scripting: :meth:`FakeWechatApi.fail` makes the next N calls of a path answer an
errcode (40001, 40014, 42001, 45009, 45047, ...), :meth:`FakeWechatApi.fail_http` an
HTTP status; ``delays`` holds seconds to wait per path before answering. Every call is
counted (``calls``), the query string of each kept (``queries``), and every accepted
message, menu and stable-token request kept (``sent``, ``menus``, ``stable_requests``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, defaultdict, deque
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

TOKEN = "/cgi-bin/token"
STABLE_TOKEN = "/cgi-bin/stable_token"
SEND = "/cgi-bin/message/custom/send"
MENU = "/cgi-bin/menu/create"

ERRMSG = {
    40001: "invalid credential, access_token is invalid or not latest",
    40002: "invalid grant_type",
    40013: "invalid appid",
    40014: "invalid access_token",
    40125: "invalid appsecret",
    42001: "access_token expired",
    45009: "reach max api daily quota limit",
    45015: "response out of time limit or subscription is canceled",
    45047: "out of response count limit",
    43002: "require POST method",
    47001: "data format error",
    -1: "system error",
}


def _is_menu(menu: Any) -> bool:
    """A ``msgmenu`` as 发送菜单消息 documents it: head and tail texts, 1-10 lines of a non-empty id and content."""
    return (isinstance(menu, dict) and isinstance(menu.get("head_content"), str)
            and isinstance(menu.get("tail_content"), str) and isinstance(menu.get("list"), list)
            and 1 <= len(menu["list"]) <= 10
            and all(isinstance(item, dict) and isinstance(item.get("id"), str) and item["id"]
                    and isinstance(item.get("content"), str) and item["content"] for item in menu["list"]))


class FakeWechatApi:
    """The fake server; ``await start()`` → base URL ``http://127.0.0.1:PORT``.

    Args:
        appid / secret: the credentials the token endpoints accept.
        expires_in: seconds reported with each token (a stable token's lifetime).
        stable: serve ``/cgi-bin/stable_token`` (else it answers 404).
    """

    def __init__(self, appid: str = "wx0123456789abcdef", secret: str = "app-secret-for-tests",
                 expires_in: int = 7200, stable: bool = False):
        self.appid = appid
        self.secret = secret
        self.expires_in = expires_in
        self.stable = stable
        self.stable_requests: list[Any] = []      # every stable_token body (parsed JSON, or the raw bytes)
        self.stable_token: str | None = None       # the current stable token
        self.stable_expires_at = 0.0               # its expiry, time.monotonic() seconds
        self.stable_issued = 0
        self.queries: dict[str, list[dict[str, str]]] = defaultdict(list)
        self.calls: Counter[str] = Counter()
        self.sent: list[dict[str, Any]] = []       # accepted custom/send bodies, in arrival order
        self.raw_bodies: list[bytes] = []          # every custom/send body as received
        self.menus: list[dict[str, Any]] = []
        self.delays: dict[str, float] = defaultdict(float)
        self.valid_tokens: set[str] = set()
        self.issued = 0
        self._script: dict[str, deque[int]] = defaultdict(deque)
        self._http_script: dict[str, deque[int]] = defaultdict(deque)
        self._server: TestServer | None = None

    # ---- scripting

    def fail(self, path: str, errcode: int, times: int = 1) -> None:
        """The next ``times`` calls of ``path`` answer ``errcode``."""
        self._script[path].extend([errcode] * times)

    def fail_http(self, path: str, status: int, times: int = 1) -> None:
        """The next ``times`` calls of ``path`` answer HTTP ``status`` with a plain-text body."""
        self._http_script[path].extend([status] * times)

    def revoke_tokens(self) -> None:
        """Every token issued so far stops working (someone else fetched one, or force-refreshed
        the stable token)."""
        self.valid_tokens.clear()
        self.stable_token = None

    @property
    def contents(self) -> list[str]:
        """Texts of the accepted customer-service text messages, in order."""
        return [m["text"]["content"] for m in self.sent if m["msgtype"] == "text"]

    @property
    def menus_sent(self) -> list[dict[str, Any]]:
        """The ``msgmenu`` objects of the accepted customer-service menu messages, in order."""
        return [m["msgmenu"] for m in self.sent if m["msgtype"] == "msgmenu"]

    # ---- server

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get(TOKEN, self._token)
        if self.stable:
            app.router.add_route("*", STABLE_TOKEN, self._stable)
        app.router.add_post(SEND, self._send)
        app.router.add_post(MENU, self._menu)
        self._server = TestServer(app, host="127.0.0.1", port=0)
        await self._server.start_server()
        return str(self._server.make_url("")).rstrip("/")

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()

    async def _common(self, request: web.Request, path: str) -> web.Response | None:
        self.calls[path] += 1
        self.queries[path].append(dict(request.query))
        if self.delays[path]:
            await asyncio.sleep(self.delays[path])
        if self._http_script[path]:
            return web.Response(status=self._http_script[path].popleft(), text="scripted HTTP error")
        if self._script[path]:
            code = self._script[path].popleft()
            return web.json_response({"errcode": code, "errmsg": ERRMSG.get(code, "scripted error")})
        return None

    async def _token(self, request: web.Request) -> web.Response:
        scripted = await self._common(request, TOKEN)
        if scripted is not None:
            return scripted
        q = request.query
        if q.get("grant_type") != "client_credential" or q.get("appid") != self.appid:
            return web.json_response({"errcode": 40013, "errmsg": ERRMSG[40013]})
        if q.get("secret") != self.secret:
            return web.json_response({"errcode": 40125, "errmsg": ERRMSG[40125]})
        self.issued += 1
        token = f"tok-{self.issued}"
        self.valid_tokens = {token}
        return web.json_response({"access_token": token, "expires_in": self.expires_in})

    async def _stable(self, request: web.Request) -> web.Response:
        raw = await request.read()
        scripted = await self._common(request, STABLE_TOKEN)
        if scripted is not None:
            return scripted
        if request.method != "POST":
            return web.json_response({"errcode": 43002, "errmsg": ERRMSG[43002]})
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        self.stable_requests.append(body if body is not None else raw)
        if not isinstance(body, dict) or not isinstance(body.get("force_refresh", False), bool):
            return web.json_response({"errcode": 47001, "errmsg": ERRMSG[47001]})
        if body.get("grant_type") != "client_credential":
            return web.json_response({"errcode": 40002, "errmsg": ERRMSG[40002]})
        if body.get("appid") != self.appid:
            return web.json_response({"errcode": 40013, "errmsg": ERRMSG[40013]})
        if body.get("secret") != self.secret:
            return web.json_response({"errcode": 40125, "errmsg": ERRMSG[40125]})
        now = time.monotonic()
        if body.get("force_refresh") or self.stable_token is None or now >= self.stable_expires_at:
            self.stable_issued += 1
            self.stable_token, self.stable_expires_at = f"stable-{self.stable_issued}", now + self.expires_in
        left = max(1, int(self.stable_expires_at - now))
        return web.json_response({"access_token": self.stable_token, "expires_in": left})

    def _stable_valid(self, token: str | None) -> bool:
        return token is not None and token == self.stable_token and time.monotonic() < self.stable_expires_at

    def _authorized(self, request: web.Request) -> web.Response | None:
        token = request.query.get("access_token")
        if token not in self.valid_tokens and not self._stable_valid(token):
            return web.json_response({"errcode": 40001, "errmsg": ERRMSG[40001]})
        return None

    async def _send(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.raw_bodies.append(raw)
        scripted = await self._common(request, SEND)
        if scripted is not None:
            return scripted
        refused = self._authorized(request)
        if refused is not None:
            return refused
        body = json.loads(raw)
        if body.get("msgtype") not in ("text", "msgmenu") or not body.get("touser") or (
                body["msgtype"] == "msgmenu" and not _is_menu(body.get("msgmenu"))):
            return web.json_response({"errcode": 40008, "errmsg": "invalid message type"})
        if body["msgtype"] == "text" and len(body["text"]["content"].encode("utf-8")) > 2048:
            return web.json_response({"errcode": 45002, "errmsg": "content size out of limit"})
        self.sent.append(body)
        return web.json_response({"errcode": 0, "errmsg": "ok"})

    async def _menu(self, request: web.Request) -> web.Response:
        raw = await request.read()
        scripted = await self._common(request, MENU)
        if scripted is not None:
            return scripted
        refused = self._authorized(request)
        if refused is not None:
            return refused
        self.menus.append(json.loads(raw))
        return web.json_response({"errcode": 0, "errmsg": "ok"})
