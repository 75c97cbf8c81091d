"""TensorRT engine and engine build, run against an API double (TensorRT cannot be installed here).

The double mirrors the TensorRT 10 / 11 Python API subset the project uses
(Builder, INetworkDefinition, OnnxParser, IBuilderConfig, optimization
profiles, timing cache, Runtime.deserialize_cuda_engine, ICudaEngine,
IExecutionContext.set_optimization_profile_async / set_input_shape /
set_tensor_address / execute_async_v3) and the cuda-python runtime calls
(``cuda.bindings.runtime``). Both are injected through ``sys.modules`` so the
engine's own logic runs unchanged: profile selection, shape checks, buffer
allocation per bucket, engine naming and rebuild on mismatch, the 10 vs 11
precision branches, per-thread device handling. The double's execution
context reads its inputs through the CUDA runtime it finds (the fake one here,
the real one on a GPU: ``tools/gpu_bench.py`` reuses this double, tests/trt_doubles.py, to exercise the
real cuda-python path) and computes with ONNX Runtime on the ONNX file the
parser was given, so numerics are real, including the strongly typed FP16 ONNX
of the 11.x branch. What real TensorRT does differently (kernel choice, FP16
arithmetic of the 10.x weak-typing branch) is NOT tested here.

Behaviour of the double taken from the TensorRT 10.x Python API reference and
the 10.x -> 11.x migration guide: removed 11.x APIs (``BuilderFlag.FP16``,
``OBEY_PRECISION_CONSTRAINTS``) raise AttributeError; ``set_input_shape``
returns False and logs outside the active profile; ``deserialize_cuda_engine``
returns None for an engine of another TensorRT version or GPU.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto  # noqa: E402

from tests.trt_doubles import (DIM, FAKE_ENGINE_MAGIC, VOCAB, FakeCudaRuntime, cudaError_t,  # noqa: E402
                               install_fakes, write_tiny_bert_onnx)

from inference.engines import cuda as cuda_helpers  # noqa: E402
from inference.engines.tensorrt import build as be  # noqa: E402
from inference.engines.tensorrt import fp16 as trt_fp16  # noqa: E402
from inference.engines.tensorrt import spec as ts  # noqa: E402
from inference.model import build_cli  # noqa: E402
from inference.engines.base import Engine, EngineError  # noqa: E402

def random_batch(rng, batch: int, seq: int, pad_id: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int64[B, T] ids/mask; the first row is full length, others random."""
    lens = [seq] + list(rng.integers(1, seq + 1, batch - 1))
    ids = np.full((batch, seq), pad_id, np.int64)
    mask = np.zeros((batch, seq), np.int64)
    for r, n in enumerate(lens):
        ids[r, :n] = rng.integers(2, VOCAB, n)
        mask[r, :n] = 1
    return ids, mask


def ort_reference(onnx_path: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    return sess.run(["pooled"], {"input_ids": ids, "attention_mask": mask})[0]


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


SMALL = ts.BuildSpec(max_batch_size=64, seq_buckets=(16, 32, 64, 128, 256, 512), max_tokens=1024, opt_tokens=256)
"""Profiles with small token caps so batch splitting is exercised on small inputs."""


@pytest.fixture()
def model_dir(tmp_path) -> Path:
    write_tiny_bert_onnx(tmp_path / "model.onnx")
    return tmp_path


@pytest.fixture(params=["10.13.3.9", "11.4.1.2"], ids=["trt10", "trt11"])
def fakes(request, monkeypatch):
    return install_fakes(monkeypatch, trt_version=request.param)


def _engine(model_dir, spec=SMALL, **kw):
    from inference.engines.tensorrt.engine import TensorRTEngine

    return TensorRTEngine(model_dir, spec=spec, **kw)


# =========================================================================== profiles and naming


def test_buckets_match_the_batchers_so_each_batch_falls_in_one_profile():
    from inference.batcher import DEFAULT_BUCKETS

    assert ts.DEFAULT_SEQ_BUCKETS == tuple(DEFAULT_BUCKETS)


@pytest.mark.parametrize("per_bucket", [True, False])
def test_profiles_cover_every_sequence_length_from_1_to_512_exactly_once(per_bucket):
    profiles = ts.BuildSpec(per_bucket=per_bucket).profiles()
    for t in range(1, 513):
        assert sum(p.seq_min <= t <= p.seq_max for p in profiles) == 1, t
    assert profiles[0].seq_min == 1  # a 7-token query never meets a 128..128 profile


def test_profile_batches_are_capped_by_the_token_budget_and_tuned_for_the_batcher():
    profiles = {p.seq_max: p for p in ts.BuildSpec().profiles()}
    assert profiles[16].batch_max == 256 and profiles[16].batch_opt == 256
    assert profiles[128].batch_max == 128 and profiles[128].batch_opt == 64
    assert profiles[512].batch_max == 32 and profiles[512].batch_opt == 16
    assert all(p.batch_min == 1 and p.batch_max * p.seq_max <= ts.DEFAULT_MAX_TOKENS for p in profiles.values())


def test_engine_name_says_model_precision_gpu_compute_capability_and_tensorrt_version(tmp_path):
    dev = cuda_helpers.DeviceInfo("NVIDIA H200", 9, 0)
    path = ts.engine_path(tmp_path, "model", ts.BuildSpec(), dev, "10.13.3.9")
    assert path.name == "model.fp16.nvidia-h200.sm90.trt10.13.3.engine"
    other = ts.engine_path(tmp_path, "model", ts.BuildSpec(), cuda_helpers.DeviceInfo("NVIDIA A10", 8, 6), "10.13.3.9")
    assert other != path and "nvidia-a10.sm86" in other.name


def test_bad_spec_is_rejected_with_a_reason():
    with pytest.raises(ts.BuildError, match="precision"):
        ts.BuildSpec(precision="int4")
    with pytest.raises(ts.BuildError, match="ascending"):
        ts.BuildSpec(seq_buckets=(64, 16))


# =========================================================================== build branches 10 vs 11


def test_trt10_builds_fp16_with_normalization_softmax_and_reductions_pinned_to_fp32(model_dir, monkeypatch):
    trt, _ = install_fakes(monkeypatch, trt_version="10.13.3.9")
    res = be.build_engine(model_dir / "model.onnx", spec=SMALL)
    meta = json.loads(res.engine.read_bytes()[len(FAKE_ENGINE_MAGIC):])
    assert {"FP16", "OBEY_PRECISION_CONSTRAINTS"} <= set(meta["flags"])
    assert not meta["strongly_typed"] and trt.stats["parsed"] == ["model.onnx"]
    pinned = meta["fp32_layers"]
    assert len(pinned) == 3 + 1 + 2  # 3 LayerNorms, 1 Softmax, 2 ReduceSums
    assert len(meta["profiles"]) == len(SMALL.seq_buckets)
    side = json.loads(ts.sidecar_path(res.engine).read_text())
    assert side["fp32_layers_pinned"] == 6 and side["tensorrt"] == "10.13.3.9"


def test_trt11_builds_a_strongly_typed_fp16_onnx_without_the_removed_precision_flags(model_dir, monkeypatch):
    trt, _ = install_fakes(monkeypatch, trt_version="11.4.1.2")
    assert not hasattr(trt.BuilderFlag, "FP16")  # using it would raise AttributeError, as on real 11.x
    res = be.build_engine(model_dir / "model.onnx", spec=SMALL)
    meta = json.loads(res.engine.read_bytes()[len(FAKE_ENGINE_MAGIC):])
    assert meta["strongly_typed"] and meta["flags"] == []
    assert trt.stats["parsed"] == ["model.fp16-st.onnx"] and res.strongly_typed
    fp16 = onnx.load(str(model_dir / "model.fp16-st.onnx"))
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(fp16.graph.value_info) + list(fp16.graph.output)}
    for node in fp16.graph.node:
        if node.op_type in ("LayerNormalization", "Softmax", "ReduceSum"):
            assert types[node.output[0]] == TensorProto.FLOAT, node.op_type
        if node.op_type == "MatMul":
            assert types[node.output[0]] == TensorProto.FLOAT16
    assert types["pooled"] == TensorProto.FLOAT


def test_fp16_onnx_saturates_the_additive_mask_and_stays_within_cosine_0_999(model_dir):
    src = onnx.load(str(model_dir / "model.onnx"))
    fp16 = trt_fp16.to_strongly_typed_fp16(src)
    onnx.checker.check_model(fp16, full_check=True)
    rng = np.random.default_rng(3)
    ids, mask = random_batch(rng, 6, 24)
    want = ort_reference(model_dir / "model.onnx", ids, mask)
    got = ort.InferenceSession(fp16.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["pooled"], {"input_ids": ids, "attention_mask": mask})[0]
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert cosine_rows(got, want).min() >= 0.999


def test_int8_needs_an_explicitly_quantized_onnx(model_dir, monkeypatch):
    install_fakes(monkeypatch)
    with pytest.raises(ts.BuildError, match="explicitly quantized"):
        be.build_engine(model_dir / "model.onnx", spec=ts.BuildSpec(precision="int8"))


def test_timing_cache_is_saved_and_fed_to_the_next_build(model_dir, monkeypatch):
    trt, _ = install_fakes(monkeypatch)
    first = be.build_engine(model_dir / "model.onnx", spec=SMALL)
    cache = ts.timing_cache_path(model_dir, cuda_helpers.DeviceInfo("NVIDIA H200", 9, 0), "10.13.3.9")
    assert cache.is_file() and trt.stats["timing_cache_in"] == [b""]
    saved = cache.read_bytes()
    be.build_engine(model_dir / "model.onnx", spec=SMALL, force=True)
    assert trt.stats["timing_cache_in"][1] == saved and json.loads(saved)["builds"] == 1
    assert first.built and trt.stats["builds"] == 2


def test_a_current_engine_is_not_built_again(model_dir, monkeypatch):
    trt, _ = install_fakes(monkeypatch)
    assert be.build_engine(model_dir / "model.onnx", spec=SMALL).built
    assert not be.build_engine(model_dir / "model.onnx", spec=SMALL).built
    assert trt.stats["builds"] == 1


# =========================================================================== runtime


def test_engine_satisfies_the_protocol_and_matches_onnx_runtime(model_dir, fakes):
    eng = _engine(model_dir)
    try:
        assert isinstance(eng, Engine) and eng.name == "tensorrt" and eng.dim == DIM and eng.max_seq_len == 512
        rng = np.random.default_rng(0)
        for batch, seq in ((1, 1), (1, 7), (3, 16), (5, 17), (8, 100), (2, 512)):
            ids, mask = random_batch(rng, batch, seq)
            got = eng.infer(ids, mask)
            want = ort_reference(model_dir / "model.onnx", ids, mask)
            assert got.shape == (batch, DIM) and got.dtype == np.float32
            if fakes[0].__version__.startswith("10"):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            else:  # 11.x runs the strongly typed FP16 ONNX
                assert cosine_rows(got, want).min() >= 0.999
    finally:
        eng.close()


def test_a_7_token_query_runs_in_the_first_bucket_instead_of_being_rejected(model_dir, fakes):
    trt, _ = fakes
    eng = _engine(model_dir)
    ids, mask = random_batch(np.random.default_rng(1), 1, 7)
    eng.infer(ids, mask)
    assert eng.bucket_for(1, 7).profile.seq_min == 1 and eng.bucket_for(1, 7).profile.seq_max == 16
    assert not any("setInputShape" in line for line in trt.log)
    eng.close()


def test_profile_is_the_smallest_bucket_holding_t_and_switches_only_when_it_changes(model_dir, fakes):
    trt, _ = fakes
    eng = _engine(model_dir)
    rng = np.random.default_rng(2)
    assert eng.bucket_for(4, 16).profile.seq_max == 16
    assert eng.bucket_for(4, 17).profile.seq_max == 32
    assert eng.bucket_for(1, 512).profile.seq_max == 512
    for seq in (10, 12, 16):  # same bucket: one switch (from the initial -1)
        eng.infer(*random_batch(rng, 2, seq))
    assert trt.stats["profile_switches"] == 1
    eng.infer(*random_batch(rng, 2, 40))
    eng.infer(*random_batch(rng, 2, 40))
    assert trt.stats["profile_switches"] == 2
    eng.close()


def test_batch_beyond_a_profiles_largest_batch_is_split_and_rows_stay_in_order(model_dir, fakes):
    trt, _ = fakes
    eng = _engine(model_dir)
    bucket = eng.bucket_for(64, 100)
    assert bucket.profile.batch_max == 1024 // 128  # SMALL caps B x T at 1024
    ids, mask = random_batch(np.random.default_rng(4), 64, 100)
    before = trt.stats["executions"]
    got = eng.infer(ids, mask)
    assert trt.stats["executions"] - before == 8
    want = ort_reference(model_dir / "model.onnx", ids, mask)
    assert cosine_rows(got, want).min() >= 0.999
    eng.close()


def test_out_of_range_inputs_raise_engine_error_naming_the_limits(model_dir, fakes):
    eng = _engine(model_dir)
    with pytest.raises(EngineError, match=r"outside \[1..64, 1..512\]"):
        eng.infer(np.ones((1, 513), np.int64), np.ones((1, 513), np.int64))
    with pytest.raises(EngineError, match="must both be"):
        eng.infer(np.ones((2, 5), np.int64), np.ones((2, 6), np.int64))
    eng.close()


def test_context_shape_check_failure_becomes_an_engine_error_with_the_profile(model_dir, fakes):
    eng = _engine(model_dir)
    b = eng.bucket_for(1, 16)
    object.__setattr__(b, "profile", ts.Profile(1, 1, 64, 1, 16, 64))  # lie: pretend the bucket reaches 64
    with pytest.raises(EngineError, match=r"rejected input shape \[1, 40\].*T 1..64"):
        eng._run(b, np.ones((1, 40), np.int64), np.ones((1, 40), np.int64))
    eng.close()


def test_buffers_are_allocated_once_per_bucket_at_load_and_freed_at_close(model_dir, fakes):
    _, cudart = fakes
    eng = _engine(model_dir)
    n_profiles = len(SMALL.seq_buckets)
    assert len(cudart.device_allocs) == len(cudart.host_allocs) == 3 * n_profiles  # ids, mask, pooled
    expected = set()
    for p in SMALL.profiles():
        expected |= {p.batch_max * p.seq_max * 8, p.batch_max * DIM * 4}
    assert set(cudart.malloc_sizes) == expected
    rng = np.random.default_rng(5)
    for _ in range(20):
        eng.infer(*random_batch(rng, int(rng.integers(1, 64)), int(rng.integers(1, 300))))
    assert len(cudart.malloc_sizes) == 2 * 3 * n_profiles  # nothing allocated per call
    eng.close()
    eng.close()  # idempotent
    assert not cudart.device_allocs and not cudart.host_allocs and not cudart.streams
    with pytest.raises(EngineError, match="closed"):
        eng.infer(np.ones((1, 3), np.int64), np.ones((1, 3), np.int64))


def test_other_threads_make_the_device_current_before_first_use(model_dir, fakes):
    _, cudart = fakes
    eng = _engine(model_dir)  # made on this thread, like the manager's probe
    ids, mask = random_batch(np.random.default_rng(6), 2, 9)
    out: dict[str, object] = {}

    def worker():
        try:
            out["y"] = eng.infer(ids, mask)
        except Exception as exc:  # noqa: BLE001
            out["err"] = exc

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert "err" not in out, out.get("err")
    assert len(cudart.set_device_threads) == 2
    eng.close()


def test_the_fake_runtime_really_rejects_a_thread_without_a_current_device(fakes):
    _, cudart = fakes
    res: list = []
    t = threading.Thread(target=lambda: res.append(cudart.cudaMalloc(16)[0]))
    t.start()
    t.join()
    assert res == [cudaError_t.cudaErrorDeviceUninitialized]


async def test_pool_workers_each_own_an_engine_and_results_match(model_dir, fakes):
    from inference.engines.tensorrt.engine import TensorRTEngine
    from inference.pool import InferencePool

    _, cudart = fakes
    pool = await InferencePool.start(lambda: TensorRTEngine(model_dir, spec=SMALL), workers=2, pad_id=1)
    try:
        rng = np.random.default_rng(7)
        windows = [[0] + list(rng.integers(3, VOCAB, int(n))) + [2] for n in rng.integers(1, 60, 40)]
        outs = await asyncio.gather(*(pool.run_batch(windows[i:i + 5]) for i in range(0, 40, 5)))
        got = np.concatenate(outs)
        from inference.batching.windows import pad_batch

        want = np.concatenate([ort_reference(model_dir / "model.onnx", *pad_batch(windows[i:i + 5], 1))
                               for i in range(0, 40, 5)])
        assert cosine_rows(got, want).min() >= 0.999
        assert len(cudart.set_device_threads) >= 2 and len(cudart.streams) == 2
    finally:
        await pool.close()
    assert not cudart.streams


# =========================================================================== engine identity, rebuild


def test_engine_from_another_gpu_is_rebuilt_never_loaded(model_dir, monkeypatch):
    a10 = FakeCudaRuntime("NVIDIA A10", (8, 6))
    trt, _ = install_fakes(monkeypatch, cudart=a10)
    built_on_a10 = be.build_engine(model_dir / "model.onnx", spec=SMALL).engine
    trt2, h200 = install_fakes(monkeypatch)  # same files, now on an H200
    eng = _engine(model_dir)
    assert eng.engine_file != built_on_a10 and "nvidia-h200.sm90" in eng.engine_file.name
    assert trt2.stats["deserialized"] == [("10.13.3.9", "NVIDIA H200")]  # the A10 plan was never read
    assert built_on_a10.is_file()
    eng.close()


def test_engine_from_another_tensorrt_version_is_rebuilt_never_loaded(model_dir, monkeypatch):
    install_fakes(monkeypatch, trt_version="10.13.3.9")
    old = be.build_engine(model_dir / "model.onnx", spec=SMALL).engine
    trt11, _ = install_fakes(monkeypatch, trt_version="11.4.1.2")
    eng = _engine(model_dir)
    assert eng.engine_file != old and ".trt11.4.1." in eng.engine_file.name
    assert all(v == "11.4.1.2" for v, _ in trt11.stats["deserialized"])
    eng.close()


def test_unreadable_engine_under_the_right_name_is_rebuilt_once(model_dir, fakes):
    trt, _ = fakes
    path = _engine(model_dir).engine_file
    path.write_bytes(b"truncated copy")
    eng = _engine(model_dir)
    assert trt.stats["builds"] == 2 and any("magic tag" in line for line in trt.log)
    eng.infer(*random_batch(np.random.default_rng(8), 2, 5))
    eng.close()


def test_a_re_prepared_onnx_makes_the_engine_stale(model_dir, fakes):
    trt, _ = fakes
    _engine(model_dir).close()
    write_tiny_bert_onnx(model_dir / "model.onnx", seed=1)
    _engine(model_dir).close()
    assert trt.stats["builds"] == 2


def test_missing_engine_without_build_permission_says_what_to_run(model_dir, fakes):
    with pytest.raises(EngineError, match="run 'healthbot build-engine'"):
        _engine(model_dir, build_missing=False)


def test_missing_tensorrt_is_an_engine_error_with_the_install_hint(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(EngineError, match="pip install tensorrt"):
        _engine(model_dir)


def test_missing_onnx_is_an_engine_error_pointing_at_prepare_model(tmp_path, fakes):
    with pytest.raises(EngineError, match="prepare-model"):
        _engine(tmp_path)


def test_build_engine_cli_prints_the_engine_path(model_dir, fakes, capsys):
    assert build_cli.main(["--engines-dir", str(model_dir), "--max-batch", "32"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.endswith(".engine") and Path(printed).is_file()


def test_unexpected_errors_while_loading_become_engine_errors_so_the_manager_falls_back(model_dir, fakes, monkeypatch):
    trt, _ = fakes

    def broken(self, logger):
        raise TypeError("pybind11 signature mismatch")

    monkeypatch.setattr(trt.Runtime, "__init__", broken)
    with pytest.raises(EngineError, match="TypeError: pybind11 signature mismatch"):
        _engine(model_dir)
