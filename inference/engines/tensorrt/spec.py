"""What a TensorRT engine is built with and for: build settings (:class:`BuildSpec`, its
optimization :class:`Profile` s), the engine file's name (its compatibility key) and sidecar,
and the ``tensorrt`` import. Module doc of :mod:`inference.engines.tensorrt.build`: why."""

from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference.engines.cuda import DeviceInfo

ENGINE_FORMAT = 1
"""Version of the sidecar JSON and naming scheme; bump it to invalidate engines."""

DEFAULT_SEQ_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
"""Sequence buckets in tokens; the same as :data:`inference.batching.windows.DEFAULT_BUCKETS`
(a test pins them equal), so each batch the batcher forms falls in one profile."""

DEFAULT_MAX_BATCH = 256
"""Largest batch the engine accepts (the pool splits larger ones)."""

DEFAULT_OPT_TOKENS = 8192
"""B x T the profiles are tuned for: the batcher's default ``max_batch_tokens``
(text-embeddings-inference's padded budget), so ``opt`` batch = 8192 // bucket."""

DEFAULT_MAX_TOKENS = 16384
"""Cap on B x T of a profile's largest shape; bounds the activation memory
TensorRT reserves. Larger batches are split by the runtime."""

DEFAULT_WORKSPACE_BYTES = 1 << 30
"""Builder workspace (``MemoryPoolType.WORKSPACE``) limit: 1 GiB."""

class BuildError(RuntimeError):
    """The engine could not be built; the message says what to do."""


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Profile:
    """One optimization profile: inclusive ranges over batch B and sequence T.

    ``opt`` is the shape TensorRT tunes kernels for.
    """

    batch_min: int
    batch_opt: int
    batch_max: int
    seq_min: int
    seq_opt: int
    seq_max: int

    def contains(self, batch: int, seq: int) -> bool:
        """True when a [batch, seq] input is inside this profile."""
        return self.batch_min <= batch <= self.batch_max and self.seq_min <= seq <= self.seq_max

    def shapes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """``(min, opt, max)`` [B, T] shapes as ``IOptimizationProfile.set_shape`` takes them."""
        return ((self.batch_min, self.seq_min), (self.batch_opt, self.seq_opt), (self.batch_max, self.seq_max))

    def describe(self) -> str:
        """``"B 1..256 x T 1..16"``."""
        return f"B {self.batch_min}..{self.batch_max} x T {self.seq_min}..{self.seq_max}"


@dataclass(frozen=True)
class BuildSpec:
    """Build settings; part of the sidecar, so changing one triggers a rebuild.

    Attributes:
        max_batch_size: largest B (default 256).
        seq_buckets: ascending sequence buckets in tokens, the last one the
            model's max length (512).
        per_bucket: one profile per bucket (default) or one profile over 1..512.
        precision: ``"fp16"`` (default), ``"fp32"``, or ``"int8"`` (needs an
            explicitly quantized ONNX with Q/DQ nodes).
        opt_tokens: B x T each profile is tuned for (default 8192).
        max_tokens: cap on B x T of each profile's largest shape (default 16384).
        workspace_bytes: builder workspace limit in bytes (default 1 GiB).
    """

    max_batch_size: int = DEFAULT_MAX_BATCH
    seq_buckets: tuple[int, ...] = DEFAULT_SEQ_BUCKETS
    per_bucket: bool = True
    precision: str = "fp16"
    opt_tokens: int = DEFAULT_OPT_TOKENS
    max_tokens: int = DEFAULT_MAX_TOKENS
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES

    def __post_init__(self) -> None:
        if self.precision not in ("fp16", "fp32", "int8"):
            raise BuildError(f"precision {self.precision!r}: use 'fp16', 'fp32' or 'int8'")
        buckets = tuple(self.seq_buckets)
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise BuildError(f"seq_buckets {buckets} must be ascending, distinct and >= 1")
        if self.max_batch_size < 1 or self.opt_tokens < 1 or self.max_tokens < buckets[-1]:
            raise BuildError("max_batch_size and opt_tokens must be >= 1 and max_tokens >= the largest bucket")
        object.__setattr__(self, "seq_buckets", buckets)

    def profiles(self) -> list[Profile]:
        """The optimization profiles, in index order.

        Per bucket b (previous bucket p, 0 for the first): T in ``p+1 .. b``,
        ``opt`` T = b; B in ``1 .. min(max_batch, max_tokens // b)`` with
        ``opt`` B = ``min(that max, max(1, opt_tokens // b))``. Every T in
        1..max bucket lies in exactly one profile.
        """
        edges = list(self.seq_buckets) if self.per_bucket else [self.seq_buckets[-1]]
        out, lo = [], 1
        for hi in edges:
            bmax = max(1, min(self.max_batch_size, self.max_tokens // hi))
            bopt = min(bmax, max(1, self.opt_tokens // hi))
            out.append(Profile(1, bopt, bmax, lo, hi, hi))
            lo = hi + 1
        return out

    def as_json(self) -> dict[str, Any]:
        """The settings as JSON-ready values (for the sidecar)."""
        d = dataclasses.asdict(self)
        d["seq_buckets"] = list(self.seq_buckets)
        return d


def trt_major(trt: Any) -> int:
    """TensorRT major version from ``trt.__version__`` (``"10.13.3.9"`` -> 10)."""
    try:
        return int(str(trt.__version__).split(".")[0])
    except (AttributeError, ValueError) as exc:
        raise BuildError(f"cannot read the TensorRT version ({exc})") from None


def trt_tag(trt: Any) -> str:
    """``"trt10.13.3"``: the first three parts of ``trt.__version__``."""
    return "trt" + ".".join(str(trt.__version__).split(".")[:3])


def engine_path(engines_dir: Path, onnx_stem: str, spec: BuildSpec, device: DeviceInfo, trt_version: str) -> Path:
    """Where the engine for this model, precision, GPU and TensorRT version lives.

    Example: ``engines/model.fp16.nvidia-h200.sm90.trt10.13.3.engine``. The
    name is the compatibility key: an engine made elsewhere never matches it.
    """
    tag = "trt" + ".".join(str(trt_version).split(".")[:3])
    return Path(engines_dir) / f"{onnx_stem}.{spec.precision}.{device.slug}.{device.sm}.{tag}.engine"


def timing_cache_path(engines_dir: Path, device: DeviceInfo, trt_version: str) -> Path:
    """Timing cache for one GPU model and TensorRT version (caches are not portable either)."""
    tag = "trt" + ".".join(str(trt_version).split(".")[:3])
    return Path(engines_dir) / f"timing.{device.slug}.{device.sm}.{tag}.cache"


def sidecar_path(engine: Path) -> Path:
    """``<engine>.json``: what the engine was built from and with."""
    return engine.with_name(engine.name + ".json")


def engine_is_current(engine: Path, onnx_sha256: str, spec: BuildSpec) -> bool:
    """True when ``engine`` exists and its sidecar names the same ONNX, settings and format."""
    try:
        meta = json.loads(sidecar_path(engine).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return (engine.is_file() and meta.get("format") == ENGINE_FORMAT
            and meta.get("onnx_sha256") == onnx_sha256 and meta.get("spec") == spec.as_json())


# --------------------------------------------------------------------------- imports
def import_tensorrt() -> Any:
    """The ``tensorrt`` module (whatever ``sys.modules`` holds: tests inject a double).

    Raises:
        ImportError: with the install hint.
    """
    try:
        return importlib.import_module("tensorrt")
    except ImportError as exc:
        raise ImportError(f"TensorRT is not installed ({exc}): pip install tensorrt "
                          "(needs an NVIDIA GPU and driver); otherwise use the torch_cuda or onnxruntime engine") from None
