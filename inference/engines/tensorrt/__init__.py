"""The TensorRT engine: the runtime (:mod:`~inference.engines.tensorrt.engine`), its build
(:mod:`~inference.engines.tensorrt.build`, :mod:`~inference.engines.tensorrt.fp16`) and what an
engine file is built with and for (:mod:`~inference.engines.tensorrt.spec`)."""
