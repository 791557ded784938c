"""`tandem bench offline`: the figures it writes (throughput per concurrency, the weights' memory)."""

from __future__ import annotations

import json

from tandem import LLM
from tandem.bench.offline import bench_offline, weight_memory


def _arch_params(cfg) -> int:
    per_layer = ((cfg.q_size + 2 * cfg.kv_size) * cfg.hidden_size + cfg.q_size * cfg.hidden_size
                 + 3 * cfg.intermediate_size * cfg.hidden_size + 2 * cfg.hidden_size)
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return cfg.vocab_size * cfg.hidden_size + cfg.num_layers * per_layer + cfg.hidden_size + head


def test_weight_memory_counts_each_parameter_and_each_layout_once(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", progress=False)
    model = llm.engine.executor.model
    mem = weight_memory(model)
    cfg = model.cfg
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.qk_norm)
    assert mem["parameters"] == _arch_params(cfg)
    # float32 weights: 4 bytes a parameter, and no more than one packed copy of each linear layer
    assert 4.0 <= mem["bytes_per_parameter"] <= 8.0
    assert mem["weight_resident_bytes"] == mem["bytes_per_parameter"] * mem["parameters"]


def test_bench_offline_writes_throughput_and_memory(tiny_llama, tmp_path):
    llm = LLM(model=str(tiny_llama), dtype="float32", progress=False)
    out = tmp_path / "offline.json"
    data = bench_offline(llm, [1, 2], repeats=1, max_tokens=4, json_path=str(out), log=lambda _: None)
    saved = json.loads(out.read_text())
    assert [r["concurrency"] for r in saved["results"]] == [1, 2]
    assert all(r["runs"][0]["output_tokens"] == 4 * r["concurrency"] for r in saved["results"])
    assert saved["peak_rss_mb"] > 0 and saved["parameters"] == data["parameters"] > 0
    assert saved["bytes_per_parameter"] >= 4.0
