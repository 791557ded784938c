"""Quantized linear layers on GGUF blocks (Q4_1, Q8_0, and the K-quants repacked at load): the
weight-only kernels against a NumPy reference of the format, the layer's choice between the
quantized and the float paths, and the default model served from its own GGUF blocks. The
8-bit-activation kernel has its own file, test_quant_i8.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.quant_blocks import kernels, needs_kernels, q4_1_blocks, q8_0_blocks


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
