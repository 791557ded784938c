"""Torch primitives that models/ and speculative/ build on: paged KV tensors, attention, input building,
sampling, CPU kernels. The executor that drives them is tandem.executor (TorchExecutor)."""
