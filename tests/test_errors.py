"""Bad input raises a clear typed error naming the problem, and the engine stays usable."""

from __future__ import annotations

import pytest

from tandem import LLM, InvalidRequestError, ModelLoadError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", progress=False, max_model_len=64)


def still_works(llm):
    out = llm.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].token_ids) >= 1
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and field in str(e.value)


@pytest.mark.parametrize("call, field", [
    (lambda llm: llm.generate("", SamplingParams()), "prompt"),
    (lambda llm: llm.generate(prompt_token_ids=[[]]), "prompt"),
    (lambda llm: llm.generate(prompt_token_ids=[[1, 2, 10**6]]), "prompt_token_ids"),
    (lambda llm: llm.generate(prompt_token_ids=[[1, -3]]), "prompt_token_ids"),
    (lambda llm: llm.generate(prompt_token_ids=[list(range(1, 70))]), "prompt"),
    (lambda llm: llm.generate([{"prompt": "a", "prompt_token_ids": [1]}]), "prompts"),
    (lambda llm: llm.generate({"prompt_ids": [1, 2]}), "prompts"),
    (lambda llm: llm.generate({"prompt_token_ids": 5}), "prompt_token_ids"),
    (lambda llm: llm.generate(["a", "b"], [SamplingParams()]), "sampling_params"),
    (lambda llm: llm.chat([], SamplingParams()), "messages"),
])
def test_bad_requests_leave_the_engine_usable(llm, call, field):
    with pytest.raises(InvalidRequestError) as e:
        call(llm)
    assert e.value.field == field
    still_works(llm)


def test_vllm_prompt_dicts_are_accepted(llm):
    """vLLM's TextPrompt / TokensPrompt dicts, alone or in a list, give what the plain forms give."""
    params = SamplingParams(max_tokens=4, temperature=0)
    by_ids = llm.generate(prompt_token_ids=[[4, 5, 6]], sampling_params=params)[0].token_ids
    assert llm.generate({"prompt_token_ids": [4, 5, 6]}, params)[0].token_ids == by_ids
    both = llm.generate([{"prompt": "hello"}, {"prompt_token_ids": [4, 5, 6]}], params)
    assert both[0].token_ids == llm.generate("hello", params)[0].token_ids and both[1].token_ids == by_ids


def test_one_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate(prompt_token_ids=[[1, 2, 3], [1, 999999]])
    assert not llm.engine.has_unfinished_requests()
    still_works(llm)


def test_prompt_exactly_at_context_limit_is_rejected_and_one_below_finishes_by_length(llm):
    with pytest.raises(InvalidRequestError, match="context length is 64"):
        llm.generate(prompt_token_ids=[[7] * 64])
    out = llm.generate(prompt_token_ids=[[7] * 63], sampling_params=SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(out[0].token_ids) == 1 and out[0].finish_reason == "length"


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        LLM(model=str(tmp_path / "nope"), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(model=str(tmp_path / "empty"), progress=False)


def test_corrupt_safetensors(tiny_llama, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(model=str(bad), dtype="float32", progress=False)
    f.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(model=str(bad), dtype="float32", progress=False)


def test_unsupported_architecture(tiny_llama, tmp_path):
    import json
    import shutil

    bad = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError):
        LLM(model=str(bad), dtype="float32", progress=False)


@pytest.mark.parametrize("method", ["fp8", "gptq", "awq"])
def test_quantized_hf_checkpoint_is_refused_by_name(tiny_llama, tmp_path, method):
    """A checkpoint with a quantization_config would load its packed weights as plain tensors."""
    import json
    import shutil

    bad = tmp_path / method
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=f"'{method}'-quantized"):
        LLM(model=str(bad), dtype="float32", progress=False)


def test_top_k_zero_means_off_as_in_vllm():
    """vLLM's SamplingParams takes top_k=0 for "no top-k" (its default); -1 is the older spelling."""
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(top_k=5).top_k == 5
