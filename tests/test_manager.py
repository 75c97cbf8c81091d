"""Model manager: runtime fallback to the CPU engine (circuit breaker), recovery, hot swap,
and the ONNX Runtime variant choice. Fake engines; no GPU and no model needed."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

from bot import metrics
from bot.config import ConfigError, InferenceConfig
from inference.batcher import DynamicBatcher
from inference.encoder import Encoder
from inference.engines.base import EngineError
from inference.engines.loader import onnx_model_for
from inference.manager import CLOSED, OPEN, ModelManager
from inference.pool import InferencePool

PAD = 1


class FlakyEngine:
    """Fake engine named ``name``: rows ``[tag, real token count]``; fails while ``broken`` is set."""

    dim, max_batch_size, max_seq_len = 2, 64, 512

    def __init__(self, name: str, tag: float, broken: threading.Event | None = None, delay_s: float = 0.0):
        self.name = name
        self.tag = tag
        self.broken = broken or threading.Event()
        self.delay_s = delay_s
        self.calls = 0
        self.closed = False

    def infer(self, input_ids, attention_mask):
        self.calls += 1
        if self.delay_s:
            threading.Event().wait(self.delay_s)
        if self.broken.is_set():
            raise EngineError(f"{self.name}: CUDA error: unspecified launch failure")
        return np.stack([np.full(len(input_ids), self.tag), attention_mask.sum(1)], 1).astype(np.float32)

    def close(self):
        self.closed = True


def circuit_state(engine: str) -> float | None:
    return metrics.REGISTRY.get_sample_value("healthbot_engine_circuit_state", {"engine": engine})


def fallbacks(frm: str, to: str) -> float:
    return metrics.REGISTRY.get_sample_value("healthbot_engine_fallbacks_total",
                                             {"from_engine": frm, "to_engine": to}) or 0.0


def workers_gauge(engine: str) -> float:
    return metrics.REGISTRY.get_sample_value("healthbot_inference_workers", {"engine": engine}) or 0.0


async def manager(gpu_name="gpu_a", broken=None, delay_s=0.0, failures=3, reset_s=60.0):
    gpu = FlakyEngine(gpu_name, 1.0, broken, delay_s)
    cpu = FlakyEngine("cpu_a", 9.0)
    primary = await InferencePool.start(lambda: gpu, 1, PAD)
    fallback = await InferencePool.start(lambda: cpu, 1, PAD, record_workers=False)
    m = ModelManager(primary, fallback, circuit_failures=failures, reset_s=reset_s,
                     pool_options={"workers": 1, "pad_id": PAD})
    return m, gpu, cpu


async def test_a_failed_batch_is_served_on_the_cpu_engine_and_repeated_failures_open_the_circuit():
    broken = threading.Event()
    m, gpu, cpu = await manager("gpu_open", broken, failures=3)
    before = fallbacks("gpu_open", "cpu_a")
    assert (await m.run_batch([[0, 5, 2]]))[0, 0] == 1.0
    broken.set()
    for i in range(3):
        out = await m.run_batch([[0, 5, 2]])
        assert out.tolist() == [[9.0, 3.0]]  # every failed batch answered by the CPU engine
        assert m.state == (OPEN if i == 2 else CLOSED)
    assert circuit_state("gpu_open") == metrics.CircuitState.OPEN
    assert fallbacks("gpu_open", "cpu_a") == before + 1
    assert m.engine_name == "cpu_a" and m.variant == "cpu_a/?"
    assert workers_gauge("cpu_a") == 1 and workers_gauge("gpu_open") == 0  # the serving engine holds the workers
    calls = gpu.calls
    await m.run_batch([[0, 5, 2]])
    assert gpu.calls == calls  # open: no traffic to the broken GPU
    await m.close()


async def test_the_circuit_closes_when_a_half_open_probe_succeeds():
    broken = threading.Event()
    m, gpu, cpu = await manager("gpu_probe", broken, failures=1, reset_s=0.05)
    broken.set()
    await m.run_batch([[0, 5, 2]])
    assert m.state == OPEN
    await asyncio.sleep(0.06)
    out = await m.run_batch([[0, 5, 2]])  # probe fails: served by the CPU, open again for twice as long
    assert out[0, 0] == 9.0 and m.state == OPEN and m._backoff == pytest.approx(0.1)
    broken.clear()  # the GPU recovers
    await asyncio.sleep(0.11)
    assert (await m.run_batch([[0, 5, 2]]))[0, 0] == 1.0
    assert m.state == CLOSED and circuit_state("gpu_probe") == metrics.CircuitState.CLOSED
    assert m.engine_name == "gpu_probe" and workers_gauge("gpu_probe") == 1
    await m.close()


async def test_only_one_probe_at_a_time_the_rest_stay_on_the_cpu():
    broken = threading.Event()
    m, gpu, cpu = await manager("gpu_one_probe", broken, delay_s=0.05, failures=1, reset_s=0.01)
    broken.set()
    await m.run_batch([[0, 5, 2]])
    broken.clear()
    await asyncio.sleep(0.02)
    outs = await asyncio.gather(*(m.run_batch([[0, 5, 2]]) for _ in range(4)))
    tags = sorted(o[0, 0] for o in outs)
    assert tags == [1.0, 9.0, 9.0, 9.0]  # one half-open probe on the GPU, three on the CPU meanwhile
    assert m.state == CLOSED
    await m.close()


async def test_without_a_fallback_the_error_reaches_the_caller():
    gpu = FlakyEngine("gpu_alone", 1.0)
    gpu.broken.set()
    m = ModelManager(await InferencePool.start(lambda: gpu, 1, PAD), None)
    with pytest.raises(EngineError, match="unspecified launch failure"):
        await m.run_batch([[0, 5, 2]])
    await m.close()


class CharTokenizer:
    pad_id, max_len = PAD, 512

    def encode_batch(self, texts, prefix="query: "):
        return [[[0] + [3 + ord(c) % 90 for c in (prefix + t)[:510]] + [2]] for t in texts]


async def test_fault_mid_run_under_load_loses_no_request():
    """The GPU engine starts failing in the middle of a load; every request is answered
    (by the GPU before, by the CPU after), none fails, and the circuit is open at the end."""
    broken = threading.Event()
    m, gpu, cpu = await manager("gpu_fault", broken, delay_s=0.002, failures=3)
    tok = CharTokenizer()
    enc = Encoder(tok, m, DynamicBatcher(m.run_batch, max_queue_delay_ms=1, concurrency=1,
                                         tokenize=tok.encode_batch))
    answered, errors = [], []

    async def client(i: int):
        for j in range(25):
            try:
                answered.append((await enc.encode([f"question {i} {j}"]))[0])
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
            if i == 0 and j == 10:
                broken.set()  # the GPU breaks mid-run

    await asyncio.gather(*(client(i) for i in range(16)))
    assert errors == [] and len(answered) == 16 * 25
    assert m.state == OPEN and gpu.calls > 0 and cpu.calls > 0
    assert enc.engine_name == "cpu_a"
    await enc.close()


async def test_hot_swap_under_load_fails_no_request_and_closes_the_old_engine():
    m, old, cpu = await manager("gpu_v1", delay_s=0.003)
    tok = CharTokenizer()
    enc = Encoder(tok, m, DynamicBatcher(m.run_batch, max_queue_delay_ms=1, tokenize=tok.encode_batch))
    new = FlakyEngine("gpu_v1", 2.0, delay_s=0.003)
    results, errors = [], []
    stop = asyncio.Event()

    async def client():
        while not stop.is_set():
            try:
                results.append((await enc.encode(["水"]))[0])
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

    clients = [asyncio.create_task(client()) for _ in range(12)]
    await asyncio.sleep(0.1)
    pool = await m.swap(lambda: new)
    n_at_swap = len(results)
    await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*clients)
    assert errors == []
    assert old.closed and not new.closed and m.primary is pool and m.swaps == 1
    assert new.calls > 0 and len(results) > n_at_swap
    assert cpu.calls == 0  # nothing fell back during the swap
    await enc.close()
    assert new.closed


async def test_swap_to_an_engine_of_another_dimension_is_refused_and_the_old_one_keeps_serving():
    m, old, cpu = await manager("gpu_dim")

    class Wide(FlakyEngine):
        dim = 3

    with pytest.raises(EngineError, match="3-dim vectors"):
        await m.swap(lambda: Wide("gpu_dim", 5.0))
    assert (await m.run_batch([[0, 5, 2]]))[0, 0] == 1.0 and not old.closed
    await m.close()


async def test_swap_of_a_version_that_does_not_load_keeps_the_old_one():
    m, old, cpu = await manager("gpu_badload")

    def broken_factory():
        raise EngineError("new.engine does not deserialize: run 'healthbot build-engine --force'")

    with pytest.raises(EngineError, match="deserialize"):
        await m.swap(broken_factory)
    assert (await m.run_batch([[0, 5, 2]]))[0, 0] == 1.0
    await m.close()


# ------------------------------------------------------------------ config and ONNX variant

def test_inference_config_validate_names_the_key():
    InferenceConfig().validate()
    with pytest.raises(ConfigError, match="onnx_precision"):
        InferenceConfig(onnx_precision="int4").validate()
    with pytest.raises(ConfigError, match="devices"):
        InferenceConfig(devices=["gpu0"]).validate()
    InferenceConfig(devices=["0", "1"]).validate()
    from bot.config import load_config

    cfg = load_config(env={"HEALTHBOT_INFERENCE_DEVICES": "0,1", "HEALTHBOT_INFERENCE_ONNX_PRECISION": "int8"})
    assert cfg.inference.devices == ["0", "1"] and cfg.inference.onnx_precision == "int8"


def _fake_engines_dir(tmp_path, *, int8=True, passed=True, source_sha="abc"):
    (tmp_path / "model.onnx").write_bytes(b"fp32")
    (tmp_path / "manifest.json").write_text(json.dumps({"onnx": "model.onnx", "onnx_bytes": 4, "onnx_sha256": "abc"}))
    if int8:
        (tmp_path / "model.int8.onnx").write_bytes(b"int8!")
        (tmp_path / "model.int8.onnx.json").write_text(json.dumps(
            {"format": 1, "source_sha256": source_sha, "bytes": 5,
             "accuracy": {"passed": passed, "reason": "" if passed else "parity min cosine 0.98 < 0.99"}}))
    return tmp_path


def test_auto_uses_int8_only_when_current_and_passed(tmp_path):
    d = _fake_engines_dir(tmp_path)
    assert onnx_model_for(InferenceConfig(), d) == (d / "model.int8.onnx", "int8")
    assert onnx_model_for(InferenceConfig(onnx_precision="fp32"), d) == (d / "model.onnx", "fp32")


@pytest.mark.parametrize("kw, why", [({"passed": False}, "did not pass the accuracy check"),
                                     ({"source_sha": "old"}, "built from another model.onnx"),
                                     ({"int8": False}, "missing")])
def test_auto_keeps_fp32_when_int8_is_stale_failed_or_missing(tmp_path, kw, why):
    from inference.onnx_variants import int8_status

    d = _fake_engines_dir(tmp_path, **kw)
    assert onnx_model_for(InferenceConfig(), d) == (d / "model.onnx", "fp32")
    st = int8_status(d)
    assert not st.usable and why in st.reason


def test_int8_asked_for_but_not_built_says_how_to_build_it(tmp_path):
    d = _fake_engines_dir(tmp_path, int8=False)
    with pytest.raises(EngineError, match="build-engine --engine onnxruntime --precision int8"):
        onnx_model_for(InferenceConfig(onnx_precision="int8"), d)
