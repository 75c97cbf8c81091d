"""Sizes every reply the bot composes must fit into, owned here so that bot code
(the knowledge base checks each rendered answer) needs no adapter; the WeChat
adapter imports its limit from here (:mod:`adapters.wechat.constants`)."""

from __future__ import annotations

from typing import Final

PASSIVE_TEXT_MAX_BYTES: Final[int] = 2048
"""Most bytes of ``Content`` in a WeChat passive text reply, counted in UTF-8.

Source: WeChat official-account developer documentation,
https://developers.weixin.qq.com/doc/offiaccount/ — 消息管理 / 被动回复用户消息
(Passive_user_reply_message: 回复文本消息, ``Content``) and the platform's
text-message limit of 2048 bytes (the same figure as 客服消息 text); a Chinese
character takes 3 bytes, so about 680 characters."""
