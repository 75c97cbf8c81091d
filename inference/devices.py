"""Devices: which GPUs are visible, where an engine's workers are placed, and how logs and
metrics name a device (``"cpu"``, ``"cuda:N"``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

from inference.engines.base import EngineError

#: ``None`` for the CPU, else the GPU index.
Device = int | None

#: Engines that run on a GPU (placed per device); the others run on the CPU. A set that
#: :func:`inference.engines.loader.register_loader` updates in place.
GPU_ENGINES: set[str] = {"tensorrt", "torch_cuda"}

#: Why a GPU engine is skipped on a machine without one (logged at info, not counted as a fallback).
NO_GPU = "no NVIDIA GPU visible"


def gpu_visible() -> bool:
    """True when an NVIDIA device node exists (checked before importing a CUDA stack)."""
    return any(Path("/dev").glob("nvidia[0-9]*")) or bool(os.environ.get("HEALTHBOT_ASSUME_GPU"))


def visible_gpu_count() -> int:
    """GPUs this process can use: PyTorch's count when torch has CUDA, else cuda-python's
    ``cudaGetDeviceCount``, else the ``/dev/nvidia<N>`` nodes (limited by
    ``CUDA_VISIBLE_DEVICES``); 0 without any. ``HEALTHBOT_ASSUME_GPU=N`` (tests, whose
    GPU engines are doubles) makes it N."""
    if not gpu_visible():
        return 0
    if os.environ.get("HEALTHBOT_ASSUME_GPU", "").isdigit():
        return int(os.environ["HEALTHBOT_ASSUME_GPU"])
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.device_count())
    except ImportError:
        pass
    try:
        from inference.engines.cuda import cuda_check, import_cudart

        cudart = import_cudart()
        return int(cuda_check(cudart, cudart.cudaGetDeviceCount(), "cudaGetDeviceCount"))
    except (ImportError, RuntimeError):
        pass
    nodes = len(list(Path("/dev").glob("nvidia[0-9]*")))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        nodes = min(nodes, len([v for v in visible.split(",") if v.strip()]))
    return nodes


def resolve_devices(devices: Sequence[str | int], engine: str,
                    count: Callable[[], int] = visible_gpu_count) -> list[Device]:
    """The devices an engine's workers are placed on.

    Args:
        devices: ``inference.devices``: ``["all"]`` or GPU indices (``["0", "1"]``).
        engine: the engine's name; CPU engines always get ``[None]``.
        count: visible GPU count (tests pass a fake).

    Returns:
        ``[None]`` for a CPU engine, else the GPU indices in order, without duplicates.

    Raises:
        EngineError: no GPU visible, or an index beyond the visible GPUs.
    """
    if engine not in GPU_ENGINES:
        return [None]
    spec = [str(d).strip() for d in devices] or ["all"]
    n = count()
    if n < 1:
        raise EngineError(f"{engine}: no GPU visible (inference.devices = {spec})")
    if spec == ["all"]:
        return list(range(n))
    try:
        ids = list(dict.fromkeys(int(d) for d in spec))
    except ValueError:
        raise EngineError(f"inference.devices {spec}: use \"all\" or GPU indices") from None
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise EngineError(f"inference.devices {spec}: GPU(s) {bad} not visible ({n} visible: 0..{n - 1})")
    return ids


def device_label(device: Device) -> str:
    """``"cpu"`` for the CPU (None), ``"cuda:N"`` for GPU N: how logs and metrics name a device."""
    return "cpu" if device is None else f"cuda:{device}"
