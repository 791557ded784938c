"""Quantized linear layers on GGUF blocks (Q4_1, Q8_0): the weight-only kernels against a NumPy
reference of the format, the 8-bit-activation kernel against llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 arithmetic,
the layer's choice between the quantized and the float paths, and the default model served from
its own GGUF blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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


@needs_kernels
@pytest.mark.parametrize("qtype,make", [(0, q4_1_blocks), (1, q8_0_blocks)])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_quant_linear_matches_the_format_reference(qtype, make, rows):
    rng = np.random.default_rng(qtype * 100 + rows)
    n, k = 80, 192
    raw, w = make(rng, n, k)
    data = torch.from_numpy(raw)
    assert torch.equal(kernels.quant_dequantize(data, k, qtype), torch.from_numpy(w))   # exact values
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n)
    want = x.double() @ torch.from_numpy(w).double().T + bias.double()
    got = kernels.quant_linear(x, data, bias, qtype)
    assert got.shape == (rows, n) and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.allclose(kernels.quant_linear(x, data, None, qtype).double(), want - bias.double(),
                          rtol=1e-5, atol=1e-4)


bf16_quant = pytest.mark.skipif(kernels is None or not kernels.bf16_linear_available(),
                                reason="no AVX512-BF16 here: bfloat16 models decode GGUF blocks to float32")


@bf16_quant
@pytest.mark.parametrize("qtype,make", [(0, q4_1_blocks), (1, q8_0_blocks)])
@pytest.mark.parametrize("n, k", [(80, 192), (16, 32), (37, 1536)])     # 37: a partial 16-row group
@pytest.mark.parametrize("rows", [1, 3, 8, 17])                         # 17: two full 8-row tiles and one row
def test_quant_linear_bf16_is_the_exact_weights_times_x(qtype, make, n, k, rows):
    """No weight is rounded: the result is the float32 product of the exact block values and the
    bfloat16 activations, rounded once to bfloat16 (so within half a bfloat16 step of it)."""
    rng = np.random.default_rng(qtype * 100 + rows + n)
    raw, w = make(rng, n, k)
    packed = kernels.quant_pack_bf16(torch.from_numpy(raw), qtype, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    bias = torch.randn(n).bfloat16()
    want = x.double() @ torch.from_numpy(w).double().T + bias.double()
    got = kernels.quant_linear_bf16(x, packed, bias, qtype, n)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert torch.allclose(got.double(), want, rtol=2 ** -8, atol=1e-3)
    rounded_weights = x.double() @ torch.from_numpy(w).bfloat16().double().T + bias.double()
    assert (got.double() - want).abs().mean() < (rounded_weights.bfloat16().double() - want).abs().mean() + 1e-9


@bf16_quant
def test_quant_linear_bf16_rejects_bad_shapes_with_a_clear_error():
    raw, _ = q4_1_blocks(np.random.default_rng(0), 8, 64)
    with pytest.raises(RuntimeError, match="not \\[8, 60\\] bytes"):
        kernels.quant_pack_bf16(torch.from_numpy(raw), 0, 8, 96)
    packed = kernels.quant_pack_bf16(torch.from_numpy(raw), 0, 8, 64)
    with pytest.raises(RuntimeError, match="not a packed"):
        kernels.quant_linear_bf16(torch.randn(2, 96).bfloat16(), packed, None, 0, 8)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.quant_linear_bf16(torch.randn(2, 64), packed, None, 0, 8)
    with pytest.raises(RuntimeError, match="qtype"):
        kernels.quant_linear_bf16(torch.randn(2, 64).bfloat16(), packed, None, 7, 8)


@needs_kernels
def test_quant_linear_rejects_bad_shapes_with_a_clear_error():
    raw, _ = q4_1_blocks(np.random.default_rng(0), 8, 64)
    with pytest.raises(RuntimeError, match="blocks"):
        kernels.quant_linear(torch.randn(2, 96), torch.from_numpy(raw), None, 0)
    with pytest.raises(RuntimeError, match="unsupported block type"):
        kernels.quant_linear(torch.randn(2, 64), torch.from_numpy(raw), None, 7)


@needs_kernels
def test_linear_uses_the_quantized_kernel_up_to_max_rows():
    from tandem.models.llama import Linear
    from tandem.models.quant import QuantWeight
    from tandem.runner.kernels import CpuKernelOps

    raw, w = q4_1_blocks(np.random.default_rng(5), 64, 128)
    lin = Linear(64, 128, False, torch.float32)
    lin.weight.data = torch.from_numpy(w) + 1.0          # a different dense weight tells the paths apart
    lin.quant, lin.quant_ops = QuantWeight(torch.from_numpy(raw), 0, 128, max_rows=4), CpuKernelOps(kernels)
    x = torch.randn(4, 128)
    assert torch.allclose(lin(x), x @ torch.from_numpy(w).T, atol=1e-4)              # quantized
    x8 = torch.randn(8, 128)
    assert torch.allclose(lin(x8), x8 @ (torch.from_numpy(w) + 1.0).T, atol=1e-4)    # dense


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


@i8_quant
@pytest.mark.parametrize("qtype, make, reference", [(0, q4_1_blocks, q8_1_reference), (1, q8_0_blocks, q8_0_reference)],
                         ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("n, k", [(80, 192), (8, 32), (37, 1536)])      # 37: a partial 8-row group
@pytest.mark.parametrize("rows", [1, 3, 4, 17, 100])                    # 100: past a 96-row chunk
def test_quant_linear_i8_is_llama_cpp_arithmetic(qtype, make, reference, n, k, rows):
    """Q4_1 x Q8_1 and Q8_0 x Q8_0 (q = -128 included: |q| as unsigned, the sign moved to x)."""
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
@pytest.mark.parametrize("qtype, make", [(0, q4_1_blocks), (1, q8_0_blocks)], ids=["q4_1", "q8_0"])
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


@pytest.mark.slow
@needs_kernels
def test_default_model_on_its_gguf_blocks_equals_the_float_model(default_model_dir):
    """Served from its own Q4_1 / Q8_0 blocks, the default model computes the same function as from
    the float32 weights (which are those blocks dequantized): greedy tokens agree except at near ties."""
    from tandem import LLM, SamplingParams
    from tandem.models.llama import Linear
    from tandem.workload.prompts import load_prompt_set

    quant = LLM(dtype="float32", progress=False, quantization="gguf-float")
    dense = LLM(dtype="float32", progress=False, quantization="none")
    layers = [m for m in quant.engine.executor.model.modules() if isinstance(m, Linear)]
    assert all(m.quant is not None for m in layers)
    for m in layers:                  # whatever this CPU's calibration chose: every step below 64 rows
        m.quant.max_rows = 64
    assert all(m.quant is None for m in dense.engine.executor.model.modules() if isinstance(m, Linear))
    prompts = [quant.tokenizer.apply_chat_template(p.messages) for p in load_prompt_set()[:8]]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2)
    for p in prompts:
        a = quant.generate(prompt_token_ids=[p], sampling_params=params)[0]
        b = dense.generate(prompt_token_ids=[p], sampling_params=params)[0]
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                top = b.outputs[0].logprobs[i].top
                assert top[0][1] - top[1][1] < 1e-3, f"difference at token {i} without a near tie"
                break


def _k_blocks(rng: np.random.Generator, rows: int, k: int, block_bytes: int, scale_at: list[int]) -> np.ndarray:
    """Random K-quant rows (any bytes are valid blocks) with sane float16 scales at `scale_at`."""
    raw = rng.integers(0, 256, (rows * k // 256, block_bytes), dtype=np.uint8)
    for off in scale_at:
        raw[:, off:off + 2] = rng.uniform(0.001, 0.01, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def test_q4_k_and_q4_0_repack_into_q4_1_blocks_of_the_same_weights():
    import gguf

    from tandem.models.quant import q4_0_to_q4_1, q4_k_to_q4_1

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(3)
    raw = _k_blocks(rng, 3, 512, 144, [0, 2])                  # d, dmin
    want = gguf.dequantize(raw, T.Q4_K)
    got = gguf.dequantize(q4_k_to_q4_1(raw), T.Q4_1)
    assert got.shape == want.shape == (3, 512)
    # only the sub-blocks' scale and min are rounded to float16 (relative 2^-11 of each)
    assert np.allclose(got, want, rtol=0, atol=2 ** -10 * np.abs(want).max())
    w = rng.standard_normal((4, 64)).astype(np.float32)
    q4_0 = gguf.quantize(w, T.Q4_0)
    assert np.array_equal(gguf.dequantize(q4_0_to_q4_1(q4_0), T.Q4_1), gguf.dequantize(q4_0, T.Q4_0))


def test_six_bit_types_are_requantized_to_q8_0_within_its_rounding():
    import gguf

    from tandem.models.quant import requant_q8_0

    T = gguf.GGMLQuantizationType
    raw = _k_blocks(np.random.default_rng(4), 5, 256, 210, [208])       # Q6_K: d last
    want = gguf.dequantize(raw, T.Q6_K)
    got = gguf.dequantize(requant_q8_0(raw, T.Q6_K, slab_rows=2), T.Q8_0)
    amax = np.abs(want.reshape(5, -1, 32)).max(axis=-1, keepdims=True)
    err = np.abs(got - want).reshape(5, -1, 32)
    # half a step of amax / 127, plus the float16 rounding of the scale (2^-11 relative, times up to 127)
    assert np.all(err <= amax * (1 / 254 + 2 ** -11) + 1e-7)
    assert err.max() > 0                                                 # it is a requantization


@needs_kernels
def test_linear_on_q4_k_blocks_and_on_mixed_parts(monkeypatch):
    """A Q4_K layer runs the Q4_1 kernel on its repacked blocks; a fused layer whose parts are
    Q4_K and Q6_K (as in Q4_K_M files) runs Q8_0 on all of them."""
    import gguf

    from tandem.models.llama import Linear
    from tandem.models.quant import attach_blocks
    from tandem.runner.kernels import CpuKernelOps

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(5)

    class Tensor:
        def __init__(self, data, kind):
            self.data, self.tensor_type = data, kind

    q4k, q6k = _k_blocks(rng, 16, 256, 144, [0, 2]), _k_blocks(rng, 8, 256, 210, [208])
    tensors = {"a": Tensor(q4k, T.Q4_K), "b": Tensor(q6k, T.Q6_K)}
    x = torch.randn(3, 256)
    ops = CpuKernelOps(kernels)
    single = Linear(16, 256, False, torch.float32)
    assert attach_blocks(single, tensors, [("a", None)], ops, "float") and single.quant.qtype == 0
    w = torch.from_numpy(gguf.dequantize(q4k, T.Q4_K))
    assert torch.allclose(single.forward_quant(x), x @ w.T, rtol=1e-3, atol=1e-3 * float((x @ w.T).abs().max()))
    fused = Linear(24, 256, False, torch.float32)
    assert attach_blocks(fused, tensors, [("a", None), ("b", None)], ops, "float") and fused.quant.qtype == 1
    w = torch.from_numpy(np.concatenate([gguf.dequantize(q4k, T.Q4_K), gguf.dequantize(q6k, T.Q6_K)]))
    ref = x @ w.T
    assert torch.allclose(fused.forward_quant(x), ref, atol=2e-2 * float(ref.abs().max()))
