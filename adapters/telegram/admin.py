"""Administration of the bot's Telegram side: ``healthbot telegram set-webhook |
delete-webhook | webhook-info``, and keeping the bot token out of logs."""

from __future__ import annotations

import logging
from typing import Any

import structlog
from telegram import Bot

from adapters.telegram import constants as tc
from bot.config import ConfigError, TelegramConfig

log = structlog.get_logger("healthbot.telegram")

__all__ = ["api_host", "quiet_httpx", "redact", "webhook_admin"]


def redact(text: str, token: str) -> str:
    """``text`` with the bot token replaced by ``<token>`` (it is part of every Bot API
    URL, and python-telegram-bot puts it in ``InvalidToken`` messages)."""
    return text.replace(token, "<token>") if token else text


def quiet_httpx() -> None:
    """httpx logs every request URL at INFO, and a Bot API URL contains the token
    (``https://api.telegram.org/bot<token>/sendMessage``): unless its level was set
    on purpose, the ``httpx`` logger is raised to WARNING."""
    logger = logging.getLogger("httpx")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


def api_host(api_base: str) -> str:
    """The Bot API base URL without the token part, for logs."""
    return api_base.split("/bot")[0]


async def webhook_admin(cfg: TelegramConfig, action: str) -> dict[str, Any]:
    """Run ``healthbot telegram ACTION``: ``set-webhook``, ``delete-webhook`` or ``webhook-info``.

    ``set-webhook`` registers ``telegram.webhook_url`` with ``secret_token`` =
    ``telegram.secret``, ``allowed_updates`` =
    :data:`~adapters.telegram.constants.ALLOWED_UPDATES` and ``max_connections`` =
    :data:`~adapters.telegram.constants.WEBHOOK_MAX_CONNECTIONS`, keeping pending
    updates. Every action returns getWebhookInfo as a dict.

    Raises:
        ConfigError: no token; for ``set-webhook``: a webhook URL that is not
            ``https://`` (Bot API setWebhook: "HTTPS URL to send updates to"), or no
            valid secret (the webhook refuses unauthenticated deliveries).
        telegram.error.TelegramError: the Bot API refused.
    """
    if not cfg.token:
        raise ConfigError("config key 'telegram.token': empty; set HEALTHBOT_TELEGRAM_TOKEN")
    if action not in ("set-webhook", "delete-webhook", "webhook-info"):
        raise ConfigError(f"unknown telegram action {action!r}: set-webhook | delete-webhook | webhook-info")
    if action == "set-webhook":
        if not cfg.webhook_url.startswith("https://"):
            raise ConfigError("config key 'telegram.webhook_url': must be an https:// URL ending in "
                              f"{tc.WEBHOOK_PATH} (set HEALTHBOT_TELEGRAM_WEBHOOK_URL)")
        if not tc.SECRET_TOKEN_RE.match(cfg.secret):
            raise ConfigError("config key 'telegram.secret': set HEALTHBOT_TELEGRAM_SECRET (1-256 characters of "
                              "A-Z a-z 0-9 _ -); POST /telegram refuses deliveries without it")
        if not cfg.webhook_url.rstrip("/").endswith(tc.WEBHOOK_PATH):
            log.warning("telegram.webhook_path", url=cfg.webhook_url, expected_suffix=tc.WEBHOOK_PATH)
    quiet_httpx()
    async with Bot(cfg.token, base_url=cfg.api_base) as bot:
        if action == "set-webhook":
            await bot.set_webhook(url=cfg.webhook_url, secret_token=cfg.secret,
                                  allowed_updates=list(tc.ALLOWED_UPDATES),
                                  max_connections=tc.WEBHOOK_MAX_CONNECTIONS, drop_pending_updates=False)
        elif action == "delete-webhook":
            await bot.delete_webhook(drop_pending_updates=False)
        info = await bot.get_webhook_info()
        return info.to_dict()
