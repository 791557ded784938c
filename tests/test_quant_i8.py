"""The 8-bit-activation kernel on GGUF blocks: llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 arithmetic,
and Q6_K from its own bits, against a NumPy reference, bfloat16 in and out, bad shapes, the layer's choice by row count, and
the weight-only blocks it frees."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.quant_blocks import kernels, q4_1_blocks, q4_k_blocks, q4_k_values, q6_k_blocks, q6_k_values, q8_0_blocks

i8_quant = pytest.mark.skipif(kernels is None or not kernels.i8_linear_available(),
                              reason="no AVX2 + FMA + F16C here")


def round_x_to_8_bits(x: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_0/q8_1: per block of 32, scale max|x| / 127 and q rounded to
    nearest (ties to even). Returns qx int64 [rows, nb, 32] and dx float64 [rows, nb]."""
    xb = x.reshape(x.shape[0], nb, 32).astype(np.float32)
    amax = np.abs(xb).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    qx = np.rint(xb * inv[..., None]).astype(np.int64)
    return qx, (amax / np.float32(127)).astype(np.float32).astype(np.float64)


def q8_1_reference(raw: np.ndarray, x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """llama.cpp's Q4_1 x Q8_1 product: x rounded per block of 32, integer dot products with the
    4-bit q, then d dx sum(q qx) + m dx sum(qx), in float64."""
    n, k = raw.shape[0], x.shape[1]
    nb = k // 32
    blk = raw.reshape(n, nb, 20)
    d = blk[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = blk[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    q = np.concatenate([blk[:, :, 4:] & 0x0F, blk[:, :, 4:] >> 4], axis=2).astype(np.int64)   # [n, nb, 32]
    qx, dx = round_x_to_8_bits(x, nb)
    dots = np.einsum("rbk,nbk->rnb", qx, q).astype(np.float64)
    y = (dots * d[None] * dx[:, None, :]).sum(2) + (m[None] * (dx * qx.sum(2))[:, None, :]).sum(2)
    return y + (0 if bias is None else bias.astype(np.float64))


def q8_0_reference(raw: np.ndarray, x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """llama.cpp's Q8_0 x Q8_0 product: d dx sum(q qx) per block, in float64."""
    n, k = raw.shape[0], x.shape[1]
    nb = k // 32
    blk = raw.reshape(n, nb, 34)
    d = blk[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    q = blk[:, :, 2:].copy().view(np.int8).astype(np.int64)                                     # [n, nb, 32]
    qx, dx = round_x_to_8_bits(x, nb)
    dots = np.einsum("rbk,nbk->rnb", qx, q).astype(np.float64)
    return (dots * d[None] * dx[:, None, :]).sum(2) + (0 if bias is None else bias.astype(np.float64))


def q6_k_reference(raw: np.ndarray, x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """Q6_K against x rounded per block of 32 (as Q8_0): per 16 inputs an integer dot product of
    q - 32 and qx, times that half's d sc rounded to float16 (the records' one rounding) and dx."""
    n, k = raw.shape[0], x.shape[1]
    nb = k // 32
    q, sc, d = q6_k_values(raw, k)
    dsc = (np.repeat(d, 16, axis=1) * sc.astype(np.float32)).astype(np.float16).astype(np.float64)   # [n, k/16]
    qx, dx = round_x_to_8_bits(x, nb)
    dots = np.einsum("rhk,nhk->rnh", qx.reshape(-1, 2 * nb, 16), (q - 32).reshape(n, 2 * nb, 16)).astype(np.float64)
    y = (dots * dsc[None] * np.repeat(dx, 2, axis=1)[:, None, :]).sum(2)
    return y + (0 if bias is None else bias.astype(np.float64))


def q4_k_reference(raw: np.ndarray, x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """Q4_K as llama.cpp multiplies it, with x rounded per block of 32 (Q8_1): per sub-block
    d sc dx sum(q qx) - dmin m dx sum(qx), in float64."""
    n, k = raw.shape[0], x.shape[1]
    nb = k // 32
    q, sc, mn, d, dmin = q4_k_values(raw, k)
    scale = np.repeat(d, 8, axis=1).astype(np.float64) * sc                   # [n, nb]
    offset = np.repeat(dmin, 8, axis=1).astype(np.float64) * mn
    qx, dx = round_x_to_8_bits(x, nb)
    dots = np.einsum("rbk,nbk->rnb", qx, q.reshape(n, nb, 32)).astype(np.float64)
    y = (dots * scale[None] * dx[:, None, :]).sum(2) - (offset[None] * (dx * qx.sum(2))[:, None, :]).sum(2)
    return y + (0 if bias is None else bias.astype(np.float64))


@i8_quant
@pytest.mark.parametrize("qtype, make, reference", [(0, q4_1_blocks, q8_1_reference), (1, q8_0_blocks, q8_0_reference),
                                                    (2, q6_k_blocks, q6_k_reference), (3, q4_k_blocks, q4_k_reference)],
                         ids=["q4_1", "q8_0", "q6_k", "q4_k"])
@pytest.mark.parametrize("n, k", [(80, 192), (8, 32), (37, 1536)])      # 37: a partial 8-row group
@pytest.mark.parametrize("rows", [1, 3, 4, 17, 100])                    # 100: past a 96-row chunk
def test_quant_linear_i8_is_llama_cpp_arithmetic(qtype, make, reference, n, k, rows):
    """Q4_1 x Q8_1 and Q8_0 x Q8_0 (q = -128 included: |q| as unsigned, the sign moved to x), Q6_K
    (q - 32 = -32 included; scales of either sign), Q4_K."""
    k = -(-k // 256) * 256 if qtype >= 2 else k          # (K-quant super-blocks are 256 wide)
    rng = np.random.default_rng(n + k + rows + 1000 * qtype)
    raw, w = make(rng, n, k)
    packed = kernels.quant_pack_i8(torch.from_numpy(raw), n, k, qtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * torch.linspace(0.1, 8, rows)[:, None]
    x[0, :32] = 0.0                                                      # an all-zero block rounds to zeros
    bias = torch.randn(n)
    want = reference(raw, x.numpy(), bias.numpy())
    got = kernels.quant_linear_i8(x, packed, bias, n, qtype)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert np.allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
    assert np.allclose(kernels.quant_linear_i8(x, packed, None, n, qtype).double().numpy(), want - bias.double().numpy(),
                       rtol=1e-5, atol=1e-4 * np.abs(want).max())
    # against the exact float product: only the rounding of x to 8 bits per block
    exact = x.double().numpy() @ w.astype(np.float64).T + bias.double().numpy()
    assert np.linalg.norm(got.double().numpy() - exact) < 0.02 * np.linalg.norm(exact)


@i8_quant
@pytest.mark.parametrize("qtype, make", [(0, q4_1_blocks), (1, q8_0_blocks), (2, q6_k_blocks), (3, q4_k_blocks)],
                         ids=["q4_1", "q8_0", "q6_k", "q4_k"])
@pytest.mark.parametrize("rows", [1, 5, 100])
def test_quant_linear_i8_takes_bfloat16_and_rounds_its_float32_sums_once(qtype, make, rows):
    """A bfloat16 model's small steps run the 8-bit kernel on its bf16 activations: the result is
    the float32 kernel's on the same (bf16-valued) x, rounded to bfloat16 once, bias (bf16) included."""
    n, k = 37, 1536
    raw, _ = make(np.random.default_rng(rows + 7 * qtype), n, k)
    packed = kernels.quant_pack_i8(torch.from_numpy(raw), n, k, qtype)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).bfloat16()
    bias = torch.randn(n).bfloat16()
    got = kernels.quant_linear_i8(x, packed, bias, n, qtype)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.equal(got, kernels.quant_linear_i8(x.float(), packed, bias.float(), n, qtype).bfloat16())
    assert torch.equal(kernels.quant_linear_i8(x, packed, None, n, qtype),
                       kernels.quant_linear_i8(x.float(), packed, None, n, qtype).bfloat16())


@i8_quant
def test_release_shadowed_blocks_frees_weight_only_blocks_the_int8_kernel_covers():
    """Where the 8-bit kernel takes every step size the weight-only kernel would have served
    (max_rows <= i8_max_rows: bfloat16 models on AVX512-BF16), those blocks go; outputs stay."""
    from tandem.models.llama import Linear
    from tandem.models.quant import QuantWeight, release_shadowed_blocks
    from tandem.runner.kernels import CpuKernelOps

    raw, w = q4_1_blocks(np.random.default_rng(12), 64, 128)
    data = torch.from_numpy(raw)
    layers = []
    for max_rows, i8_rows in [(4, 8), (8, 4)]:
        lin = Linear(64, 128, False, torch.float32)
        lin.weight.data = torch.from_numpy(w)
        lin.quant = QuantWeight(data.clone(), 0, 128, max_rows=max_rows, i8=kernels.quant_pack_i8(data, 64, 128, 0),
                                i8_max_rows=i8_rows)
        lin.quant_ops = CpuKernelOps(kernels)
        layers.append(lin)
    covered, needed = layers
    xs = [torch.randn(r, 128) for r in (2, 6, 16)]
    before = [covered(x) for x in xs]
    assert release_shadowed_blocks(covered) == 64 * 128 // 32 * 20
    assert covered.quant.data.numel() == 0 and covered.quant.max_rows == 0
    assert all(torch.equal(covered(x), b) for x, b in zip(xs, before))
    assert release_shadowed_blocks(needed) == 0 and needed.quant.max_rows == 8


@i8_quant
def test_quant_linear_i8_rejects_bad_shapes_with_a_clear_error():
    raw, _ = q4_1_blocks(np.random.default_rng(0), 8, 64)
    with pytest.raises(RuntimeError, match="Q4_1 blocks"):
        kernels.quant_pack_i8(torch.from_numpy(raw), 8, 96, 0)
    with pytest.raises(RuntimeError, match="Q8_0 blocks"):
        kernels.quant_pack_i8(torch.from_numpy(raw), 8, 64, 1)           # Q4_1 bytes read as Q8_0
    with pytest.raises(RuntimeError, match="Q6_K blocks"):
        kernels.quant_pack_i8(torch.from_numpy(raw), 8, 64, 2)           # Q6_K super-blocks are 256 wide
    with pytest.raises(RuntimeError, match="Q4_K blocks"):
        kernels.quant_pack_i8(torch.from_numpy(raw), 8, 64, 3)
    with pytest.raises(RuntimeError, match="qtype"):
        kernels.quant_pack_i8(torch.from_numpy(raw), 8, 64, 7)
    packed = kernels.quant_pack_i8(torch.from_numpy(raw), 8, 64, 0)
    with pytest.raises(RuntimeError, match="records"):
        kernels.quant_linear_i8(torch.randn(2, 96), packed, None, 8, 0)
    with pytest.raises(RuntimeError, match="records"):
        kernels.quant_linear_i8(torch.randn(2, 64), packed, None, 8, 1)  # Q4_1 records as Q8_0
    with pytest.raises(RuntimeError, match="float32"):
        kernels.quant_linear_i8(torch.randn(2, 64).double(), packed, None, 8, 0)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.quant_linear_i8(torch.randn(2, 64), packed, torch.randn(5), 8, 0)


@i8_quant
def test_linear_uses_int8_then_weight_only_then_dense_by_row_count():
    from tandem.models.llama import Linear
    from tandem.models.quant import QuantWeight
    from tandem.runner.kernels import CpuKernelOps

    raw, w = q4_1_blocks(np.random.default_rng(6), 64, 128)
    lin = Linear(64, 128, False, torch.float32)
    lin.weight.data = torch.from_numpy(w) + 1.0          # a different dense weight tells the paths apart
    data = torch.from_numpy(raw)
    lin.quant = QuantWeight(data, 0, 128, max_rows=4, i8=kernels.quant_pack_i8(data, 64, 128, 0), i8_max_rows=2)
    lin.quant_ops = CpuKernelOps(kernels)
    x2, x4, x8 = torch.randn(2, 128), torch.randn(4, 128), torch.randn(8, 128)
    assert torch.allclose(lin(x2), torch.from_numpy(q8_1_reference(raw, x2.numpy(), None)).float(), atol=1e-4)
    assert torch.allclose(lin(x4), x4 @ torch.from_numpy(w).T, atol=1e-4)                # weight-only, float x
    assert torch.allclose(lin(x8), x8 @ (torch.from_numpy(w) + 1.0).T, atol=1e-4)        # dense


@i8_quant
def test_release_layer_frees_only_what_the_int8_kernel_made_unused():
    """A layer whose 8-bit kernel serves every step size loses its float panels and GGUF blocks and
    computes the same; a layer that still needs the dense path above some row count keeps them."""
    import sys

    from tandem.models.llama import Linear
    from tandem.models.quant import QuantWeight, release_layer
    from tandem.runner.kernels import CpuKernelOps

    model = torch.nn.Module()
    layers = []
    for i, bound in enumerate([sys.maxsize, 16]):
        raw, w = q4_1_blocks(np.random.default_rng(10 + i), 64, 128)
        lin = Linear(64, 128, False, torch.float32)
        lin.weight.data = torch.from_numpy(w)
        assert lin.prepack()                                           # float panels, plain weight freed
        data = torch.from_numpy(raw)
        lin.quant = QuantWeight(data, 0, 128, max_rows=4, i8=kernels.quant_pack_i8(data, 64, 128, 0), i8_max_rows=bound)
        lin.quant_ops = CpuKernelOps(kernels)
        layers.append(lin)
    model.served, model.bounded = layers
    x = torch.randn(300, 128)
    before = model.served(x)
    panels = model.served._panels.numel() * 4
    assert release_layer(model.served) == panels + 64 * 128 // 32 * 20
    assert release_layer(model.bounded) == 0
    assert model.served._panels is None and model.served.quant.data.numel() == 0
    assert torch.equal(model.served(x), before)                         # 300 rows: still the int8 kernel
    with pytest.raises(RuntimeError, match="released"):
        model.served.forward_dense(x)
    assert model.bounded._panels is not None and model.bounded.quant.data.numel() == 64 * 128 // 32 * 20
    assert torch.allclose(model.bounded(x), x @ torch.from_numpy(q4_1_blocks(np.random.default_rng(11), 64, 128)[1]).T,
                          atol=1e-4)                                    # 300 rows > 16: the dense path


@i8_quant
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6])
def test_a_fused_layer_of_mixed_types_runs_each_part_on_its_own_records(dtype, rows):
    """Q4_K_M's q/k/v where v is Q6_K: one call over the parts' records back to back gives what
    each part's own call gives, bit for bit (a part of 12 rows ends in a partial group of 8)."""
    k, rng = 512, np.random.default_rng(rows)
    parts = [(3, q4_k_blocks, 16), (2, q6_k_blocks, 8), (1, q8_0_blocks, 12), (3, q4_k_blocks, 12)]
    packs = [(kernels.quant_pack_i8(torch.from_numpy(make(rng, n, k)[0]), n, k, qtype), qtype, n)
             for qtype, make, n in parts]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(sum(n for _, _, n in parts)).to(dtype)
    flat = torch.cat([p.reshape(-1) for p, _, _ in packs])
    got = kernels.quant_linear_i8_parts(x, flat, bias, [q for _, q, _ in packs], [n for _, _, n in packs])
    want = torch.cat([kernels.quant_linear_i8(x, p, b, n, q)
                      for (p, q, n), b in zip(packs, bias.split([n for _, _, n in packs]))], dim=1)
    assert got.dtype == dtype and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="records"):
        kernels.quant_linear_i8_parts(x, flat[:-1], None, [q for _, q, _ in packs], [n for _, _, n in packs])
    with pytest.raises(RuntimeError, match="one type per part"):
        kernels.quant_linear_i8_parts(x, flat, None, [3, 2], [16])
