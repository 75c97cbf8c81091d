"""InferencePool: worker threads, one engine per thread, padding."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from inference.engines.base import Engine, EngineError
from inference.pool import InferencePool, pad_batch

PAD = 1


class ThreadRecordingEngine:
    """Test double: remembers the threads it was created and run on.

    ``infer`` returns float32[B, 2] rows ``[sum of real ids, real token count]``.
    """

    name = "recording"
    dim = 2
    max_seq_len = 512

    def __init__(self, max_batch_size: int = 64, hold: threading.Event | None = None):
        self.max_batch_size = max_batch_size
        self.created_on = threading.get_ident()
        self.ran_on: set[int] = set()
        self.inputs: list[tuple[np.ndarray, np.ndarray]] = []
        self.hold = hold
        self.closed = False

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        self.ran_on.add(threading.get_ident())
        self.inputs.append((input_ids, attention_mask))
        if self.hold is not None:
            self.hold.wait(5)
        return np.stack([(input_ids * attention_mask).sum(1), attention_mask.sum(1)], 1).astype(np.float32)

    def close(self) -> None:
        self.closed = True


def test_pad_batch_right_pads_with_the_pad_id():
    ids, mask = pad_batch([[0, 5, 6, 2], [0, 7, 2], [0, 2]], pad_id=PAD)
    assert ids.dtype == np.int64 and mask.dtype == np.int64
    assert ids.tolist() == [[0, 5, 6, 2], [0, 7, 2, 1], [0, 2, 1, 1]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]


def test_test_double_satisfies_the_engine_protocol():
    assert isinstance(ThreadRecordingEngine(), Engine)


async def test_engine_is_created_and_run_on_its_worker_thread_not_the_loop():
    engines: list[ThreadRecordingEngine] = []

    def factory() -> ThreadRecordingEngine:
        engines.append(ThreadRecordingEngine())
        return engines[-1]

    pool = await InferencePool.start(factory, workers=1, pad_id=PAD)
    loop_thread = threading.get_ident()
    for _ in range(3):
        out = await pool.run_batch([[0, 5, 2], [0, 2]])
        assert out.dtype == np.float32 and out.tolist() == [[7.0, 3.0], [2.0, 2.0]]
    (engine,) = engines
    assert engine.created_on != loop_thread
    assert engine.ran_on == {engine.created_on}  # one dedicated thread, always the same
    ids, mask = engine.inputs[0]
    assert ids.tolist() == [[0, 5, 2], [0, 2, PAD]] and mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert pool.engine_name == "recording" and pool.dim == 2 and pool.batches_run == 3
    await pool.close()
    assert engine.closed


async def test_two_workers_run_batches_concurrently_on_separate_threads():
    hold = threading.Event()
    engines: list[ThreadRecordingEngine] = []

    def factory() -> ThreadRecordingEngine:
        engines.append(ThreadRecordingEngine(hold=hold))
        return engines[-1]

    pool = await InferencePool.start(factory, workers=2, pad_id=PAD)
    a = asyncio.create_task(pool.run_batch([[0, 3, 2]]))
    b = asyncio.create_task(pool.run_batch([[0, 4, 2]]))
    for _ in range(200):  # both engines busy at the same time
        if all(e.inputs for e in engines):
            break
        await asyncio.sleep(0.01)
    assert all(e.inputs for e in engines)
    hold.set()
    assert sorted([(await a)[0, 0], (await b)[0, 0]]) == [5.0, 6.0]
    threads = [e.ran_on for e in engines]
    assert len(threads[0] | threads[1]) == 2 and threads[0] == {engines[0].created_on}
    await pool.close()


async def test_batch_larger_than_engine_limit_runs_in_chunks():
    engine = ThreadRecordingEngine(max_batch_size=2)
    pool = await InferencePool.start(lambda: engine, workers=1, pad_id=PAD)
    out = await pool.run_batch([[0, i, 2] for i in range(10, 15)])
    assert out[:, 0].tolist() == [12.0, 13.0, 14.0, 15.0, 16.0]
    assert [ids.shape[0] for ids, _ in engine.inputs] == [2, 2, 1]
    await pool.close()


async def test_engine_creation_failure_is_an_engine_error_naming_the_cause():
    def factory():
        raise FileNotFoundError("engines/model.onnx")

    with pytest.raises(EngineError, match="model.onnx"):
        await InferencePool.start(factory, workers=2, pad_id=PAD)


def test_unknown_engine_name_is_a_clear_error_before_loading_anything(tmp_path):
    from bot.config import InferenceConfig
    from inference.manager import load_engine_factory

    with pytest.raises(EngineError, match=r"unknown engine\(s\) \['onnx'\].*choose from"):
        load_engine_factory(InferenceConfig(engine_order=["onnx"]), tmp_path)


def test_no_loadable_engine_lists_why_each_was_skipped(tmp_path):
    from bot.config import InferenceConfig
    from inference.manager import load_engine_factory

    with pytest.raises(EngineError) as err:
        load_engine_factory(InferenceConfig(engine_order=["tensorrt", "onnxruntime"]), tmp_path)
    assert "tensorrt: no NVIDIA GPU visible" in str(err.value)
    assert "model.onnx missing: run 'healthbot prepare-model'" in str(err.value)
