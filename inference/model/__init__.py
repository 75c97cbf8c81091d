"""Offline model work, never imported by serving code: preparing the default model
(:mod:`~inference.model.prepare`), the ONNX Runtime INT8 variant (:mod:`~inference.model.int8`),
the accuracy check of a variant (:mod:`~inference.model.accuracy`) and the ``build-engine``
command (:mod:`~inference.model.build_cli`)."""
