"""The inference package's Prometheus metrics, and the registry they live on.

:data:`REGISTRY` is the application's registry (not prometheus-client's
process-global default one, which libraries may also write to): bot/metrics.py
adds the request and channel metrics to it and ``GET /metrics`` serves it (with
``healthbot serve --processes N``, the sum over the processes: :func:`render`); a
worker process of ``inference.device_processes`` serves it to its parent
(:class:`inference.multiproc.router.WorkerMetrics`). Where each metric is recorded:
the table in bot/metrics.py.
"""

from __future__ import annotations

import os
from typing import Final

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

#: The environment variable of prometheus-client's multiprocess mode: the folder where each process
#: keeps its values (prometheus-client reads it when imported; bot/prefork.py sets it).
MULTIPROC_DIR_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"

REGISTRY: Final = CollectorRegistry(auto_describe=True)
"""The application's registry: every metric below and in bot/metrics.py, and the process collector."""

ProcessCollector(registry=REGISTRY)

# ---------------------------------------------------------------- buckets

#: Inference queue-time buckets, seconds: 0.5 ms … 2 s (``inference.deadline_ms`` default).
#: ``inference.max_queue_delay_ms`` (default 10 ms) is the edge of interest.
QUEUE_BUCKETS_S: Final = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)

#: Engine time per batch, seconds: sub-ms GPU batches to 1 s CPU batches of 512 tokens.
ENGINE_BUCKETS_S: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

#: Windows per batch: powers of two up to 128 (``inference.max_batch_size`` default 32).
BATCH_SIZE_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128)

#: Padded tokens per batch: 8 (one short query, specials included) … 16384 (twice
#: ``inference.max_batch_tokens``; a single window over the budget still runs alone).
BATCH_TOKEN_BUCKETS: Final = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# ---------------------------------------------------------------- inference

INFERENCE_QUEUE_TIME: Final = Histogram(
    "healthbot_inference_queue_seconds",
    "Time a token window waited in the dynamic batcher, from submit to the start of its batch, seconds.",
    buckets=QUEUE_BUCKETS_S, registry=REGISTRY)

INFERENCE_BATCH_SIZE: Final = Histogram(
    "healthbot_inference_batch_size",
    "Token windows per batch handed to the inference pool (dimensionless count).",
    buckets=BATCH_SIZE_BUCKETS, registry=REGISTRY)

INFERENCE_BATCH_TOKENS: Final = Histogram(
    "healthbot_inference_batch_tokens",
    "Padded tokens per batch: longest window × windows, the batcher's token-budget cost (tokens).",
    buckets=BATCH_TOKEN_BUCKETS, registry=REGISTRY)

INFERENCE_PENDING: Final = Gauge(
    "healthbot_inference_pending",
    "Token windows queued in the dynamic batcher and not yet taken into a batch "
    "(submits fail with busy beyond inference.max_queue_size).",
    multiprocess_mode="livesum", registry=REGISTRY)

INFERENCE_DROPPED: Final = Counter(
    "healthbot_inference_dropped",
    "Token windows not computed, by reason: busy (queue full), closed (shutting down), expired "
    "(deadline passed before the result), cancelled (caller went away), failed (the batch raised).",
    ["reason"], registry=REGISTRY)

INFERENCE_ENGINE_TIME: Final = Histogram(
    "healthbot_inference_engine_seconds",
    "Time one batch spent in the engine (padding and engine.infer on the worker thread), seconds, by engine.",
    ["engine"], buckets=ENGINE_BUCKETS_S, registry=REGISTRY)

INFERENCE_WORKERS: Final = Gauge(
    "healthbot_inference_workers",
    "Inference pool workers running, by engine: the engine in use is the one with a non-zero value.",
    ["engine"], multiprocess_mode="livesum", registry=REGISTRY)

INFERENCE_WORKER_EXITS: Final = Counter(
    "healthbot_inference_worker_exits",
    "Inference worker processes (inference.device_processes) and engine servers that exited, were killed as "
    "silent, or sent a garbled message; a worker's texts were resent to a live worker. By worker (e.g. cuda:0#1, "
    "engine-server:cuda:0).",
    ["worker"], registry=REGISTRY)

INFERENCE_WORKER_RESTARTS: Final = Counter(
    "healthbot_inference_worker_restarts",
    "Inference worker processes and engine servers started again after an exit, by worker.",
    ["worker"], registry=REGISTRY)

ENGINE_FALLBACKS: Final = Counter(
    "healthbot_engine_fallbacks",
    "Times an engine earlier in inference.engine_order was passed over for a later one (it failed to load "
    "at start-up, or failed at run time), by the engine left and the engine used instead (none: no engine).",
    ["from_engine", "to_engine"], registry=REGISTRY)

ENGINE_CIRCUIT_STATE: Final = Gauge(
    "healthbot_engine_circuit_state",
    "Circuit state per engine: 0 closed (serving), 1 open (failed: no traffic sent to it), "
    "2 half-open (being retried). With several serving processes (server.processes), one series per "
    "process (label pid): each process has its own circuit.",
    ["engine"], multiprocess_mode="liveall", registry=REGISTRY)

EMBEDDING_CACHE_HITS: Final = Counter(
    "healthbot_embedding_cache_hits",
    "Texts whose embedding came from the serving process's cache of repeated texts (or from the same text "
    "already being encoded): the encoder was not asked (inference.embedding_cache_size).",
    registry=REGISTRY)

EMBEDDING_CACHE_MISSES: Final = Counter(
    "healthbot_embedding_cache_misses",
    "Texts looked up in the embedding cache and sent to the encoder (bulk calls that bypass the cache "
    "are not counted).",
    registry=REGISTRY)

EMBEDDING_CACHE_ENTRIES: Final = Gauge(
    "healthbot_embedding_cache_entries",
    "Vectors held in the embedding cache now (at most inference.embedding_cache_size per serving process).",
    multiprocess_mode="livesum", registry=REGISTRY)

for _reason in ("busy", "closed", "expired", "cancelled", "failed"):
    INFERENCE_DROPPED.labels(reason=_reason)


class CircuitState:
    """Values of ``healthbot_engine_circuit_state``."""

    CLOSED: Final = 0
    OPEN: Final = 1
    HALF_OPEN: Final = 2


# ---------------------------------------------------------------- helpers


def _served_registry() -> CollectorRegistry:
    """:data:`REGISTRY`, or in prometheus-client's multiprocess mode (:data:`MULTIPROC_DIR_ENV` set
    before prometheus-client was imported: the processes of ``healthbot serve --processes N``,
    bot/prefork.py) a registry that reads every process's values from that folder and sums them
    (gauges as their ``multiprocess_mode`` says; collectors of one process, such as ``process_*``,
    are left out: https://prometheus.github.io/client_python/multiprocess/)."""
    if not os.environ.get(MULTIPROC_DIR_ENV):
        return REGISTRY
    merged = CollectorRegistry()
    MultiProcessCollector(merged)
    return merged


#: What ``GET /metrics`` serves (:func:`render`).
_SERVED: Final = _served_registry()


def render(accept: str | None = None) -> tuple[bytes, str]:
    """Every metric in the format the scraper asked for; returns ``(body, Content-Type)``.

    The metrics are :data:`REGISTRY`'s, or with several serving processes the sum over all of
    them (:func:`_served_registry`).

    Args:
        accept: the request's ``Accept`` header. Prometheus asks for OpenMetrics when it
            can; anything else (curl, None) gets the classic text format 0.0.4
            (``text/plain; version=0.0.4``), which every Prometheus version reads.
            Negotiation is prometheus-client's own (``exposition.choose_encoder``).
    """
    encoder, content_type = choose_encoder(accept or "")
    return encoder(_SERVED), content_type


def record_fallback(from_engine: str, to_engine: str | None) -> None:
    """Count one fallback from ``from_engine`` to ``to_engine`` (None: no engine left)."""
    ENGINE_FALLBACKS.labels(from_engine=from_engine, to_engine=to_engine or "none").inc()


def set_circuit_state(engine: str, state: int) -> None:
    """Set ``engine``'s circuit to ``state`` (a :class:`CircuitState` value)."""
    ENGINE_CIRCUIT_STATE.labels(engine=engine).set(state)


def observe_many(histogram, values_s: np.ndarray) -> None:
    """``histogram.observe(v)`` for every value of ``values_s`` (seconds) at once.

    prometheus-client's ``observe`` takes a lock per bucket and per sum (~2 µs a
    call); at tens of thousands of windows a second that is a noticeable share
    of the event loop, so the bucket counts are added per batch instead. Falls
    back to one ``observe`` per value where the client's internals differ.
    """
    try:
        bounds = histogram._upper_bounds
        buckets = histogram._buckets
        total = histogram._sum
    except AttributeError:
        for v in values_s:
            histogram.observe(float(v))
        return
    counts = np.bincount(np.searchsorted(np.asarray(bounds, dtype=np.float64), values_s, side="left"),
                         minlength=len(buckets))
    for i in np.flatnonzero(counts):
        buckets[int(i)].inc(int(counts[i]))
    total.inc(float(values_s.sum()))
