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


def q6_k_values(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K rows (uint8 [n, k/256*210], ggml's block_q6_K: ql[128], qh[64], int8 scales[16],
    float16 d) decoded: q int64 [n, k] in 0..63, scales int64 [n, k/16], d float32 [n, k/256]."""
    n = raw.shape[0]
    b = raw.reshape(n, k // 256, 210)
    ql, qh = b[..., :128].astype(np.int64), b[..., 128:192].astype(np.int64)
    q = np.empty((n, k // 256, 256), dtype=np.int64)
    for half in range(2):
        lo, hi, o = ql[..., 64 * half:64 * half + 64], qh[..., 32 * half:32 * half + 32], 128 * half
        q[..., o:o + 32] = (lo[..., :32] & 15) | ((hi & 3) << 4)
        q[..., o + 32:o + 64] = (lo[..., 32:] & 15) | (((hi >> 2) & 3) << 4)
        q[..., o + 64:o + 96] = (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4)
        q[..., o + 96:o + 128] = (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4)
    scales = b[..., 192:208].copy().view(np.int8).astype(np.int64).reshape(n, k // 16)
    d = b[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    return q.reshape(n, k), scales, d


def q6_k_blocks(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Random Q6_K rows (uint8 [n, k/256*210]; scales over all of int8, -128 included) and the
    float32 weights they encode (d sc (q - 32))."""
    ns = k // 256
    bits = rng.integers(0, 256, (n, ns, 192), dtype=np.uint8)
    scales = rng.integers(-128, 128, (n, ns, 16), dtype=np.int8)
    d = rng.uniform(1e-5, 4e-4, (n, ns)).astype(np.float16)
    raw = np.concatenate([bits, scales.view(np.uint8), d.view(np.uint8).reshape(n, ns, 2)], axis=2).reshape(n, ns * 210)
    q, sc, dd = q6_k_values(raw, k)
    w = np.repeat(dd, 256, axis=1) * np.repeat(sc, 16, axis=1).astype(np.float32) * (q - 32).astype(np.float32)
    return raw, w.astype(np.float32)


def q4_k_values(raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K rows (uint8 [n, k/256*144], ggml's block_q4_K) decoded: q int64 [n, k] in 0..15, the
    sub-blocks' scales and mins int64 [n, k/32], d and dmin float32 [n, k/256]."""
    import gguf

    n = raw.shape[0]
    b = raw.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(n, k // 256)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(n, k // 256)
    sc, mn = gguf.quants.Q4_K.get_scale_min(b[:, 4:16].copy())
    q = (b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
    return (q.reshape(n, k).astype(np.int64), sc.reshape(n, k // 32).astype(np.int64),
            mn.reshape(n, k // 32).astype(np.int64), d, dmin)


def q4_k_blocks(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Random Q4_K rows (uint8 [n, k/256*144]) and the float32 weights they encode (d sc q - dmin m)."""
    ns = k // 256
    d = rng.uniform(1e-4, 1e-3, (n, ns)).astype(np.float16)
    dmin = rng.uniform(1e-4, 2e-3, (n, ns)).astype(np.float16)
    bits = rng.integers(0, 256, (n, ns, 140), dtype=np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(n, ns, 2), dmin.view(np.uint8).reshape(n, ns, 2), bits],
                         axis=2).reshape(n, ns * 144)
    q, sc, mn, dd, dm = q4_k_values(raw, k)
    w = (np.repeat(dd, 256, axis=1) * np.repeat(sc, 32, axis=1) * q
         - np.repeat(dm, 256, axis=1) * np.repeat(mn, 32, axis=1))
    return raw, w.astype(np.float32)
