"""Start-up and shutdown of the core: encoder (inference pool), knowledge base, retriever, dispatcher.

One place owns these long-lived resources; the aiohttp app (bot/app.py) and the
CLI (bot/cli.py) both use :func:`open_dispatcher`.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

import structlog
from threadpoolctl import threadpool_limits

from bot.classifier import DecisionHead
from bot.follow_up_judge import FollowJudge
from bot.topic_fit import TopicFit
from bot.topic_prior import TopicPrior
from bot.config import Config
from bot.embedding import SCHEME as EMBEDDING_SCHEME
from bot.dispatcher import Dispatcher
from bot.handoff import HandoffManager
from bot.knowledge import KnowledgeBase, load_knowledge_base
from bot.logs import logged_step
from bot.retrieval import Retriever
from bot.store import open_store
from inference.encoder import open_encoder
from inference.tokenizer import REVISION as TOKENIZER_REVISION

log = structlog.get_logger("healthbot.runtime")


#: ``module:function`` with which inference worker processes set up their logging.
LOG_SETUP = "bot.logs:configure_logging"


def model_digest(cfg: Config, manifest: dict | None = None) -> str:
    """The prepared model's ONNX sha256 from ``manifest`` (default: engines/manifest.json read now;
    "" if absent) and the tokenizer's :data:`~inference.tokenizer.REVISION`: what cached vectors
    are keyed by."""
    if manifest is None:
        try:
            manifest = json.loads((cfg.engines_path / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return ""
    onnx = str(manifest.get("onnx_sha256") or manifest.get("onnx", {}).get("sha256", ""))
    return f"{onnx}/tokenizer-{TOKENIZER_REVISION}"


async def derive(cfg: Config, kb: KnowledgeBase, encoder, digest: str) -> tuple[Retriever, DecisionHead, TopicFit]:
    """What is computed from the model for ``kb``: the retriever (the examples' vectors) with its
    topic prior (bot/topic_prior.py) and follow-up judge (bot/follow_up_judge.py), the decision
    head and the topic-fit verifier, each cached in engines/cache under ``digest``
    (:func:`model_digest`) plus ``encoder.variant``, how texts are embedded
    (:data:`bot.embedding.SCHEME`) and its
    data's digest: seconds when cached, six to ten minutes on 2 CPU cores when not (376 and
    415 s on two clean clones, 2026-12-05; 585 s on 2026-12-06, each text embedded alone)."""
    cache, key = cfg.engines_path / "cache", f"{digest}{encoder.variant}/{EMBEDDING_SCHEME}"
    # indexing the topics (scopes, BM25) takes seconds to tens of seconds at every start
    with logged_step(log, "retrieval_index", topics=len(kb)):
        retriever = await Retriever.build(kb, encoder, cache_dir=cache, model_digest=key)
    known = retriever.known_vectors()  # texts embedded once, shared by both trainings
    head = await DecisionHead.build(kb, encoder, cache_dir=cache, model_digest=key, known=known)
    retriever.prior = await TopicPrior.build(retriever, cache_dir=cache, model_digest=key, known=known)
    fit = await TopicFit.build(retriever, retriever.prior, cache_dir=cache, model_digest=key, known=known)
    retriever.follow_judge = await FollowJudge.build(retriever, cache_dir=cache, model_digest=key, known=known)
    return retriever, head, fit


@asynccontextmanager
async def open_dispatcher(cfg: Config, handoff: HandoffManager | None = None, *,
                          drain_deadline: Callable[[], float | None] | None = None) -> AsyncIterator[Dispatcher]:
    """Load the model, the knowledge base and the retrieval index; yield a ready dispatcher.

    The store (``cfg.effective_store_url``: SQLite under the data directory by
    default, Redis for several replicas) holds dedup claims, sessions, handoffs and
    rate limits. On exit, in order: in-flight replies are finished (until
    ``drain_deadline()``, an event-loop time, when it gives one: the server's shutdown
    deadline, by which every channel has answered or handed its unfinished messages to
    the store; computations still running then are abandoned), the inference pool is
    drained, and only then is the store closed.

    Raises:
        FileNotFoundError / inference errors: the model is not prepared
            (message says to run ``healthbot prepare-model``).
        bot.knowledge.KnowledgeBaseError: the knowledge base is invalid.
    """
    # Retrieval's numpy work is small matrix-vector products: one BLAS thread does
    # each in ~0.05 ms, while OpenBLAS's thread pool, contending with ONNX Runtime's
    # threads for the same cores, took ~8 ms (measured on the 2-core machine).
    threadpool_limits(1, user_api="blas")
    kb = load_knowledge_base(cfg.kb_path)
    store = await open_store(cfg.effective_store_url)
    if handoff is not None:
        handoff.store = store
    encoder = await open_encoder(cfg.inference, cfg.engines_path, log_setup=LOG_SETUP)
    dispatcher = None
    try:
        retriever, head, fit = await derive(cfg, kb, encoder, model_digest(cfg))
        dispatcher = Dispatcher(cfg, retriever, head, fit, handoff, store)
        log.info("loaded", topics=len(kb), engine=encoder.engine_name, examples=len(retriever.vectors))
        try:
            yield dispatcher
        finally:
            await _drain(dispatcher, drain_deadline() if drain_deadline is not None else None)
            await dispatcher.unanswered.flush(timeout_s=1.0)  # questions still being recorded (bot/unanswered.py)
    finally:
        # the encoder serving now: a hot swap (bot/model_reload.py) closed the one loaded here
        await (dispatcher.retriever.encoder if dispatcher is not None else encoder).close()
        await store.close()


async def _drain(dispatcher: Dispatcher, deadline: float | None) -> None:
    """Wait for the dispatcher's computations, until ``deadline`` (event-loop time) if given."""
    if deadline is None:
        await dispatcher.once.drain()
        return
    left = deadline - asyncio.get_running_loop().time()
    try:
        await asyncio.wait_for(asyncio.shield(dispatcher.once.drain()), timeout=max(left, 0.05))
    except TimeoutError:
        log.warning("shutdown.computations_abandoned",
                    hint="past the shutdown deadline: their channels answered or handed them to the store")
