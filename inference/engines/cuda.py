"""CUDA runtime helpers the GPU engines share: cuda-python's runtime bindings, its
``(err, *values)`` results unwrapped, and the device's name and compute capability."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeviceInfo:
    """The GPU an engine is built for (``cudaGetDeviceProperties``)."""

    name: str
    major: int
    minor: int

    @property
    def slug(self) -> str:
        """File-name-safe GPU name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-") or "gpu"

    @property
    def sm(self) -> str:
        """Compute capability as ``"sm90"``."""
        return f"sm{self.major}{self.minor}"


def import_cudart() -> Any:
    """cuda-python's runtime bindings: ``cuda.bindings.runtime`` (cuda-python >= 12.6),
    else the older ``cuda.cudart``.

    Raises:
        ImportError: with the install hint.
    """
    try:
        return importlib.import_module("cuda.bindings.runtime")
    except ImportError:
        try:
            return importlib.import_module("cuda.cudart")
        except ImportError as exc:
            raise ImportError(f"cuda-python is not installed ({exc}): pip install 'healthbot[gpu]'") from None


def cuda_check(cudart: Any, result: Any, what: str) -> Any:
    """Unwrap a cuda-python call's ``(err, *values)`` tuple.

    Returns:
        None, the single value, or a tuple of values.

    Raises:
        RuntimeError: ``err`` is not ``cudaSuccess`` (message: call, error name, description).
    """
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if int(err) != 0:
        try:
            name = cudart.cudaGetErrorName(err)[1]
            desc = cudart.cudaGetErrorString(err)[1]
            name = name.decode() if isinstance(name, bytes) else str(name)
            desc = desc.decode() if isinstance(desc, bytes) else str(desc)
        except Exception:  # noqa: BLE001 - best effort description
            name, desc = str(err), ""
        raise RuntimeError(f"CUDA {what} failed: {name} ({int(err)}): {desc}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def query_device(cudart: Any, device: int = 0) -> DeviceInfo:
    """Name and compute capability of CUDA device ``device`` (``cudaGetDeviceProperties``).

    Raises:
        RuntimeError: no such device or no driver.
    """
    prop = cuda_check(cudart, cudart.cudaGetDeviceProperties(device), f"cudaGetDeviceProperties({device})")
    name = prop.name
    if isinstance(name, (bytes, bytearray)):
        name = bytes(name).split(b"\0", 1)[0].decode("utf-8", "replace")
    return DeviceInfo(str(name).strip(), int(prop.major), int(prop.minor))
