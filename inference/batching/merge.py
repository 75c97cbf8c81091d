"""Batching across processes: the process pool packs texts into messages for its worker
processes (:func:`pack_messages`), and the engine server merges the padded batches its
workers send into fewer, fuller engine calls (:func:`merge_plan`, :func:`merge`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

#: Texts per message at most: a flush with more pending spreads them over workers.
MAX_TEXTS_PER_MESSAGE = 128
#: Texts per message at least when more are pending: a flush is not cut into a message
#: per worker smaller than this. Each message costs every process it passes a fixed
#: amount of Python: on the H200 host, 6 workers' messages of ~5 texts cost the workers
#: 127 us of CPU per text; at least 32 per message, 56 us, and c = 256 went from
#: 45.0k to 53.6k encodes/s (docs/benchmarks.md, sixth session).
MIN_TEXTS_PER_MESSAGE = 32


def pack_messages(sizes: Sequence[int], workers: int) -> list[list[int]]:
    """Which ``encode`` calls travel together: calls of ``sizes`` texts (in submit order, one
    prefix) packed in order into messages of at most ``per`` texts, where ``per`` spreads the
    total evenly over ``workers`` live workers but stays within
    [:data:`MIN_TEXTS_PER_MESSAGE`, :data:`MAX_TEXTS_PER_MESSAGE`]; a call larger than
    ``per`` travels alone. Returns groups of indices into ``sizes``."""
    total = sum(sizes)
    per = min(MAX_TEXTS_PER_MESSAGE, max(MIN_TEXTS_PER_MESSAGE, -(-total // max(1, workers))))
    groups: list[list[int]] = [[]]
    texts = 0
    for i, n in enumerate(sizes):
        if texts and texts + n > per:
            groups.append([])
            texts = 0
        groups[-1].append(i)
        texts += n
    return groups


def merge_plan(shapes: Sequence[tuple[int, int]], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Which waiting batches run together (first fit, in arrival order).

    A batch joins the first open group where, with it, the rows stay ≤ ``max_rows``,
    the padded cost (rows × longest window) stays ≤ ``max_tokens`` (the batcher's
    ``inference.max_batch_tokens``, TEI's padded budget) and at most 2× the tokens
    the batches would cost run apart (the batcher's own bound on padding waste, its
    power-of-two length buckets): queries of 12 and 27 tokens merge, one 512-token
    passage does not drag 8 queries to its length.

    Args:
        shapes: ``(B, T)`` of each waiting batch, oldest first (a batch beyond the limits runs alone).
        max_rows / max_tokens: limits of one merged batch.

    Returns:
        Groups of indices into ``shapes``, ordered by their oldest batch.
    """
    groups: list[list[int]] = []
    state: list[tuple[int, int, int]] = []  # per group: rows, longest, tokens apart
    for i, (rows, seq) in enumerate(shapes):
        for k, (g_rows, g_seq, g_apart) in enumerate(state):
            n, t, apart = g_rows + rows, max(g_seq, seq), g_apart + rows * seq
            if n <= max_rows and n * t <= min(max_tokens, 2 * apart):
                groups[k].append(i)
                state[k] = (n, t, apart)
                break
        else:
            groups.append([i])
            state.append((rows, seq, rows * seq))
    return groups


def merge(batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Stack padded batches ``[(int64[B_i, T_i] ids, int64[B_i, T_i] mask)]`` into one
    int64[sum B_i, max T_i] pair; added columns are id 0, mask 0."""
    if len(batches) == 1:
        return batches[0]
    rows = sum(ids.shape[0] for ids, _ in batches)
    seq = max(ids.shape[1] for ids, _ in batches)
    ids_out = np.zeros((rows, seq), dtype=np.int64)
    mask_out = np.zeros((rows, seq), dtype=np.int64)
    row = 0
    for ids, mask in batches:
        b, t = ids.shape
        ids_out[row:row + b, :t] = ids
        mask_out[row:row + b, :t] = mask
        row += b
    return ids_out, mask_out
