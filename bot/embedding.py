"""Embedding the project's own texts so that each text's vector is the same on every build.

Used wherever the project's own texts are embedded at start-up or after an edit: the
knowledge base (bot/retrieval.py), the training lines of the decision head, the topic-fit
verifier and the topic prior, and the unanswered-questions report.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class TextEncoder(Protocol):
    """What retrieval and training need from :class:`inference.encoder.Encoder`."""

    engine_name: str

    async def encode(self, texts: list[str], prefix: str = "query: ") -> np.ndarray:
        """float32[N, D], L2-normalized."""
        ...


#: How :func:`embed_all` embeds (one text a call): part of the cache key of everything derived from
#: its vectors (bot/runtime.py ``derive``), so that caches embedded another way are not mixed in.
SCHEME = "alone"


async def embed_all(encoder: TextEncoder, texts: list[str], prefix: str = "query: ") -> list[np.ndarray]:
    """float32[D] vectors of ``texts``, one text per ``encode`` call, one call after another.

    Alone, a text is not padded to a longer neighbour's length, and its vector is the same
    whatever else is embedded and in what order: a clean build, a partial one (one model's
    cache kept, another retrained) and a build under load give the same vectors, hence the
    same learned models (in a batch a padded text's vector moves by about 1e-8, which the
    trainings' solvers and trees amplified into different models). On 2 CPU cores this costs
    about a third more time than chunks of 64 (600 texts: 1.24 against 0.91 s). The embedding
    cache in front of the encoder (inference/encoder.py ``CachedEncoder``) is bypassed: it is
    for users' questions, which may have been embedded in a batch. Only texts embedded while
    the server answers users (a reload) can share a batch with a user's question.

    Raises:
        DeadlineExceeded: one text alone did not finish within ``inference.deadline_ms``.
    """
    engine = getattr(encoder, "inner", encoder)  # the cache's encoder, not the cache
    return [(await engine.encode([text], prefix=prefix))[0] for text in texts]
