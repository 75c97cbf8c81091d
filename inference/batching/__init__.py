"""All batching of the inference package, in one place.

- :mod:`~inference.batching.batcher`: :class:`DynamicBatcher`, the asyncio queue that
  tokenizes texts in batches and groups token windows into padded batches;
  :mod:`~inference.batching.queue` (admission, bucket queues, deadlines, which batch
  runs next), :mod:`~inference.batching.tokenize` (texts tokenized in batches),
  :mod:`~inference.batching.requests` (what waits in the queue);
- :mod:`~inference.batching.windows`: length buckets, :func:`pad_batch`, :func:`combine_windows`;
- :mod:`~inference.batching.merge`: the engine server's merge of padded batches from
  several worker processes, and the process pool's packing of texts into messages;
- :mod:`~inference.batching.errors`: BusyError, BatcherClosed, DeadlineExceeded.
"""
