"""Torch lives here: paged KV tensors, attention, input building, sampling, the model runner."""
