"""The ONNX files of the ``onnxruntime`` engine's precisions and whether the INT8 one may be used.

``engines/model.onnx`` is FP32; ``engines/model.int8.onnx`` (with its sidecar
``engines/model.int8.onnx.json``) is built by ``healthbot build-engine --engine onnxruntime
--precision int8`` (:mod:`inference.model.int8`, which says how and why). The ``onnxruntime``
engine uses the INT8 file only when asked (``inference.onnx_precision = "int8"``) or, with
``"auto"`` (the default), when the sidecar says it is current (built from this ``model.onnx``)
and passed the accuracy check (:func:`int8_status`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference.model_files import onnx_sha256_of

VARIANT_FORMAT = 1
"""Version of the sidecar; bump it to make every built variant stale."""

FP32_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"

def variant_path(engines_dir: Path | str, precision: str) -> Path:
    """The ONNX file of ``precision`` (``"fp32"`` or ``"int8"``) in ``engines_dir``.

    Raises:
        ValueError: an unknown precision.
    """
    files = {"fp32": FP32_FILE, "int8": INT8_FILE}
    if precision not in files:
        raise ValueError(f"ONNX precision {precision!r}: use one of {sorted(files)}")
    return Path(engines_dir) / files[precision]


def sidecar_path(model: Path) -> Path:
    """``<model>.json``: what the variant was built from and its accuracy check."""
    return model.with_name(model.name + ".json")


def source_sha(engines_dir: Path) -> str:
    """sha256 of the ``model.onnx`` the variants are built from."""
    return onnx_sha256_of(engines_dir / FP32_FILE)


def read_sidecar(model: Path) -> dict[str, Any] | None:
    """The parsed sidecar of ``model``, or None when absent or unreadable."""
    try:
        return json.loads(sidecar_path(model).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@dataclass(frozen=True)
class VariantStatus:
    """Whether a built variant may be used by ``onnx_precision = "auto"``.

    Attributes:
        path: the variant's file.
        exists: the file is there.
        current: built from the present ``model.onnx`` with this format.
        passed: its recorded accuracy check passed (parity and eval).
        reason: why it is not usable (``""`` when usable).
    """

    path: Path
    exists: bool
    current: bool
    passed: bool
    reason: str

    @property
    def usable(self) -> bool:
        return self.exists and self.current and self.passed


def int8_status(engines_dir: Path | str) -> VariantStatus:
    """State of ``engines/model.int8.onnx`` (cheap: reads the sidecar and manifest only)."""
    engines_dir = Path(engines_dir)
    path = engines_dir / INT8_FILE
    hint = "build it with 'healthbot build-engine --engine onnxruntime --precision int8'"
    if not path.is_file():
        return VariantStatus(path, False, False, False, f"{path.name} missing: {hint}")
    meta = read_sidecar(path)
    if not meta:
        return VariantStatus(path, True, False, False, f"{sidecar_path(path).name} missing: {hint}")
    try:
        sha = source_sha(engines_dir)
    except FileNotFoundError:
        return VariantStatus(path, True, False, False, f"{FP32_FILE} missing: run 'healthbot prepare-model'")
    current = (meta.get("format") == VARIANT_FORMAT and meta.get("source_sha256") == sha
               and meta.get("bytes") == path.stat().st_size)
    if not current:
        return VariantStatus(path, True, False, False, f"{path.name} was built from another model.onnx: rebuild it ({hint})")
    acc = meta.get("accuracy") or {}
    passed = bool(acc.get("passed"))
    if not passed:
        why = acc.get("reason") or "no accuracy check recorded"
        return VariantStatus(path, True, True, False, f"{path.name} did not pass the accuracy check ({why})")
    return VariantStatus(path, True, True, True, "")
