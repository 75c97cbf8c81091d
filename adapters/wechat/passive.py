"""What one delivery of a WeChat message answers, passively (see the package
docstring, "The deadline" and "Long answers").

The delivery of each answer is claimed once in the store (:data:`DELIVERED_KEY`):
a passive reply carries it (page 1 of a long answer, after what was pending for
the user), replays it to a re-delivery, or leaves it to the late path
(:class:`~adapters.wechat.late.LateDelivery`); a user's "1" gets the next unread page; a click on
a feedback menu line is a vote, thanked passively (adapters/wechat/feedback.py).
"""

from __future__ import annotations

import asyncio
import json
import weakref
from typing import Any

import structlog

from adapters.masking import mask_id
from adapters.wechat import constants as wc
from adapters.wechat.feedback import click_reply
from adapters.wechat.late import LateDelivery
from adapters.wechat.pages import CONTINUE_WORDS, Pages, paginate
from adapters.wechat.parsing import strip_invalid_xml_chars
from adapters.wechat.store_state import (COMPOSING_TTL_S, COMPOSING_WAIT_S, CONTINUED_HEADER, DELIVERED_KEY,
                                         DELIVERY_STATE_TTL_S, MORE_KEY, MORE_TTL_S, NO_ANSWER, PENDING_HEADER,
                                         PENDING_KEY, SEGMENT_SEPARATOR, PassiveAnswer, via)
from bot.dedup import ReplayRefused
from bot.types import Inbound, Intent, MessageKind, Reply

log = structlog.get_logger("healthbot.wechat")

__all__ = ["PassiveDelivery"]


class PassiveDelivery(LateDelivery):
    """The passive side of :class:`adapters.wechat.webhook.WechatAdapter`."""

    _user_locks: weakref.WeakValueDictionary[str, asyncio.Lock]

    async def _respond(self, inbound: Inbound, budget_s: float) -> PassiveAnswer:
        """What this delivery of ``inbound`` answers (see the package docstring, "The deadline")."""
        if inbound.raw.get("event") == "unsubscribe":
            await self._answer(inbound, budget_s, late=False)  # the core sees it too; nothing can be sent
            await self._forget(inbound.user_id)
            return NO_ANSWER
        if self.feedback is not None:  # a click on a 👍 / 👎 menu line is a vote, not a question
            thanks = await click_reply(self.feedback, inbound)
            if thanks is not None:
                return PassiveAnswer("text", thanks)
        if self.store is not None and inbound.kind is MessageKind.TEXT and inbound.text.strip() in CONTINUE_WORDS:
            try:
                out = await self._continuation(inbound)
            except Exception:  # noqa: BLE001 — a store failure: let the dispatcher answer "1"
                self.stats["store_errors"] += 1
                log.exception("wechat.store_error", stage="continuation", message_id=inbound.message_id)
                out = None
            if out is not None:
                return out
        reply = await self._answer(inbound, budget_s)
        if reply is None:
            return NO_ANSWER
        if self.store is None:
            return self._plain(reply)
        try:
            out = await self._deliver_passive(inbound, reply)
        except Exception:  # noqa: BLE001 — the store failed: answer this reply alone, unrecorded
            self.stats["store_errors"] += 1
            log.exception("wechat.store_error", stage="passive", message_id=inbound.message_id)
            return self._plain(reply)
        if out.kind != "none":
            self.stats["passive"] += 1
        return out

    def _plain(self, reply: Reply) -> PassiveAnswer:
        """The reply on its own (no store): a handoff, or its text cut to one page."""
        if reply.intent is Intent.HANDOFF:
            return PassiveAnswer("transfer")
        return PassiveAnswer("text", reply.text) if reply.text.strip() else NO_ANSWER

    async def _answer(self, inbound: Inbound, budget_s: float, late: bool = True) -> Reply | None:
        """``dispatcher.handle(inbound)`` if it finishes within ``budget_s`` seconds, else None.

        Raises :class:`~bot.dedup.ReplayRefused` (the request's replay record conflicts).
        The computation runs in its own task behind :func:`asyncio.shield`: neither
        this timeout nor a cancelled request handler (client gone) cancels it. On a
        timeout with ``late``, the answer is delivered when it is ready
        (:meth:`_deliver_late`, once per message in this process).
        """
        task = asyncio.ensure_future(self.dispatcher.handle(inbound))
        self._track(task)
        left = self.admission.seconds_left() if self.admission is not None else None
        if left is not None:  # shutting down: answer before the drain deadline, the rest is handed over
            budget_s = min(budget_s, left - 0.1)
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout=max(budget_s, 0.0))
        except ReplayRefused:
            raise
        except TimeoutError:
            self.stats["deferred"] += 1
            log.warning("wechat.reply_deferred", message_id=inbound.message_id, user=mask_id(inbound.user_id, head=6),
                        budget_s=round(budget_s, 3), kind=inbound.kind.value,
                        then="customer-service API" if self.service else "pending queue")
            if late and self.store is not None and inbound.message_id not in self._late:
                self._watch_late(inbound, task)
            return None
        except Exception as exc:  # noqa: BLE001 — logged with its trace in _finished
            log.error("wechat.dispatcher_failed", message_id=inbound.message_id, error=type(exc).__name__)
            return None

    async def _deliver_passive(self, inbound: Inbound, reply: Reply) -> PassiveAnswer:
        """Claim the delivery of ``inbound``'s answer for this passive reply, or replay / hand over."""
        assert self.store is not None
        key = DELIVERED_KEY.format(msgid=inbound.message_id)
        openid = inbound.user_id
        # The claim and what composing reads, in one round trip: the pending answers are then
        # popped, and unread pages deleted, only where there are some (rarely). An answer of one page
        # is claimed as delivered at once, unless the same read finds something pending (then the
        # claim says "composing", and the answer is composed with it and stored after).
        alone = self._alone(reply)
        found = await self.store.claim_and_read(
            key, *((alone.state(), DELIVERY_STATE_TTL_S) if alone else (via("composing"), COMPOSING_TTL_S)),
            strings=[MORE_KEY.format(openid=openid)], lists=[PENDING_KEY.format(openid=openid)],
            if_found=(via("composing"), COMPOSING_TTL_S) if alone else None)
        claimed, (more,), (pending,) = found.claimed, found.strings, found.lists
        if claimed:
            if alone is not None and not pending and more is None:
                return alone
            out = await self._compose(inbound, reply, pending=bool(pending), more=more is not None)
            await self.store.set(key, out.state(), DELIVERY_STATE_TTL_S)
            return out
        state = await self._state(key)
        if state.get("via") == "passive":  # WeChat did not get our earlier response: the same again
            self.stats["replayed"] += 1
            return PassiveAnswer(str(state.get("type", "none")), str(state.get("content", "")))
        if state.get("via") not in ("kf", "pending"):
            return NO_ANSWER  # another delivery is still composing it (or died doing so)
        # Sent through the API or queued: this delivery carries whatever is pending
        # for the user (its own answer, if still queued), and nothing else.
        out = await self._compose(inbound, None)
        if out.kind != "none":
            await self.store.set(key, out.state(), DELIVERY_STATE_TTL_S)
        return out

    @staticmethod
    def _alone(reply: Reply) -> PassiveAnswer | None:
        """What :meth:`_compose` makes of ``reply`` with nothing pending and no unread pages: its
        text, when it fits one page; None for a handoff, an empty reply or several pages."""
        own = strip_invalid_xml_chars(reply.text).strip()
        if reply.intent is Intent.HANDOFF or not own:
            return None
        pages = paginate(own, reply.lang)
        return PassiveAnswer("text", pages.page(0)) if len(pages.bodies) == 1 else None

    async def _state(self, key: str) -> dict[str, Any]:
        """The delivery state at ``key``, waiting up to :data:`COMPOSING_WAIT_S` while it is "composing"."""
        assert self.store is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + COMPOSING_WAIT_S
        while True:
            raw = await self.store.get(key)
            try:
                state = json.loads(raw) if raw else {}
            except ValueError:
                state = {}
            if state.get("via") != "composing" or loop.time() >= deadline:
                return state
            await asyncio.sleep(0.02)

    async def _compose(self, inbound: Inbound, reply: Reply | None, *, pending: bool = True,
                       more: bool = True) -> PassiveAnswer:
        """The passive reply: what is pending for the user, then ``reply`` (paged); or a transfer.

        ``pending`` / ``more``: False when the user is known to have no pending answers / no
        unread pages (the store is then not asked to pop or delete them).
        """
        assert self.store is not None
        openid = inbound.user_id
        if reply is not None and reply.intent is Intent.HANDOFF:
            text = strip_invalid_xml_chars(reply.text).strip()
            if self.service and text:
                self._spawn(self._send_later(openid, paginate(text, reply.lang, wc.KF_TEXT_MAX_BYTES),
                                             0, inbound.message_id, ""))
            self.stats["transfers"] += 1
            log.info("wechat.transfer", message_id=inbound.message_id, user=mask_id(openid, head=6),
                     kf_account=bool(self.cfg.kf_account))
            return PassiveAnswer("transfer")
        own = strip_invalid_xml_chars(reply.text).strip() if reply is not None else ""
        lang = reply.lang if reply is not None else "zh"
        queued = await self.store.pop_all(PENDING_KEY.format(openid=openid)) if pending else []
        segments = [self._format_pending(raw, inbound.message_id) for raw in queued]
        segments = [s for s in segments if s] + ([own] if own else [])
        if queued:
            self.stats["pending_delivered"] += len(queued)
            log.info("wechat.pending_delivered", message_id=inbound.message_id,
                     user=mask_id(openid, head=6), count=len(queued))
        if not segments:
            return NO_ANSWER
        pages = paginate(SEGMENT_SEPARATOR.join(segments), lang)
        more_key = MORE_KEY.format(openid=openid)
        if len(pages.bodies) == 1:
            if own and more:  # a new answer: unread pages of an older one no longer follow on
                await self.store.delete(more_key)
            return PassiveAnswer("text", pages.page(0))
        if self.service:
            if more:
                await self.store.delete(more_key)
            self._spawn(self._send_later(openid, pages, 1, inbound.message_id, "", reply if own else None))
            return PassiveAnswer("text", pages.page(0))
        await self.store.set(more_key, pages.to_json(1), MORE_TTL_S)
        return PassiveAnswer("text", pages.page(0, more=True))

    @staticmethod
    def _format_pending(raw: str, current_msgid: str) -> str:
        try:
            item = json.loads(raw)
            text, lang = str(item["text"]).strip(), str(item.get("lang") or "zh")
        except (ValueError, KeyError, TypeError):
            log.error("wechat.pending_unreadable")
            return ""
        if item.get("cont"):
            header = CONTINUED_HEADER.get(lang, CONTINUED_HEADER["en"])
        elif item.get("q") and item.get("msgid") != current_msgid:
            header = PENDING_HEADER.get(lang, PENDING_HEADER["en"]).format(q=item["q"])
        else:
            header = ""
        return f"{header}\n{text}" if header else text

    async def _continuation(self, inbound: Inbound) -> PassiveAnswer | None:
        """The next unread page for a user's "1" (None when there is none: the dispatcher answers "1")."""
        assert self.store is not None
        key = DELIVERED_KEY.format(msgid=inbound.message_id)
        if await self.store.get(key):  # a re-delivery of this "1"
            return await self._deliver_passive(inbound, Reply("", Intent.SYSTEM))
        more_key = MORE_KEY.format(openid=inbound.user_id)
        lock = self._user_locks.get(inbound.user_id)
        if lock is None:
            lock = self._user_locks[inbound.user_id] = asyncio.Lock()
        async with lock:  # two quick "1"s of one user get consecutive pages
            raw = await self.store.get(more_key)
            if not raw:
                return None
            if not await self.store.set_if_absent(key, via("composing"), COMPOSING_TTL_S):
                return await self._deliver_passive(inbound, Reply("", Intent.SYSTEM))
            pages = Pages.from_json(raw)
            more = len(pages.bodies) > 1
            if more:
                await self.store.set(more_key, pages.to_json(1), MORE_TTL_S)
            else:
                await self.store.delete(more_key)
            out = PassiveAnswer("text", pages.page(0, more=more))
            await self.store.set(key, out.state(), DELIVERY_STATE_TTL_S)
        self.stats["continuations"] += 1
        return out


    # ---- unsubscribe

    async def _forget(self, openid: str) -> None:
        """Drop what is kept about a user who unfollowed: the core's handoff and session
        state (``dispatcher.forget_user``), their pending answers and unread pages."""
        forget = getattr(self.dispatcher, "forget_user", None)  # absent on test doubles
        if forget is not None:
            try:
                await forget(wc.CHANNEL, openid)
            except Exception:  # noqa: BLE001 — the rest is still forgotten
                log.exception("wechat.forget_failed")
        if self.store is not None:
            try:
                await self.store.delete(PENDING_KEY.format(openid=openid))
                await self.store.delete(MORE_KEY.format(openid=openid))
            except Exception:  # noqa: BLE001
                self.stats["store_errors"] += 1
                log.exception("wechat.store_error", stage="unsubscribe")
        self.stats["unsubscribes"] += 1
        log.info("wechat.unsubscribed", user=mask_id(openid, head=6))

