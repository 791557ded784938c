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
from tandem.executor import TorchExecutor
from tandem.sampling_params import SamplingParams
from tandem.sched.scheduler import Scheduler
from tandem.types import StepPlan, StepResult

ATOL = 1e-4


class RecordingExecutor:
    """Greedy executor that keeps every computed token's logits, keyed by (request, position)."""

    def __init__(self, runner: TorchExecutor) -> None:
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
    runner = TorchExecutor(model, num_blocks, block_size, torch.device("cpu"))
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


# --- Llama 3.1+ RoPE scaling (rope_scaling rope_type llama3) ----------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def make_llama3_model(out, rope_scaling: dict | None = None, seed: int = 0):
    """A tiny random Llama with Llama 3's RoPE scaling: head_dim 16 and theta 10000 give wavelengths
    6.3 ... 19869, so with original_max_position_embeddings 64 its dimensions are high-frequency
    (kept), medium (smoothed) and low-frequency (divided by the factor)."""
    import transformers

    from conftest import make_tokenizer

    tok = make_tokenizer(out)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=dict(rope_scaling or LLAMA3_ROPE), tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if n.endswith("norm.weight") else p.normal_(0, 0.2)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def tiny_llama3(tmp_path_factory):
    return make_llama3_model(tmp_path_factory.mktemp("llama3") / "llama3")


def test_llama3_rope_frequencies_are_transformers_own(tiny_llama3):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from tandem.models.loader import load_arch

    inv, scaling = load_arch(tiny_llama3).rope_inv_freq()
    ref = LlamaRotaryEmbedding(AutoConfig.from_pretrained(str(tiny_llama3)))
    assert torch.equal(inv, ref.inv_freq) and scaling == ref.attention_scaling == 1.0
    plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    kept, divided = inv == plain, torch.isclose(inv, plain / 8, rtol=1e-6)
    assert kept[:1].all() and divided[-5:].all() and not (kept | divided)[1:3].any()   # all three bands


def test_llama3_rope_model_matches_transformers(tiny_llama3):
    run_and_compare(tiny_llama3, [list(range(3, 80)), [5, 6, 7]], max_tokens=8, budget=64)


# --- quantized Hugging Face checkpoints: refused by name, with what to do ---------------------------

@pytest.mark.parametrize("method, advice", [
    ("fp8", "BF16/FP16 model it was made from"), ("fbgemm_fp8", "FP8 kernels"), ("gptq", "GGUF"), ("awq", "GGUF"),
    ("bitsandbytes", "unquantized model"), ("compressed-tensors", "llm-compressor"), ("mxfp4", "unquantized model"),
])
def test_quantized_checkpoint_is_a_typed_error_naming_the_method(tiny_llama, tmp_path, method, advice):
    import json
    import shutil

    from tandem.errors import ModelLoadError, UnsupportedQuantizationError
    from tandem.models.loader import load_arch

    bad = tmp_path / method
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedQuantizationError) as e:
        load_arch(bad)
    assert isinstance(e.value, ModelLoadError) and e.value.method == method
    msg = str(e.value)
    assert f"'{method}'-quantized" in msg and "cannot run" in msg and advice in msg and "GGUF files" in msg


def test_autogptq_quantize_config_is_refused_too(tiny_llama, tmp_path):
    import json
    import shutil

    from tandem.errors import UnsupportedQuantizationError
    from tandem.models.loader import load_arch

    bad = tmp_path / "gptq-old"
    shutil.copytree(tiny_llama, bad)
    (bad / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    with pytest.raises(UnsupportedQuantizationError, match="'gptq'-quantized checkpoint \\(quantize_config.json, 4-bit"):
        load_arch(bad)
