"""Tokens per KV block: the default (128 on CPU, 16 on GPU), explicit sizes, and that the block size
changes where K/V live but never what the engine generates."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tandem.config import CacheConfig
from tandem.errors import ConfigError
from tandem.runner.device import GPU_BLOCK_SIZE, resolve_block_size


def test_an_engine_built_without_a_block_size_gets_128_token_blocks_on_cpu(tiny_llama):
    """In a fresh interpreter (this suite pins 16 for its own engines, see conftest.py): what
    `LLM()` and `tandem serve` build by default."""
    code = ("from tandem import LLM\n"
            f"llm = LLM(model={str(tiny_llama)!r}, dtype='float32', device='cpu', progress=False)\n"
            "print(llm.engine.scheduler.kv.block_size, llm.engine.executor.block_size)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["128", "128"]


def test_explicit_and_gpu_block_sizes():
    assert resolve_block_size(32, torch.device("cpu")) == 32
    assert resolve_block_size(None, torch.device("cuda")) == GPU_BLOCK_SIZE == 16
    assert resolve_block_size(64, torch.device("cuda")) == 64
    with pytest.raises(ConfigError, match="power of two"):
        CacheConfig(block_size=48)
    with pytest.raises(ConfigError, match="power of two"):
        CacheConfig(block_size=0)


@pytest.mark.parametrize("block_size", [128, 32])
def test_generation_is_the_same_at_any_block_size(tiny_llama, block_size):
    """Greedy ids over prompts longer than a block, then a second round that reuses the first's
    prompts from the prefix cache (whole blocks only), equal those of 16-token blocks."""
    from tandem import LLM, SamplingParams

    prompts = [list(range(3, 3 + n)) for n in (20, 150, 290)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(bs):
        llm = LLM(model=str(tiny_llama), dtype="float32", progress=False, block_size=bs)
        assert llm.engine.scheduler.kv.block_size == bs
        first = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        again = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        return first, again

    ref, _ = run(16)
    first, again = run(block_size)
    def ids(outs):
        return [o.outputs[0].token_ids for o in outs]

    assert ids(first) == ids(again) == ids(ref)
    # the prefix cache counts whole blocks of the prompt (the last prompt token is always computed)
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // block_size * block_size for p in prompts]
