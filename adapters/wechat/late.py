"""WeChat answers that are ready only after their webhook answered ``success``.

Sent through the customer-service API (service accounts) or queued for the user's
next passive reply (subscription accounts, and whatever the API refused); at
shutdown, computations still running are handed to the store and the next process
computes and delivers them (see the package docstring, "The deadline").
:class:`LateDelivery` is the base of :class:`adapters.wechat.webhook.WechatAdapter`;
it holds the adapter's state.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import structlog

from adapters.masking import mask_id
from adapters.wechat import constants as wc
from adapters.wechat.api import SendOutcome, WechatApi
from adapters.wechat.feedback import send_feedback_menu
from adapters.wechat.pages import Pages, paginate
from adapters.wechat.parsing import strip_invalid_xml_chars
from adapters.wechat.store_state import (DELIVERED_KEY, DELIVERY_STATE_TTL_S, MORE_KEY, MORE_TTL_S, PENDING_KEY,
                                         PENDING_TTL_S, UNFINISHED_KEY, UNFINISHED_TTL_S, DispatcherLike,
                                         inbound_from_json, inbound_to_json, question_snippet, via)
from bot.admission import Admission
from bot.config import WechatConfig
from bot.dedup import ReplayRefused
from bot.feedback import FeedbackBook
from bot.store import Store
from bot.types import Inbound, Intent, Reply
from safety.pii import mask_pii

log = structlog.get_logger("healthbot.wechat")

__all__ = ["KF_FOLLOW_UP_DELAY_S", "SHUTDOWN_GRACE_S", "LateDelivery"]

KF_FOLLOW_UP_DELAY_S = 1.0
"""Seconds between a passive page 1 and the customer-service messages with the rest,
so that they reach the user after it."""
SHUTDOWN_GRACE_S = 0.5
"""Seconds a shutdown waits, after handing unfinished work to the store, for the last store writes."""


class LateDelivery:
    """Late answers, shutdown and recovery of one official account's adapter.

    The state below is set by :class:`adapters.wechat.webhook.WechatAdapter`.
    """

    cfg: WechatConfig
    dispatcher: DispatcherLike
    store: Store | None
    api: WechatApi | None
    stats: Counter[str]
    #: Computations and deliveries still running.
    pending: set[asyncio.Task[Any]]
    #: Late messages (answer still computing when their webhook answered): MsgId -> (Inbound, task).
    _late: dict[str, tuple[Inbound, asyncio.Future[Reply]]]
    #: Tasks waiting on a customer-service API call (cancelled at the shutdown deadline).
    _in_api: set[asyncio.Task[Any]]
    #: Set by :meth:`hand_over`: from then on, pages go to the pending queue instead of the API.
    _closing: bool
    #: The app's admission control (its shutdown deadline bounds a delivery's wait).
    admission: Admission | None
    #: Votes on answers (bot/feedback.py); the menu is sent only with ``wechat.feedback_menu``.
    feedback: FeedbackBook | None

    @property
    def service(self) -> bool:
        """True when late answers and extra pages go out through the customer-service API."""
        return self.cfg.account_type == "service" and self.api is not None

    def _watch_late(self, inbound: Inbound, task: asyncio.Future[Reply]) -> None:
        """Deliver ``task``'s answer when it is ready (:meth:`_deliver_late`)."""
        self._late[inbound.message_id] = (inbound, task)
        task.add_done_callback(lambda t: self._spawn(self._deliver_late(inbound, t)))

    def _track(self, task: asyncio.Task[Any]) -> None:
        self.pending.add(task)
        task.add_done_callback(self._finished)

    def _spawn(self, coro: Any) -> None:
        self._track(asyncio.ensure_future(coro))

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self.pending.discard(task)
        if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), ReplayRefused):
            log.error("wechat.dispatcher_error", exc_info=task.exception())

    # ---- late answers

    async def _deliver_late(self, inbound: Inbound, task: asyncio.Future[Reply]) -> None:
        """Deliver the answer of a computation that outlived its webhook, unless a passive reply claimed it."""
        try:
            if task.cancelled() or task.exception() is not None:
                return  # not cached by the dispatcher: WeChat's next delivery computes it again
            await self._deliver_late_reply(inbound, task.result())
        except Exception:  # noqa: BLE001
            self.stats["store_errors"] += 1
            log.exception("wechat.error", stage="late", message_id=inbound.message_id)
        finally:
            self._late.pop(inbound.message_id, None)

    async def _deliver_late_reply(self, inbound: Inbound, reply: Reply) -> None:
        assert self.store is not None
        text = strip_invalid_xml_chars(reply.text or "").strip()
        if not text:
            return  # nothing to say (an event, a silent handoff relay)
        key = DELIVERED_KEY.format(msgid=inbound.message_id)
        question = question_snippet(mask_pii(inbound.text))  # kept up to 24 h in the store: no personal data
        if self.service:
            if not await self.store.set_if_absent(key, via("kf"), DELIVERY_STATE_TTL_S):
                return  # a passive reply has it
            self.stats["late_kf"] += 1
            log.info("wechat.late_answer_kf", message_id=inbound.message_id, user=mask_id(inbound.user_id, head=6))
            await self._send_pages(inbound.user_id, paginate(text, reply.lang, wc.KF_TEXT_MAX_BYTES), 0,
                                   inbound.message_id, question, reply)
            return
        if reply.intent is Intent.HANDOFF:
            # Too late for transfer_customer_service; the dispatcher has started the
            # handoff and the user's next message is transferred. A stale "connecting
            # you" text is not queued.
            log.info("wechat.late_handoff_text_dropped", message_id=inbound.message_id,
                     user=mask_id(inbound.user_id, head=6))
            return
        if not await self.store.set_if_absent(key, via("pending"), DELIVERY_STATE_TTL_S):
            return
        item = {"msgid": inbound.message_id, "q": question, "text": text, "lang": reply.lang}
        await self.store.push(PENDING_KEY.format(openid=inbound.user_id), json.dumps(item, ensure_ascii=False),
                              PENDING_TTL_S)
        self.stats["late_pending"] += 1
        log.info("wechat.answer_pending", message_id=inbound.message_id, user=mask_id(inbound.user_id, head=6))

    async def _send_later(self, openid: str, pages: Pages, start: int, msgid: str, question: str,
                          reply: Reply | None = None) -> None:
        """:meth:`_send_pages` after :data:`KF_FOLLOW_UP_DELAY_S` (so they follow the passive reply)."""
        try:
            await asyncio.sleep(KF_FOLLOW_UP_DELAY_S)
            await self._send_pages(openid, pages, start, msgid, question, reply)
        except Exception:  # noqa: BLE001
            self.stats["store_errors"] += 1
            log.exception("wechat.error", stage="kf_pages", message_id=msgid)

    async def _send_pages(self, openid: str, pages: Pages, start: int, msgid: str, question: str,
                          reply: Reply | None = None) -> None:
        """Send ``pages.bodies[start:]`` through the customer-service API, in order.

        At most :data:`~adapters.wechat.constants.KF_MESSAGES_PER_USER_MESSAGE`
        messages; the last one allowed says "回复 1 查看更多" when pages remain, and
        those wait under :data:`MORE_KEY`. A message WeChat refused (45047, 45015,
        45009, …) and everything after it go to the pending queue; a message whose
        fate is unknown (timeout) is not queued again (it may have arrived), the rest is.
        When every page went out with a message of the quota to spare, ``reply`` (the answer
        to ``msgid``) is followed by the feedback menu, if on (adapters/wechat/feedback.py).
        """
        assert self.store is not None and self.api is not None
        n = len(pages.bodies)
        allowed_end = start + wc.KF_MESSAGES_PER_USER_MESSAGE
        me = asyncio.current_task()
        for i in range(start, n):
            if self._closing:  # shutting down: what is left waits for the user's next message
                await self._queue_rest(openid, pages, i, msgid, question)
                return
            last_allowed = i == allowed_end - 1 and n > allowed_end
            if me is not None:
                self._in_api.add(me)
            try:
                outcome = await self.api.send_text(openid, pages.page(i, more=last_allowed))
            except asyncio.CancelledError:
                # The shutdown deadline came during the call: the page may or may not have
                # arrived; queued again (a repeat rather than a loss), with the rest.
                if self._closing:
                    await self._queue_rest(openid, pages, i, msgid, question)
                raise
            finally:
                if me is not None:
                    self._in_api.discard(me)
            if outcome is SendOutcome.SENT:
                self.stats["kf_pages"] += 1
                if last_allowed:
                    await self.store.set(MORE_KEY.format(openid=openid), pages.to_json(i + 1), MORE_TTL_S)
                    return
                if i == n - 1 and reply is not None and n - start < wc.KF_MESSAGES_PER_USER_MESSAGE:
                    await self._feedback_menu(openid, msgid, reply)
                continue
            if outcome is SendOutcome.UNKNOWN:
                self.stats["kf_unknown"] += 1
                log.warning("wechat.kf_unknown", message_id=msgid, user=mask_id(openid, head=6), page=i + 1,
                            hint="no answer from the API: not queued again, it may have reached the user")
            rest = i if outcome is SendOutcome.FAILED else i + 1
            if rest < n:
                await self._queue_rest(openid, pages, rest, msgid, question)
                self.stats["kf_fallback_pending"] += 1
                log.info("wechat.kf_failed_answer_pending", message_id=msgid,
                         user=mask_id(openid, head=6), from_page=rest + 1)
            return

    async def _feedback_menu(self, openid: str, msgid: str, reply: Reply) -> None:
        """The 👍 / 👎 menu after ``reply`` when ``wechat.feedback_menu`` is on (adapters/wechat/feedback.py)."""
        if self.cfg.feedback_menu and self.feedback is not None and self.api is not None and not self._closing:
            if await send_feedback_menu(self.api, self.feedback, openid, msgid, reply):
                self.stats["feedback_menus"] += 1

    async def _queue_rest(self, openid: str, pages: Pages, rest: int, msgid: str, question: str) -> None:
        """Pages ``rest`` on of an answer into the user's pending queue (their next passive reply)."""
        assert self.store is not None
        text = "\n\n".join(pages.bodies[rest:] + ((pages.tail,) if pages.tail else ()))
        item = {"msgid": msgid, "q": question if rest == 0 else "", "cont": rest > 0, "text": text,
                "lang": pages.lang}
        await self.store.push(PENDING_KEY.format(openid=openid), json.dumps(item, ensure_ascii=False),
                              PENDING_TTL_S)
        if self._closing:
            self.stats["shutdown_pages_pending"] += 1
            log.info("wechat.shutdown_answer_pending", message_id=msgid,
                     user=mask_id(openid, head=6), from_page=rest + 1)


    async def drain(self, timeout_s: float | None = None) -> None:
        """Wait up to ``timeout_s`` seconds (default ``reply_budget_s``) for computations
        and deliveries still running after their webhook answered; never cancels them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.cfg.reply_budget_s if timeout_s is None else max(timeout_s, 0.0))
        while self.pending and loop.time() < deadline:
            await asyncio.wait(set(self.pending), timeout=deadline - loop.time())

    async def hand_over(self) -> None:
        """Graceful shutdown, after :meth:`drain` and before the store closes: nothing
        computed or being delivered is lost.

        Each message whose answer is still being computed goes to :data:`UNFINISHED_KEY`
        (the next process to start answers it; the delivery claim keeps it to one
        delivery) and is no longer delivered from here; a customer-service send still
        waiting on the API is cancelled, and its page with every page not yet sent goes
        to the user's pending queue (as does every page from now on). Then up to
        :data:`SHUTDOWN_GRACE_S` for those store writes.
        """
        if self.store is None:
            return
        self._closing = True
        saved = 0
        for inbound, task in list(self._late.values()):
            if task.done():
                continue
            try:
                await self.store.push(UNFINISHED_KEY, inbound_to_json(inbound), UNFINISHED_TTL_S)
            except Exception:  # noqa: BLE001 - it may still finish and be delivered before the store closes
                self.stats["store_errors"] += 1
                log.exception("wechat.store_error", stage="shutdown", message_id=inbound.message_id)
                continue
            saved += 1
            task.cancel()  # its delivery is now the next process's (the computation itself goes on)
        for task in list(self._in_api):
            task.cancel()
        if self.pending:
            await asyncio.wait(set(self.pending), timeout=SHUTDOWN_GRACE_S)
        self.stats["shutdown_unfinished_saved"] += saved
        if saved or self.pending:
            log.info("wechat.shutdown_handed_over", unfinished_saved=saved, still_running=len(self.pending))

    async def recover(self) -> int:
        """At start-up: compute and deliver the messages a stopped process left unfinished
        (:data:`UNFINISHED_KEY`); returns how many were taken. Never raises."""
        if self.store is None:
            return 0
        try:
            items = await self.store.pop_all(UNFINISHED_KEY)
        except Exception:  # noqa: BLE001 - the store is down: they wait for a later start
            self.stats["store_errors"] += 1
            log.exception("wechat.store_error", stage="recover")
            return 0
        taken = 0
        for raw in items:
            inbound = inbound_from_json(raw)
            if inbound is None or inbound.message_id in self._late:
                continue
            task = asyncio.ensure_future(self.dispatcher.handle(inbound))
            self._track(task)
            self._watch_late(inbound, task)
            taken += 1
        if taken:
            self.stats["recovered"] += taken
            log.info("wechat.recovered_unfinished", count=taken)
        return taken

    async def close(self) -> None:
        """Close the API client's HTTP session."""
        if self.api is not None:
            await self.api.close()

