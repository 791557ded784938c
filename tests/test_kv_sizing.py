"""The KV cache's default size: a share of free memory, at least 0.5 GiB, never more than
max_num_seqs full contexts need; an explicit size wins."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM
from tandem import llm as llm_module
from tandem.runner.attention import PagedKVCache
from tandem.runner.device import available_memory_bytes

CPU = torch.device("cpu")
GiB = 2**30


@pytest.mark.parametrize("free, need, expected", [
    (24 * GiB, 100 * GiB, int(0.1 * 24 * GiB)),   # a tenth of free memory
    (24 * GiB, 1 * GiB, 1 * GiB),                 # no more than the requests could fill
    (1 * GiB, 100 * GiB, GiB // 2),               # at least 0.5 GiB
    (1 * GiB, GiB // 8, GiB // 8),                # ... unless that is more than needed
])
def test_automatic_size(monkeypatch, free, need, expected):
    monkeypatch.setattr(llm_module, "available_memory_bytes", lambda device: free)
    assert llm_module.kv_cache_bytes(None, CPU, need) == expected


def test_an_explicit_size_wins(monkeypatch):
    monkeypatch.setattr(llm_module, "available_memory_bytes", lambda device: 100 * GiB)
    assert llm_module.kv_cache_bytes(0.25, CPU, 100 * GiB) == GiB // 4


def test_free_memory_is_read_on_this_machine():
    assert available_memory_bytes(CPU) > 0


def test_the_engine_sizes_its_cache_by_the_rule(tiny_llama, monkeypatch):
    monkeypatch.setattr(llm_module, "available_memory_bytes", lambda device: 20 * GiB)
    llm = LLM(model=str(tiny_llama), dtype="float32", progress=False, max_num_seqs=4)
    kv = llm.engine.scheduler.kv
    assert kv.num_blocks == 4 * 512 // 16                 # 4 sequences x the tiny model's 512 positions
    sized = LLM(model=str(tiny_llama), dtype="float32", progress=False, max_num_seqs=4,
                kv_cache_memory_gb=1 / 1024)
    arch = llm_module.load_arch(tiny_llama)
    kv_dtype = sized.engine.executor.cache.dtype          # float16 where auto picks it (see test_kv_dtype)
    per_block = PagedKVCache.bytes_per_block(arch.num_layers, 16, arch.num_kv_heads, arch.head_dim, kv_dtype)
    assert sized.engine.scheduler.kv.num_blocks == 2**20 // per_block


def test_loader_leftovers_are_released_before_the_kv_cache(tiny_llama, monkeypatch):
    """The engine gives the memory its loader freed back to the system before it allocates the KV
    cache, so that the process's peak is the weights plus the cache (the 8B shape's budget,
    docs/benchmarks.md, "Model sizes")."""
    events = []
    monkeypatch.setattr(llm_module, "release_free_host_memory", lambda: events.append("release"))
    executor = llm_module.TorchExecutor

    def build(*args, **kwargs):
        events.append("kv cache")
        return executor(*args, **kwargs)

    monkeypatch.setattr(llm_module, "TorchExecutor", build)
    LLM(model=str(tiny_llama), dtype="float32", progress=False, max_num_seqs=2)
    assert events == ["release", "kv cache"]
