"""WeChat server API (outbound): the shared access token, customer-service text, the menu
(its file format and limits: :mod:`adapters.wechat.menu`).

An aiohttp client for four endpoints of the official-account server API
(:mod:`adapters.wechat.constants` names each with its documentation page):
``/cgi-bin/stable_token`` (:data:`STABLE_TOKEN_PATH`) and, as its fallback,
``/cgi-bin/token``; ``/cgi-bin/message/custom/send`` (texts, and the ``msgmenu`` of
feedback buttons) and ``/cgi-bin/menu/create``.

Which token endpoint: the stable one (获取稳定版接口调用凭据, ``POST`` JSON with
``force_refresh: false``) by default: it answers the token that is current while it
is valid, so another system that fetches one with the same AppID (a second server, a
WeChat tool, a colleague's script) does not knock ours out, as every call of the
classic ``/cgi-bin/token`` does; its tokens and the classic ones are independent. When
the stable endpoint fails (no connection, no answer, an HTTP error, an answer that is
not JSON or has no token, or an errcode such as -1 "system busy"), the token is fetched
from ``/cgi-bin/token`` (logged as ``wechat_api.stable_token_failed``, counted in
``stats["stable_token_fallbacks"]``). Not for an errcode about the account itself
(:data:`STABLE_FINAL_ERRCODES`: wrong AppID or AppSecret, IP not whitelisted, quota
spent), which the classic endpoint would answer the same way.

The access token (获取 Access token: "建议公众号开发者使用中控服务器统一获取和刷新
access_token … 不应该各自去刷新"): every fetch invalidates the previous token, so
workers and replicas that each fetch their own knock each other out (40001). Here
the token lives in the shared :class:`bot.store.Store`:

* ``wechat:access_token`` — the token, with a TTL of ``expires_in`` minus
  :data:`~adapters.wechat.constants.TOKEN_REFRESH_MARGIN_S` (300 s), so it is
  fetched again before WeChat expires it (the old one stays valid 5 minutes);
* ``wechat:access_token:lock`` — taken with ``set_if_absent`` (TTL
  :data:`TOKEN_LOCK_TTL_S`) by the one worker that fetches; released with
  ``delete_if_equal`` (only by its holder). Everyone else polls the token key
  every :data:`TOKEN_WAIT_POLL_S` until it appears (or the lock lapses and they
  try to take it themselves).

A call answered 40001/40014/42001 drops exactly the token it used
(``delete_if_equal``: a newer token another worker stored is kept), gets a token
again (one fetch for everyone) and retries once. 45009 (API daily quota) and
45047 (the user's customer-service quota) are logged as
``wechat_api.quota_exceeded`` / ``wechat_api.kf_limit`` and counted in
:attr:`WechatApi.stats` / :attr:`WechatApi.errors`; they never raise out of
:meth:`WechatApi.send_text`. Prometheus (bot/metrics.py):
``healthbot_wechat_token_refreshes_total`` per token fetched,
``healthbot_wechat_api_errors_total{code}`` per failed call — the errcode,
``http_<status>``, ``network`` (no connection / no answer) or ``bad_answer`` (not JSON).

Secrets: the AppSecret and the access token travel in query strings; no log line
or exception message here contains a URL (aiohttp errors are logged by type only).
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import socket
import uuid
from collections import Counter
from typing import Any

import aiohttp
import structlog

from adapters.masking import mask_id
from adapters.wechat import constants as wc
from adapters.wechat.menu import load_menu, validate_menu
from bot import metrics
from bot.config import WechatConfig
from bot.store import Store

log = structlog.get_logger("healthbot.wechat_api")

__all__ = [
    "STABLE_FINAL_ERRCODES",
    "STABLE_TOKEN_PATH",
    "TOKEN_KEY",
    "TOKEN_LOCK_KEY",
    "SendOutcome",
    "WechatApi",
    "WechatApiError",
    "load_menu",
    "validate_menu",
]

TOKEN_KEY = "wechat:access_token"
"""Store key of the shared access token (value: the token; TTL: expires_in − 300 s)."""

TOKEN_LOCK_KEY = "wechat:access_token:lock"
"""Store key of the refresh lock (value: the holder's id)."""

TOKEN_LOCK_TTL_S = 15.0
"""Seconds a refresh lock lives: longer than a fetch (the stable endpoint, then perhaps
the classic one: two calls of at most ``api_timeout_s``, default 5 s, each) so a slow
fetch is not duplicated; short enough that a crashed holder blocks the others for at
most this long."""

STABLE_TOKEN_PATH = "/cgi-bin/stable_token"
"""POST ``{"grant_type": "client_credential", "appid", "secret", "force_refresh": false}``
(JSON; the secret is not in the URL) → ``{"access_token", "expires_in"}``, where
``expires_in`` is what is left of the current token's lifetime, seconds. Source:
获取稳定版接口调用凭据 (getStableAccessToken): "普通模式，access_token 有效期内重复调用该接口
不会更新 access_token"; its tokens are isolated from ``/cgi-bin/token``'s."""

STABLE_FINAL_ERRCODES = frozenset({40013, 40125, 40164, 40243, 41002, 41004, 45009})
"""errcodes of the stable endpoint that are not worth a second try at ``/cgi-bin/token``:
invalid AppID (40013), invalid or frozen AppSecret (40125, 40243), caller IP not in the
whitelist (40164), AppID or secret missing (41002, 41004), daily quota spent (45009;
falling back would spend the other quota and invalidate other systems' classic tokens).
Source: 全局返回码说明."""

TOKEN_WAIT_POLL_S = 0.05
"""Seconds between re-reads of the token key by workers waiting for the lock holder."""


class WechatApiError(Exception):
    """A server-API call failed.

    Attributes:
        errcode: WeChat's errcode (全局返回码说明), or None for a transport failure
            (no connection, timeout, HTTP status other than 200, a body that is not JSON).
        errmsg: WeChat's errmsg, or what went wrong (never a URL or a secret).
        path: the API path (``/cgi-bin/...``).
        maybe_sent: True when the request may have reached WeChat without an answer
            coming back (timeout, dropped connection): a message may have been delivered.
    """

    def __init__(self, errcode: int | None, errmsg: str, path: str, maybe_sent: bool = False):
        super().__init__(f"{path}: {'errcode ' + str(errcode) if errcode is not None else 'transport'}: {errmsg}")
        self.errcode = errcode
        self.errmsg = errmsg
        self.path = path
        self.maybe_sent = maybe_sent


class SendOutcome(str, enum.Enum):
    """What became of one customer-service message."""

    SENT = "sent"        #: WeChat answered errcode 0
    FAILED = "failed"    #: not delivered: WeChat refused it, or it never left this process
    UNKNOWN = "unknown"  #: sent, but no answer came back (timeout): it may have been delivered


ERRCODE_UNREADABLE = -2
"""The errcode recorded when WeChat's answer has one that is not an integer (WeChat's own -1 means "system busy")."""


def _errcode(value: object) -> int:
    """WeChat's ``errcode`` as an int: 0 when absent, :data:`ERRCODE_UNREADABLE` when not an integer."""
    if value in (None, "", 0, False):
        return 0
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return ERRCODE_UNREADABLE


class WechatApi:
    """Server-API client of one official account, sharing its token through ``store``.

    Args:
        cfg: ``appid``, ``appsecret`` (secret), ``api_base``, ``api_timeout_s`` (seconds, per call).
        store: the shared store (token and lock keys above).
        session: an aiohttp session to use (default: one created on first use, closed by :meth:`close`).
        lock_ttl_s / wait_poll_s: see :data:`TOKEN_LOCK_TTL_S` / :data:`TOKEN_WAIT_POLL_S`.

    Attributes:
        stats: counters for metrics — ``token_fetches``, ``token_waits`` (calls that waited for
            another worker's fetch), ``token_rejected`` (40001/40014/42001 seen), ``kf_sent``,
            ``quota_exceeded`` (45009), ``kf_limit`` (45047), ``api_errors`` (any other errcode),
            ``transport_errors``.
        errors: count per errcode of every errcode answer.
    """

    def __init__(self, cfg: WechatConfig, store: Store, *, session: aiohttp.ClientSession | None = None,
                 lock_ttl_s: float = TOKEN_LOCK_TTL_S, wait_poll_s: float = TOKEN_WAIT_POLL_S):
        self.appid = cfg.appid
        self._secret = cfg.appsecret
        self.base = (cfg.api_base or wc.API_BASE).rstrip("/")
        self.timeout_s = cfg.api_timeout_s
        self.store = store
        self.lock_ttl_s = lock_ttl_s
        self.wait_poll_s = wait_poll_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self._session = session
        self._own_session = session is None
        self.stats: Counter[str] = Counter()
        self.errors: Counter[int] = Counter()

    def __repr__(self) -> str:  # never the secret
        return f"WechatApi(appid={self.appid!r}, base={self.base!r})"

    # ---- HTTP

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
            self._own_session = True
        return self._session

    async def close(self) -> None:
        """Close the HTTP session if this client created it."""
        if self._own_session and self._session is not None and not self._session.closed:
            await self._session.close()

    async def _request(self, method: str, path: str, params: dict[str, str],
                       body: dict[str, Any] | None = None, user: str | None = None) -> dict[str, Any]:
        """One HTTP call → the JSON object; raises :class:`WechatApiError` for an errcode or a transport failure."""
        data = None if body is None else json.dumps(body, ensure_ascii=False).encode("utf-8")
        headers = {"Content-Type": "application/json; charset=utf-8"} if data is not None else None
        try:
            async with self._http().request(method, self.base + path, params=params, data=data,
                                            headers=headers) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    self.stats["transport_errors"] += 1
                    metrics.WECHAT_API_ERRORS.labels(code=f"http_{resp.status}").inc()
                    log.warning("wechat_api.http_error", path=path, status=resp.status)
                    raise WechatApiError(None, f"HTTP {resp.status}", path, maybe_sent=resp.status >= 500)
        except aiohttp.ClientConnectorError as exc:  # never connected: nothing was sent
            self.stats["transport_errors"] += 1
            metrics.WECHAT_API_ERRORS.labels(code="network").inc()
            log.warning("wechat_api.unreachable", path=path, error=type(exc).__name__)
            raise WechatApiError(None, f"cannot connect ({type(exc).__name__})", path) from None
        except (TimeoutError, aiohttp.ClientError) as exc:
            self.stats["transport_errors"] += 1
            metrics.WECHAT_API_ERRORS.labels(code="network").inc()
            log.warning("wechat_api.transport_error", path=path, error=type(exc).__name__)
            raise WechatApiError(None, f"no answer ({type(exc).__name__})", path, maybe_sent=True) from None
        try:
            out = json.loads(raw)
            if not isinstance(out, dict):
                raise ValueError("not an object")
        except (ValueError, RecursionError):  # not JSON, not UTF-8, a huge number, nested too deeply
            self.stats["transport_errors"] += 1
            metrics.WECHAT_API_ERRORS.labels(code="bad_answer").inc()
            log.warning("wechat_api.bad_answer", path=path)
            raise WechatApiError(None, "answer is not a JSON object", path, maybe_sent=True) from None
        errcode = _errcode(out.get("errcode"))
        if errcode:
            errmsg = str(out.get("errmsg") or "")[:300]
            self._note_error(errcode, errmsg, path, user)
            raise WechatApiError(errcode, errmsg, path)
        return out

    def _note_error(self, errcode: int, errmsg: str, path: str, user: str | None) -> None:
        self.errors[errcode] += 1
        metrics.WECHAT_API_ERRORS.labels(code=str(errcode)).inc()
        who = {"user": mask_id(user, head=6)} if user else {}
        if errcode == wc.ERR_API_QUOTA:
            self.stats["quota_exceeded"] += 1
            log.error("wechat_api.quota_exceeded", errcode=errcode, path=path, errmsg=errmsg, **who,
                      hint="the daily call quota of this API is spent; it resets at midnight Beijing time "
                           "(or clear it in the console: 接口调用次数清零)")
        elif errcode == wc.ERR_KF_OUT_OF_LIMIT:
            self.stats["kf_limit"] += 1
            log.warning("wechat_api.kf_limit", errcode=errcode, path=path, errmsg=errmsg, **who,
                        hint="this user's customer-service message quota is spent (5 in 48 h after a message)")
        elif errcode in wc.TOKEN_INVALID_ERRCODES:
            self.stats["token_rejected"] += 1
            log.warning("wechat_api.token_rejected", errcode=errcode, path=path, errmsg=errmsg)
        else:
            self.stats["api_errors"] += 1
            log.warning("wechat_api.error", errcode=errcode, path=path, errmsg=errmsg, **who)

    # ---- the access token

    async def access_token(self) -> str:
        """The account's current access token, shared through the store.

        Reads ``wechat:access_token``; when it is absent, one caller (holder of
        ``wechat:access_token:lock``) fetches it from ``/cgi-bin/stable_token`` (or, when
        that fails, ``/cgi-bin/token``: module docstring) while the others wait and
        re-read it. Waiting is bounded by ``lock_ttl_s`` + the API timeout.

        Raises:
            WechatApiError: the fetch failed (40013 bad appid, 40125 bad appsecret,
                40164 IP not whitelisted, 45009 quota, transport), or no token
                appeared in time.
        """
        if not self.appid or not self._secret:
            raise WechatApiError(None, "wechat.appid or HEALTHBOT_WECHAT_APPSECRET not set", wc.TOKEN_PATH)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lock_ttl_s + self.timeout_s
        waited = False
        while True:
            token = await self.store.get(TOKEN_KEY)
            if token:
                return token
            if await self.store.set_if_absent(TOKEN_LOCK_KEY, self.owner, self.lock_ttl_s):
                try:
                    token = await self.store.get(TOKEN_KEY)  # stored by the previous holder just now?
                    return token or await self._fetch_token()
                finally:
                    await self.store.delete_if_equal(TOKEN_LOCK_KEY, self.owner)
            if not waited:
                waited = True
                self.stats["token_waits"] += 1
            if loop.time() > deadline:
                raise WechatApiError(None, "no access token: another worker holds the refresh lock and has "
                                     "not stored one", wc.TOKEN_PATH)
            await asyncio.sleep(self.wait_poll_s)

    async def _token_answer(self, method: str, path: str, params: dict[str, str],
                            body: dict[str, Any] | None = None) -> tuple[str, int]:
        """One token call → ``(access_token, expires_in seconds)``; a missing or nonsense
        ``expires_in`` reads as the documented lifetime. Raises :class:`WechatApiError`."""
        out = await self._request(method, path, params, body)
        token = str(out.get("access_token") or "")
        if not token:
            raise WechatApiError(None, "answer without access_token", path)
        try:
            expires_in = int(out.get("expires_in") or wc.ACCESS_TOKEN_TTL_S)
        except (TypeError, ValueError, OverflowError):
            expires_in = wc.ACCESS_TOKEN_TTL_S
        if not 0 < expires_in <= 24 * wc.ACCESS_TOKEN_TTL_S:  # nonsense: assume the documented lifetime
            expires_in = wc.ACCESS_TOKEN_TTL_S
        return token, expires_in

    async def _fetch_token(self) -> str:
        """Fetch a token (stable endpoint, else the classic one) and store it for everyone."""
        grant = {"grant_type": "client_credential", "appid": self.appid, "secret": self._secret}
        path = STABLE_TOKEN_PATH
        try:
            token, expires_in = await self._token_answer("POST", path, {}, {**grant, "force_refresh": False})
        except WechatApiError as exc:
            if exc.errcode in STABLE_FINAL_ERRCODES:
                raise
            self.stats["stable_token_fallbacks"] += 1
            log.warning("wechat_api.stable_token_failed", errcode=exc.errcode, error=exc.errmsg,
                        hint=f"fetching the access token from {wc.TOKEN_PATH} instead")
            path = wc.TOKEN_PATH
            token, expires_in = await self._token_answer("GET", path, grant)
        ttl = max(expires_in - wc.TOKEN_REFRESH_MARGIN_S, expires_in / 2, 1)
        await self.store.set(TOKEN_KEY, token, ttl)
        self.stats["token_fetches"] += 1
        metrics.WECHAT_TOKEN_REFRESHES.inc()
        log.info("wechat_api.token_fetched", endpoint=path, expires_in_s=expires_in, shared_for_s=ttl)
        return token

    async def invalidate_token(self, token: str) -> bool:
        """Drop ``token`` from the store if it is still the shared one (True if dropped)."""
        return await self.store.delete_if_equal(TOKEN_KEY, token)

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None,
                   user: str | None = None) -> dict[str, Any]:
        """``method path?access_token=…`` with a JSON ``body`` → WeChat's JSON answer (errcode 0).

        A token errcode (40001/40014/42001) drops that token, gets a fresh one and
        retries once.

        Raises:
            WechatApiError: any other errcode, a second token error, or a transport failure.
        """
        token = await self.access_token()
        try:
            return await self._request(method, path, {"access_token": token}, body, user)
        except WechatApiError as exc:
            if exc.errcode not in wc.TOKEN_INVALID_ERRCODES:
                raise
        await self.invalidate_token(token)
        token = await self.access_token()
        return await self._request(method, path, {"access_token": token}, body, user)

    # ---- customer-service messages and the menu

    async def send_text(self, openid: str, text: str, kf_account: str = "") -> SendOutcome:
        """Send one customer-service text message to ``openid`` (客服接口-发消息).

        Args:
            openid: the user's OpenID.
            text: at most :data:`~adapters.wechat.constants.KF_TEXT_MAX_BYTES` UTF-8
                bytes, free of XML-invalid characters (the adapter prepares it).
            kf_account: send as this customer-service account (``name@wxid``); "" = the account itself.

        Returns:
            :class:`SendOutcome`; never raises for WeChat's answers (45009, 45047,
            45015 … are logged and counted) nor for transport failures.

        Raises:
            ValueError: ``text`` is over the byte limit (a bug in the caller).
        """
        if len(text.encode("utf-8")) > wc.KF_TEXT_MAX_BYTES:
            raise ValueError(f"customer-service text over {wc.KF_TEXT_MAX_BYTES} bytes; split it first")
        body: dict[str, Any] = {"touser": openid, "msgtype": "text", "text": {"content": text}}
        if kf_account:
            body["customservice"] = {"kf_account": kf_account}
        return await self._send_custom(openid, body)

    async def send_menu(self, openid: str, head: str, choices: list[tuple[str, str]], tail: str = "") -> SendOutcome:
        """Send one customer-service menu message (``msgtype`` ``msgmenu``, 客服接口-发消息, 发送菜单消息) to
        ``openid``: ``head``, then one clickable line per ``(id, content)`` of ``choices``, then ``tail``.

        A click comes back as a text message whose ``Content`` is the choice's content and whose
        ``bizmsgmenuid`` is its id. Service accounts only (others: errcode 40200, "invalid account
        type"). Returns :class:`SendOutcome` as :meth:`send_text` does; never raises.
        """
        body = {"touser": openid, "msgtype": "msgmenu",
                "msgmenu": {"head_content": head, "list": [{"id": i, "content": c} for i, c in choices],
                            "tail_content": tail}}
        return await self._send_custom(openid, body)

    async def _send_custom(self, openid: str, body: dict[str, Any]) -> SendOutcome:
        try:
            await self.call("POST", wc.CUSTOM_SEND_PATH, body, user=openid)
        except WechatApiError as exc:
            return SendOutcome.UNKNOWN if exc.maybe_sent else SendOutcome.FAILED
        except Exception:  # noqa: BLE001 — a store failure while getting the token must not crash a sender
            log.exception("wechat_api.send_failed", user=mask_id(openid, head=6))
            return SendOutcome.FAILED
        self.stats["kf_sent"] += 1
        return SendOutcome.SENT

    async def create_menu(self, menu: dict[str, Any]) -> None:
        """Replace the account's custom menu with ``menu`` (``{"button": [...]}``, 自定义菜单 / 创建接口).

        Raises:
            ValueError: ``menu`` breaks a documented limit (see :func:`validate_menu`).
            WechatApiError: WeChat refused it (e.g. 40016 bad button count, 40018 bad
                name, 48001 no menu permission) or the call failed.
        """
        validate_menu(menu)
        await self.call("POST", wc.MENU_CREATE_PATH, menu)
        log.info("wechat_api.menu_created", buttons=len(menu["button"]))
