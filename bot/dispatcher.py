"""The one async dispatcher every channel calls: Inbound -> Reply.

Order of checks (docs/architecture.md, "One WeChat text message, end to end"):

1. exactly-once on (channel, user, message id): a channel's retry gets the same reply,
   computed once;
2. message kind: follow events get the greeting, non-text a helpful text;
3. normalize once; safety.triage: emergencies and crises first, with no knowledge-base advice (rules on
   the text alone, so they answer even when the encoder is busy; a flag told as over gets a net at step 6);
4. a chat handed to a person is relayed, not answered; the per-user rate limit;
5. rule intents: ending a handoff, greeting, a request for a person (started only where a person can
   take it), abuse; scope and care-team rules;
6. one encoder call: retrieval, the decision head (bot/classifier.py) and the topic-fit verifier
   (bot/topic_fit.py) read the same embedding; the policy (bot/decision.py) decides: emergency or crisis,
   a safety-net line, greeting, handoff, referral, out of scope, an answer only when everything agrees,
   else an honest no_answer;
7. safety.review + disclaimer on every health text; the reply follows the user's script (Traditional in,
   Traditional out).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Awaitable, TypeVar

import structlog

from bot import metrics
from bot.classifier import DecisionHead
from bot.config import Config
from bot.decision import decide
from bot.dedup import ExactlyOnce, MessageState, OnceCache, message_key
from bot.follow_up import (FACET_AFTER_REFERRAL, SEE_DOCTOR, FollowUpPlan, after_crisis_reply, ask_back_reply,
                           asks_in_general, below_referral, follow_up_reply, has_facet, more_reply, new_subject_of,
                           read_follow_up, read_named_facet)
from bot.follow_up_judge import plan_follow_up
from bot.handoff import HandoffManager
from bot.intents import (BUSY_REPLY, HANDOFF_ENDED_REPLY, HANDOFF_UNAVAILABLE_REPLY, SLOW_DOWN_REPLY, VOICE_OFF_REPLY,
                         abuse_reply, care_team_reply, drop_handoff_offer, greeting_reply, intent_reply, is_abuse,
                         is_end_handoff, rule_intent, unsupported_reply)
from bot.knowledge import KnowledgeBase, Topic
from bot.logs import ensure_request_id
from bot.retrieval import Retriever
from bot.session import Session, Sessions
from bot.suggestion import (DECLINED, MAX_OFFERED, answer_to_offer, ask_again_reply, choose_first_reply,
                            offered_topics, suggestion_reply)
from bot.store import Bucket, MemoryStore, Store, StoreError
from bot.store.health import store_unavailable
from bot.topic_fit import TopicFit
from bot.types import Inbound, Intent, MessageKind, Reply
from bot.unanswered import UnansweredRecorder
from inference.batcher import BusyError, DeadlineExceeded
from inference.engines.base import EngineError
from safety.disclaimer import with_disclaimer
from safety.normalize import normalize, to_user_script
from safety.pii import mask_pii, pseudonym
from safety.readings import moderate_bp
from safety.review import review
from safety.safety_net import after_danger_line, safety_net
from safety.settled import settled
from safety.scope import check_scope, has_medicine, names_medicine, refer_reply, without_medicine_avoided
from safety.triage import crisis_reply, triage

log = structlog.get_logger("healthbot.dispatch")

T = TypeVar("T")

#: Replies about health: reviewed (no dose, no "stop taking") and carrying the disclaimer.
HEALTH_INTENTS = frozenset({Intent.ANSWER, Intent.EMERGENCY, Intent.REFER_DOCTOR, Intent.NO_ANSWER})
#: Channels whose users are rate limited (the CLI and evaluations are local tools).
RATE_LIMITED_CHANNELS = frozenset({"wechat", "telegram", "http"})


class Dispatcher:
    """Decides and composes the reply to each message, exactly once per message.

    Args:
        cfg: the effective configuration.
        kb: the knowledge base (swappable at run time through :attr:`retriever`).
        retriever: hybrid retrieval over ``kb`` (owns the encoder).
        head: the learned decision head over the question's embedding (bot/classifier.py).
        topic_fit: the verifier of the best topic against the question (bot/topic_fit.py).
    """

    def __init__(self, cfg: Config, retriever: Retriever, head: DecisionHead, topic_fit: TopicFit,
                 handoff: HandoffManager | None = None, store: Store | None = None):
        self.cfg = cfg
        self.retriever, self.head, self.topic_fit = retriever, head, topic_fit
        self.store: Store = store if store is not None else MemoryStore()
        self.handoff = handoff or HandoffManager(self.store)
        self.sessions = Sessions(self.store)
        self.once: OnceCache[Reply] = OnceCache()
        self.exactly_once = ExactlyOnce(self.store)
        self.replay_store: Store = self.store  # where handle() records Inbound.replay_record, with the claim
        self.unanswered = UnansweredRecorder(cfg.knowledge)  # knowledge.record_unanswered

    async def _without_store(self, operation: str, call: Awaitable[T], fallback: T) -> T:
        """``await call``; if the store fails, ``fallback`` instead: the reply is still computed and
        delivered, and the outage logged and counted (``store.unavailable``, bot/store/health.py)."""
        try:
            return await call
        except StoreError as exc:
            store_unavailable(operation, exc)
            return fallback

    def _bucket(self, inbound: Inbound) -> Bucket | None:
        """The sender's token bucket (``server.user_rate_per_minute``, ``server.user_burst``); None for
        a channel without a rate limit, or a message that is no text (a follow, a photo)."""
        if inbound.channel not in RATE_LIMITED_CHANNELS or inbound.kind is not MessageKind.TEXT:
            return None
        srv = self.cfg.server
        return f"rate:{inbound.channel}:{inbound.user_id}", srv.user_rate_per_minute / 60.0, srv.user_burst

    async def _within_rate(self, inbound: Inbound, state: MessageState) -> bool:
        """The token taken with the message's read (:meth:`handle`), else one taken now; True
        with no limit, and while the store is down."""
        if state.token is not None or (bucket := self._bucket(inbound)) is None:
            return state.token is not False
        return await self._without_store("rate_limit", self.store.take_token(*bucket), True)

    async def forget_user(self, channel: str, user_id: str) -> None:
        """Drop everything kept about a user: handoff, transcript, session (unsubscribe, /stop)."""
        await self.handoff.forget(channel, user_id)
        await self.sessions.forget(channel, user_id)

    @property
    def kb(self) -> KnowledgeBase:
        return self.retriever.kb

    async def handle(self, inbound: Inbound) -> Reply:
        """The reply to ``inbound``; a retried message returns the first computation's reply.

        Never raises for bad input or an overloaded pool (polite replies), only bot.dedup.ReplayRefused for a
        conflicting ``inbound.replay_record``. A retry answered without computing (in flight here, or stored by
        any replica) counts in ``healthbot_dedup_hits_total``."""
        computed = False

        def compute(state: MessageState):
            nonlocal computed
            computed = True
            return self._timed(inbound, state)

        reads = (self.handoff.session_key(inbound.channel, inbound.user_id), self.sessions.key(inbound.channel, inbound.user_id),
                 self.handoff.turns_key(inbound.channel, inbound.user_id))
        reply = await self.once.run(message_key(inbound), lambda: self.exactly_once.run(
            inbound, compute, reads, self._bucket(inbound)), joining=lambda: self.exactly_once.check_record(inbound))
        if not computed:  # answered by an in-flight or stored computation
            metrics.DEDUP_HITS.labels(channel=inbound.channel).inc()
        return reply

    def _read(self, state: MessageState, operation: str, key: str) -> str | None:
        """``state``'s value at ``key``; None if the store failed (the outage reported as ``operation``)."""
        try:
            return state.get(key)
        except StoreError as exc:
            store_unavailable(operation, exc)
            return None

    async def _timed(self, inbound: Inbound, state: MessageState) -> Reply:
        """``_decide`` plus one log line (event ``reply``: ``request_id``, bound here when the channel bound
        none, channel, intent, topic, confidence, engine, input length in characters, latency in ms, outcome
        and the decision's details; bot/logs.py masks personal data in it) and the request metrics
        (bot/metrics.py) per computed message. A question the bot could not answer is recorded (bot/unanswered.py)."""
        with ensure_request_id():
            metrics.REQUESTS_IN_FLIGHT.inc()
            start = time.perf_counter()
            try:
                reply, extra = await self._decide(inbound, state)
            except Exception as exc:
                latency_s = time.perf_counter() - start
                metrics.observe_request(inbound.channel, "error", latency_s)
                log.error("reply", channel=inbound.channel, user=pseudonym(inbound.user_id),
                          message_id=inbound.message_id, input_chars=len(inbound.text),
                          latency_ms=round(latency_s * 1000.0, 2), outcome="error", error=type(exc).__name__)
                raise
            finally:
                metrics.REQUESTS_IN_FLIGHT.dec()
            latency_ms = (latency_s := time.perf_counter() - start) * 1000.0
            reply = Reply(**{**reply.__dict__, "latency_ms": latency_ms})
            outcome = metrics.request_outcome(reply.intent.value, extra)
            metrics.observe_request(inbound.channel, outcome, latency_s)
            metrics.record_safety(reply.intent.value, extra)
            metrics.record_offer(extra)
            if inbound.kind is MessageKind.TEXT and inbound.text:  # both turns, written with the reply
                turns = [("user", inbound.text)] + ([("bot", reply.text)] if reply.text else [])
                kept = self._read(state, "transcript", self.handoff.turns_key(inbound.channel, inbound.user_id))
                if state.error is None:
                    state.set("transcript", *self.handoff.with_turns(inbound.channel, inbound.user_id, kept, *turns))
            log.info("reply", channel=inbound.channel, user=pseudonym(inbound.user_id), message_id=inbound.message_id,
                     intent=reply.intent.value, topic=reply.topic, confidence=round(reply.confidence, 3),
                     engine=reply.engine, input_chars=len(inbound.text), latency_ms=round(latency_ms, 2),
                     outcome=outcome, **extra)
            self.unanswered.record(self.store, inbound, reply, extra)  # in the background; never fails
            return reply

    async def _decide(self, inbound: Inbound, state: MessageState) -> tuple[Reply, dict[str, Any]]:
        norm = normalize(text := inbound.text or "")
        # A message with no words (a follow event, a photo) says nothing of its language: the channel's hint, else Chinese.
        lang = inbound.lang or (norm.lang if norm.text.strip() else "zh")
        agents = self.handoff.reachable(inbound.channel)  # can a person take a handoff here?
        notes: dict[str, Any] = {}

        def out(body: str, intent: Intent, **kw: Any) -> Reply:
            """The reply in the user's script; health texts reviewed and carrying the disclaimer;
            no offer of a person where nobody can take a handoff."""
            if intent in HEALTH_INTENTS:
                checked = review(body, lang)
                if checked.blocked:
                    notes["review_blocked"] = list(checked.reasons)
                body = checked.text
            if not agents:
                body = drop_handoff_offer(body)
            if intent in HEALTH_INTENTS:
                body = with_disclaimer(body, lang)
            return Reply(to_user_script(body, norm.script, norm.variant), intent, lang, **kw)

        if inbound.kind is MessageKind.SUBSCRIBE or inbound.kind is MessageKind.TEXT and not norm.text.strip():
            return out(intent_reply(Intent.GREETING, lang), Intent.GREETING), {}
        if inbound.kind is MessageKind.EVENT:
            return Reply("", Intent.SYSTEM, lang), {}
        in_handoff = self.handoff.active_in(self._read(state, "handoff_active", self.handoff.session_key(
            inbound.channel, inbound.user_id)))
        if inbound.kind is MessageKind.UNSUPPORTED:
            if in_handoff is not None:  # agents see that something was sent; the bot stays silent
                await self._without_store("handoff_relay", self.handoff.user_message(
                    in_handoff, f"[{inbound.raw.get('type') or 'attachment'}]"), None)
                return Reply("", Intent.HANDOFF, lang, handoff=True), {"handoff": "relayed"}
            if inbound.raw.get("type") == "voice":
                return Reply(VOICE_OFF_REPLY[lang], Intent.SYSTEM, lang), {"unsupported": "voice"}
            return Reply(unsupported_reply(lang), Intent.SYSTEM, lang), {"unsupported": inbound.raw.get("type")}

        urgent = triage(norm.text, lang, self.cfg.safety)
        told_over, urgent = (urgent, None) if urgent is not None and urgent.settled else (None, urgent)  # "现在好了"
        notes.update({"settled": f"{told_over.rule}: {told_over.settled}"} if told_over else {})  # a net, not 120 now
        if urgent is None and is_end_handoff(norm):  # "结束人工", "end chat": the bot takes the chat back
            ended = in_handoff is not None and await self._without_store("handoff_end", self.handoff.end(
                inbound.channel, inbound.user_id, by="user"), None)
            return out(HANDOFF_ENDED_REPLY[lang], Intent.SYSTEM), {"handoff": "ended_by_user" if ended else "none"}
        if in_handoff is not None:
            # The bot stays silent while a person handles the chat, except for an
            # emergency, which always gets emergency guidance at once.
            await self._without_store("handoff_relay", self.handoff.user_message(in_handoff, text), None)
            if urgent is None:
                return Reply("", Intent.HANDOFF, lang, handoff=True), {"handoff": "relayed"}
        session = self.sessions.parse(self._read(state, "session_get",
                                                 self.sessions.key(inbound.channel, inbound.user_id)))
        if urgent is not None:
            session.danger = urgent.kind  # a thanks that follows keeps the safety net
            self._save_session(inbound, state, session)
            return out(urgent.reply, Intent.EMERGENCY, handoff=True), {"rule": urgent.rule, "kind": urgent.kind, **notes}
        if not await self._within_rate(inbound, state):
            return Reply(SLOW_DOWN_REPLY[lang], Intent.SYSTEM, lang), {"rule": "rate_limited"}
        if (choice := answer_to_offer(norm.text)) is not None:  # "是", "2", "不是" to the topics last offered
            offered = offered_topics(self.kb, session.suggested)
            if len(session.offer_form) == 3:  # the reply follows the last offer's language and script
                lang, script, variant = session.offer_form
                norm = dataclasses.replace(norm, script=script, variant=variant)
            if 0 <= choice < len(offered):
                if session.offer_facet is not None:  # "那饮食上呢" came while the offer stood: that facet of the choice
                    facet, session.offer_facet, session.suggested = session.offer_facet, None, []
                    self._save_session(inbound, state, session)
                    return self._follow_up(inbound, state, session, offered[choice], facet, lang, out)
                return self._send_topic(inbound, state, session, offered[choice], lang, out, {"decided_by": "suggestion"})
            if choice == DECLINED:  # a bare "不是" is no question: ask for one rather than read it as one
                if offered:
                    session.suggested = []
                    self._save_session(inbound, state, session)
                return out(ask_again_reply(lang), Intent.NO_ANSWER), {"decided_by": "suggestion", "offer": "declined"}
        intent = rule_intent(norm)
        if intent is None and is_abuse(norm):
            return out(abuse_reply(lang), Intent.OUT_OF_SCOPE), {"rule": "abuse"}
        if intent is Intent.HANDOFF:
            return await self._handoff(inbound, agents, out, lang, "rule")
        scope = check_scope(norm.text, lang)
        referral = care_team_reply(norm, lang)
        retriever, head, topic_fit = self.retriever, self.head, self.topic_fit  # one model per message: bot/model_reload.py
        last = retriever.kb.topics.get(session.last_topic or "")
        # Personal data (a phone number, an ID) says nothing about the question and pulls the
        # embedding toward "call me": the follow-up reading, retrieval and the head read it masked.
        masked = mask_pii(norm.text)
        # a medicine or diagnosis question ("我在喂奶 能吃感冒药吗" after a cold) is referred, the facet below
        plan = (await plan_follow_up(masked, last, lang, retriever, referred=scope is not None)
                if intent is None and referral is None and (scope is None or scope.reason in FACET_AFTER_REFERRAL)
                else FollowUpPlan())
        if plan.ask_back:  # a follow-up with no topic answered before it: ask, don't guess
            offered = offered_topics(retriever.kb, session.suggested)
            if offered and (asked := read_follow_up(masked)) is not None:  # ... but topics were just offered
                session.offer_facet, session.offer_form = asked.facet, [lang, norm.script, norm.variant]
                self._save_session(inbound, state, session)
                return out(choose_first_reply(offered, asked.facet, lang), Intent.NO_ANSWER,
                           suggested=tuple(session.suggested)), {"follow_up": "choose_offer"}
            return out(ask_back_reply(lang), Intent.NO_ANSWER), {"follow_up": "no_context"}
        if plan.facet is not None:  # "那饮食上呢": the topic in context answers, or says honestly it can't
            return self._follow_up(inbound, state, session, last, plan.facet.facet, lang, out)
        # "那饮食上呢" after a blood-pressure answer: read it with the last topic's title.
        context = last.title[lang] if plan.with_context else None
        query = without_medicine_avoided(masked)
        try:
            found = plan.searched.get((query, context)) or await retriever.search(query, context=context)
        except (BusyError, DeadlineExceeded, EngineError) as exc:
            # EngineError reaches here only when no engine can serve (no CPU fallback, or every
            # inference worker process is restarting). What the rules decided still goes out;
            # otherwise the user is asked to resend, not failed.
            if told_over is not None:  # nothing can read the rest: the red flag's own reply, as the rules alone give it
                return out(told_over.reply, Intent.EMERGENCY, handoff=True), {**notes, "rule": told_over.rule, "error": type(exc).__name__}
            if intent is not None:
                return out(intent_reply(intent, lang), intent), {"rule": "rule_intent", "error": type(exc).__name__}
            if scope is not None:
                return out(scope.reply, Intent.REFER_DOCTOR), {"rule": scope.reason, "error": type(exc).__name__}
            return Reply(BUSY_REPLY[lang], Intent.SYSTEM, lang), {"error": type(exc).__name__}
        best = found.matches[0]
        probs = head.probabilities(found.vector)
        if found.context_vector is not None:
            # A follow-up ("那夏天呢") is classified with the topic it follows; danger is read
            # from both, so a follow-up that brings a red flag keeps it.
            bare, probs = probs, head.probabilities(found.context_vector)
            for label in ("emergency", "crisis"):
                probs[label] = max(probs[label], bare[label])
        d = decide(probs, self.cfg.decision, rule=intent, scope=scope is not None,
                   care_team=referral is not None, off_topic=found.off_topic, retrieval_confidence=best.confidence,
                   min_confidence=self.cfg.knowledge.min_confidence,
                   scope_gap=retriever.scope.uncovered(norm.text, best.topic_id), names_medicine=names_medicine(norm.text),
                   # a follow-up ("那饮食上呢") was retrieved within the topic it follows; the verifier,
                   # trained on whole questions, judges only questions that stand alone
                   topic_fit=(topic_fit.probability(found.fit_features, found.prior_terms)
                              if found.context_vector is None else best.confidence), contested=found.contested,
                   danger_over=told_over is not None or bool(settled(norm.text) or moderate_bp(norm.text)), flagged=told_over is not None,
                   sibling=topic_fit.runner_up_is_sibling(found.matches))
        notes.update(d.notes, decided_by=d.source, best_topic=best.topic_id)
        net_ids, net_line = (), ""
        if d.safety_net:
            net_ids, net_line = safety_net(norm.text, lang, d.safety_net, *self.cfg.safety.contacts(lang))
            notes["safety_net"] = list(net_ids)

        def reply(body: str, intent: Intent, **kw: Any) -> Reply:
            if net_line:
                body = f"{body}\n{net_line}"
            return out(body, intent, safety_net=net_ids, engine=retriever.encoder.engine_name, **kw)

        # a cue inside a message the judge read as following the topic in context ("我外公快九十了 老人洗要注意啥"):
        # that topic answers when nothing but the head's doubts stands against it
        if plan.loose is not None and (d.intent in (Intent.ANSWER, Intent.NO_ANSWER) or d.source == "head" and d.intent in (
                Intent.REFER_DOCTOR, Intent.OUT_OF_SCOPE)):
            return self._follow_up(inbound, state, session, last, plan.loose.facet, lang, reply, hint=True)
        # "would exercise help?" after a restless-legs answer finds the exercise topic on its own, and "要去医院看吗
        # 挂什么科" after a sore-throat answer finds no topic it is sure of: each asks for that facet of the topic
        # just answered, when that topic has it and the message names no subject of its own
        if (plan.cue is not None and d.intent in (Intent.ANSWER, Intent.NO_ANSWER) and d.source != "rule"
                and (asks_in_general(plan.cue.facet, best.topic_id)
                     or d.intent is Intent.NO_ANSWER and plan.cue.facet == SEE_DOCTOR)
                and has_facet(last, plan.cue.facet)
                and new_subject_of(retriever, masked, last.id) is None):
            return self._follow_up(inbound, state, session, last, plan.cue.facet, lang, reply, hint=True)
        if d.intent is Intent.EMERGENCY:
            body = (crisis_reply(lang, self.cfg.safety) if d.kind == "crisis"
                    else f"{intent_reply(Intent.EMERGENCY, lang)}\n{safety_net(norm.text, lang, 'emergency', *self.cfg.safety.contacts(lang))[1]}")
            if d.kind == "crisis" and last is not None and probs["crisis"] < self.cfg.decision.crisis_sure:
                body = f"{body.rstrip()}\n\n{after_crisis_reply(retriever.kb, last, norm.text, lang)}"  # frustration, maybe
            session.danger = d.kind
            self._save_session(inbound, state, session)
            return out(body, Intent.EMERGENCY, handoff=True, engine=retriever.encoder.engine_name), {**notes, "kind": d.kind}
        if d.intent is Intent.HANDOFF:
            return await self._handoff(inbound, agents, out, lang, "head")
        if d.intent is Intent.REFER_DOCTOR:
            body = scope.reply if scope is not None and d.source == "rule" else refer_reply("prescription" if has_medicine(norm.text) else "diagnosis", lang, norm.text)
            if (below := below_referral(last, plan.loose, lang)) is not None:  # a head referral with a facet: above
                body, notes["follow_up"] = f"{body}\n\n{below}", plan.loose.facet
            return reply(body, Intent.REFER_DOCTOR, topic=last.id if below else None), {
                **notes, "rule": scope.reason if scope and d.source == "rule" else "head"}
        if d.intent is Intent.NO_ANSWER and d.source == "rule" and referral is not None:
            return reply(referral[1], Intent.NO_ANSWER, handoff=True), {**notes, "rule": referral[0]}
        if d.intent is Intent.GREETING:
            if session.danger:  # "好的谢谢" soon after an emergency reply: what to do if the danger is still there
                net_line, session.danger = after_danger_line(session.danger, lang, *self.cfg.safety.contacts(lang)), ""
                self._save_session(inbound, state, session)
            return reply(greeting_reply(norm.text, lang), Intent.GREETING), notes
        if d.intent is Intent.OUT_OF_SCOPE:
            return reply(intent_reply(d.intent, lang), d.intent), notes
        if d.intent is Intent.NO_ANSWER:
            # "您是想了解「…」吗？": the best topic and the next that cover who the question names
            offered = [best.topic_id] + [m.topic_id for m in found.matches[1:MAX_OFFERED]
                                         if retriever.scope.uncovered(norm.text, m.topic_id) is None] if d.offer else []
            session.no_answer_streak += 1
            session.suggested, session.offer_form, session.offer_facet = offered, [lang, norm.script, norm.variant] if offered else [], None
            self._save_session(inbound, state, session)
            if offered:
                return reply(suggestion_reply([retriever.kb.topics[t] for t in offered], lang), Intent.NO_ANSWER,
                             confidence=d.fit, suggested=tuple(offered)), {**notes, "suggested": offered}
            return reply(intent_reply(Intent.NO_ANSWER, lang), Intent.NO_ANSWER, confidence=d.fit, handoff=True), notes
        topic = retriever.kb.topics[best.topic_id]
        if topic is last and session.last_facet is None:
            # the topic whose main answer was just sent, asked about again: never that answer word for
            # word; the facet the message names ("what about for kids? my son keeps licking his lips"),
            # else what else can be asked
            if (asked := plan.loose or read_named_facet(norm.text)) is not None:
                return self._follow_up(inbound, state, session, last, asked.facet, lang, reply, hint=True)
            return reply(more_reply(topic, lang), Intent.ANSWER, topic=topic.id,
                         confidence=d.fit), {**notes, "follow_up": "more"}
        return self._send_topic(inbound, state, session, topic, lang, reply, notes, confidence=d.fit)

    def _send_topic(self, inbound: Inbound, state: MessageState, session: Session, topic: Topic, lang: str, out,
                    notes: dict, confidence: float = 1.0) -> tuple[Reply, dict]:
        """``topic``'s answer, remembered as the topic in context. ``confidence``: P(fit), or 1.0
        where the user chose the topic (a yes to an offer)."""
        session.last_topic, session.last_facet, session.suggested, session.no_answer_streak, session.offer_facet = topic.id, None, [], 0, None
        self._save_session(inbound, state, session)
        return out(topic.render(lang), Intent.ANSWER, topic=topic.id, confidence=confidence), notes

    async def _handoff(self, inbound: Inbound, agents: bool, out, lang: str, source: str) -> tuple[Reply, dict]:
        """Start a handoff where a person can take it; else say honestly that nobody is available."""
        if not agents:  # asked for a person, but no console or agents' group could answer: say so
            return out(HANDOFF_UNAVAILABLE_REPLY[lang], Intent.HANDOFF), {"handoff": "no_agents", "decided_by": source}
        try:
            await self.handoff.start(inbound.channel, inbound.user_id, inbound.chat_id, "user_request")
        except StoreError as exc:  # nothing recorded, so no person would see the chat: say so honestly
            store_unavailable("handoff_start", exc)
            return out(HANDOFF_UNAVAILABLE_REPLY[lang], Intent.HANDOFF), {"handoff": "store_unavailable", "decided_by": source}
        return out(intent_reply(Intent.HANDOFF, lang), Intent.HANDOFF, handoff=True), {"decided_by": source}

    def _follow_up(self, inbound: Inbound, state: MessageState, session: Session, topic: Topic, facet: str | None,
                   lang: str, out, hint: bool = False) -> tuple[Reply, dict]:
        """``facet`` of the topic in context ("那饮食上呢"): its text, the topic that answers it, or an
        honest "nothing specific here"; for "还有呢" (``None``) what else can be asked."""
        topic, facet, body, found = follow_up_reply(self.kb, topic, facet, lang, hint)
        if found:
            session.last_topic, session.last_facet, session.suggested = topic.id, facet, []
            self._save_session(inbound, state, session)
        return (out(body, Intent.ANSWER if found else Intent.NO_ANSWER, topic=topic.id, confidence=1.0 if found else 0.0),
                {"follow_up": facet or "more", "decided_by": "follow_up", **({} if found else {"facet": "missing"})})

    def _save_session(self, inbound: Inbound, state: MessageState, session: Session) -> None:
        """Write ``session`` back with the reply (bot/dedup.py)."""
        state.set("session_save", *self.sessions.dump(inbound.channel, inbound.user_id, session))
