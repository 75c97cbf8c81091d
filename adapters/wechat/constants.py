"""WeChat official-account (公众号) protocol limits, each with its source.

Code elsewhere says ``constants.PASSIVE_TEXT_MAX_BYTES``, never 2048
(STYLE.md, "limits and constants in one documented place").

Sources: WeChat official-account developer documentation,
https://developers.weixin.qq.com/doc/offiaccount/ — pages
"消息管理 / 接收普通消息" (Message_Management/Receiving_standard_messages),
"消息管理 / 接收事件推送" (Receiving_event_pushes),
"消息管理 / 被动回复用户消息" (Passive_user_reply_message),
"开始开发 / 获取 Access token" (Basic_Information/Get_access_token),
"消息加解密说明" (Message encryption / decryption),
"消息管理 / 客服消息" (Service_Center_messages: 客服接口-发消息),
"消息管理 / 消息转发到客服" (transfer_customer_service),
"自定义菜单 / 创建接口" (Custom_Menus/Creating_Custom-Defined_Menu),
"全局返回码说明" (Global return codes).
"""

from __future__ import annotations

from typing import Final

# Most bytes of a passive text reply's ``Content`` in UTF-8 (2048; source: 被动回复用户消息,
# 回复文本消息). The number lives in bot/reply_limits.py, where the knowledge base checks
# its answers against it; adapter code says ``constants.PASSIVE_TEXT_MAX_BYTES``.
from bot.reply_limits import PASSIVE_TEXT_MAX_BYTES  # noqa: F401

CHANNEL: Final = "wechat"
"""Value of :attr:`bot.types.Inbound.channel` for this adapter."""

REPLY_DEADLINE_S: Final[float] = 5.0
"""Seconds the WeChat server waits for the webhook's HTTP response.

Source: 接收普通消息 — "微信服务器在五秒内收不到响应会断掉连接，并且重新发起请求".
``WechatConfig.reply_budget_s`` must stay below this (default 4.0 s leaves 1 s for
the network and for WeChat's own clock)."""

MAX_DELIVERIES: Final[int] = 3
"""Deliveries of one message when the webhook does not answer in time.

Source: 接收普通消息 — "...重新发起请求，总共重试三次" (read, as most SDKs do, as
three requests in all). After the last one the user sees "该公众号暂时无法提供服务，
请稍后再试". Retries carry the same MsgId (events: same FromUserName + CreateTime)."""

ACCESS_TOKEN_TTL_S: Final[int] = 7200
"""Lifetime of an access_token in seconds (``expires_in``).

Source: 获取 Access token — "access_token 的有效期目前为2个小时". Used by the
customer-service message API (not by passive replies); refresh before expiry."""

NO_REPLY: Final[str] = "success"
"""Body that tells WeChat "no reply, do not retry".

Source: 被动回复用户消息 — "直接回复success（推荐方式）" or an empty body; anything
else that is not valid reply XML shows the user an error."""

EVENT_DEDUP_FIELDS: Final[tuple[str, ...]] = ("FromUserName", "CreateTime")
"""Dedup key of events, which have no MsgId.

Source: 接收事件推送 — "关于重试的消息排重，推荐使用FromUserName + CreateTime 排重"."""

AES_KEY_CHARS: Final[int] = 43
"""Length of the EncodingAESKey (base64 of 32 bytes without the trailing ``=``).

Source: 消息加解密说明 — AES-256-CBC, key = Base64_Decode(EncodingAESKey + "="),
IV = first 16 bytes of the key, PKCS#7 padding to 32 bytes."""

XML_CONTENT_TYPE: Final = "text/xml"
"""Content-Type of passive replies (WeChat accepts any; XML is what it sends us)."""


# --------------------------------------------------------------------------- server API (outbound)

API_BASE: Final = "https://api.weixin.qq.com"
"""Default base URL of the server API (``WechatConfig.api_base``; tests point it at a fake)."""

TOKEN_PATH: Final = "/cgi-bin/token"
"""GET ``?grant_type=client_credential&appid=APPID&secret=APPSECRET`` →
``{"access_token": ..., "expires_in": 7200}``. Source: 获取 Access token. Each call
invalidates the previous token (after an overlap, see
:data:`TOKEN_REFRESH_MARGIN_S`), so every worker and replica must share one."""

CUSTOM_SEND_PATH: Final = "/cgi-bin/message/custom/send"
"""POST ``?access_token=...`` with ``{"touser", "msgtype": "text", "text": {"content"}}``
(+ ``"customservice": {"kf_account"}``), or ``"msgtype": "msgmenu"`` with ``"msgmenu":
{"head_content", "list": [{"id", "content"}], "tail_content"}`` (发送菜单消息: a click comes
back as a text message carrying ``<bizmsgmenuid>``). Source: 客服消息 / 客服接口-发消息. Only
for accounts with the customer-service permission (verified service accounts)."""

MENU_CREATE_PATH: Final = "/cgi-bin/menu/create"
"""POST ``?access_token=...`` with ``{"button": [...]}``. Source: 自定义菜单 / 创建接口."""

TOKEN_REFRESH_MARGIN_S: Final[int] = 300
"""The shared token is dropped from the store this many seconds before ``expires_in``
ends, so it is fetched again before WeChat expires it.

Source: 获取 Access token — "在刷新过程中…公众平台后台会保证在5分钟内，新老access_token
都可用": a worker still holding the old token keeps working for 5 minutes."""

TOKEN_INVALID_ERRCODES: Final[frozenset[int]] = frozenset({40001, 40014, 42001})
"""errcodes that mean "this access_token is no longer good": fetch a new one once
and retry. Source: 全局返回码说明 — 40001 "获取 access_token 时 AppSecret 错误，或者
access_token 无效" (also: another worker fetched a newer token), 40014 "不合法的
access_token", 42001 "access_token 超时"."""

ERR_API_QUOTA: Final[int] = 45009
"""errcode "reach max api daily quota limit" (接口调用超过限制): the daily call quota of
this API is spent (2000/day for /cgi-bin/token). Source: 全局返回码说明. Retrying
makes it worse; logged as ``wechat_api.quota_exceeded``."""

ERR_KF_OUT_OF_LIMIT: Final[int] = 45047
"""errcode "out of response count limit" (客服接口下行条数超过上限): this user's
customer-service message quota is spent. Source: 全局返回码说明; quota (since
2023-06): 5 messages within 48 h after a user message, 3 within 1 min after a menu
click, follow or QR scan. Logged as ``wechat_api.kf_limit``."""

ERR_KF_OUT_OF_TIME: Final[int] = 45015
"""errcode "response out of time limit or subscription is canceled": the user has
not written within the reply window (48 h) or unfollowed. Source: 全局返回码说明."""

ERR_SYSTEM_BUSY: Final[int] = -1
"""errcode "system error" (系统繁忙，此时请开发者稍候再试). Source: 全局返回码说明."""

KF_TEXT_MAX_BYTES: Final[int] = 2048
"""Most bytes (UTF-8) of one customer-service text message, as for passive replies.

Source: 客服消息 (text ``content``) — the platform-wide text-message limit."""

KF_MESSAGES_PER_USER_MESSAGE: Final[int] = 5
"""Customer-service messages allowed within 48 h after one user message (since
2023-06; before: 20). Source: 客服消息 announcement of 2023-06-12 ("用户发送消息 5条
48小时"). Long answers send at most this many parts; the rest waits for "1"."""

TRANSFER_MSG_TYPE: Final = "transfer_customer_service"
"""Passive reply MsgType that hands the message to the customer-service system
(human agents). With ``<TransInfo><KfAccount>`` it goes to that agent
(``account@wxid``). Source: 消息转发到客服."""

MENU_MAX_BUTTONS: Final[int] = 3
"""Top-level menu buttons at most. Source: 自定义菜单 / 创建接口 ("一级菜单最多3个")."""

MENU_MAX_SUB_BUTTONS: Final[int] = 5
"""Buttons under one top-level button at most. Source: 自定义菜单 ("每个一级菜单最多包含5个二级菜单")."""

MENU_NAME_MAX_BYTES: Final[int] = 16
"""Top-level button ``name`` at most this many bytes (4 Chinese characters).
Source: 自定义菜单 / 创建接口, parameter ``name`` ("不超过16个字节")."""

MENU_SUB_NAME_MAX_BYTES: Final[int] = 60
"""Sub-button ``name`` at most this many bytes. Source: 自定义菜单 ("子菜单不超过60个字节")."""
