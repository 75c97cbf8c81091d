"""InferencePool: worker threads, one engine per thread, padding."""

from __future__ import annotations

import asyncio
import threading
import time

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
    from inference.engines.loader import load_engine_factory

    with pytest.raises(EngineError, match=r"unknown engine\(s\) \['onnx'\].*choose from"):
        load_engine_factory(InferenceConfig(engine_order=["onnx"]), tmp_path)


def test_no_loadable_engine_lists_why_each_was_skipped(tmp_path):
    from bot.config import InferenceConfig
    from inference.engines.loader import load_engine_factory

    with pytest.raises(EngineError) as err:
        load_engine_factory(InferenceConfig(engine_order=["tensorrt", "onnxruntime"]), tmp_path)
    assert "tensorrt: no NVIDIA GPU visible" in str(err.value)
    assert "model.onnx missing: run 'healthbot prepare-model'" in str(err.value)


# ------------------------------------------------ several GPUs: placement and routing

class DeviceEngine:
    """Fake GPU engine: knows its device; ``infer`` returns float32[B, 2] rows
    ``[device, real token count]``; can be told to fail or to hold."""

    name = "fakegpu"
    dim = 2
    max_batch_size = 64
    max_seq_len = 512

    def __init__(self, device: int):
        self.device = device
        self.thread = threading.get_ident()
        self.calls = 0
        self.fail = False
        self.hold: threading.Event | None = None
        self.busy_s = 0.0  # how long each batch keeps the device busy (without using the CPU)
        self.closed = False

    def infer(self, input_ids, attention_mask):
        self.calls += 1
        if self.hold is not None:
            self.hold.wait(5)
        time.sleep(self.busy_s)
        if self.fail:
            raise EngineError(f"CUDA error on device {self.device}: an illegal memory access was encountered")
        return np.stack([np.full(len(input_ids), self.device), attention_mask.sum(1)], 1).astype(np.float32)

    def close(self):
        self.closed = True


async def gpu_pool(devices=(0, 1, 2), workers=1, **kw):
    made: dict[int, list[DeviceEngine]] = {}

    def factory(device: int) -> DeviceEngine:
        made.setdefault(device, []).append(DeviceEngine(device))
        return made[device][-1]

    pool = await InferencePool.start(factory, workers, PAD, devices=list(devices), **kw)
    return pool, made


async def test_workers_are_placed_on_every_device_each_on_its_own_thread():
    pool, made = await gpu_pool(devices=(0, 1), workers=2)
    assert sorted(made) == [0, 1] and [len(made[d]) for d in (0, 1)] == [2, 2]
    assert pool.workers == 4 and pool.devices == [0, 1] and pool.on_gpu
    assert len({e.thread for es in made.values() for e in es}) == 4
    assert all(e.device == d for d, es in made.items() for e in es)
    await pool.close()
    assert all(e.closed for es in made.values() for e in es)


async def test_each_batch_goes_to_the_least_loaded_device():
    pool, made = await gpu_pool(devices=(0, 1, 2))
    hold = threading.Event()
    for d in (0, 1):
        made[d][0].hold = hold
    big = asyncio.create_task(pool.run_batch([[0] + [5] * 100 + [2]] * 8))   # 816 tokens -> device 0
    small = asyncio.create_task(pool.run_batch([[0, 5, 2]]))                 # idle 1 and 2: lowest index, 1
    await asyncio.sleep(0.05)
    states = {s.device: s for s in pool.device_states()}
    assert states[0].in_flight_tokens == 8 * 102 and states[1].in_flight_tokens == 3
    third = await pool.run_batch([[0, 7, 2]])  # device 2 is the only idle one
    assert third[:, 0].tolist() == [2.0]
    hold.set()
    assert (await big)[0, 0] == 0.0 and (await small)[0, 0] == 1.0
    await pool.close()


async def test_busy_devices_share_the_load_evenly():
    """Each batch keeps its device busy 5 ms, as a real one would: a batch waiting for a device
    takes whichever frees first. (With instant batches, how many each device took depended on how
    fast its thread was scheduled: 33 / 7 once on a loaded 2-core machine.)"""
    pool, made = await gpu_pool(devices=(0, 1))
    for d in (0, 1):
        made[d][0].busy_s = 0.005
    outs = await asyncio.gather(*(pool.run_batch([[0, 5, 2]] * 4) for _ in range(40)))
    per_device = [made[d][0].calls for d in (0, 1)]
    assert sum(per_device) == 40 and min(per_device) >= 10  # both used, neither starved
    assert all(o.shape == (4, 2) for o in outs)
    await pool.close()


async def test_a_failing_gpu_leaves_the_rotation_and_the_others_serve_every_batch():
    pool, made = await gpu_pool(devices=(0, 1), circuit_failures=2, reset_s=60.0)
    made[0][0].fail = True
    outs = await asyncio.gather(*(pool.run_batch([[0, 5, 2]]) for _ in range(20)))
    assert [o[0, 0] for o in outs] == [1.0] * 20  # every batch answered, by GPU 1 (failed ones retried there)
    states = {s.device: s for s in pool.device_states()}
    assert not states[0].in_rotation and states[1].in_rotation
    assert pool.devices_in_rotation == [1]
    assert made[0][0].calls == 2  # out after 2 consecutive failures, then no traffic
    await pool.close()


async def test_a_gpu_out_of_rotation_is_probed_and_comes_back_when_it_recovers():
    pool, made = await gpu_pool(devices=(0, 1), circuit_failures=1, reset_s=0.05)
    made[0][0].fail = True
    await asyncio.gather(*(pool.run_batch([[0, 5, 2]]) for _ in range(4)))
    assert pool.devices_in_rotation == [1]
    made[0][0].fail = False
    await asyncio.sleep(0.06)
    out = await pool.run_batch([[0, 5, 2]])  # the probe goes to GPU 0 first
    assert out[0, 0] == 0.0 and pool.devices_in_rotation == [0, 1]
    await pool.close()


async def test_a_failed_probe_doubles_the_wait():
    pool, made = await gpu_pool(devices=(0, 1), circuit_failures=1, reset_s=0.05, max_reset_s=0.15)
    made[0][0].fail = True
    await pool.run_batch([[0, 5, 2]])
    await asyncio.sleep(0.06)
    assert (await pool.run_batch([[0, 5, 2]]))[0, 0] == 1.0  # probe failed on 0, retried on 1
    (st0,) = [s for s in pool.device_states() if s.device == 0]
    assert st0.reset_s == pytest.approx(0.1) and not st0.in_rotation
    await pool.close()


async def test_when_every_gpu_fails_the_batch_fails_with_an_engine_error():
    pool, made = await gpu_pool(devices=(0, 1), circuit_failures=1, reset_s=60.0)
    for d in (0, 1):
        made[d][0].fail = True
    with pytest.raises(EngineError, match="illegal memory access"):
        await pool.run_batch([[0, 5, 2]])
    with pytest.raises(EngineError, match="no device left in rotation"):
        await pool.run_batch([[0, 5, 2]])
    made[1][0].fail = False
    out = await pool.run_batch([[0, 5, 2]], probe=True)  # the manager's probe tries each GPU anyway
    assert out[0, 0] == 1.0 and pool.devices_in_rotation == [1]
    await pool.close()


async def test_a_single_gpu_is_never_taken_out_its_errors_reach_the_caller():
    pool, made = await gpu_pool(devices=(0,), circuit_failures=1)
    made[0][0].fail = True
    for _ in range(3):
        with pytest.raises(EngineError, match="illegal memory access"):
            await pool.run_batch([[0, 5, 2]])
    made[0][0].fail = False
    assert (await pool.run_batch([[0, 5, 2]]))[0, 0] == 0.0
    await pool.close()


async def test_close_waits_for_admitted_batches():
    pool, made = await gpu_pool(devices=(0,))
    hold = threading.Event()
    made[0][0].hold = hold
    running = asyncio.create_task(pool.run_batch([[0, 5, 2]]))
    await asyncio.sleep(0.02)
    closing = asyncio.create_task(pool.close())
    await asyncio.sleep(0.02)
    assert not closing.done()
    with pytest.raises(EngineError, match="closed"):
        await pool.run_batch([[0, 5, 2]])
    hold.set()
    assert (await running)[0, 0] == 0.0
    await closing
    assert made[0][0].closed


def test_resolve_devices_places_gpu_engines_only():
    from inference.devices import resolve_devices

    assert resolve_devices(["all"], "onnxruntime", count=lambda: 4) == [None]
    assert resolve_devices(["all"], "torch_cuda", count=lambda: 3) == [0, 1, 2]
    assert resolve_devices(["1", "0", "1"], "tensorrt", count=lambda: 2) == [1, 0]
    with pytest.raises(EngineError, match=r"GPU\(s\) \[2\] not visible \(2 visible: 0..1\)"):
        resolve_devices(["0", "2"], "torch_cuda", count=lambda: 2)
    with pytest.raises(EngineError, match="no GPU visible"):
        resolve_devices(["all"], "torch_cuda", count=lambda: 0)
