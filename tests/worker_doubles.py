"""Encoders for worker processes in tests/test_process_pool.py (``encoder_factory="worker_doubles:…"``).

Each is an async ``factory(cfg, engines_dir)`` returning what a worker process needs
from :class:`inference.encoder.Encoder`: ``encode``, ``close``, ``engine_name``,
``variant``, ``dim``, ``pool`` (precision, workers, devices) and ``batcher``
(``max_batch_size``, ``stats``).
"""

from __future__ import annotations

import asyncio
import os
import time
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


class GpuEngineDouble:
    """The real ONNX model on the CPU under the name of a GPU engine (``torch_cuda``), for the
    engine server in tests/test_engine_server.py: ``infer`` and torch_cuda's ``launch`` /
    ``finish`` pair (computed at launch); each batch's rows are recorded, and a batch hangs
    (``finish``, like a stuck GPU) while the file named by ``GPU_DOUBLE_HANG_FILE`` exists."""

    name = "torch_cuda"
    gpu_memory_bytes = 123 * 2**20
    launch_slots = 2

    def __init__(self, engines_dir, max_batch_size: int = 256) -> None:
        from pathlib import Path

        from inference.engines.onnxruntime import OnnxRuntimeEngine

        self._ort = OnnxRuntimeEngine(Path(engines_dir) / "model.onnx", intra_op_threads=1,
                                      max_batch_size=max_batch_size)
        self.dim, self.max_batch_size, self.max_seq_len = self._ort.dim, max_batch_size, self._ort.max_seq_len
        self.precision = "fp32"
        self.batch_rows: list[int] = []

    def infer(self, input_ids, attention_mask):
        return self.launch(input_ids, attention_mask)()

    def launch(self, input_ids, attention_mask):
        self.batch_rows.append(input_ids.shape[0])
        out = self._ort.infer(input_ids, attention_mask)

        def finish():
            hang = os.environ.get("GPU_DOUBLE_HANG_FILE")
            if hang and os.path.exists(hang):  # a stuck GPU call
                time.sleep(3600)
            return out

        return finish

    def close(self) -> None:
        self._ort.close()


def gpu_engine_double(cfg, engines_dir, device) -> GpuEngineDouble:
    return GpuEngineDouble(engines_dir, cfg.gpu_max_batch_size)


def no_gpu_engine(cfg, engines_dir, device):
    raise EngineError("torch_cuda: CUDA error: no kernel image is available for execution on the device")
