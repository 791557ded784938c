"""Torch primitives that models/ and speculative/ build on: paged KV tensors, attention, input building,
sampling, CPU kernels. The model runner that drives them is tandem.model_runner."""
