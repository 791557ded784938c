"""Speculation is lossless on the real default model: greedy token ids with each proposer (n-gram, suffix,
layer-skip, a draft model: the same model drafting for itself, from its GGUF blocks quantized as
`draft_quantization` says) and each length policy are those of the same engine without
speculation. Float target (quantization none), where a verification pass of k+1 rows and a decode
of one row compute the same function; slow (real model), few."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tandem.config import SpecConfig
from tandem.workload.prompts import load_prompt_set

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=32, temperature=0, logprobs=2)


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    llm = LLM(dtype="float32", progress=False, quantization="none")
    items = load_prompt_set()
    picked = [next(p for p in items if p.kind == kind) for kind in ("chat", "rewrite", "extract", "code")]
    ids = [llm.tokenizer.apply_chat_template(p.messages) for p in picked]
    return ids, [o for o in llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)]


@pytest.mark.parametrize("kw", [
    dict(method="ngram", policy="adaptive"),
    dict(method="ngram", policy="fixed", max_draft_tokens=4),
    dict(method="suffix", policy="adaptive"),
    dict(method="layerskip", policy="fixed", max_draft_tokens=3),
    dict(method="draft", policy="adaptive", max_draft_tokens=4),
    dict(method="draft", policy="fixed", max_draft_tokens=4, draft_quantization="none"),
], ids=["ngram-adaptive", "ngram-fixed4", "suffix-adaptive", "layerskip-fixed3", "q4-selfdraft-adaptive", "float-selfdraft-fixed4"])
def test_greedy_ids_are_identical_with_speculation(default_model_dir, prompts, kw):
    ids, plain = prompts
    spec = SpecConfig(**kw, draft_model=str(default_model_dir) if kw["method"] == "draft" else None)
    llm = LLM(dtype="float32", progress=False, quantization="none", speculative=spec)
    outs = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)
    for o, ref in zip(outs, plain):
        if o.token_ids != ref.token_ids:
            i = next(j for j, (a, b) in enumerate(zip(o.token_ids, ref.token_ids)) if a != b)
            top = ref.outputs[0].logprobs[i].top
            # Only a near tie may flip: rows batched differently sum in another order.
            assert top[0][1] - top[1][1] < 1e-3, f"speculation changed token {i} without a near tie"
    assert llm.engine.scheduler.spec_stats.num_steps > 0, "no speculation happened"
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_quantized_self_draft_is_quantized_and_mostly_accepted(default_model_dir, prompts):
    """The default model's own GGUF drafting for its float32 self: the draft's linear layers run
    the 8-bit kernel (quantization auto), and most drafts pass (about 97% on an AVX2 EPYC; a
    quarter would mean the draft is not the same model)."""
    from tandem.models.llama import Linear

    ids, plain = prompts
    spec = SpecConfig(method="draft", policy="fixed", max_draft_tokens=4, draft_model=str(default_model_dir))
    llm = LLM(dtype="float32", progress=False, quantization="none", speculative=spec)
    target = llm.engine.executor.model
    draft = llm.engine.executor.spec.proposer.model
    assert not any(getattr(m, "quant", None) for m in target.modules() if isinstance(m, Linear))
    assert all(getattr(m, "quant", None) is not None for m in draft.modules() if isinstance(m, Linear))
    llm.generate(prompt_token_ids=ids, sampling_params=GREEDY)
    assert llm.engine.scheduler.spec_stats.acceptance_rate > 0.75
