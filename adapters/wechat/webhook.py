"""The WeChat webhook: :class:`WechatAdapter`'s request checks and handlers, and
:func:`setup_wechat` (see the package docstring for the protocol)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import time
import weakref
from collections import Counter
from dataclasses import replace
from typing import Any

import structlog
from aiohttp import web
from wechatpy.crypto import PrpCrypto, WeChatCrypto
from wechatpy.exceptions import InvalidAppIdException, InvalidSignatureException
from wechatpy.utils import WeChatSigner

from adapters.body import BodyTooLarge, read_limited
from adapters.wechat import constants as wc
from adapters.wechat.api import WechatApi
from adapters.wechat.parsing import Reject, extract_encrypt, parse_inbound, parse_timestamp, parse_xml, \
    strip_invalid_xml_chars
from adapters.wechat.pages import CONTINUE_WORDS
from adapters.wechat.passive import PassiveDelivery
from adapters.wechat.replies import render_text_reply, render_transfer_reply
from adapters.wechat.store_state import NO_ANSWER, REPLAY_KEY, DispatcherLike, PassiveAnswer
from bot.admission import ADMISSION_KEY, Admission
from bot.config import Config, ConfigError
from bot.dedup import ReplayRefused, record_once
from bot.feedback import FeedbackBook
from bot.handoff import HandoffManager, PlatformAgentRelay
from bot.store import Store, open_store
from bot.store.health import store_unavailable
from bot.types import Inbound, MessageKind, Reply

log = structlog.get_logger("healthbot.wechat")

__all__ = ["WECHAT_ADAPTER", "WechatAdapter", "setup_wechat"]


def _signature(*parts: str) -> str:
    signer = WeChatSigner()
    signer.add_data(*(p.encode("utf-8", "surrogatepass") for p in parts))  # a lone surrogate is no crash
    return signer.signature


def _same(expected: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


class WechatAdapter(PassiveDelivery):
    """Request handlers for one official account; see the package docstring.

    Args:
        cfg: the effective config (``cfg.wechat``, ``cfg.server.max_body_bytes``).
        dispatcher: anything with ``async handle(Inbound) -> Reply`` that
            deduplicates on (channel, message_id).
        store: the shared store for delivery claims, pending answers, unread pages
            and the access token; may be given later with :meth:`attach`. Without
            one, replies are passive only (a late answer waits in the dispatcher's
            dedup cache for a re-delivery).
        api: the server-API client (default: one on ``store`` for service accounts).
        feedback: where votes on answers go: clicks on a feedback menu line are votes, and with
            ``wechat.feedback_menu`` answers sent through the API are followed by the menu
            (adapters/wechat/feedback.py).

    Attributes:
        stats: counters for metrics — ``passive``, ``deferred`` (budget missed),
            ``replayed``, ``late_kf``, ``late_pending``, ``pending_delivered``,
            ``kf_pages``, ``kf_fallback_pending``, ``kf_unknown``, ``continuations``,
            ``transfers``, ``unsubscribes``, ``store_errors``, ``feedback_menus``. The API client's own
            counters are at ``api.stats``.

    Raises:
        ConfigError: ``wechat.reply_budget_s`` not in (0, 5) s, an EncodingAESKey
            that is not base64 of 32 bytes, or a service account without
            ``wechat.appid`` / ``HEALTHBOT_WECHAT_APPSECRET``.
    """

    def __init__(self, cfg: Config, dispatcher: DispatcherLike, store: Store | None = None,
                 api: WechatApi | None = None, handoff: HandoffManager | None = None,
                 feedback: FeedbackBook | None = None):
        self.cfg = cfg.wechat
        handoff = handoff if handoff is not None else getattr(dispatcher, "handoff", None)
        if self.cfg.token and hasattr(handoff, "register"):
            # a handed-off chat goes to WeChat's customer-service system (transfer_customer_service)
            handoff.register(wc.CHANNEL, PlatformAgentRelay())
        self.max_body_bytes = cfg.server.max_body_bytes
        self.dispatcher = dispatcher
        if not 0 < self.cfg.reply_budget_s < wc.REPLY_DEADLINE_S:
            raise ConfigError(f"config key 'wechat.reply_budget_s': {self.cfg.reply_budget_s} s must be > 0 and "
                              f"below WeChat's {wc.REPLY_DEADLINE_S} s deadline (4.0 leaves room for the network)")
        self.crypto: WeChatCrypto | None = None
        if self.cfg.mode != "plaintext":
            try:
                if len(base64.b64decode(self.cfg.aes_key + "=", validate=True)) != 32:
                    raise ValueError("not 32 bytes")
                self.crypto = WeChatCrypto(self.cfg.token, self.cfg.aes_key, self.cfg.appid)
            except (ValueError, binascii.Error, AssertionError) as exc:
                raise ConfigError(f"config key 'wechat.aes_key': not a valid EncodingAESKey ({exc}); copy the "
                                  f"{wc.AES_KEY_CHARS} characters from the console's 服务器配置") from None
        if self.cfg.token and self.cfg.account_type == "service" and not (self.cfg.appid and self.cfg.appsecret):
            raise ConfigError("config key 'wechat.appsecret': account_type 'service' sends late answers through the "
                              "customer-service API, which needs wechat.appid and HEALTHBOT_WECHAT_APPSECRET")
        self.store: Store | None = None
        self.api: WechatApi | None = api
        self.pending: set[asyncio.Task[Any]] = set()
        self.stats: Counter[str] = Counter()
        #: Late messages (answer still computing when their webhook answered): MsgId -> (Inbound, task).
        self._late: dict[str, tuple[Inbound, asyncio.Future[Reply]]] = {}
        #: Tasks waiting on a customer-service API call (cancelled at the shutdown deadline).
        self._in_api: set[asyncio.Task[Any]] = set()
        #: Set by :meth:`hand_over`: from then on, pages go to the pending queue instead of the API.
        self._closing = False
        #: The app's admission control (its shutdown deadline bounds a delivery's wait).
        self.admission: Admission | None = None
        self.feedback = feedback
        self._user_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        if store is not None:
            self.attach(store)
        if not self.cfg.token:
            log.info("wechat.not_configured", hint="set HEALTHBOT_WECHAT_TOKEN; /wechat answers 503 until then")

    def attach(self, store: Store) -> None:
        """Use ``store`` from now on (and, for a service account, a :class:`WechatApi` on it)."""
        self.store = store
        if self.api is None and self.cfg.account_type == "service" and self.cfg.appsecret:
            self.api = WechatApi(self.cfg, store)

    # ---- request checks

    def _check_timestamp(self, query: Any) -> None:
        ts = parse_timestamp(query.get("timestamp"))
        skew = abs(time.time() - ts)
        if skew > self.cfg.timestamp_window_s:
            raise Reject(403, "stale timestamp", f"timestamp {skew:.0f} s from now (window "
                         f"{self.cfg.timestamp_window_s} s): replay or wrong clock")

    def _check_signature(self, query: Any, required: bool) -> None:
        given = query.get("signature")
        if given is None and not required:
            return
        expected = _signature(self.cfg.token, query.get("timestamp", ""), query.get("nonce", ""))
        if not _same(expected, given):
            raise Reject(403, "invalid signature", "signature missing or wrong")

    def _replay_record(self, query: Any, body: bytes) -> tuple[str, str, float]:
        """Plaintext mode: the record that refuses a (timestamp, nonce) seen with a different body.

        The plaintext ``signature`` covers only token, timestamp and nonce, not the body: a
        query string captured once could carry any body for the whole timestamp window.
        Each (timestamp, nonce) is remembered in the store for twice the window with a
        digest of its body; WeChat's own re-deliveries (up to three, same message) match
        and pass, a different body is refused 403. Safe mode signs the body and needs no
        such record (README recommends it). A store that cannot answer is counted and
        the request let through, as every other store call in the dispatch path is.

        A text message for the dispatcher carries the record to its claim (``Inbound.replay_record``,
        bot/dedup.py: one store round trip a message, not two); any other message (a "1" for the next
        page, a feedback click, an event) is checked by :meth:`_check_replay` before it is answered.
        """
        key = f"{REPLAY_KEY}:{query.get('timestamp', '')}:{query.get('nonce', '')}"
        return key, hashlib.sha256(body).hexdigest(), 2.0 * self.cfg.timestamp_window_s

    async def _check_replay(self, record: tuple[str, str, float]) -> None:
        """:meth:`_replay_record`'s record on its own, before anything else reads the store.

        Raises:
            Reject: 403 ``replayed nonce``.
        """
        try:
            if await record_once(self.store, record):
                return
        except Exception as exc:  # noqa: BLE001 — any store failure: let the request through, counted
            store_unavailable("replay_check", exc)
            return
        raise _replayed()

    def _is_encrypted(self, query: Any) -> bool:
        if self.cfg.mode == "safe":
            return True
        return self.cfg.mode == "compatible" and query.get("encrypt_type", "").lower() == "aes"

    async def _read_body(self, request: web.Request) -> bytes:
        try:
            return await read_limited(request, self.max_body_bytes)
        except BodyTooLarge as exc:
            raise Reject(413, "body too large", str(exc)) from None

    def _decrypt(self, envelope_text: str, query: Any) -> str:
        assert self.crypto is not None
        # Authenticate before any XML parser sees the body: <Encrypt> is found by one
        # linear search, checked against msg_signature, and only then is the envelope parsed.
        encrypt = extract_encrypt(envelope_text)
        ts, nonce = query.get("timestamp", ""), query.get("nonce", "")
        given = query.get("msg_signature")
        if not _same(_signature(self.cfg.token, ts, nonce, encrypt), given):
            raise Reject(403, "invalid signature", "msg_signature missing or wrong")
        if str(parse_xml(envelope_text).get("Encrypt") or "").strip() != encrypt:
            raise Reject(400, "malformed xml", "<Encrypt> is not a field of the <xml> envelope")
        try:
            return self.crypto.decrypt_message({"Encrypt": encrypt}, given, ts, nonce)
        except InvalidSignatureException:
            raise Reject(403, "invalid signature", "msg_signature wrong") from None
        except InvalidAppIdException:
            raise Reject(403, "invalid signature", "decrypted message is for another appid") from None
        except Exception as exc:  # noqa: BLE001 — bad base64 / padding / length from a signed sender
            raise Reject(400, "malformed xml", f"cannot decrypt <Encrypt>: {type(exc).__name__}") from None

    # ---- handlers

    async def handle_get(self, request: web.Request) -> web.Response:
        """``GET /wechat``: URL verification (接入指南).

        Echoes ``echostr`` when ``signature`` = sha1(sorted [token, timestamp, nonce])
        is valid. In compatible/safe mode a request with ``msg_signature`` (=
        sha1(sorted [token, timestamp, nonce, echostr])) gets ``echostr`` decrypted.
        403 ``invalid signature`` otherwise (also outside the timestamp window).
        """
        if not self.cfg.token:
            return web.Response(status=503, text="wechat adapter not configured")
        query = request.query
        try:
            echostr = query.get("echostr")
            if not echostr:
                raise Reject(400, "missing echostr", "GET without echostr")
            if self.crypto is not None and "msg_signature" in query:
                ts, nonce = query.get("timestamp", ""), query.get("nonce", "")
                if not _same(_signature(self.cfg.token, ts, nonce, echostr), query.get("msg_signature")):
                    raise Reject(403, "invalid signature", "msg_signature wrong (GET)")
                self._check_timestamp(query)
                try:
                    echo = PrpCrypto(self.crypto.key).decrypt(echostr, self.cfg.appid)
                except Exception as exc:  # noqa: BLE001
                    raise Reject(403, "invalid signature", f"cannot decrypt echostr: {type(exc).__name__}") from None
            else:
                self._check_signature(query, required=True)
                self._check_timestamp(query)
                echo = echostr
        except Reject as rej:
            log.warning("wechat.rejected", method="GET", status=rej.status, reason=rej.reason)
            return rej.response()
        log.info("wechat.url_verified")
        return web.Response(text=echo)


    async def handle_post(self, request: web.Request) -> web.Response:
        """``POST /wechat``: one message or event → at most one passive reply.

        Answers within ``wechat.reply_budget_s`` seconds of arrival: a passive text
        reply (page 1 of a long answer, with what was pending for the user before
        it), ``transfer_customer_service`` for a handoff, the same reply again for a
        re-delivery of a message already answered, or ``success`` (not ready — the
        answer follows later —, nothing to say, or ``unsubscribe``); encrypted in
        safe mode. 403/413/400 as in the package docstring; 500 ``internal error``
        (logged, never a trace) for a bug while parsing; a dispatcher or store error
        is logged and answered as well as possible (``success`` at worst).
        """
        if not self.cfg.token:
            return web.Response(status=503, text="wechat adapter not configured")
        loop = asyncio.get_running_loop()
        started = loop.time()
        received_at = time.time()
        query = request.query
        try:
            encrypted = self._is_encrypted(query)
            # `signature` covers only the query, so it is checked before the body is
            # read; encrypted requests are authenticated by msg_signature below.
            self._check_signature(query, required=not encrypted)
            if encrypted and not query.get("msg_signature"):
                raise Reject(403, "invalid signature", "encrypted request without msg_signature")
            self._check_timestamp(query)
            body = await self._read_body(request)
            try:
                text = strip_invalid_xml_chars(body.decode("utf-8"))
            except UnicodeDecodeError:
                raise Reject(400, "malformed xml", "body is not UTF-8") from None
            if encrypted:
                text = strip_invalid_xml_chars(self._decrypt(text, query))
            inbound = parse_inbound(text, received_at)
            if not encrypted and self.store is not None:
                record = self._replay_record(query, body)
                if _dispatched(inbound) and getattr(self.dispatcher, "replay_store", None) is self.store:
                    inbound = replace(inbound, replay_record=record)
                else:
                    await self._check_replay(record)
        except Reject as rej:
            log.warning("wechat.rejected", method="POST", status=rej.status, reason=rej.reason)
            return rej.response()
        except Exception:  # noqa: BLE001 — a bug here must not show WeChat a trace
            log.exception("wechat.error", stage="parse")
            return web.Response(status=500, text="internal error")

        try:
            out = await self._respond(inbound, self.cfg.reply_budget_s - (loop.time() - started))
        except ReplayRefused:
            rej = _replayed()
            log.warning("wechat.rejected", method="POST", status=rej.status, reason=rej.reason)
            return rej.response()
        except Exception:  # noqa: BLE001
            log.exception("wechat.error", stage="respond", message_id=inbound.message_id)
            out = NO_ANSWER
        try:
            xml = self._render(out, inbound)
            if xml == wc.NO_REPLY:
                return web.Response(text=wc.NO_REPLY)
            if encrypted:
                assert self.crypto is not None
                xml = self.crypto.encrypt_message(xml, query.get("nonce", ""), str(int(time.time())))
            return web.Response(text=xml, content_type=wc.XML_CONTENT_TYPE)
        except Exception:  # noqa: BLE001
            log.exception("wechat.error", stage="render", message_id=inbound.message_id)
            return web.Response(text=wc.NO_REPLY)


    def _render(self, out: PassiveAnswer, inbound: Inbound) -> str:
        account = str(inbound.raw["ToUserName"])
        if out.kind == "transfer":
            return render_transfer_reply(inbound.user_id, account, self.cfg.kf_account)
        if out.kind == "text" and out.content.strip():
            return render_text_reply(out.content, to_user=inbound.user_id, from_user=account)
        return wc.NO_REPLY



def _replayed() -> Reject:
    return Reject(403, "replayed nonce", "this timestamp and nonce came with another body")


def _dispatched(inbound: Inbound) -> bool:
    """Whether ``inbound`` goes to the dispatcher, whose claim can carry its replay record: a text
    message that is neither a feedback click nor a "1" for the next page (adapters/wechat/passive.py)."""
    return (inbound.kind is MessageKind.TEXT and "bizmsgmenuid" not in inbound.raw
            and inbound.text.strip() not in CONTINUE_WORDS)


WECHAT_ADAPTER = web.AppKey("wechat_adapter", WechatAdapter)
"""Where :func:`setup_wechat` stores its :class:`WechatAdapter` in the app."""


def setup_wechat(app: web.Application, cfg: Config, dispatcher: DispatcherLike, store: Store | None = None,
                 handoff: HandoffManager | None = None, feedback: FeedbackBook | None = None) -> None:
    """Add ``GET /wechat`` (URL verification) and ``POST /wechat`` (messages) to ``app``.

    Args:
        app: the aiohttp application (not yet started).
        cfg: the effective config; ``cfg.wechat``, ``cfg.server.max_body_bytes`` and
            ``cfg.effective_store_url`` are used. With an empty ``wechat.token`` both
            routes answer 503 (an unsigned webhook is never accepted) and no store is opened.
        dispatcher: ``async handle(Inbound) -> Reply``, deduplicating on
            (channel, message_id); called once per WeChat delivery.
        store: the shared store to use; None = the started dispatcher's (``dispatcher.target.store``,
            bot/app.py), else open ``cfg.effective_store_url`` in the app's cleanup context (closed on
            cleanup).
        handoff: the app's handoff manager: told that WeChat's customer-service system
            takes handed-off chats (default: the dispatcher's, if it has one).
        feedback: where votes on answers go (see :class:`WechatAdapter`).

    At start-up, messages a stopped process left unfinished are answered
    (:meth:`WechatAdapter.recover`). On shutdown, computations and deliveries still
    running are waited for until the server's drain deadline (the app's
    :class:`~bot.admission.Admission`; without one, ``reply_budget_s``), and what is
    left is handed to the store (:meth:`WechatAdapter.hand_over`) before it closes.

    Raises:
        ConfigError: see :class:`WechatAdapter`.
        bot.store.StoreError: at start-up, the store cannot be opened.
    """
    adapter = WechatAdapter(cfg, dispatcher, store=store, handoff=handoff, feedback=feedback)
    adapter.admission = app.get(ADMISSION_KEY)
    app[WECHAT_ADAPTER] = adapter
    app.router.add_get("/wechat", adapter.handle_get)
    app.router.add_post("/wechat", adapter.handle_post)

    async def lifecycle(_app: web.Application):
        opened = None
        if adapter.store is None and cfg.wechat.token:
            # The dispatcher's store when it has started (bot/app.py): one connection per process,
            # so the adapter's writes do not wait on the dispatcher's for SQLite's write lock.
            shared = getattr(getattr(dispatcher, "target", None), "store", None)
            if shared is None:
                shared = opened = await open_store(cfg.effective_store_url)
            adapter.attach(shared)
        if cfg.wechat.token:
            await adapter.recover()  # what a stopped process left unfinished
        try:
            yield
        finally:
            await adapter.close()
            if opened is not None:
                await opened.close()

    async def _drain(_app: web.Application) -> None:
        # Until the server's drain deadline (bot/app.py serve), else one reply budget.
        left = adapter.admission.seconds_left() if adapter.admission is not None else None
        await adapter.drain(left)
        await adapter.hand_over()

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(_drain)
