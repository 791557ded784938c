"""The KV cache's dtype: `auto` picks float16 under a float32 model on CPU (half the bytes decode
attention reads), float32 keeps the model exact, and every attention path reads a 16-bit cache
as the float32 values it stores."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.errors import ConfigError
from tandem.runner import device
from tandem.runner.attention import (AttentionBackend, AttentionMetadata, BatchedGroup, PagedKVCache,
                                     PrefillSeq)

CPU = torch.device("cpu")


@pytest.mark.parametrize("model, dev, kernel, flags, expected", [
    (torch.float32, "cpu", True, "avx2 fma f16c", torch.float16),    # the AVX2 default
    (torch.float32, "cpu", True, "sse4_2", torch.float32),           # no F16C: reading float16 is slow
    (torch.float32, "cpu", False, "avx2 f16c", torch.float32),       # no compiled kernel
    (torch.bfloat16, "cpu", True, "avx512_bf16 f16c", torch.bfloat16),
    (torch.float32, "cuda", False, "avx2 f16c", torch.float32),      # GPUs: the model's dtype
])
def test_auto_follows_model_device_and_cpu(monkeypatch, model, dev, kernel, flags, expected):
    monkeypatch.setattr(device, "cpu_info", lambda: {"flags": flags})
    assert device.resolve_kv_dtype("auto", model, torch.device(dev), kernel) == expected


def test_explicit_choices_and_errors():
    assert device.resolve_kv_dtype("float32", torch.float32, CPU, True) == torch.float32
    assert device.resolve_kv_dtype("bfloat16", torch.float32, CPU, True) == torch.bfloat16
    assert device.resolve_kv_dtype("bfloat16", torch.bfloat16, CPU, True) == torch.bfloat16
    with pytest.raises(ConfigError, match="unknown kv_cache_dtype"):
        device.resolve_kv_dtype("fp8", torch.float32, CPU, True)
    with pytest.raises(ConfigError, match="needs a float32 model"):
        device.resolve_kv_dtype("float16", torch.bfloat16, CPU, True)


def _backend(kv_dtype, ops=None):
    cache = PagedKVCache(1, 8, 4, 2, 64, kv_dtype, CPU)
    return AttentionBackend(cache, 4, 2, 64, ops)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True], ids=["torch", "kernel"])
def test_a_16_bit_cache_attends_like_float32_over_the_rounded_values(kv_dtype, fused):
    """A prefill of 6 tokens, then a decode token: a float32 model over a 16-bit cache equals the
    same model over a float32 cache holding the 16-bit values (the rounding is the only change)."""
    from tandem.runner.kernels import CpuKernelOps, load_cpu_kernels

    module = load_cpu_kernels()
    if fused and module is None:
        pytest.skip("CPU kernels could not be built here")
    ops = CpuKernelOps(module) if fused else None
    torch.manual_seed(0)
    q, k, v = torch.randn(7, 4, 64), torch.randn(7, 2, 64), torch.randn(7, 2, 64)
    low, ref = _backend(kv_dtype, ops), _backend(torch.float32, ops)
    slots = torch.tensor([8, 9, 10, 11, 20, 21, 22])                   # blocks 2 and 5
    prefill = AttentionMetadata(slots[:6], 0, None, [PrefillSeq(0, 6, slots[:6], None, 0,
                                                                torch.tensor([2, 5], dtype=torch.int32))])
    decode = AttentionMetadata(slots[6:], 1, BatchedGroup(
        1, 1, 8, table=torch.tensor([[2, 5]], dtype=torch.int32), query_seq=torch.tensor([0], dtype=torch.int32),
        query_pos=torch.tensor([6], dtype=torch.int32), gather_slots=torch.tensor([8, 9, 10, 11, 20, 21, 22, 23]),
        mask=torch.tensor([0.0] * 7 + [float("-inf")]).view(1, 1, 1, 1, 8)))
    rk, rv = k.to(kv_dtype).float(), v.to(kv_dtype).float()
    got = [low.forward(0, q[:6], k[:6], v[:6], prefill), low.forward(0, q[6:], k[6:], v[6:], decode)]
    want = [ref.forward(0, q[:6], rk[:6], rv[:6], prefill), ref.forward(0, q[6:], rk[6:], rv[6:], decode)]
    assert low.cache.k[0].dtype == kv_dtype
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_the_engine_builds_the_cache_it_was_asked_for(tiny_llama):
    same_memory = dict(model=str(tiny_llama), dtype="float32", progress=False, kv_cache_memory_gb=1 / 256)
    full = LLM(**same_memory, kv_cache_dtype="float32")
    half = LLM(**same_memory, kv_cache_dtype="float16")
    assert full.engine.executor.cache.dtype == torch.float32
    assert half.engine.executor.cache.dtype == torch.float16
    assert half.engine.scheduler.kv.num_blocks == 2 * full.engine.scheduler.kv.num_blocks
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    prompt = [[5, 6, 7, 8, 9, 10, 11, 12]]
    a = full.generate(prompt_token_ids=prompt, sampling_params=params)[0]
    b = half.generate(prompt_token_ids=prompt, sampling_params=params)[0]
    assert len(b.token_ids) == 12
    # float16 K/V move the log-probabilities by far less than the gaps that decide a greedy token
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert abs(x.logprob - y.logprob) < 5e-2


def test_an_unknown_kv_dtype_is_a_config_error(tiny_llama):
    with pytest.raises(ConfigError, match="unknown kv_cache_dtype"):
        LLM(model=str(tiny_llama), progress=False, kv_cache_dtype="int3")
