"""Torch primitives that models/ and spec/ build on: paged KV tensors, attention, input building,
sampling, CPU kernels. The model runner that drives them is tandem.model_runner."""
