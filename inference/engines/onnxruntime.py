"""ONNX Runtime engine: the CPU default and fallback (CUDA EP where onnxruntime-gpu is installed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import structlog

from inference.engines.base import EngineError, check_batch

log = structlog.get_logger("healthbot.inference.onnxruntime")

#: BERT's learned position table has 512 rows (multilingual-e5-small config).
MAX_SEQ_LEN = 512
#: No hard limit on CPU; bounds one call's activation memory
#: (~B × T × 384 × 4 bytes × a few dozen live tensors).
DEFAULT_MAX_BATCH_SIZE = 256


class OnnxRuntimeEngine:
    """Runs ``model.onnx`` (inputs ``input_ids``, ``attention_mask`` int64[B, T];
    output ``pooled`` float32[B, D]) in one ONNX Runtime session.

    Session settings and why:

    - ``graph_optimization_level = ORT_ENABLE_ALL`` (constant folding, fusions,
      layout optimizations).
    - ``enable_cpu_mem_arena = False``: the arena keeps every block it ever
      allocated and, with a new (B, T) shape on almost every call, grows to the
      largest batch seen and never gives memory back. Measured on the FP32
      e5-small (2 cores, 2026-11-29): after one [16, 512] batch the process stays
      at 986 MiB with the arena against 514 MiB without it; with both sessions
      timed interleaved, a [1, 16] query, [8, 24] and [32, 32] batches ran
      equally fast with and without it (the per-run mallocs are small next to a
      BERT forward pass). Padding to shape buckets would also bound the arena but
      computes padding tokens for nothing; the arena-shrinkage run option
      (``memory.enable_memory_arena_shrinkage``) measured the same as no arena.
    - ``enable_mem_pattern = False``: memory patterns are planned per input shape
      and only pay off when shapes repeat.
    - ``inter_op_num_threads = 1``, sequential execution: a BERT graph is one
      chain; parallelism comes from intra-op threads and from pool workers.

    Args:
        model_path: the ``.onnx`` file (``engines/model.onnx``, written by
            ``healthbot prepare-model``).
        intra_op_threads: threads per session (0 = ONNX Runtime's default, one per
            physical core). With several pool workers, workers × threads should
            not exceed the cores.
        device: ``"cpu"`` or ``"cuda"`` (needs onnxruntime-gpu; CUDA EP first,
            CPU EP for unsupported nodes).
        max_batch_size: largest B accepted by :meth:`infer`.
        allow_spinning: let idle intra-op threads busy-wait for the next parallel
            section (ONNX Runtime's default). Off by default here: the event loop
            (tokenization, batching) shares the cores with the session, and on a
            2-core machine spinning threads took CPU from it (docs/benchmarks.md).
        precision: what the file holds, ``"fp32"`` or ``"int8"`` (the fused,
            per-channel INT8 ``model.int8.onnx`` of :mod:`inference.onnx_variants`);
            reported as :attr:`precision`, not checked.

    Raises:
        EngineError: file missing, onnxruntime or the CUDA EP unavailable, or the
            model does not have the expected inputs/output.
    """

    name = "onnxruntime"

    def __init__(self, model_path: str | Path, intra_op_threads: int = 0, device: str = "cpu",
                 max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, precision: str = "fp32",
                 allow_spinning: bool = False) -> None:
        model_path = Path(model_path)
        if not model_path.is_file():
            raise EngineError(f"{model_path} missing: run 'healthbot prepare-model'")
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise EngineError(f"onnxruntime is not installed ({exc}): pip install onnxruntime") from None
        if device == "cpu":
            providers = ["CPUExecutionProvider"]
        elif device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise EngineError("ONNX Runtime CUDA execution provider unavailable: "
                                  "install onnxruntime-gpu matching your CUDA, or use device='cpu'")
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        else:
            raise EngineError(f"unknown ONNX Runtime device {device!r}: use 'cpu' or 'cuda'")

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.enable_cpu_mem_arena = False
        opts.enable_mem_pattern = False
        opts.intra_op_num_threads = max(0, int(intra_op_threads))
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
        try:
            self._session = ort.InferenceSession(str(model_path), sess_options=opts, providers=providers)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            raise EngineError(f"ONNX Runtime could not load {model_path}: {exc} "
                              "(re-run 'healthbot prepare-model --force')") from exc

        inputs = {i.name for i in self._session.get_inputs()}
        outputs = {o.name: o for o in self._session.get_outputs()}
        if not {"input_ids", "attention_mask"} <= inputs or "pooled" not in outputs:
            raise EngineError(f"{model_path} has inputs {sorted(inputs)} and outputs {sorted(outputs)}; "
                              "expected input_ids, attention_mask -> pooled: re-run 'healthbot prepare-model --force'")
        self._feeds_type_ids = "token_type_ids" in inputs
        dim = outputs["pooled"].shape[-1]
        if not isinstance(dim, int):
            raise EngineError(f"{model_path}: output 'pooled' has no static dimension ({outputs['pooled'].shape})")
        self.dim = dim
        self.max_batch_size = max_batch_size
        self.max_seq_len = MAX_SEQ_LEN
        self.device = device
        self.precision = precision
        self.model_path = model_path
        self.providers = self._session.get_providers()
        log.info("onnxruntime_loaded", model=model_path.name, precision=precision, provider=self.providers[0],
                 intra_op_threads=intra_op_threads)

    def infer(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """Run one padded batch (see :meth:`inference.engines.base.Engine.infer`).

        Args:
            input_ids: int64[B, T], 1 ≤ B ≤ ``max_batch_size``, 1 ≤ T ≤ 512.
            attention_mask: int64[B, T].

        Returns:
            float32[B, D] mean-pooled, not normalized.

        Raises:
            EngineError: bad shapes or the session failed.
        """
        b, t = check_batch(input_ids, attention_mask, self.max_batch_size, self.max_seq_len)
        feeds = {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                 "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.int64)}
        if self._feeds_type_ids:
            feeds["token_type_ids"] = np.zeros_like(feeds["input_ids"])
        try:
            (pooled,) = self._session.run(["pooled"], feeds)
        except Exception as exc:  # noqa: BLE001
            raise EngineError(f"ONNX Runtime failed on a [{b}, {t}] batch: {exc}") from exc
        return np.asarray(pooled, dtype=np.float32)

    def close(self) -> None:
        """Drop the session (ONNX Runtime frees it when the last reference goes)."""
        self._session = None
