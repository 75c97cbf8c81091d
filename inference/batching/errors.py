"""The errors a batched inference call raises besides the engine's own (:class:`~inference.engines.base.EngineError`).

Callers (the dispatcher) answer :class:`BusyError` and :class:`DeadlineExceeded` politely
("busy, try again in a moment"); nothing more was computed.
"""

from __future__ import annotations


class BusyError(RuntimeError):
    """The batcher cannot take the request now (queue full or shutting down).

    Callers answer politely ("busy, try again in a moment"); nothing was computed.
    """


class BatcherClosed(BusyError):
    """The batcher is closing or closed; no new requests are accepted."""


class DeadlineExceeded(TimeoutError):
    """The request's deadline passed before its result was ready; it was dropped
    (not computed) if its batch had not started yet."""
