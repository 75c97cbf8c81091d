"""The decision policy: rules and the learned head, combined in one documented place.

Inputs: what the rules found (bot/intents.py rule intent, safety/scope.py referral,
the care-team rules), the decision head's calibrated label probabilities
(bot/classifier.py) and retrieval's best topic and confidence. Output: one
:class:`Decision`. The red-flag rules (safety/triage.py) run before this, without the
embedding, so a rule emergency is answered even when the inference pool is busy.

Order (first that holds wins; thresholds are :class:`DecisionConfig`):

1. danger = p(emergency) + p(crisis) >= ``danger_full`` -> the emergency reply, or the
   crisis reply when p(crisis) > p(emergency); p(crisis) >= ``crisis_full`` alone -> the
   crisis reply (a wish not to wake up must never get sleep tips: a gentle crisis reply
   to someone who is only low costs little, a missed one can cost a life). Not when the
   message tells the danger as over (safety/settled.py: "前几天胸口闷了一下 现在好了"), or tells
   blood-pressure readings that all lie below the urgent range (safety/readings.py: "高压145 低压95
   医生说先观察"), and the head reads an emergency, not a crisis: then, as for a red flag told as
   over, the reply below goes out with the safety net, and p(answer) is read among the non-danger labels;
2. otherwise danger >= ``danger_net`` sets a safety net: whatever is decided below goes
   out with a line naming the warning signs and when to call 120 (safety/safety_net.py); the
   crisis line only at p(crisis) >= ``crisis_net``;
   below ``danger_answer`` the answer step reads p(answer) among the non-danger labels,
   p(answer) / (1 - danger), since the net line already speaks to the danger;
3. a rule greeting, or the head's greeting >= ``greeting``;
4. the head's handoff >= ``handoff`` (the rule handoff is handled before encoding);
5. a scope rule -> refer_doctor with the rule's specific reply;
6. a rule out-of-scope, retrieval's nearest-example out_of_scope, or the head's
   out_of_scope >= ``out_of_scope``;
7. a care-team rule -> no_answer with its own text;
8. the head's refer_doctor >= ``refer`` -> refer_doctor (a clinician or pharmacist);
9. a question that names a medicine (not a supplement) -> refer_doctor (a doctor or
   pharmacist), whatever the head says of it;
   then an answer only when the head's answer >= ``answer``, retrieval found no nearer
   non-answer example, retrieval's confidence >= ``knowledge.min_confidence``, the
   topic covers every population or named disease the question names (bot/topic_scope.py),
   and the topic-fit verifier's probability that the topic answers the question
   (bot/topic_fit.py) >= ``topic_fit`` (``topic_fit_contested`` when the topic prior, not the
   hybrid score, ranked the topic first; ``topic_fit_sibling`` when the runner-up is a sibling topic);
10. else no_answer (honest: cannot answer reliably, see a doctor).

A no_answer offers the best topic instead ("您是想了解「…」吗？", bot/suggestion.py) when only
one of the two learned judges doubts it: the verifier, at ``suggest`` <= P(fit) < ``topic_fit``
(step 9), or the head, at p(answer) < ``answer`` with P(fit) >= ``topic_fit`` and nothing else
against the topic (no scope gap, retrieval confident).

The thresholds were chosen on the project's own files (evals/safety.jsonl, the dev
set), never on a blind batch; `healthbot eval FILE` shows their effect (risk-coverage).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bot.types import Intent


@dataclass
class DecisionConfig:
    """Probability thresholds of the decision policy (``decision:`` in the config file)."""

    danger_full: float = 0.8
    crisis_full: float = 0.5
    #: P(crisis) from which the head is taken as sure. Below it, in a conversation whose last topic was
    #: just answered, the crisis reply (always whole and first) also carries what the user asked about
    #: that topic (bot/follow_up.py :func:`after_crisis_reply`): the head reads frustration told as a
    #: second turn as crisis ("还有呢 试了好多药都不管用" after an athlete's-foot answer: 0.82; on the
    #: development follow-up sets 0.58-0.82), and such a user should not lose the answer. Real crises told
    #: the same way read 0.64-1.0: they get the same complete crisis reply, whatever this value.
    crisis_sure: float = 0.9
    danger_net: float = 0.12
    #: P(crisis) a crisis safety-net line needs (the suicide-line sentence under a reply). Below it, where
    #: the head's danger is mostly crisis, no line is added unless P(emergency) alone reaches ``danger_net``
    #: (then the warning-signs line). Chosen on the development files (2026-12-06): at ``danger_net`` alone
    #: 97 of 7,269 lines without danger (1.3 %) got the crisis line ("what's a good breakfast", "thanks, bye
    #: for now", 三伏贴), most at P(crisis) 0.07-0.25; the five real crises and emergencies that earlier
    #: had only that line to catch them read 0.25-0.45 (each now also has its red flag). At 0.25: 27.
    crisis_net: float = 0.25
    #: Danger below which a safety-netted message is answered when p(answer) among the labels other
    #: than emergency and crisis, p(answer) / (1 - danger), reaches ``answer``. Chosen on the
    #: development files (blind A, B, D, H-P, R, safety, dev, real set 4): 16 answerable questions
    #: gained (bee and wasp stings, a small scald, a child's 38 °C fever, morning sickness), none
    #: lost; at or above 0.6 were a bleeding cut that will not stop, a child who bit a laundry pod
    #: and a bleeding gum half an hour on: these keep the no_answer with the net.
    danger_answer: float = 0.6
    greeting: float = 0.6
    handoff: float = 0.6
    out_of_scope: float = 0.6
    refer: float = 0.5
    answer: float = 0.5
    #: P(fit) below which a topic answer is declined, chosen on the development batches (blind A, B,
    #: D, H-V: 3,340 lines, 1,652 answerable) with the verifier of FIT_VERSION 6 (it reads the topic
    #: prior, bot/topic_fit.py) and the near-miss lines of bot/decision_data/train_nearmiss_topics.jsonl,
    #: as the threshold that keeps the right topic where it was and gives fewer confidently wrong
    #: replies: at 0.35 about 84.3 % on topic with 5.1 % of replies confidently wrong, at 0.4 82.0 % and
    #: 4.4 %, at 0.45 80.9 % and 4.0 %; before (FIT_VERSION 5, threshold 0.35): 82.1 % and 4.9 %.
    #: 0.4 -> 0.45 with the register lines of train_registers_3.jsonl (2026-12-05, 2,047 lines then,
    #: 2,030 now): on the development batches (4,180 lines) at 0.35 / 0.4 / 0.45 / 0.5: 84.4 / 83.8 /
    #: 83.3 / 82.6 % on topic, 4.7 / 4.4 / 4.1 / 3.9 % confidently wrong (without those lines at 0.4:
    #: 82.4 % and 4.2 %; with the 2,030 at 0.45: 83.2 % and 4.1 %).
    #: 0.45 -> 0.5 with the verifier that no longer learns a sibling topic as a wrong answer (bot/topic_fit.py
    #: FIT_VERSION 12, 2026-12-07): on the blind development batches (8,430 lines, 4,330 answerable) the right
    #: topic 85.0 % (FIT_VERSION 11 at 0.45) -> 87.4 % at 0.45 / 86.8 % at 0.5 / 86.3 % at 0.5 without
    #: ``topic_fit_sibling``, confidently wrong 3.6 -> 4.2 / 3.9 / 3.8 %; between 0.45 and 0.5 the answers were
    #: right 23 times in 43. Real set 7 half A: the same figures at 0.45 as before. With ``topic_fit_contested``
    #: 0.6: 86.3 % and 3.8 %.
    topic_fit: float = 0.5
    #: P(fit) from which a topic declined by ``topic_fit`` is offered instead ("您是想了解「…」吗？",
    #: bot/suggestion.py). Chosen on the development batches H, I, J, K (2026-12-03): of the answerable
    #: questions declined at 0.1 <= P(fit) < 0.35 the offered topic was right for 35 of 52; below 0.1,
    #: for 11 of 23, where 25 of 48 offers would go to questions no topic answers. A topic the head
    #: alone doubts is offered at P(fit) >= ``topic_fit``: right for 17 of the 17 answerable questions
    #: among 24 such declines on blind A, B, D, H-L (at >= 0.1: 19 of 20, but 34 offers, one an emergency).
    #: 0.1 -> 0.05 with the verifier's trees (bot/topic_fit.py FIT_VERSION 8), whose probabilities are
    #: sharper (temperature 1.57 -> 0.97): on the development batches (4,180 lines) the right topic
    #: answered or offered 90.3 -> 91.2 %, answers unchanged (2026-12-05).
    suggest: float = 0.05
    #: P(fit) an answer needs instead of ``topic_fit`` when the topic prior put first a topic the
    #: hybrid score ranks lower (bot/topic_prior.py: the two rankers disagree). On the development
    #: batches H-P, such answers at P(fit) >= 0.35 were right 55 times in 74; at >= 0.5, 46 in 59
    #: (the 15 between are offered instead: 9 right topics, 6 wrong). 0.5 -> 0.6 with ``topic_fit`` 0.45 -> 0.5
    #: (FIT_VERSION 12, 2026-12-07; the blind development batches, 8,430 lines): the right topic 86.8 -> 86.3 %,
    #: confidently wrong 3.9 -> 3.8 %, false premises agreed with 13 -> 10 of 221.
    topic_fit_contested: float = 0.6
    #: P(fit) an answer needs instead of ``topic_fit`` when retrieval's runner-up is a sibling of the best
    #: topic (bot/topic_fit.py :func:`~bot.topic_fit.sibling_pairs`: listed together as right answers in the
    #: training data): the verifier reads a close runner-up as doubt, but a question between knee pain and
    #: knee osteoarthritis is answered by either. On the blind development batches (8,430 lines, 2026-12-07)
    #: at 0.3: 60 more right answers and 11 more others (most of them the sibling, unlisted: insomnia for
    #: waking at night; 4 clicking knees no topic covers); lowering ``topic_fit`` to 0.3 for every
    #: question instead gave 141 more right and 96 more others.
    topic_fit_sibling: float = 0.3


@dataclass(frozen=True)
class Decision:
    """What to reply.

    Attributes:
        intent: the reported intent.
        source: what decided it: ``"rule"``, ``"head"`` or ``"retrieval"``.
        kind: for an emergency, ``"emergency"`` or ``"crisis"``; else ``""``.
        safety_net: ``"emergency"`` or ``"crisis"`` when a safety-net line goes with the reply, else ``""``.
        fit: the calibrated probability that the topic's answer fits the question (the topic-fit
            verifier, bot/topic_fit.py), reported to clients as the confidence; 0 for others.
        offer: a no_answer that offers the best topic ("did you mean …?"; see the module docstring).
    """

    intent: Intent
    source: str
    kind: str = ""
    safety_net: str = ""
    fit: float = 0.0
    notes: dict = field(default_factory=dict)
    offer: bool = False


def decide(probs: dict[str, float], cfg: DecisionConfig, *, rule: Intent | None, scope: bool, care_team: bool,
           off_topic: str | None, retrieval_confidence: float, min_confidence: float,
           scope_gap: str | None = None, names_medicine: bool = False, topic_fit: float = 0.0,
           contested: bool = False, danger_over: bool = False, flagged: bool = False, sibling: bool = False) -> Decision:
    """Apply the policy of this module's docstring.

    Args:
        probs: the head's ``{label: probability}`` (bot/classifier.py :data:`LABELS`).
        cfg: the thresholds.
        rule: the rule intent (greeting or out_of_scope; handoff is handled earlier), or None.
        scope: a scope rule matched (a referral with its own reply).
        care_team: a care-team rule matched (a no_answer with its own reply).
        off_topic: retrieval's nearest-example verdict (``"out_of_scope"``, ``"no_answer"``, None).
        retrieval_confidence: the best topic's calibrated retrieval confidence in [0, 1].
        min_confidence: ``knowledge.min_confidence``.
        scope_gap: a population or disease the question names that the best topic does not cover.
        names_medicine: the question names a medicine (safety/scope.py :func:`names_medicine`).
        topic_fit: the verifier's probability that the best topic answers the question.
        contested: the topic prior, not the hybrid score, put the best topic first
            (``SearchResult.contested``): the answer needs P(fit) >= ``topic_fit_contested``.
        danger_over: the message tells the danger as over (safety/settled.py) or only blood-pressure
            readings below the urgent range (safety/readings.py): an emergency the head reads gets the
            safety net instead of the full reply.
        flagged: a red flag matched, told as over: the safety net goes out whatever the head reads.
        sibling: retrieval's runner-up is a sibling of the best topic: the answer needs P(fit) >=
            ``topic_fit_sibling`` (not contested).
    """
    danger = probs["emergency"] + probs["crisis"]
    kind = "crisis" if probs["crisis"] > probs["emergency"] else "emergency"
    notes = {"p_" + k: round(v, 3) for k, v in probs.items() if v >= 0.01}
    full = danger >= cfg.danger_full or probs["crisis"] >= cfg.crisis_full
    over = danger_over and kind == "emergency" and probs["crisis"] < cfg.crisis_full
    if full and not over:
        return Decision(Intent.EMERGENCY, "head", kind=kind, notes=notes)
    net = kind if danger >= cfg.danger_net else ""
    if net == "crisis" and probs["crisis"] < cfg.crisis_net:
        net = "emergency" if probs["emergency"] >= cfg.danger_net else ""
    if flagged or full:  # the warning signs of the flag told as over, not the crisis line ("吓死我了")
        net = "emergency" if flagged else net or "emergency"

    def out(intent: Intent, source: str, fit: float = 0.0, offer: bool = False) -> Decision:
        return Decision(intent, source, safety_net=net, fit=fit, notes=notes, offer=offer)

    if rule is Intent.GREETING:
        return out(Intent.GREETING, "rule")
    if probs["greeting"] >= cfg.greeting:
        return out(Intent.GREETING, "head")
    if probs["handoff"] >= cfg.handoff:
        return out(Intent.HANDOFF, "head")
    if scope:
        return out(Intent.REFER_DOCTOR, "rule")
    if rule is Intent.OUT_OF_SCOPE:
        return out(Intent.OUT_OF_SCOPE, "rule")
    if probs["out_of_scope"] >= cfg.out_of_scope or off_topic == "out_of_scope" and probs["answer"] < cfg.answer:
        return out(Intent.OUT_OF_SCOPE, "head")
    if care_team:
        return out(Intent.NO_ANSWER, "rule")
    if probs["refer_doctor"] >= cfg.refer:
        return out(Intent.REFER_DOCTOR, "head")
    if names_medicine:
        return out(Intent.REFER_DOCTOR, "medicine")
    topic_stands = scope_gap is None and off_topic is None and retrieval_confidence >= min_confidence
    # Below ``danger_answer`` the net line answers the danger, and whether the rest is an answer is
    # judged among the other labels (a bee sting "with no other symptoms" at p(emergency) 0.54)
    p_answer = (probs["answer"] / max(1.0 - danger, 1e-9) if net and (danger < cfg.danger_answer or danger_over)
                else probs["answer"])
    if p_answer < cfg.answer:  # P(fit) is reported only with an offer: no topic is in play otherwise
        offer = topic_stands and topic_fit >= cfg.topic_fit
        return out(Intent.NO_ANSWER, "head", fit=topic_fit if offer else 0.0, offer=offer)
    if scope_gap is not None:
        return out(Intent.NO_ANSWER, "topic_scope")
    if off_topic is not None or retrieval_confidence < min_confidence:
        return out(Intent.NO_ANSWER, "retrieval")
    need = max(cfg.topic_fit, cfg.topic_fit_contested) if contested else cfg.topic_fit_sibling if sibling else cfg.topic_fit
    if topic_fit < need:
        return out(Intent.NO_ANSWER, "topic_fit", fit=topic_fit, offer=topic_fit >= cfg.suggest)
    return out(Intent.ANSWER, "head", fit=topic_fit)
