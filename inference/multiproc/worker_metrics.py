"""The worker processes' own Prometheus metrics, re-exported by the serving process."""

from __future__ import annotations

from typing import Any

class WorkerMetrics:
    """A Prometheus collector on the server's registry that re-exports each worker
    process's own metrics (``healthbot_inference_*``, ``healthbot_engine_*`` and
    ``process_*``: its batcher, pool, model manager and the process itself), as
    last fetched (every :data:`~inference.multiproc.supervision.METRICS_POLL_S` s): every family ``healthbot_X`` or
    ``X`` becomes ``healthbot_worker_X`` with a ``worker`` label (``"cuda:0#1"``).
    Worker families keep their own names apart from the server's, whose
    ``healthbot_inference_*`` stay (the server runs no batcher in this mode)."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._latest: dict[str, list[Any]] = {}

    def update(self, worker: str, text: str) -> None:
        """Keep ``text`` (the worker's exposition, text format 0.0.4) as its latest metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        self._latest[worker] = list(text_string_to_metric_families(text))

    def describe(self) -> list:
        return []  # names vary with the workers; nothing to check against the server's own

    def collect(self):
        from prometheus_client.metrics_core import Metric

        merged: dict[str, Metric] = {}
        alive = {w.label for w in self._pool.alive}
        for worker, families in self._latest.items():
            if worker not in alive:
                continue
            for fam in families:
                if not fam.name.startswith(_WORKER_FAMILIES):
                    continue  # a worker serves no channel: its request and channel families stay empty
                name = _worker_name(fam.name)
                out = merged.get(name)
                if out is None:
                    out = merged[name] = Metric(name, f"Worker processes: {fam.documentation}", fam.type, fam.unit)
                for smp in fam.samples:
                    out.add_sample(name + smp.name[len(fam.name):], {**smp.labels, "worker": worker},
                                   smp.value, smp.timestamp, smp.exemplar)
        yield from merged.values()


#: The families a worker process records (its batcher, pool, model manager and the process itself).
_WORKER_FAMILIES = ("healthbot_inference_", "healthbot_engine_", "process_")


def _worker_name(name: str) -> str:
    return "healthbot_worker_" + name.removeprefix("healthbot_")
