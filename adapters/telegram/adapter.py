"""The Telegram channel's adapter: the python-telegram-bot application's lifecycle,
``POST /telegram`` and deduplication of updates; :func:`setup_telegram` and
:func:`use_polling` (see the package docstring for the protocol)."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Awaitable

import structlog
from aiohttp import web
from telegram import Bot, BotCommand, Update
from telegram.error import InvalidToken, TelegramError
from telegram.ext import (Application, ApplicationBuilder, ApplicationHandlerStop, CallbackQueryHandler,
                          ChatMemberHandler, CommandHandler, ContextTypes, MessageHandler, TypeHandler, filters)

from adapters.body import BodyTooLarge, read_limited
from adapters.telegram import constants as tc
from adapters.telegram.admin import api_host, quiet_httpx, redact
from adapters.telegram.commands import DispatcherLike, TelegramCommands
from adapters.telegram.feedback import FEEDBACK_BUTTON_RE, FeedbackButtons
from adapters.telegram.handoff import TelegramAgentRelay
from adapters.telegram.sender import SendPolicy, TelegramSender
from adapters.telegram.texts import COMMANDS
from adapters.telegram.update_checks import update_problem
from adapters.telegram.updates import PerChatUpdateProcessor
from bot.config import Config, ConfigError, TelegramConfig
from bot.feedback import FeedbackBook

if TYPE_CHECKING:  # pragma: no cover
    from bot.handoff import HandoffManager

log = structlog.get_logger("healthbot.telegram")

__all__ = ["TELEGRAM_ADAPTER", "TelegramAdapter", "setup_telegram", "use_polling"]


class TelegramAdapter(TelegramCommands):
    """The Telegram channel: webhook handler, python-telegram-bot application, commands.

    Args:
        cfg: the effective config (``cfg.telegram``; ``cfg.safety`` for the emergency
            number in /help).
        dispatcher: ``async handle(Inbound) -> Reply``, deduplicating on (channel, message_id).
        handoff: the :class:`bot.handoff.HandoffManager` the dispatcher uses; the
            adapter registers its relay (when ``telegram.agent_chat`` is set) and
            :meth:`notify_user` with it.
        policy: retry rules for Bot API calls (tests shorten the waits).
        feedback: where votes on answers go; with it, answers carry 👍 / 👎 buttons
            (:mod:`adapters.telegram.feedback`).

    Raises:
        ConfigError: no ``telegram.token``, or a ``telegram.secret`` Telegram would
            refuse (1-256 characters of ``A-Z a-z 0-9 _ -``).
    """

    def __init__(self, cfg: Config, dispatcher: DispatcherLike, handoff: HandoffManager,
                 policy: SendPolicy | None = None, feedback: FeedbackBook | None = None):
        self.cfg: TelegramConfig = cfg.telegram
        self.safety = cfg.safety
        if not self.cfg.token:
            raise ConfigError("config key 'telegram.token': empty; set HEALTHBOT_TELEGRAM_TOKEN")
        if self.cfg.secret and not tc.SECRET_TOKEN_RE.match(self.cfg.secret):
            raise ConfigError("config key 'telegram.secret': must be 1-256 characters of A-Z a-z 0-9 _ - "
                              "(Bot API setWebhook secret_token); set HEALTHBOT_TELEGRAM_SECRET")
        quiet_httpx()
        self.dispatcher = dispatcher
        self.handoff = handoff
        self.sender = TelegramSender(policy)
        self.langs: dict[str, str] = {}          # user_id -> /lang choice
        self._client_langs: dict[str, str] = {}  # user_id -> from Telegram's language_code
        self._seen: OrderedDict[int, None] = OrderedDict()
        self.polling = False
        self.application: Application | None = None
        self.accepting = False
        self._starter: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.stats: dict[str, int] = {"updates": 0, "duplicates": 0, "dispatched": 0, "errors": 0}
        self.relay: TelegramAgentRelay | None = None
        if self.cfg.agent_chat:
            self.relay = TelegramAgentRelay(self.cfg.agent_chat, self.sender, handoff, self.ui_lang_of)
        handoff.register(tc.CHANNEL, self.relay, self.notify_user)
        self.feedback_buttons = (FeedbackButtons(feedback, self.sender, self.ui_lang_of) if feedback is not None
                                 else None)
        if not self.cfg.secret:
            log.warning("telegram.no_secret", hint="set HEALTHBOT_TELEGRAM_SECRET; POST /telegram answers 503 "
                        "until then (polling works without it)")

    # ---- application

    @property
    def bot(self) -> Bot:
        """The running application's bot (raises when not started)."""
        if self.application is None:
            raise RuntimeError("telegram adapter not started")
        return self.application.bot

    def build_application(self) -> Application:
        """A python-telegram-bot ``Application`` for this adapter, handlers added.

        ``updater(None)`` for the webhook (updates come from ``POST /telegram``); the
        default ``Updater`` when :attr:`polling`. ``base_url`` is ``telegram.api_base``.
        """
        builder = (ApplicationBuilder().token(self.cfg.token).base_url(self.cfg.api_base)
                   .concurrent_updates(PerChatUpdateProcessor()))
        if not self.polling:
            builder = builder.updater(None)
        app = builder.build()
        message_only = filters.UpdateType.MESSAGE
        app.add_handler(TypeHandler(Update, self._gate), group=-1)
        if self.relay is not None:
            for handler in self.relay.handlers():
                app.add_handler(handler)
        app.add_handler(CommandHandler("start", self._cmd_start, filters=message_only))
        app.add_handler(CommandHandler("help", self._cmd_help, filters=message_only))
        app.add_handler(CommandHandler("human", self._cmd_human, filters=message_only))
        app.add_handler(CommandHandler("stop", self._cmd_stop, filters=message_only))
        app.add_handler(CommandHandler("lang", self._cmd_lang, filters=message_only))
        if self.feedback_buttons is not None:
            app.add_handler(CallbackQueryHandler(self.feedback_buttons.on_press, pattern=FEEDBACK_BUTTON_RE))
        app.add_handler(CallbackQueryHandler(self._on_lang_button))  # every other button; unknown data answered politely
        app.add_handler(ChatMemberHandler(self._on_my_chat_member, ChatMemberHandler.MY_CHAT_MEMBER))
        app.add_handler(MessageHandler(filters.UpdateType.MESSAGES, self._on_message))
        app.add_error_handler(self._on_error)
        return app

    async def start(self) -> None:
        """Build the application and connect (getMe, then start; polling starts the Updater).

        A Bot API that cannot be reached is retried in the background with backoff
        up to :data:`~adapters.telegram.constants.STARTUP_RETRY_MAX_S` (``/telegram``
        answers 503 meanwhile); a token Telegram rejects is logged and not retried.
        The rest of the server starts either way.
        """
        self.application = self.build_application()
        self.sender.bot = self.application.bot
        try:
            await self._connect()
        except InvalidToken as exc:
            log.error("telegram.invalid_token", error=self._redact(exc), hint="check HEALTHBOT_TELEGRAM_TOKEN")
        except (TelegramError, OSError) as exc:
            log.error("telegram.start_failed", error=self._redact(exc), api_base=api_host(self.cfg.api_base))
            self._starter = asyncio.create_task(self._connect_later(), name="telegram-connect")

    async def _connect(self) -> None:
        app = self.application
        assert app is not None
        await app.initialize()  # getMe; a no-op once it succeeded (safe to retry)
        if not app.running:
            await app.start()
        if self.polling and app.updater is not None and not app.updater.running:
            await app.updater.start_polling(timeout=tc.POLL_TIMEOUT_S, allowed_updates=list(tc.ALLOWED_UPDATES),
                                            drop_pending_updates=False)
        self.accepting = True
        self._spawn(self._register_commands())
        log.info("telegram.started", bot=app.bot.username, mode="polling" if self.polling else "webhook",
                 agent_chat=bool(self.relay))

    async def _connect_later(self) -> None:
        wait = 1.0
        while True:
            await self.sender.policy.sleep(wait)
            try:
                await self._connect()
                return
            except InvalidToken as exc:
                log.error("telegram.invalid_token", error=self._redact(exc), hint="check HEALTHBOT_TELEGRAM_TOKEN")
                return
            except (TelegramError, OSError) as exc:
                wait = min(wait * 2, tc.STARTUP_RETRY_MAX_S)
                log.warning("telegram.start_retry", error=self._redact(exc), next_in_s=wait)

    def _redact(self, exc: BaseException) -> str:
        return redact(str(exc), self.cfg.token)

    async def _register_commands(self) -> None:
        """The command menu (setMyCommands), zh by default and en for English clients; best effort."""
        bot = self.bot
        try:
            for lang, code in (("zh", None), ("en", "en")):
                commands = [BotCommand(c, d) for c, d in COMMANDS[lang]]
                await self.sender.call("setMyCommands",
                                       lambda commands=commands, code=code: bot.set_my_commands(commands,
                                                                                                 language_code=code))
        except TelegramError as exc:
            log.warning("telegram.commands_not_registered", error=str(exc))

    async def stop(self) -> None:
        """Stop taking updates, finish the queued ones, disconnect (graceful shutdown)."""
        self.accepting = False
        if self._starter is not None:
            self._starter.cancel()
            await asyncio.gather(self._starter, return_exceptions=True)
            self._starter = None
        app = self.application
        if app is None:
            return
        try:
            if app.updater is not None and app.updater.running:
                await app.updater.stop()
            if app.running:
                await app.stop()
        finally:
            for task in list(self._background):
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            await app.shutdown()
            log.info("telegram.stopped", **self.sender.stats, **self.stats)

    async def idle(self) -> None:
        """Return once every update received so far has been processed (tests, shutdown)."""
        if self.application is not None and self.application.running:
            await self.application.update_queue.join()

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- webhook

    async def handle_webhook(self, request: web.Request) -> web.Response:
        """``POST /telegram``: authenticate, parse, queue, answer 200 at once.

        Answers (short plain-text bodies, never a trace): 503 without a configured
        secret, or while not connected / shutting down; 403 when
        ``X-Telegram-Bot-Api-Secret-Token`` is missing or wrong (constant-time
        comparison); 413 over :data:`~adapters.telegram.constants.UPDATE_MAX_BYTES`;
        400 for a body that is not a JSON object with an integer ``update_id``; 200
        otherwise — including an update python-telegram-bot cannot parse, or an
        error in this handler (logged and dropped, so Telegram does not re-send it
        for ever).
        """
        if not self.cfg.secret:
            return web.Response(status=503, text="telegram webhook secret not configured")
        given = request.headers.get(tc.SECRET_HEADER)
        if given is None or not hmac.compare_digest(given.encode("utf-8", "replace"), self.cfg.secret.encode()):
            log.warning("telegram.rejected", status=403, reason="secret token missing or wrong",
                        remote=request.remote)
            return web.Response(status=403, text="forbidden")
        app = self.application
        if app is None or not app.running or not self.accepting:
            return web.Response(status=503, text="telegram adapter not ready")
        try:
            return await self._accept(request, app)
        except Exception:  # noqa: BLE001 — a bug here must not turn into a 5xx that Telegram re-sends
            log.exception("telegram.webhook_error")
            return web.Response(text="ok")

    async def _accept(self, request: web.Request, app: Application) -> web.Response:
        """Read, check and queue one authenticated delivery (see :meth:`handle_webhook`)."""
        try:
            body = await read_limited(request, tc.UPDATE_MAX_BYTES)
        except BodyTooLarge:
            log.warning("telegram.rejected", status=413, reason="body too large")
            return web.Response(status=413, text="body too large")
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, ValueError, RecursionError):
            log.warning("telegram.rejected", status=400, reason="body is not JSON")
            return web.Response(status=400, text="malformed update")
        update_id = data.get("update_id") if isinstance(data, dict) else None
        if not isinstance(update_id, int) or isinstance(update_id, bool):
            log.warning("telegram.rejected", status=400, reason="not an object with an integer update_id")
            return web.Response(status=400, text="malformed update")
        problem = update_problem(data)  # fields of the wrong type would fail later, in a handler
        if problem is not None:
            log.warning("telegram.malformed_update", update_id=update_id, reason=problem)
            return web.Response(text="ok")  # dropped: a 4xx/5xx would make Telegram re-send it for ever
        try:
            update = Update.de_json(data, app.bot)
        except Exception as exc:  # noqa: BLE001 — a 4xx/5xx here would make Telegram re-send it for ever
            log.warning("telegram.unparsable_update", update_id=update_id,
                        error=f"{type(exc).__name__}: {str(exc)[:200]}")
            return web.Response(text="ok")
        await app.update_queue.put(update)
        return web.Response(text="ok")

    # ---- handlers

    async def _gate(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        """Group -1, before every handler: drop a repeated ``update_id``; note the user."""
        self.stats["updates"] += 1
        if update.update_id in self._seen:
            self.stats["duplicates"] += 1
            log.info("telegram.duplicate_update", update_id=update.update_id)
            raise ApplicationHandlerStop
        self._seen[update.update_id] = None
        while len(self._seen) > tc.SEEN_UPDATES_MAX:
            self._seen.popitem(last=False)
        self._note_user(update.effective_user)
        if update.message is not None and update.effective_chat is not None:
            self.sender.unblock(int(update.effective_chat.id))

    async def _on_error(self, update: object, context: ContextTypes.DEFAULT_TYPE) -> None:
        self.stats["errors"] += 1
        update_id = update.update_id if isinstance(update, Update) else None
        log.error("telegram.handler_error", update_id=update_id, exc_info=context.error)


# --------------------------------------------------------------------------- wiring


TELEGRAM_ADAPTER = web.AppKey("telegram_adapter", TelegramAdapter)
"""Where :func:`setup_telegram` stores its :class:`TelegramAdapter` in the app."""


def setup_telegram(app: web.Application, cfg: Config, dispatcher: DispatcherLike, handoff: HandoffManager,
                   *, policy: SendPolicy | None = None, feedback: FeedbackBook | None = None) -> TelegramAdapter:
    """Add ``POST /telegram`` to ``app`` and run the Telegram application in its lifecycle.

    Args:
        app: the aiohttp application (not yet started). The adapter starts in a
            ``cleanup_ctx`` appended here — after the core's, so the dispatcher is
            ready — and stops (finishing queued updates) before the core does.
        cfg: the effective config; ``cfg.telegram`` must have a token.
        dispatcher: ``async handle(Inbound) -> Reply``, deduplicating on (channel, message_id).
        handoff: the HandoffManager shared with the dispatcher.
        policy: retry rules (tests shorten the waits).
        feedback: where votes on answers go (answers then carry 👍 / 👎 buttons).

    Returns:
        The adapter (also at ``app[TELEGRAM_ADAPTER]``). Call :func:`use_polling`
        before the app starts for ``getUpdates`` instead of the webhook.

    Raises:
        ConfigError: see :class:`TelegramAdapter`.
    """
    adapter = TelegramAdapter(cfg, dispatcher, handoff, policy=policy, feedback=feedback)
    app[TELEGRAM_ADAPTER] = adapter
    app.router.add_post(tc.WEBHOOK_PATH, adapter.handle_webhook)

    async def lifecycle(_app: web.Application):
        await adapter.start()
        try:
            yield
        finally:
            await adapter.stop()

    app.cleanup_ctx.append(lifecycle)
    return adapter


def use_polling(app: web.Application) -> TelegramAdapter:
    """Make the app's Telegram adapter poll ``getUpdates`` (local development) instead of
    taking webhook deliveries; call before the app starts. Polling deletes the
    registered webhook (python-telegram-bot's ``Updater.start_polling``).

    Raises:
        ConfigError: the app has no Telegram adapter (no ``HEALTHBOT_TELEGRAM_TOKEN``).
    """
    adapter = app.get(TELEGRAM_ADAPTER)
    if adapter is None:
        raise ConfigError("--telegram-polling: no Telegram adapter; set HEALTHBOT_TELEGRAM_TOKEN")
    adapter.polling = True
    return adapter
