"""Every Prometheus metric of healthbot, defined once, with its help text and units: the
request and channel metrics here, the inference ones in inference/metrics.py (re-exported here).

ARCHITECTURE.md, "Operations". The metrics live on :data:`REGISTRY` (inference/metrics.py), a registry the
application owns (not prometheus-client's process-global default one, which
libraries may also write to); ``GET /metrics`` (bot/app.py, or its own port: bot/metrics_endpoint.py) serves exactly this
registry in the Prometheus text format. Names follow the Prometheus naming
guide (https://prometheus.io/docs/practices/naming/): a ``healthbot_`` prefix,
base units (seconds, not ms), ``_total`` on counters (prometheus-client adds it).

Where each metric is recorded — at the exact point the event happens, as
text-embeddings-inference records its queue metrics (STYLE.md):

==================================================  ==========================================
metric                                              recorded in
==================================================  ==========================================
``healthbot_request_latency_seconds{channel,outcome}``  ``Dispatcher._timed``, once per computed message
``healthbot_requests_in_flight``                    ``Dispatcher._timed`` (entry / exit)
``healthbot_dedup_hits_total{channel}``             ``Dispatcher.handle``: a retry answered from the dedup cache
``healthbot_safety_outcomes_total{outcome,rule}``   ``Dispatcher._timed``, from the decision's ``extra`` dict
``healthbot_offers_total{event}``                   ``Dispatcher._timed`` (``record_offer``): "did you mean …?" offered, chosen, declined
``healthbot_inference_queue_seconds``               ``DynamicBatcher._run``: enqueue → batch start, per window
``healthbot_inference_batch_size``                  ``DynamicBatcher._run``: windows per batch
``healthbot_inference_batch_tokens``                ``DynamicBatcher._run``: padded tokens (longest × size)
``healthbot_inference_pending``                     ``DynamicBatcher``: +n on enqueue, −n when taken or dropped
``healthbot_inference_dropped_total{reason}``       ``DynamicBatcher``: busy, closed, expired, cancelled, failed
``healthbot_inference_engine_seconds{engine}``      ``InferencePool.run_batch``: time inside the engine per batch
``healthbot_inference_workers{engine}``             ``InferencePool.start`` / ``close``
``healthbot_engine_fallbacks_total{from_engine,to_engine}``  ``inference.manager``: an engine skipped for a later one
``healthbot_engine_circuit_state{engine}``          ``inference.manager``: 0 closed, 1 open, 2 half-open
``healthbot_model_info{version,model_digest,engine}``  ``bot.model_reload``: 1 for the model serving (start, swap)
``healthbot_model_reloads_total{outcome}``          ``bot.model_reload``: swapped or refused, per reload
``healthbot_wechat_token_refreshes_total``          the WeChat access_token manager, per token fetched
``healthbot_wechat_api_errors_total{code}``         the WeChat API client, per failed call
``healthbot_telegram_retry_after_total{method}``    ``TelegramSender.call``: each 429 RetryAfter received
``healthbot_feedback_total{topic,vote}``            ``FeedbackBook.vote`` (bot/feedback.py): each vote that counts
``healthbot_server_process_restarts_total``         ``bot.front_ends``: a front-end process the master started again
``healthbot_worker_*{worker}``                      ``inference.multiproc.worker_metrics.WorkerMetrics``: with
                                                    ``inference.device_processes``, each worker
                                                    process's ``healthbot_inference_*``,
                                                    ``healthbot_engine_*`` and ``process_*``
==================================================  ==========================================

Plus ``process_*`` (CPU seconds, resident memory bytes, open fds, start time) from
prometheus-client's process collector, with one serving process. With several
(``healthbot serve --processes N``, bot/prefork.py) every process keeps its values in
prometheus-client's multiprocess folder and ``/metrics`` serves their sum (counters and
histograms added up, gauges as their ``multiprocess_mode`` says), without ``process_*``.

Labels only take values from closed sets (channel names, intents, rule names
from the safety tables, engine names, API error codes, knowledge-base topic ids), never user text or ids.
"""

from __future__ import annotations

from typing import Any, Final, Mapping

from prometheus_client import Counter, Gauge, Histogram

from inference.metrics import (  # noqa: F401 - the inference metrics, re-exported: one registry
    BATCH_SIZE_BUCKETS, BATCH_TOKEN_BUCKETS, ENGINE_BUCKETS_S, ENGINE_CIRCUIT_STATE, ENGINE_FALLBACKS,
    INFERENCE_BATCH_SIZE, INFERENCE_BATCH_TOKENS, INFERENCE_DROPPED, INFERENCE_ENGINE_TIME, INFERENCE_PENDING,
    INFERENCE_QUEUE_TIME, INFERENCE_WORKER_EXITS, INFERENCE_WORKER_RESTARTS, INFERENCE_WORKERS, QUEUE_BUCKETS_S,
    REGISTRY, CircuitState, record_fallback, render, set_circuit_state)

__all__ = [
    "REGISTRY", "render",
    "REQUEST_LATENCY", "REQUESTS_IN_FLIGHT", "DEDUP_HITS", "SAFETY_OUTCOMES",
    "INFERENCE_QUEUE_TIME", "INFERENCE_BATCH_SIZE", "INFERENCE_BATCH_TOKENS", "INFERENCE_PENDING",
    "INFERENCE_DROPPED", "INFERENCE_ENGINE_TIME", "INFERENCE_WORKERS", "ENGINE_FALLBACKS", "ENGINE_CIRCUIT_STATE",
    "MODEL_INFO", "MODEL_RELOADS", "WECHAT_TOKEN_REFRESHES", "WECHAT_API_ERRORS", "TELEGRAM_RETRY_AFTER", "FEEDBACK",
    "SERVER_PROCESS_RESTARTS",
    "CircuitState", "request_outcome", "observe_request", "record_safety", "record_fallback",
    "set_circuit_state",
]

CHANNELS: Final[tuple[str, ...]] = ("wechat", "telegram", "http")
"""Channels whose counters are created at zero, so ``rate()`` sees them from the start."""

# ---------------------------------------------------------------- buckets

#: Request latency buckets, seconds. Dense below 0.1 s (a CPU answer takes tens of
#: ms); 4 s is ``wechat.reply_budget_s`` and 5 s WeChat's own deadline
#: (adapters/wechat/constants.py, REPLY_DEADLINE_S), so a bucket edge sits on each.
REQUEST_BUCKETS_S: Final = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 10.0)

# ---------------------------------------------------------------- requests

REQUEST_LATENCY: Final = Histogram(
    "healthbot_request_latency_seconds",
    "Time from the dispatcher taking a message to its reply being decided, seconds; by channel "
    "(wechat, telegram, http, cli) and outcome (the reply's intent: answer, emergency, refer_doctor, "
    "out_of_scope, greeting, handoff, no_answer, system; or busy when the inference pool was overloaded, "
    "error when the dispatcher raised). Retries answered from the dedup cache are not observed.",
    ["channel", "outcome"], buckets=REQUEST_BUCKETS_S, registry=REGISTRY)

REQUESTS_IN_FLIGHT: Final = Gauge(
    "healthbot_requests_in_flight",
    "Messages being decided by the dispatcher right now (graceful shutdown waits for these).",
    multiprocess_mode="livesum", registry=REGISTRY)

DEDUP_HITS: Final = Counter(
    "healthbot_dedup_hits",
    "Channel re-deliveries of a message (same channel and message id) answered with the first "
    "delivery's reply instead of being computed again (bot/dedup.py), by channel.",
    ["channel"], registry=REGISTRY)

OFFERS: Final = Counter(
    "healthbot_offers",
    "\"Did you mean …?\" (bot/suggestion.py), by event: offered (a no_answer listing topics), chosen (the user's "
    "next message picked one), declined (a bare no to an offer).",
    ["event"], registry=REGISTRY)
SAFETY_OUTCOMES: Final = Counter(
    "healthbot_safety_outcomes",
    "Safety decisions, by outcome and rule: emergency and crisis (safety.triage red-flag rule, e.g. "
    "cardiac.chest_pain, crisis.plan), refer_doctor (safety.scope reason: diagnosis, dose, prescription, "
    "stop_medicine, report, medicine_alcohol, side_effects, see_doctor_soon, treatment, price), review_blocked (safety.review reason:rule that replaced an answer).",
    ["outcome", "rule"], registry=REGISTRY)

# ---------------------------------------------------------------- model

MODEL_INFO: Final = Gauge(
    "healthbot_model_info",
    "The model version serving new messages, 1 for its labels: version (first 12 hex digits of the sha256 "
    "of engines/manifest.json), model_digest (first 12 of the ONNX file's sha256) and engine "
    "(<engine>/<precision>, e.g. onnxruntime/fp32); the labels change when a new version is swapped in "
    "(bot/model_reload.py).",
    ["version", "model_digest", "engine"], registry=REGISTRY)

MODEL_RELOADS: Final = Counter(
    "healthbot_model_reloads",
    "Model reloads (a new engines/manifest.json, healthbot engine reload), by outcome: swapped, or refused "
    "(did not load, failed its parity probe, or its derived data could not be computed; the old model "
    "kept serving).",
    ["outcome"], registry=REGISTRY)

# ---------------------------------------------------------------- channels

WECHAT_TOKEN_REFRESHES: Final = Counter(
    "healthbot_wechat_token_refreshes",
    "WeChat access_token fetches that succeeded (cgi-bin/token or stable_token; the token lives 7200 s, "
    "adapters/wechat_constants.ACCESS_TOKEN_TTL_S).",
    registry=REGISTRY)

WECHAT_API_ERRORS: Final = Counter(
    "healthbot_wechat_api_errors",
    "WeChat API calls that failed, by code: the errcode WeChat returned (e.g. 40001 invalid token, "
    "42001 token expired, 45009 quota), http_<status> for a non-200 answer, network when no answer came, "
    "bad_answer when the answer was not the JSON the API documents (adapters/wechat_api.py).",
    ["code"], registry=REGISTRY)

TELEGRAM_RETRY_AFTER: Final = Counter(
    "healthbot_telegram_retry_after",
    "Telegram Bot API answers of 429 Too Many Requests (RetryAfter, flood control), by Bot API method.",
    ["method"], registry=REGISTRY)

FEEDBACK: Final = Counter(
    "healthbot_feedback",
    "Votes on answers that counted (the first per user and answer; bot/feedback.py), by the answer's "
    "knowledge-base topic and vote (helpful, not_helpful).",
    ["topic", "vote"], registry=REGISTRY)

# ---------------------------------------------------------------- processes

SERVER_PROCESS_RESTARTS: Final = Counter(
    "healthbot_server_process_restarts",
    "Front-end processes of healthbot serve --processes N started again by the master process after one "
    "exited or was killed; counted by the new process as it starts (bot/front_ends.py).",
    registry=REGISTRY)

# Known label values start at zero (Prometheus "avoid missing metrics").
for _channel in CHANNELS:
    DEDUP_HITS.labels(channel=_channel)
for _outcome in ("swapped", "refused"):
    MODEL_RELOADS.labels(outcome=_outcome)


# ---------------------------------------------------------------- helpers


def request_outcome(intent: str | None, extra: Mapping[str, Any] | None = None) -> str:
    """The ``outcome`` label and log field of one request.

    Args:
        intent: the reply's intent value (``"answer"`` …), or None when the dispatcher raised.
        extra: the dispatcher's decision details; an ``error`` of ``BusyError`` or
            ``DeadlineExceeded`` means the inference pool was overloaded.

    Returns:
        ``"error"``, ``"busy"``, or the intent value.
    """
    if intent is None:
        return "error"
    if extra and extra.get("error") in ("BusyError", "BatcherClosed", "DeadlineExceeded"):
        return "busy"
    return intent


def observe_request(channel: str, outcome: str, seconds: float) -> None:
    """Record one decided message: ``seconds`` from the dispatcher taking it to its reply."""
    REQUEST_LATENCY.labels(channel=channel, outcome=outcome).observe(seconds)


def record_safety(intent: str, extra: Mapping[str, Any]) -> None:
    """Count the safety decision in ``extra`` (the dispatcher's details) for a reply of ``intent``.

    ``emergency`` replies carry ``kind`` (emergency | crisis) and ``rule`` (safety.triage);
    ``refer_doctor`` replies carry ``rule`` (the safety.scope reason); answers replaced by
    safety.review carry ``review_blocked`` (a list of ``reason:rule``). Anything else
    records nothing.
    """
    if intent == "emergency" and extra.get("rule"):
        SAFETY_OUTCOMES.labels(outcome=str(extra.get("kind") or "emergency"), rule=str(extra["rule"])).inc()
    elif intent == "refer_doctor" and extra.get("rule"):
        SAFETY_OUTCOMES.labels(outcome="refer_doctor", rule=str(extra["rule"])).inc()
    for reason in extra.get("review_blocked") or ():
        SAFETY_OUTCOMES.labels(outcome="review_blocked", rule=str(reason)).inc()


def record_offer(extra: Mapping[str, Any]) -> None:
    """Count a "did you mean …?" event in ``extra`` (the dispatcher's details): a reply that offers
    topics (``suggested``), or an answer to an offer (``decided_by`` ``suggestion``: chosen, or
    ``offer`` ``declined``). Anything else records nothing."""
    if extra.get("suggested"):
        OFFERS.labels(event="offered").inc()
    elif extra.get("decided_by") == "suggestion":
        OFFERS.labels(event="declined" if extra.get("offer") == "declined" else "chosen").inc()
