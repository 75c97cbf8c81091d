"""Encoders for worker processes in tests/test_process_pool.py (``encoder_factory="worker_doubles:…"``).

Each is an async ``factory(cfg, engines_dir)`` returning what a worker process needs
from :class:`inference.encoder.Encoder`: ``encode``, ``close``, ``engine_name``,
``variant``, ``dim``, ``pool`` (precision, workers, devices) and ``batcher``
(``max_batch_size``, ``stats``).
"""

from __future__ import annotations

import asyncio
import os
import types

import numpy as np

from inference.batcher import BusyError
from inference.engines.base import EngineError


class LengthEncoder:
    """Row i = [len(text_i), pid, 0, ...] (float32[N, 8]); texts containing "BUSY" raise BusyError,
    "HANG" never return."""

    engine_name = "double"
    variant = "double/fp32"
    dim = 8

    def __init__(self) -> None:
        self.pool = types.SimpleNamespace(precision="fp32", workers=1, devices=[None])
        self.batcher = types.SimpleNamespace(max_batch_size=32,
                                             stats=types.SimpleNamespace(batches_run=0, requests_run=0))

    async def encode(self, texts: list[str], prefix: str = "query: ") -> np.ndarray:
        if any("BUSY" in t for t in texts):
            raise BusyError("inference queue full: busy, try again in a moment")
        if any("HANG" in t for t in texts):
            await asyncio.sleep(3600)
        await asyncio.sleep(0.001)
        self.batcher.stats.batches_run += 1
        self.batcher.stats.requests_run += len(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        out[:, 0] = [len(t) for t in texts]
        out[:, 1] = os.getpid()
        return out

    async def close(self) -> None:
        pass


async def length_encoder(cfg, engines_dir) -> LengthEncoder:
    return LengthEncoder()


async def no_engine(cfg, engines_dir):
    raise EngineError("torch_cuda: no GPU visible (inference.devices = ['all'])")
