"""The one protocol every inference engine implements (ARCHITECTURE.md, "The inference pool")."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


class EngineError(RuntimeError):
    """An engine failed to load or to run a batch; the message says what to do."""


@runtime_checkable
class Engine(Protocol):
    """A sentence encoder backend that owns one execution context.

    One instance is used by one pool worker thread at a time; engines need not be
    thread-safe.

    Attributes:
        name: short engine name, e.g. ``"onnxruntime"``, ``"tensorrt"``.
        dim: embedding dimension D (384 for multilingual-e5-small).
        max_batch_size: largest B :meth:`infer` accepts.
        max_seq_len: largest T :meth:`infer` accepts (512 for BERT).
    """

    name: str
    dim: int
    max_batch_size: int
    max_seq_len: int

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Run one padded batch.

        Args:
            input_ids: int64[B, T] token ids, right-padded with the pad id.
            attention_mask: int64[B, T], 1 for real tokens, 0 for padding.

        Returns:
            float32[B, D] mean-pooled token embeddings over the unmasked tokens,
            NOT L2-normalized (the encoder combines windows of long texts
            weighted by token count, then normalizes).

        Raises:
            EngineError: the batch could not be run.
        """
        ...

    def close(self) -> None:
        """Release the engine's resources (sessions, streams, buffers)."""
        ...
