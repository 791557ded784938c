"""Tandem's fused CPU kernels against plain PyTorch (the fallback path and the reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.runner.kernels import CpuKernelOps, TorchOps, load_cpu_kernels

module = load_cpu_kernels()
pytestmark = pytest.mark.skipif(module is None, reason="CPU kernels could not be built here")


@pytest.fixture(scope="module")
def ops():
    return CpuKernelOps(module)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_add_rms_norm(ops, dtype, tol):
    x = torch.randn(7, 576, dtype=dtype)
    d = torch.randn(7, 576, dtype=dtype)
    w = torch.rand(576, dtype=dtype)
    x_ref = x.clone()
    ref = TorchOps.add_rms_norm(x_ref, d, w, 1e-5)
    got = ops.add_rms_norm(x, d, w, 1e-5)
    torch.testing.assert_close(x, x_ref, atol=0, rtol=0)           # the residual stream, updated in place
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(ops.add_rms_norm(x, None, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("d", [64, 20])      # 20: half a head is not a multiple of 8 (scalar tail)
def test_rope_rotates_only_the_first_heads(ops, dtype, tol, d):
    """bfloat16 rounds after each product and after the sum, as the PyTorch expression does: exact."""
    x = torch.randn(5, 15, d, dtype=dtype)
    cos, sin = torch.randn(100, d, dtype=dtype), torch.randn(100, d, dtype=dtype)
    pos = torch.tensor([0, 3, 3, 50, 99])
    ref = x.clone()
    TorchOps.rope_(ref, 12, cos, sin, pos)
    ops.rope_(x, 12, cos, sin, pos)
    torch.testing.assert_close(x, ref, atol=tol, rtol=tol)
    assert torch.equal(x[:, 12:], ref[:, 12:])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
def test_silu_and_mul(ops, dtype, tol):
    x = (torch.randn(9, 2 * 1537) * 4).to(dtype)                      # odd width: vector and scalar tails
    torch.testing.assert_close(ops.silu_and_mul(x), TorchOps.silu_and_mul(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads, kv, d, bs", [
    (6, 2, 64, 4),      # blocks shorter than the 8-row score pass: the one-row path only
    (9, 3, 64, 16),     # the default model's shape: 8-row passes plus tails
    (8, 1, 128, 16),    # two 64-dim chunks in the V pass, 8 query heads per kv head
    (4, 4, 64, 32),     # no GQA
    (9, 3, 64, 128),    # the CPU default block size
    (4, 2, 48, 8),      # head_dim not a multiple of 64: the generic path
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_attention_matches_sdpa(ops, heads, kv, d, bs, dtype):
    """Queries at arbitrary positions over scattered blocks equal causal SDPA over the gathered context
    (computed in float32 from the same stored values; the output is rounded once to the dtype)."""
    torch.manual_seed(0)
    nblocks = 40
    width = max(150 // bs + 1, 3)
    kc, vc = torch.randn(kv, nblocks * bs, d, dtype=dtype), torch.randn(kv, nblocks * bs, d, dtype=dtype)
    table = torch.zeros(2, width, dtype=torch.int32)
    table[0] = torch.randperm(nblocks)[:width].to(torch.int32)
    table[1, :3] = torch.randperm(nblocks)[:3].to(torch.int32)
    seq = torch.tensor([0, 0, 0, 0, 1, 1], dtype=torch.int32)
    pos = torch.tensor([21, 22, 23, min(149, width * bs - 1), 0, 3 * bs - 1], dtype=torch.int32)
    q = torch.randn(len(pos), heads, d, dtype=dtype)
    got = ops.paged_attention(q, kc, vc, table, seq, pos, bs, d ** -0.5)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    q, kc, vc, got = q.float(), kc.float(), vc.float(), got.float()
    for i in range(len(pos)):
        t = int(pos[i]) + 1
        slots = torch.cat([torch.arange(int(b) * bs, int(b) * bs + bs) for b in table[int(seq[i])]])[:t]
        k, v = kc[:, slots], vc[:, slots]                               # [KV, T, D]
        ref = F.scaled_dot_product_attention(q[i].unsqueeze(1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                             enable_gqa=True)[0, :, 0]   # [H, D]
        torch.testing.assert_close(got[i].view(heads, d), ref, atol=tol, rtol=tol)


def test_paged_attention_reads_strided_query_rows(ops):
    """q as the model passes it, a slice of the fused qkv output (rows strided by H + 2 KV heads):
    the same result as from a contiguous copy."""
    torch.manual_seed(1)
    heads, kv, d, bs = 9, 3, 64, 16
    kc, vc = torch.randn(kv, 8 * bs, d), torch.randn(kv, 8 * bs, d)
    table = torch.arange(8, dtype=torch.int32).view(1, 8)
    seq, pos = torch.zeros(3, dtype=torch.int32), torch.tensor([5, 40, 127], dtype=torch.int32)
    qkv = torch.randn(3, heads + 2 * kv, d)
    q = qkv[:, :heads]
    assert not q.is_contiguous()
    assert torch.equal(ops.paged_attention(q, kc, vc, table, seq, pos, bs, 0.125),
                       ops.paged_attention(q.contiguous(), kc, vc, table, seq, pos, bs, 0.125))


decode_bf16 = pytest.mark.skipif(module is None or not module.decode_bf16_available(),
                                 reason="no AVX512-BF16 on this CPU: bfloat16 decode attention widens to float32")


@decode_bf16
@pytest.mark.parametrize("heads, kv, d, bs", [
    (9, 3, 64, 16),     # the default model: 3 heads per group
    (8, 2, 64, 32),     # 4 per group: one full value pass
    (14, 2, 64, 16),    # 7 per group: value passes of 4 and 3
    (16, 2, 128, 16),   # 8 per group, two 64-dimension value chunks
    (4, 4, 128, 32),    # no GQA
    (9, 3, 64, 128),    # the CPU default block size
])
def test_paged_attention_bf16_kernel_matches_a_float64_reference(ops, heads, kv, d, bs):
    """The VDPBF16PS decode path: contexts of one key, odd lengths (a half key pair at the end), block
    boundaries and long contexts over scattered blocks, against float64 softmax attention over the same
    stored values. The kernel rounds probabilities to bfloat16 for the value product (as the prefill
    kernel does) and the output to bfloat16: a few bfloat16 steps of the output's scale."""
    torch.manual_seed(heads * d + bs)
    nblocks = 1200 // bs + 8
    kc = torch.randn(kv, nblocks * bs, d, dtype=torch.bfloat16)
    vc = torch.randn(kv, nblocks * bs, d, dtype=torch.bfloat16)
    table = torch.stack([torch.randperm(nblocks)[:nblocks - 4] for _ in range(2)]).to(torch.int32)
    pos = torch.tensor([0, 1, 2, bs - 1, bs, 2 * bs + 6, 333, 1100, 40], dtype=torch.int32)
    seq = torch.tensor([0, 0, 1, 1, 0, 1, 0, 1, 0], dtype=torch.int32)
    qkv = torch.randn(len(pos), heads + 2 * kv, d, dtype=torch.bfloat16) * 2    # q: strided rows
    q = qkv[:, :heads]
    got = ops.paged_attention(q, kc, vc, table, seq, pos, bs, d ** -0.5)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ops.paged_attention(q.contiguous(), kc, vc, table, seq, pos, bs, d ** -0.5))
    k64, v64, q64 = kc.double(), vc.double(), q.double()
    for i in range(len(pos)):
        t = int(pos[i]) + 1
        slots = torch.cat([torch.arange(int(b) * bs, int(b) * bs + bs) for b in table[int(seq[i])]])[:t]
        k = k64[:, slots].repeat_interleave(heads // kv, 0)                # [H, T, D]
        v = v64[:, slots].repeat_interleave(heads // kv, 0)
        p = torch.softmax((k @ q64[i].unsqueeze(-1)).squeeze(-1) * d ** -0.5, -1)   # [H, T]
        ref = (p.unsqueeze(1) @ v).squeeze(1)                               # [H, D]
        torch.testing.assert_close(got[i].view(heads, d).double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("src, cache", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                        (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_kv_write_equals_index_copy_into_the_cache(ops, src, cache):
    """K/V rows (strided slices of the fused qkv output) land in their slots, rounded to the cache's
    dtype exactly as `.to(dtype)` rounds them; every other slot is untouched."""
    torch.manual_seed(2)
    kv, d, slots = 3, 64, 48
    qkv = torch.randn(5, 9 + 2 * kv, d).to(src)
    k, v = qkv[:, 9:9 + kv], qkv[:, 9 + kv:]
    mapping = torch.tensor([7, 0, 47, 20, 21])
    kc, vc = torch.randn(kv, slots, d).to(cache), torch.randn(kv, slots, d).to(cache)
    kr, vr = kc.clone(), vc.clone()
    kr.index_copy_(1, mapping, k.transpose(0, 1).to(cache))
    vr.index_copy_(1, mapping, v.transpose(0, 1).to(cache))
    ops.kv_write_(kc, vc, k, v, mapping)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.kv_write_(kc, vc, k, v, torch.tensor([7, 0, 48, 20, 21]))
    with pytest.raises(RuntimeError, match="int64"):
        ops.kv_write_(kc, vc, k, v, mapping.int())


@pytest.mark.parametrize("n, k", [(64, 32), (960, 576), (50, 300), (3, 520)])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 24, 301])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(n, k, m, bias):
    """The panel-packed float32 kernel equals F.linear for row counts across the 6-row tiles and
    the L2 row chunks, widths that leave a partial 16-column panel, depths across 256-deep blocks."""
    torch.manual_seed(0)
    w, x = torch.randn(n, k), torch.randn(m, k)
    b = torch.randn(n) if bias else None
    got = module.packed_linear(x, module.pack_linear(w), b, n)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_packed_linear_refuses_a_mismatched_weight():
    w = module.pack_linear(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="not a packed"):
        module.packed_linear(torch.randn(2, 48), w, None, 32)
    with pytest.raises(RuntimeError, match="float32"):
        module.packed_linear(torch.randn(2, 64, dtype=torch.bfloat16), w, None, 32)


bf16_gemm = pytest.mark.skipif(module is None or not module.bf16_linear_available(),
                               reason="no AVX512-BF16 on this CPU: bfloat16 linears run on oneDNN")


@bf16_gemm
@pytest.mark.parametrize("n, k", [(64, 32), (960, 576), (50, 300), (33, 2), (40, 2048)])
@pytest.mark.parametrize("m", [1, 5, 12, 13, 24, 301])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_bf16_matches_a_float32_reference(n, k, m, bias):
    """The pair-panel bfloat16 kernel accumulates in float32 and rounds once: it equals the float32
    product of the same bfloat16 values, rounded to bfloat16, up to summation order (row counts
    across the 12-row tiles and the L2 row chunks, widths with a partial 32-column panel). Where
    `amx_linear_available()`, every m > 1 with k a multiple of 32 runs on the AMX tiles: 16-row
    groups in pairs, a zero-padded last group, and at k = 2048 two row chunks, the second with an
    odd number of groups."""
    torch.manual_seed(0)
    w, x = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(m, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    got = module.packed_linear_bf16(x, module.pack_linear_bf16(w), b, n)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), ref.bfloat16().float(), atol=1e-3 * k ** 0.5, rtol=2 ** -7)


@bf16_gemm
def test_packed_linear_bf16_refuses_bad_shapes():
    with pytest.raises(RuntimeError, match="K must be even"):
        module.pack_linear_bf16(torch.randn(32, 63, dtype=torch.bfloat16))
    w = module.pack_linear_bf16(torch.randn(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="not a packed"):
        module.packed_linear_bf16(torch.randn(2, 48, dtype=torch.bfloat16), w, None, 32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        module.packed_linear_bf16(torch.randn(2, 64), w, None, 32)


prefill_bf16 = pytest.mark.skipif(module is None or not module.prefill_bf16_available(),
                                  reason="no AVX512-BF16 on this CPU: prefill chunks go through SDPA")


@prefill_bf16
@pytest.mark.parametrize("bs", [16, 8, 32, 128])
@pytest.mark.parametrize("start, length, heads, kv", [(0, 1, 9, 3), (0, 17, 9, 3), (37, 50, 9, 3), (200, 300, 9, 3),
                                                      (0, 5, 4, 4), (63, 66, 2, 1), (900, 333, 8, 2), (5, 130, 12, 3)])
def test_prefill_attention_bf16_matches_causal_sdpa(bs, start, length, heads, kv):
    """A chunk at positions start.. over scattered blocks equals float32 SDPA on the gathered context
    (the kernel rounds probabilities to bfloat16 for the value product, as bfloat16 SDPA does).
    Group sizes 1-4, rows that fill the kernel's four-row blocks (16-row blocks on AMX tiles) or
    leave a remainder, and contexts that start, end and cross its 64-key tiles anywhere."""
    torch.manual_seed(bs + start)
    d = 64
    ctx = start + length
    nblocks = ctx // bs + 5
    kc = torch.randn(kv, nblocks * bs, d, dtype=torch.bfloat16)
    vc = torch.randn(kv, nblocks * bs, d, dtype=torch.bfloat16)
    blocks = torch.randperm(nblocks)[:-(-ctx // bs)].to(torch.int32)
    q = torch.randn(length, heads, d, dtype=torch.bfloat16)
    got = CpuKernelOps(module).prefill_attention(q, kc, vc, blocks, start, bs, d ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (length, heads * d)
    slots = torch.cat([torch.arange(int(b) * bs, int(b) * bs + bs) for b in blocks])[:ctx]
    allowed = torch.arange(ctx)[None, :] <= (start + torch.arange(length))[:, None]
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], kc[:, slots].float()[None],
                                         vc[:, slots].float()[None], attn_mask=allowed, enable_gqa=True)
    torch.testing.assert_close(got.float(), ref[0].transpose(0, 1).reshape(length, -1), atol=2e-2, rtol=2e-2)


@prefill_bf16
def test_prefill_attention_declines_what_it_does_not_cover():
    """float32 or another head size: None, and the backend uses SDPA."""
    ops = CpuKernelOps(module)
    kc = torch.zeros(1, 32, 64)
    assert ops.prefill_attention(torch.zeros(4, 2, 64), kc, kc, torch.zeros(2, dtype=torch.int32), 0, 16, 1.0) is None
    kc = torch.zeros(1, 32, 32, dtype=torch.bfloat16)
    assert ops.prefill_attention(torch.zeros(4, 2, 32, dtype=torch.bfloat16), kc, kc,
                                 torch.zeros(2, dtype=torch.int32), 0, 16, 1.0) is None
    with pytest.raises(RuntimeError, match="too short"):
        kc = torch.zeros(1, 32, 64, dtype=torch.bfloat16)
        ops.prefill_attention(torch.zeros(40, 2, 64, dtype=torch.bfloat16), kc, kc,
                              torch.zeros(2, dtype=torch.int32), 0, 16, 1.0)
