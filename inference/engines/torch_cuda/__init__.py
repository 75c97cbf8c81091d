"""The PyTorch CUDA engine: the runtime with CUDA graphs (:mod:`~inference.engines.torch_cuda.engine`),
its lean BERT forward (:mod:`~inference.engines.torch_cuda.lean_bert`) and its weights
(:mod:`~inference.engines.torch_cuda.weights`)."""
