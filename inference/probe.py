"""The check a model or engine version must pass before it serves: the parity probe of a hot swap.

``healthbot prepare-model`` (inference/model/prepare.py) records the FP32 ONNX Runtime vectors
of the accuracy check's parity texts (inference/model/accuracy.py ``parity_texts``: 122
questions, answers and two long passages) in :data:`REFERENCE_FILE` beside the model, and names
that file and its sha256 in ``manifest.json`` under :data:`MANIFEST_KEY`. Before a new version
is swapped in (bot/model_reload.py), :func:`run_probe` embeds the same texts with it through the
serving path (tokenizer, batcher, engine; :data:`PROBE_CHUNK` texts a call, so they share padded
batches with each other and with the traffic) and compares each with its reference: every cosine
must reach :data:`MIN_COSINE` of the engine's precision. A corrupt or mismatched ONNX file, a
tokenizer from another model, or a reduced-precision engine that drifted fails. (The offline
accuracy check, inference/model/accuracy.py, is the thorough one: single and batched windows,
long texts, answer quality.) 96 short questions and 24 answers of 150-200 tokens: about 7 s on
2 busy CPU cores, well under a second on a GPU.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from inference.batching.errors import DeadlineExceeded

MANIFEST_KEY = "probe"
"""The manifest's entry: ``{"file": REFERENCE_FILE, "sha256": <hex of the file>, "texts": N}``."""

REFERENCE_FILE = "probe-reference.npz"
"""Arrays ``prefixes`` (str[N]), ``texts`` (str[N]) and ``vectors`` (float32[N, D], L2-normalized)."""

MIN_COSINE: dict[str, float] = {"fp32": 0.9999, "fp16": 0.999, "bf16": 0.999, "int8": 0.99}
"""Least cosine to the FP32 reference per precision (issue 6: ≥ 0.999 FP16, ≥ 0.99 INT8; FP32
differs from its own reference only by the order of float additions, ~1e-7)."""


PROBE_CHUNK = 8
"""Texts per ``encode`` call: 8 answers of ~200 tokens finish within a request's deadline on a busy CPU."""


class ProbeError(Exception):
    """The manifest names no probe reference, or its file is missing or not the one named."""


@dataclass(frozen=True)
class ProbeReference:
    """The parity texts of one model and their reference vectors.

    Attributes:
        prefixes: N e5 prefixes (``"query: "`` / ``"passage: "``), one per text.
        texts: the N texts.
        vectors: float32[N, D], L2-normalized.
    """

    prefixes: tuple[str, ...]
    texts: tuple[str, ...]
    vectors: np.ndarray


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_reference(engines_dir: Path, prefixes: Sequence[str], texts: Sequence[str],
                    vectors: np.ndarray) -> dict[str, Any]:
    """Write :data:`REFERENCE_FILE` into ``engines_dir`` (atomically) and return the manifest
    entry naming it (``{"file", "sha256", "texts"}``).

    Args:
        prefixes, texts: N each; vectors: float32[N, D], L2-normalized, the FP32 reference.
    """
    path = Path(engines_dir) / REFERENCE_FILE
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npz")
    np.savez_compressed(tmp, prefixes=np.array(list(prefixes)), texts=np.array(list(texts)),
             vectors=np.asarray(vectors, dtype=np.float32))
    os.replace(tmp, path)
    return {"file": REFERENCE_FILE, "sha256": _sha256(path), "texts": len(texts)}


def load_reference(engines_dir: Path, manifest: Mapping[str, Any]) -> ProbeReference:
    """The probe reference ``manifest`` names in ``engines_dir``.

    Raises:
        ProbeError: no :data:`MANIFEST_KEY` entry (a model prepared before the probe existed:
            ``healthbot prepare-model`` adds it in seconds), the file is missing, or its
            sha256 is not the manifest's.
    """
    entry = manifest.get(MANIFEST_KEY)
    if not isinstance(entry, Mapping) or not entry.get("file"):
        raise ProbeError("manifest.json names no probe reference: run 'healthbot prepare-model' "
                         "(it adds one to a model prepared before it existed)")
    path = Path(engines_dir) / str(entry["file"])
    if not path.is_file():
        raise ProbeError(f"{path} missing: run 'healthbot prepare-model'")
    if _sha256(path) != entry.get("sha256"):
        raise ProbeError(f"{path} is not the probe reference manifest.json names (sha256 differs)")
    with np.load(path) as z:
        return ProbeReference(tuple(map(str, z["prefixes"])), tuple(map(str, z["texts"])),
                              np.asarray(z["vectors"], dtype=np.float32))


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)


async def _embed(encoder: Any, texts: list[str], prefix: str) -> np.ndarray:
    """float32[N, D]: :data:`PROBE_CHUNK` texts a call, halved after a call past the request
    deadline (the probe shares the CPU with the traffic being served), down to one."""
    out: list[np.ndarray] = []
    size = PROBE_CHUNK
    while len(out) < len(texts):
        try:
            out.extend(await encoder.encode(texts[len(out):len(out) + size], prefix))
        except DeadlineExceeded:
            if size == 1:
                raise
            size //= 2
    return np.stack(out)


async def run_probe(encoder: Any, reference: ProbeReference, precision: str) -> dict[str, Any]:
    """Embed the reference texts with ``encoder`` and compare them with the reference (module doc).

    Args:
        encoder: anything with ``encode(texts, prefix) -> float32[N, D]`` and ``dim``.
        reference: from :func:`load_reference`.
        precision: the engine's (``"fp32"``, ``"fp16"``, ``"int8"``): picks the threshold of
            :data:`MIN_COSINE` (unknown precisions are held to FP32's).

    Returns:
        ``{"texts", "threshold", "min_cosine", "worst_text", "passed"}``; a vector dimension
        other than the reference's fails with ``min_cosine`` 0.

    Raises:
        whatever ``encoder.encode`` raises: the engine failed, a text alone missed the deadline.
    """
    threshold = MIN_COSINE.get(precision, MIN_COSINE["fp32"])
    report: dict[str, Any] = {"texts": len(reference.texts), "threshold": threshold}
    if encoder.dim != reference.vectors.shape[1]:
        return {**report, "min_cosine": 0.0, "worst_text": "", "passed": False,
                "reason": f"{encoder.dim}-dim vectors, the reference's are {reference.vectors.shape[1]}-dim"}
    vectors = np.empty_like(reference.vectors)
    for prefix in sorted(set(reference.prefixes)):
        rows = [i for i, p in enumerate(reference.prefixes) if p == prefix]
        vectors[rows] = await _embed(encoder, [reference.texts[i] for i in rows], prefix)
    cos = np.nan_to_num(_cosines(vectors, reference.vectors), nan=-1.0)  # a broken engine's NaN vectors fail
    worst = int(np.argmin(cos))
    return {**report, "min_cosine": round(float(cos[worst]), 6), "worst_text": reference.texts[worst][:60],
            "passed": bool(cos[worst] >= threshold)}
