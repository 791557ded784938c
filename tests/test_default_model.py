"""The default model (SmolLM2-135M-Instruct, fp32): exact against transformers, batch-invariant up
to near ties, unchanged under KV pressure and with prefix caching. Slow (real model), few."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.workload.prompts import load_prompt_set

pytestmark = pytest.mark.slow
N_TOKENS = 32
# transformers' generate is the slow side (~2.5 s a prompt here): it checks every third prompt of
# the set (all three kinds), the batch and preemption tests the first 16.
REFERENCE = tuple(range(0, 36, 3))
BATCH = tuple(range(16))


@pytest.fixture(scope="module")
def llm(default_model_dir):
    # exactness is the float path's (float32 weights and a float32 KV cache)
    return LLM(dtype="float32", progress=False, quantization="none", kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.tokenizer.apply_chat_template(p.messages) for p in load_prompt_set()]


@pytest.fixture(scope="module")
def alone(llm, prompts):
    """The prompts the tests compare, each generated on its own, with top-2 logprobs to recognise
    near ties: {index in the prompt set: output}."""
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0, logprobs=2)
    return {i: llm.generate(prompt_token_ids=[prompts[i]], sampling_params=params)[0]
            for i in sorted(set(REFERENCE) | set(BATCH))}


def test_greedy_equals_transformers_generate(default_model_dir, prompts, alone):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    assert len(prompts) == 36 and {p.kind for p in load_prompt_set()[::3]} == {"chat", "rewrite", "extract", "code"}
    for i in REFERENCE:
        p = prompts[i]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=N_TOKENS, do_sample=False)[0, len(p):].tolist()
        assert alone[i].token_ids == ref, f"prompt {i}"


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def test_batch_of_16_equals_alone_except_near_ties(llm, prompts, alone):
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0)
    batch = llm.generate(prompt_token_ids=[prompts[i] for i in BATCH], sampling_params=params)
    num_diff = 0
    for b, a in zip(batch, [alone[i] for i in BATCH]):
        i = first_difference(b.token_ids, a.token_ids)
        if i is None:
            continue
        num_diff += 1
        top = a.outputs[0].logprobs[i].top
        gap = top[0][1] - top[1][1]
        assert gap < 1e-3, f"difference at token {i} without a near tie (top-2 gap {gap:.2e})"
    print(f"batch of 16 vs alone: {num_diff} of 16 differ, all at near ties")


def test_small_kv_pool_preempts_and_still_gives_the_same_outputs(default_model_dir, prompts, alone, llm):
    # 16 requests need ~16 * (45 + 32) tokens; 24 blocks of 16 hold 384: preemption is unavoidable.
    small = LLM(dtype="float32", progress=False, num_kv_blocks=24, max_model_len=384, quantization="none",
                kv_cache_dtype="float32")
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0)
    outs = small.generate(prompt_token_ids=prompts[:16], sampling_params=params)
    ample = llm.generate(prompt_token_ids=prompts[:16], sampling_params=params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ample]
    kv = small.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_shared_prefix_is_computed_once(llm):
    system = ("You are a meticulous assistant. Answer in one short sentence, cite no sources, and never "
              "apologise. Prefer plain words to jargon and keep numbers exact. ") * 3
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ["What is 2+2?", "Name a colour.", "Say hi.", "What is ice?"]]
    params = SamplingParams(max_tokens=8, temperature=0)
    sched = llm.engine.scheduler
    sched.kv.reset_prefix_cache()
    before = sched.num_scheduled_tokens
    cached = llm.chat(convs, params)
    computed = sched.num_scheduled_tokens - before
    prompt_lens = [len(o.prompt_token_ids) for o in cached]
    prefix = len(llm.tokenizer.apply_chat_template([{"role": "system", "content": system}], add_generation_prompt=False))
    shared_blocks = (prefix - 1) // 16
    assert shared_blocks >= 4
    # Every request after the first takes the shared blocks from the cache: they are computed once.
    assert [o.metrics.num_cached_tokens for o in cached][1:] == [shared_blocks * 16] * 3
    outputs = sum(len(o.token_ids) for o in cached)
    assert computed == sum(prompt_lens) - 3 * shared_blocks * 16 + outputs - len(cached)
    # ... and outputs are what they are without the cache.
    sched.kv.enable_prefix_caching = False
    try:
        uncached = llm.chat(convs, params)
    finally:
        sched.kv.enable_prefix_caching = True
    assert [o.token_ids for o in cached] == [o.token_ids for o in uncached]
