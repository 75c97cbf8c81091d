"""Embedding many texts through the inference pool without tripping its request deadline.

Used wherever the project's own texts are embedded at start-up or after an edit: the
knowledge base (bot/retrieval.py), the training lines of the decision head, the topic-fit
verifier and the topic prior, and the unanswered-questions report.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import structlog

from inference.batcher import DeadlineExceeded

log = structlog.get_logger("healthbot.retrieval")


class TextEncoder(Protocol):
    """What retrieval and training need from :class:`inference.encoder.Encoder`."""

    engine_name: str

    async def encode(self, texts: list[str], prefix: str = "query: ") -> np.ndarray:
        """float32[N, D], L2-normalized."""
        ...


#: Texts per ``encode`` call when the knowledge base is embedded (start-up, hot reload).
EMBED_CHUNK = 64


async def embed_all(encoder: TextEncoder, texts: list[str], prefix: str = "query: ") -> list[np.ndarray]:
    """float32[D] vectors of ``texts``, :data:`EMBED_CHUNK` per ``encode`` call.

    A call past the encoder's request deadline (``inference.deadline_ms``: a CPU
    shared with other work at start-up) is not fatal: the chunk is halved and tried
    again, down to one text a call (logged at info; at one text a call, overloaded: a warning).

    Raises:
        DeadlineExceeded: one text alone did not finish within the deadline.
    """
    out: list[np.ndarray] = []
    size = EMBED_CHUNK
    while len(out) < len(texts):
        chunk = texts[len(out):len(out) + size]
        try:
            out.extend(await encoder.encode(chunk, prefix=prefix))
        except DeadlineExceeded:
            if size == 1:
                raise
            size //= 2
            (log.warning if size == 1 else log.info)(
                "kb_embedding_smaller_calls", texts_per_call=size, done=len(out), total=len(texts),
                why=f"{2 * size} texts took longer than inference.deadline_ms")
    return out
