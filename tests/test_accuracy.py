"""The accuracy check (inference/model/accuracy.py) and the ONNX INT8 variant's bookkeeping, with fake engines."""

from __future__ import annotations

import numpy as np
import pytest

from inference.model.accuracy import EVAL_TOLERANCE, MIN_COSINE, eval_check, eval_env, format_report, parity_check

PAD = 1


class NoisyEngine:
    """Fake engine: a fixed mean-pooled embedding table, plus noise of relative size ``noise``
    (``per_batch``: the noise depends on the batch contents, as per-tensor INT8 did)."""

    name, dim, max_batch_size, max_seq_len = "noisy", 16, 64, 512

    def __init__(self, noise: float = 0.0, per_batch: bool = False):
        self.table = np.random.default_rng(0).normal(size=(200, self.dim)).astype(np.float32)
        self.noise = noise
        self.per_batch = per_batch

    def infer(self, ids, mask):
        m = mask[..., None].astype(np.float32)
        out = (self.table[ids] * m).sum(1) / m.sum(1)
        if self.noise:
            seed = int(ids.sum()) if self.per_batch else 7
            out = out + self.noise * np.abs(out).mean() * np.random.default_rng(seed).normal(size=out.shape)
        return out.astype(np.float32)

    def close(self):
        pass


WINDOWS = [[0] + list(range(5, 5 + n)) + [2] for n in (3, 9, 14, 30, 60, 7, 7, 120)]


def test_parity_passes_an_exact_variant_and_reports_both_modes():
    ref = NoisyEngine().infer(*_pad_each(WINDOWS))
    rep = parity_check(NoisyEngine(), WINDOWS, ref, "int8", PAD)
    assert rep["passed"] and rep["min_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert rep["threshold"] == MIN_COSINE["int8"] == 0.99 and MIN_COSINE["fp16"] == 0.999
    assert rep["single"]["min"] == pytest.approx(1.0, abs=1e-6) and rep["batched"]["batch"] == 16


def test_parity_fails_a_variant_that_drifts_with_the_batch_contents():
    ref = np.concatenate([NoisyEngine().infer(*_pad_each([w])) for w in WINDOWS])
    rep = parity_check(NoisyEngine(noise=0.3, per_batch=True), WINDOWS, ref, "fp16", PAD)
    assert not rep["passed"] and rep["min_cosine"] < 0.999
    assert "FAILED" in format_report({"engine": "x", "precision": "fp16", "parity": rep, "eval": None,
                                      "passed": False, "reason": "parity"})


def _pad_each(windows):
    from inference.batching.windows import pad_batch
    return pad_batch(windows, PAD)


def test_eval_check_allows_one_point_and_compares_against_fp32_onnxruntime(tmp_path):
    calls = []

    def runner(env, path, engines_dir):
        calls.append(env)
        fp32 = env["HEALTHBOT_INFERENCE_ONNX_PRECISION"] == "fp32"
        return {"intent_accuracy": 0.9933 if fp32 else 0.9867, "topic_accuracy": 0.9785 if fp32 else 0.9785}

    rep = eval_check("onnxruntime", "int8", tmp_path / "dev.jsonl", runner=runner)
    assert calls[0]["HEALTHBOT_INFERENCE_ONNX_PRECISION"] == "fp32"
    assert calls[1] == {"HEALTHBOT_INFERENCE_ENGINE_ORDER": "onnxruntime", "HEALTHBOT_INFERENCE_ONNX_PRECISION": "int8"}
    assert rep["intent_delta"] == pytest.approx(-0.0066) and rep["passed"] and rep["tolerance"] == EVAL_TOLERANCE

    def worse(env, path, engines_dir):
        return {"intent_accuracy": 0.99 if "fp32" in env.values() else 0.97, "topic_accuracy": 0.98}

    assert not eval_check("onnxruntime", "int8", tmp_path / "dev.jsonl", runner=worse)["passed"]


def test_eval_env_pins_the_engine_without_fallback_for_gpu_variants():
    assert eval_env("torch_cuda", "fp16") == {"HEALTHBOT_INFERENCE_ENGINE_ORDER": "torch_cuda",
                                              "HEALTHBOT_INFERENCE_FALLBACK_ENGINE": ""}
    with pytest.raises(ValueError, match="no variant onnxruntime/fp16"):
        eval_env("onnxruntime", "fp16")
