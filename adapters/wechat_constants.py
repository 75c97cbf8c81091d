"""WeChat official-account (公众号) protocol limits, each with its source.

Code elsewhere says ``wechat_constants.PASSIVE_TEXT_MAX_BYTES``, never 2048
(STYLE.md, "limits and constants in one documented place").

Sources: WeChat official-account developer documentation,
https://developers.weixin.qq.com/doc/offiaccount/ — pages
"消息管理 / 接收普通消息" (Message_Management/Receiving_standard_messages),
"消息管理 / 接收事件推送" (Receiving_event_pushes),
"消息管理 / 被动回复用户消息" (Passive_user_reply_message),
"开始开发 / 获取 Access token" (Basic_Information/Get_access_token),
"消息加解密说明" (Message encryption / decryption).
"""

from __future__ import annotations

from typing import Final

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

PASSIVE_TEXT_MAX_BYTES: Final[int] = 2048
"""Most bytes of ``Content`` in a passive text reply, counted in UTF-8.

Source: 被动回复用户消息 (回复文本消息, ``Content``) and the platform's text-message
limit of 2048 bytes (the same figure as 客服消息 text); a Chinese character takes 3
bytes, so about 680 characters."""

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
