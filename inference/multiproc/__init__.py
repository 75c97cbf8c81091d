"""Inference over several processes (``inference.device_processes``, ``inference.engine_server``).

- :mod:`~inference.multiproc.router`: :class:`ProcessPoolEncoder`, the serving process's
  encoder that routes texts to worker processes (its module doc: the message protocol);
- :mod:`~inference.multiproc.supervision`: starting, watching and restarting those processes;
- :mod:`~inference.multiproc.worker`: a worker process (``python -m inference.multiproc.worker``);
- :mod:`~inference.multiproc.engine_server`: one process per GPU owning the GPU engine,
  merging the workers' batches (``python -m inference.multiproc.engine_server``);
- :mod:`~inference.multiproc.child`: what every such process does first (config, logging, loop);
- :mod:`~inference.multiproc.framing`: the length-prefixed pickle messages between them;
- :mod:`~inference.multiproc.worker_metrics`: the workers' Prometheus metrics, re-exported.
"""
