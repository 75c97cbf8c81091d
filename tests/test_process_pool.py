"""Worker processes per device (inference/multiproc/router.py): real processes, real sockets.

Routing, errors, restarts and shutdown run against a test double of the encoder
(tests/worker_doubles.py) in real worker processes; vectors and serving run the
real ONNX model in real worker processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from bot import metrics
from bot.config import Config, ConfigError, InferenceConfig, load_config
from inference.batcher import BatcherClosed, BusyError, DeadlineExceeded
from inference.encoder import Encoder, open_encoder
from inference.engines.base import EngineError
from inference.multiproc.router import ProcessPoolEncoder, plan_devices
from tests.conftest import restored_logging

ENGINES_DIR = Config().engines_path
needs_model = pytest.mark.skipif(not (ENGINES_DIR / "manifest.json").is_file(),
                                 reason="run 'healthbot prepare-model' first (CI does)")
DOUBLES = str(Path(__file__).parent)


@pytest.fixture
def doubles_on_path(monkeypatch):
    """Worker processes inherit the environment: make tests/worker_doubles.py importable there."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [DOUBLES, os.environ.get("PYTHONPATH")])))


def cpu_cfg(processes: int = 2, **kw) -> InferenceConfig:
    return InferenceConfig(device_processes=processes, engine_order=["onnxruntime"], onnx_precision="fp32",
                           fallback_engine="", intra_op_threads=1, **kw)


async def start_double(processes: int = 2, **kw) -> ProcessPoolEncoder:
    return await ProcessPoolEncoder.create(cpu_cfg(processes, **kw), ENGINES_DIR,
                                           encoder_factory="worker_doubles:length_encoder")


# ------------------------------------------------------------------ planning and config

def test_plan_devices_places_n_processes_on_each_visible_gpu_else_the_cpu():
    two_gpus = lambda: 2  # noqa: E731
    assert plan_devices(InferenceConfig(device_processes=2), two_gpus) == [0, 0, 1, 1]
    assert plan_devices(InferenceConfig(device_processes=1, devices=["1"]), two_gpus) == [1]
    assert plan_devices(InferenceConfig(device_processes=3), lambda: 0) == [None, None, None]
    # A CPU-only engine order never asks for GPUs.
    assert plan_devices(InferenceConfig(device_processes=1, engine_order=["onnxruntime"]), two_gpus) == [None]
    with pytest.raises(EngineError, match="not visible"):
        plan_devices(InferenceConfig(device_processes=1, devices=["3"]), two_gpus)


def test_config_rejects_negative_device_processes():
    with pytest.raises(ConfigError, match="device_processes"):
        load_config(env={"HEALTHBOT_INFERENCE_DEVICE_PROCESSES": "-1"})
    assert load_config(env={"HEALTHBOT_INFERENCE_DEVICE_PROCESSES": "2"}).inference.device_processes == 2


# ------------------------------------------------------------------ with the test double

@needs_model
async def test_rows_come_back_to_their_callers_and_load_is_spread(doubles_on_path):
    enc = await start_double(2)
    try:
        texts = ["a" * n for n in range(1, 301)]
        rows = await asyncio.gather(*(enc.encode([t]) for t in texts))
        assert [int(r[0, 0]) for r in rows] == list(range(1, 301))
        pids = {int(r[0, 1]) for r in rows}
        assert pids == {w.info["pid"] for w in enc.workers}  # both processes served
        many = await enc.encode(["xy", "xyz", "x"])
        assert many.shape == (3, 8) and many[:, 0].tolist() == [2.0, 3.0, 1.0]
        assert (await enc.encode([])).shape == (0, 8)
        batches, texts_run = await enc.batch_stats()
        assert texts_run == 303 and 2 <= batches < 303  # texts travelled in groups
    finally:
        await enc.close()


@needs_model
async def test_worker_errors_reach_the_caller_with_their_type_and_a_silent_worker_is_replaced(doubles_on_path):
    enc = await start_double(1, deadline_ms=300)
    try:
        with pytest.raises(BusyError, match="busy"):
            await enc.encode(["BUSY please"])
        w = enc.workers[0]
        old_pid = w.info["pid"]
        with pytest.raises(DeadlineExceeded, match="did not answer"):
            await enc.encode(["HANG"])  # a silent worker: the parent's sweep gives up after deadline + 1 s
        for _ in range(600):  # ... kills it, and it is started again (up to 30 s on a busy machine)
            if w.alive and w.info["pid"] != old_pid:
                break
            await asyncio.sleep(0.05)
        assert w.alive and w.info["pid"] != old_pid and w.restarts == 1
        assert (await enc.encode(["ok"]))[0, 0] == 2.0
    finally:
        await enc.close()


@needs_model
async def test_a_killed_worker_loses_no_request_and_is_restarted(doubles_on_path):
    enc = await start_double(2)
    try:
        victim = enc.workers[0]
        old_pid = victim.info["pid"]

        def counts() -> tuple[float, float]:
            return tuple(metrics.REGISTRY.get_sample_value(f"healthbot_inference_worker_{n}_total",
                                                           {"worker": victim.label}) or 0.0
                         for n in ("exits", "restarts"))

        before = counts()

        async def client(i: int) -> list[float]:
            out = []
            for k in range(40):
                out.append(float((await enc.encode(["x" * (1 + (i + k) % 50)]))[0, 0]))
            return out

        tasks = [asyncio.ensure_future(client(i)) for i in range(32)]
        await asyncio.sleep(0.05)
        victim.process.kill()
        results = await asyncio.gather(*tasks)  # raises if any request failed
        assert all(r == [float(1 + (i + k) % 50) for k in range(40)] for i, r in enumerate(results))
        for _ in range(600):
            if victim.alive and victim.restarts == 1:
                break
            await asyncio.sleep(0.05)
        assert victim.alive and victim.info["pid"] != old_pid
        assert [a - b for a, b in zip(counts(), before)] == [1.0, 1.0]
        assert int((await enc.encode(["abc"]))[0, 0]) == 3
    finally:
        await enc.close()


@needs_model
async def test_readyz_is_503_while_no_worker_process_runs(doubles_on_path, monkeypatch):
    from types import SimpleNamespace

    from bot.app import ServerState, readiness
    from inference.multiproc import supervision as process_supervision

    monkeypatch.setattr(process_supervision, "RESTART_S", 30.0)  # stays down for the whole test
    enc = await start_double(1)
    try:
        dispatcher = SimpleNamespace(retriever=SimpleNamespace(encoder=enc), kb=[1, 2])
        assert await readiness(dispatcher, ServerState()) == (200, {
            "ready": True, "model_loaded": True, "shutting_down": False, "engine": "double", "topics": 2,
            "inference_processes": "1/1"})
        enc.workers[0].process.kill()
        for _ in range(1000):
            if not enc.alive:
                break
            await asyncio.sleep(0.01)
        status, body = await readiness(dispatcher, ServerState())
        assert status == 503 and body["inference_processes"] == "0/1" and not body["ready"]
        with pytest.raises(EngineError, match="no inference worker process is running"):
            await enc.encode(["while restarting"])
    finally:
        await enc.close()


@needs_model
async def test_a_worker_that_cannot_load_fails_start_with_its_reason(doubles_on_path):
    with pytest.raises(EngineError, match="no GPU visible"):
        await ProcessPoolEncoder.create(cpu_cfg(2), ENGINES_DIR, encoder_factory="worker_doubles:no_engine")


@needs_model
async def test_close_answers_in_flight_then_refuses_and_stops_the_processes(doubles_on_path):
    enc = await start_double(2)
    pending = [asyncio.ensure_future(enc.encode(["t" * i])) for i in range(1, 50)]
    await asyncio.sleep(0)
    await enc.close()
    assert [int(p.result()[0, 0]) for p in pending] == list(range(1, 50))
    with pytest.raises(BatcherClosed):
        await enc.encode(["late"])
    assert all(w.process.returncode == 0 for w in enc.workers)


@needs_model
async def test_a_worker_exits_when_its_parent_goes_away(doubles_on_path):
    enc = await start_double(1)
    w = enc.workers[0]
    enc._closing = True  # as if this process died: no restart, no close message
    w.writer.close()
    assert await asyncio.wait_for(w.process.wait(), 20) == 0
    await enc.close()


def test_missing_model_is_reported():
    with pytest.raises(FileNotFoundError, match="prepare-model"):
        asyncio.run(ProcessPoolEncoder.create(cpu_cfg(1), Path("/nonexistent-engines")))


# ------------------------------------------------------------------ the real model

@needs_model
async def test_real_model_in_worker_processes_gives_the_in_process_vectors():
    texts = ["失眠怎么调理", "手脚冰凉怎么办", "how much water should I drink a day", "长" * 700]
    ref_enc = await Encoder.create(InferenceConfig(engine_order=["onnxruntime"], onnx_precision="fp32",
                                                   fallback_engine=""), ENGINES_DIR)
    try:
        ref = await ref_enc.encode(texts)
    finally:
        await ref_enc.close()
    enc = await open_encoder(cpu_cfg(2, embedding_cache_size=0), ENGINES_DIR)  # the pool itself, no cache
    try:
        assert isinstance(enc, ProcessPoolEncoder)
        assert (enc.engine_name, enc.variant, enc.dim) == ("onnxruntime", "onnxruntime/fp32", 384)
        together = await enc.encode(texts)
        one_by_one = np.vstack(await asyncio.gather(*(enc.encode([t]) for t in texts)))
    finally:
        await enc.close()
    np.testing.assert_allclose(together, ref, atol=1e-5)
    np.testing.assert_allclose(one_by_one, ref, atol=1e-5)
    assert np.allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)


@needs_model
async def test_each_worker_process_names_itself_in_its_log_lines(capfd):
    with restored_logging():
        logging.getLogger().setLevel(logging.INFO)  # workers log at the server's level
        enc = await open_encoder(cpu_cfg(2), ENGINES_DIR)
        await enc.close()
    ready = [line for line in capfd.readouterr().err.splitlines() if "encoder_ready" in line]
    assert len(ready) == 2
    assert sorted(w for w in ("cpu#0", "cpu#1") if any(w in line for line in ready)) == ["cpu#0", "cpu#1"]


@needs_model
async def test_the_bot_answers_through_worker_processes(tmp_path):
    from bot.runtime import open_dispatcher
    from bot.types import Inbound, MessageKind

    cfg = load_config(env={"HEALTHBOT_INFERENCE_DEVICE_PROCESSES": "1", "HEALTHBOT_INFERENCE_INTRA_OP_THREADS": "1"},
                      overrides={"data_dir": str(tmp_path)})
    async with open_dispatcher(cfg) as dispatcher:
        reply = await dispatcher.handle(Inbound("http", "u1", "u1", "m1", MessageKind.TEXT, "手脚冰凉怎么办"))
    assert reply.intent == "answer" and reply.topic == "body.cold_hands_feet"
    assert reply.engine == "onnxruntime" and "何时就医" in reply.text


@needs_model
async def test_server_metrics_show_each_workers_own_metrics(monkeypatch):
    import re

    from bot import metrics
    from inference.multiproc import supervision as process_supervision

    monkeypatch.setattr(process_supervision, "METRICS_POLL_S", 0.1)
    enc = await ProcessPoolEncoder.create(cpu_cfg(2), ENGINES_DIR)
    try:
        await asyncio.gather(*(enc.encode([f"第{i}个问题：失眠怎么办"]) for i in range(40)))
        batches = {}
        for _ in range(400):  # up to 20 s on a busy machine
            body = metrics.render()[0].decode()
            batches = {w: float(v) for w, v in re.findall(
                r'^healthbot_worker_inference_batch_size_count\{worker="(cpu#\d)"\} (\S+)$', body, re.M)}
            if len(batches) == 2 and min(batches.values()) >= 1:  # both workers' latest poll shows their batch
                break
            await asyncio.sleep(0.05)
        assert set(batches) == {"cpu#0", "cpu#1"} and min(batches.values()) >= 1
        assert re.search(r'^healthbot_worker_process_resident_memory_bytes\{worker="cpu#0"\} \d', body, re.M)
        assert "# TYPE healthbot_worker_inference_batch_size histogram" in body
        assert "healthbot_worker_telegram" not in body and "healthbot_worker_request" not in body
    finally:
        await enc.close()
    assert "healthbot_worker_" not in metrics.render()[0].decode()  # gone with the pool
