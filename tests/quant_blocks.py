"""GGUF test blocks shared by the quantized-kernel tests: random Q4_1 / Q8_0 rows with the float
weights they encode, and the CPU kernels (None where they could not be built)."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.runner.kernels import load_cpu_kernels

kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="Tandem's CPU kernels could not be built here")


def q4_1_blocks(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Random Q4_1 rows (uint8 [n, k/32*20]) and the float32 weights they encode (d * q + m)."""
    nb = k // 32
    d = rng.uniform(0.001, 0.05, (n, nb)).astype(np.float16)
    m = rng.uniform(-0.2, 0.0, (n, nb)).astype(np.float16)
    q = rng.integers(0, 16, (n, nb, 32), dtype=np.uint8)
    packed = (q[:, :, :16] | (q[:, :, 16:] << 4)).astype(np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(n, nb, 2), m.view(np.uint8).reshape(n, nb, 2), packed], axis=2)
    w = d.astype(np.float32)[..., None] * q.astype(np.float32) + m.astype(np.float32)[..., None]
    return raw.reshape(n, nb * 20), w.reshape(n, k)


def q8_0_blocks(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    nb = k // 32
    d = rng.uniform(0.001, 0.02, (n, nb)).astype(np.float16)
    q = rng.integers(-128, 128, (n, nb, 32), dtype=np.int8)
    raw = np.concatenate([d.view(np.uint8).reshape(n, nb, 2), q.view(np.uint8)], axis=2)
    w = d.astype(np.float32)[..., None] * q.astype(np.float32)
    return raw.reshape(n, nb * 34), w.reshape(n, k)
