"""The one protocol every inference engine implements (ARCHITECTURE.md, "The inference pool")."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


class EngineError(RuntimeError):
    """An engine failed to load or to run a batch; the message says what to do."""


def check_batch(input_ids: np.ndarray, attention_mask: np.ndarray, max_batch_size: int,
                max_seq_len: int) -> tuple[int, int]:
    """Validate one padded batch for :meth:`Engine.infer`; returns (B, T).

    Raises:
        EngineError: the two arrays are not both [B, T], or B / T is outside
            [1, max_batch_size] / [1, max_seq_len].
    """
    if input_ids.shape != attention_mask.shape or input_ids.ndim != 2:
        raise EngineError(f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} "
                          "must both be [B, T]")
    batch, seq = input_ids.shape
    if not (1 <= batch <= max_batch_size and 1 <= seq <= max_seq_len):
        raise EngineError(f"batch [{batch}, {seq}] outside [1..{max_batch_size}, 1..{max_seq_len}]")
    return batch, seq


@runtime_checkable
class Engine(Protocol):
    """A sentence encoder backend that owns one execution context.

    One instance is used by one pool worker thread at a time; engines need not be
    thread-safe.

    Optional (torch_cuda): ``launch(input_ids, attention_mask) -> finish`` starts a
    batch without waiting and ``finish()`` returns its float32[B, D]; up to
    ``launch_slots`` batches may be launched and unfinished, ``finish`` may run on
    another thread. The engine server uses it to keep the next batch queued on the
    GPU (inference/multiproc/engine_server.py); an engine without it is run with :meth:`infer`.

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


def engine_precision(engine: Any) -> str:
    """``"int8"``, ``"fp16"``, ``"fp32"``, ...: the engine's ``precision`` attribute, or
    its torch ``dtype`` (torch_cuda), or the TensorRT build spec's precision; ``"?"``."""
    p = getattr(engine, "precision", None)
    if p:
        return str(p)
    dtype = str(getattr(engine, "dtype", "")).replace("torch.", "")
    names = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
    if dtype in names:
        return names[dtype]
    spec = getattr(engine, "spec", None)
    return str(getattr(spec, "precision", "") or "?")
