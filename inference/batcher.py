"""The dynamic batcher's public names, for callers that import them from here
(the dispatcher and retrieval catch :class:`BusyError` and :class:`DeadlineExceeded`).

The batching itself lives in :mod:`inference.batching`: the queue and its merge rule
(:mod:`~inference.batching.batcher`, :mod:`~inference.batching.queue`), windows and
padding (:mod:`~inference.batching.windows`), the engine server's merge of batches
and the process pool's message packing (:mod:`~inference.batching.merge`).
"""

from inference.batching.batcher import DynamicBatcher
from inference.batching.errors import BatcherClosed, BusyError, DeadlineExceeded
from inference.batching.windows import DEFAULT_BUCKETS, bucket_for, combine_windows

__all__ = ["DynamicBatcher", "BatcherClosed", "BusyError", "DeadlineExceeded", "DEFAULT_BUCKETS", "bucket_for",
           "combine_windows"]
