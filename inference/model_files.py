"""The prepared model's files in the engines folder (``healthbot prepare-model`` writes them,
:mod:`inference.model.prepare`): whether the model is prepared, and file hashes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

#: Written last by ``healthbot prepare-model``: its presence means the other files are complete.
MANIFEST_FILE = "manifest.json"

_CHUNK = 1 << 20  # bytes per hashing read


def require_prepared(engines_dir: Path) -> None:
    """Raise FileNotFoundError (naming ``healthbot prepare-model``) unless ``engines_dir``
    holds a prepared model (its :data:`MANIFEST_FILE`, written last)."""
    if not (Path(engines_dir) / MANIFEST_FILE).is_file():
        raise FileNotFoundError(f"{Path(engines_dir) / MANIFEST_FILE} missing: run 'healthbot prepare-model'")


def sha256_file(path: Path, desc: str | None = None) -> str:
    """Hex sha256 of ``path``, with a byte progress bar when ``desc`` is given."""
    from tqdm import tqdm

    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=desc, disable=desc is None, leave=False) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()



def onnx_sha256_of(onnx_path: Path) -> str:
    """sha256 of the ONNX: from ``manifest.json`` beside it when it describes this
    file (same name and byte size), else hashed."""
    onnx_path = Path(onnx_path)
    try:
        m = json.loads((onnx_path.parent / "manifest.json").read_text(encoding="utf-8"))
        if m.get("onnx") == onnx_path.name and m.get("onnx_bytes") == onnx_path.stat().st_size and m.get("onnx_sha256"):
            return str(m["onnx_sha256"])
    except (FileNotFoundError, json.JSONDecodeError):
        pass
    return sha256_file(onnx_path)
