"""Every architecture against transformers: fp32 logits within 1e-4 for prefill, paged decode steps,
mixed batches and chunked prefill (a tiny random model per architecture)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tandem.config import SchedulerConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.kv import KVCacheManager
from tandem.models.loader import load_model
from tandem.runner.model_runner import ModelRunner
from tandem.sampling_params import SamplingParams
from tandem.sched.scheduler import Scheduler
from tandem.types import StepPlan, StepResult

ATOL = 1e-4


class RecordingExecutor:
    """Greedy executor that keeps every computed token's logits, keyed by (request, position)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.logits: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
        self.num_tokens_per_step: list[int] = []
        self.num_seqs_per_step: list[int] = []

    def execute(self, plan: StepPlan) -> StepResult:
        out = self.runner.forward_logits(plan)
        self.num_tokens_per_step.append(plan.num_tokens)
        self.num_seqs_per_step.append(len(plan.seqs))
        result = StepResult()
        for s in plan.seqs:
            for i in range(s.num_tokens):
                self.logits[s.request_id][s.start + i] = out[s.request_id][i].clone()
            if s.sample:
                result.sampled_token_ids[s.request_id] = [int(out[s.request_id][-1].argmax())]
        return result

    def release(self, request_ids):
        pass


def make_engine(model_dir, budget: int, num_blocks: int = 64, block_size: int = 4, prefix_caching=True):
    model = load_model(model_dir, torch.float32, torch.device("cpu"), max_positions=256)
    runner = ModelRunner(model, num_blocks, block_size, torch.device("cpu"))
    rec = RecordingExecutor(runner)
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=256), kv)
    return LLMEngine(sched, rec, None, vocab_size=model.cfg.vocab_size, max_model_len=256), rec


def hf_logits(model_dir, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0]


def run_and_compare(model_dir, prompts: list[list[int]], max_tokens: int, budget: int, **kw):
    engine, rec = make_engine(model_dir, budget, **kw)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    for rid, prompt in zip(ids, prompts):
        full = prompt + final[rid].token_ids
        ref = hf_logits(model_dir, full)
        ours = rec.logits[rid]
        assert sorted(ours) == list(range(len(full) - 1)), "every position but the last computed once"
        for pos, row in ours.items():
            torch.testing.assert_close(row, ref[pos], atol=ATOL, rtol=0)
    return rec


@pytest.mark.parametrize("arch", ["llama", "llama-tied", "mistral", "qwen2", "qwen3"])
def test_prefill_and_decode_match_transformers(tiny_models, arch):
    rec = run_and_compare(tiny_models[arch], [[5, 17, 33, 2, 90, 41, 7, 8, 9, 10, 11]], max_tokens=8, budget=64)
    assert rec.num_tokens_per_step[0] == 11            # the whole prompt in one step
    assert rec.num_tokens_per_step[1:] == [1] * 7      # then one paged decode token per step


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_mixed_batch_of_different_lengths(tiny_models, arch):
    prompts = [[3, 4, 5], list(range(10, 40)), [7] * 9, list(range(50, 67))]
    rec = run_and_compare(tiny_models[arch], prompts, max_tokens=6, budget=64)
    assert max(rec.num_seqs_per_step) == 4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill(tiny_models, arch):
    # A 7-token budget cuts the 40-token prompt into chunks, mixed with the other request's decodes.
    prompts = [list(range(20, 60)), [1, 2, 3]]
    rec = run_and_compare(tiny_models[arch], prompts, max_tokens=5, budget=7)
    assert max(rec.num_tokens_per_step) == 7
    assert len(rec.num_tokens_per_step) > 40 // 7


def test_prefix_cache_hit_is_exact(tiny_llama):
    # Same 24-token prefix twice: the second request reuses cached blocks and still matches transformers.
    prefix = list(range(30, 54))
    engine, rec = make_engine(tiny_llama, budget=64)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    a = engine.add_request(prompt_token_ids=prefix + [1, 2], params=params)
    while engine.has_unfinished_requests():
        engine.step()
    b = engine.add_request(prompt_token_ids=prefix + [3, 4, 5], params=params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].metrics.num_cached_tokens == 24
    assert min(rec.logits[b]) == 24                     # positions 0..23 were not recomputed
    ref = hf_logits(tiny_llama, prefix + [3, 4, 5] + outs[-1].token_ids)
    for pos, row in rec.logits[b].items():
        torch.testing.assert_close(row, ref[pos], atol=ATOL, rtol=0)
    assert a != b
