"""The inference section of the configuration (``[inference]`` in the TOML file).

bot/config.py composes this section with the others and applies file and environment
overrides; this module holds only the section's keys, defaults and validation, so the
inference package needs nothing from bot/.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration key is unknown or has a bad value; the message names the key."""


@dataclass
class InferenceConfig:
    """Inference pool and dynamic batcher (ARCHITECTURE.md, "The inference pool").

    ``engines_dir``: the prepared model's folder (``healthbot prepare-model``); a relative
    path resolves against the source checkout, or for an installed package the user data
    folder (bot/config.py ``base_dir``).

    ``max_queue_delay_ms``: how long a batch may wait for more requests after its
    first one (Triton's ``max_queue_delay_microseconds``; 0 = never wait).
    ``idle_dispatch``: an idle engine runs what waits at once (default true);
    false makes every batch wait up to ``max_queue_delay_ms`` for company, as Triton
    does (fuller batches at the cost of a lone request's latency).
    ``max_batch_size``: windows per batch on CPU engines; ``gpu_max_batch_size``
    the same for GPU engines (tensorrt, torch_cuda), whose cost per batch is
    nearly flat up to 256 short queries (docs/benchmarks.md).
    ``max_batch_tokens``: padded-cost budget per batch (longest × count), as in
    text-embeddings-inference. ``max_queue_size``: pending requests beyond this
    fail fast with a "busy" error. ``deadline_ms``: per-request deadline.
    ``intra_op_threads``: ONNX Runtime threads per session (0 = runtime default; under
    ``healthbot serve --processes N`` 0 becomes ``max(1, min(2, cores // N))`` in each process).
    ``workers``: pool workers (engine instances) per device.

    ``onnx_precision``: the ONNX Runtime model: ``fp32`` (``engines/model.onnx``),
    ``int8`` (``engines/model.int8.onnx``, built by ``healthbot build-engine
    --engine onnxruntime --precision int8``), or ``auto``: int8 when that file
    is current and passed the accuracy check (inference/model/accuracy.py), else fp32.

    ``devices``: GPUs the pool places engines on, ``["all"]`` (every visible
    GPU) or indices (``HEALTHBOT_INFERENCE_DEVICES=0,1``); ignored by CPU engines.

    ``fallback_engine``: the CPU engine a GPU engine falls back to at run time
    (``""`` = none). ``circuit_failures`` consecutive failed batches open the
    circuit (traffic goes to the fallback; a GPU of several leaves the rotation);
    after ``circuit_reset_s`` one batch probes it again (half-open), doubling up
    to ``circuit_max_reset_s`` while it keeps failing.

    ``gc_freeze``: after the model is loaded, move every object then alive out of
    the cyclic garbage collector's reach (``gc.freeze()``), so full collections
    do not scan the model's millions of objects (tail-latency spikes otherwise).

    ``device_processes``: 0 (default) runs the pool, batcher and tokenizer in
    this process; N ≥ 1 starts N worker processes per device (per GPU of
    ``devices``; on the CPU, N in all), each with its own tokenizer, batcher and
    engines (``workers`` per process), and routes texts to them
    (inference/multiproc/router.py). One Python process fed one H200 at 20-27k
    encodes/s; a process per GPU scales with the GPUs (docs/benchmarks.md).

    ``engine_server`` (default on): with ``device_processes`` ≥ 1 on GPUs, one
    engine server process per GPU owns the GPU engines (``workers`` of them, each
    on its own thread and CUDA stream; 1 measured best), and the worker processes
    (tokenizer, batcher, CPU fallback) send it their padded batches, which it
    merges into fewer, larger GPU batches, two on the GPU at a time
    (inference/multiproc/engine_server.py): one H200 served 66.9-67.4k encodes/s at
    c = 256 with 4 worker processes in ``healthbot bench`` (ninth session, 54 % of the
    engine-only ceiling; 55.8k on a slower instance; 51.5-63.7k in the eighth, 45.8-62.9k in the seventh,
    45.7-57.5k in the sixth, 37.6-52.8k with 6), against 33-36k/s with each worker process running its
    own engine (docs/benchmarks.md; switch interval 0.5 ms, max queue delay 0).
    Off: each worker process loads its own GPU engine. Ignored on the CPU.
    ``engine_socket``: set by the process pool in the worker processes it starts
    (the engine server's Unix socket); leave it empty.

    ``switch_interval_ms``: the interpreter's GIL switch interval
    (``sys.setswitchinterval``) set when the encoder starts; 0 keeps Python's 5 ms.
    A pool worker or the tokenizer thread coming back from GPU or Rust work may
    wait up to this long for the GIL while the event loop is busy; on the H200
    0.1, 0.5 and 5 ms measured the same for the in-process pool (docs/benchmarks.md),
    hence the default; the worker-process and engine-server figures were measured
    with 0.5 ms only.

    ``embedding_cache_size``: vectors of repeated texts kept per serving process
    (an LRU of normalized text → vector in front of the encoder,
    :class:`inference.encoder.CachedEncoder`; emptied when the serving model
    changes); 0 turns it off. 4096 vectors of 384 floats take about 6 MiB. The retriever
    keeps as many search results of repeated questions (bot/search_cache.py; each holds two
    384-float vectors: about 16 MiB more at 4096) and per-topic scores of as many texts (about
    16 MiB), and the decision head and the topic-fit verifier as many of their outputs, keyed by
    their inputs' bytes (about 15 MiB): about 50 MiB a process in all at 4096, off with it.

    ``reload_interval_s``: how often a serving process checks ``engines_dir/manifest.json`` for
    a new model version and, when it changed, loads, checks and swaps it in without a restart
    (bot/model_reload.py), seconds; 0 = never (then only ``healthbot engine reload``).
    """

    engines_dir: str = "engines"
    engine_order: list[str] = field(default_factory=lambda: ["tensorrt", "torch_cuda", "onnxruntime"])
    workers: int = 1
    max_batch_size: int = 32
    gpu_max_batch_size: int = 256
    max_batch_tokens: int = 8192
    max_queue_delay_ms: float = 10.0
    idle_dispatch: bool = True
    max_queue_size: int = 1024
    deadline_ms: float = 2000.0
    intra_op_threads: int = 0
    onnx_precision: str = "auto"
    devices: list[str] = field(default_factory=lambda: ["all"])
    fallback_engine: str = "onnxruntime"
    circuit_failures: int = 3
    circuit_reset_s: float = 5.0
    circuit_max_reset_s: float = 60.0
    gc_freeze: bool = True
    switch_interval_ms: float = 0.0
    device_processes: int = 0
    engine_server: bool = True
    engine_socket: str = ""
    embedding_cache_size: int = 4096
    reload_interval_s: float = 5.0

    def validate(self) -> None:
        """Check the inference keys; raises :class:`ConfigError` naming the key.

        (The checks of ``_validate`` below for the older keys stay there.)
        """
        if self.onnx_precision not in ("auto", "fp32", "int8"):
            raise ConfigError(f"config key 'inference.onnx_precision': {self.onnx_precision!r} is not auto|fp32|int8")
        if self.gpu_max_batch_size < 1 or self.circuit_failures < 1:
            raise ConfigError("config keys 'inference.gpu_max_batch_size' and 'inference.circuit_failures' must be >= 1")
        if self.device_processes < 0:
            raise ConfigError("config key 'inference.device_processes' must be >= 0 (0 = in this process)")
        if self.embedding_cache_size < 0:
            raise ConfigError("config key 'inference.embedding_cache_size' must be >= 0 (0 = no cache)")
        if self.reload_interval_s < 0:
            raise ConfigError("config key 'inference.reload_interval_s' must be >= 0 (0 = never)")
        if self.switch_interval_ms < 0:
            raise ConfigError("config key 'inference.switch_interval_ms' must be >= 0 (0 = Python's default)")
        if not 0 < self.circuit_reset_s <= self.circuit_max_reset_s:
            raise ConfigError("config keys 'inference.circuit_reset_s' must be > 0 and <= 'inference.circuit_max_reset_s'")
        devices = [str(d).strip() for d in self.devices]
        if devices != ["all"] and not all(d.isdigit() for d in devices):
            raise ConfigError(f"config key 'inference.devices': {self.devices!r} is not \"all\" or a list of GPU indices")
