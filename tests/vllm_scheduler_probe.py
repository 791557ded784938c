"""Run by tests/test_vllm_plugin.py under vLLM's interpreter: `TandemScheduler` built in-process on the
default model's config with n-gram speculation and no model behind it, fed scripted steps in which
every draft is accepted (`accept`) or rejected (`reject`), while vLLM's proposer offers 4 drafts per
request each step. A step takes 5 ms plus 2 ms per token it computes, on a scripted clock that the
plugin reads its step times from (so that the step-cost model FASER learns sees drafts cost
something, as a model's forward makes them, and the same on every machine however busy it is).
Prints, as JSON, each decode step's scheduled draft count per request."""

from __future__ import annotations

import json
import sys
import time

import torch
from vllm import SamplingParams
from vllm.config import (CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig,
                         VllmConfig)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import tandem.integrations.vllm as plugin
from tandem.integrations.vllm import TandemScheduler

BLOCK, BLOCKS = 16, 512


class ScriptedClock:
    """Stands in for the `time` module the plugin times its steps with: `perf_counter` moves only
    when a scripted step says how long it took; wall-clock time (session holds) is the real one."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    @staticmethod
    def time() -> float:
        return time.time()


CLOCK = ScriptedClock()
plugin.time = CLOCK


def build(model_dir: str) -> TandemScheduler:
    model = ModelConfig(model=model_dir, dtype="float32", max_model_len=2048)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1,
                             target_model_config=model, target_parallel_config=parallel)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    cache.num_gpu_blocks = BLOCKS
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048,
                            is_encoder_decoder=False, async_scheduling=False)
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache, parallel_config=parallel,
                        speculative_config=spec, additional_config={"tandem": {}})
    layer = FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float16)
    kv = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], layer)])
    return TandemScheduler(vllm_config=config, kv_cache_config=kv,
                           structured_output_manager=StructuredOutputManager(config), block_size=BLOCK, log_stats=False)


def run(model_dir: str, accept: bool, steps: int = 24) -> list[list[int]]:
    s = build(model_dir)
    for i in range(2):
        s.add_request(Request(f"r{i}", [5, 6, 7] * 10, SamplingParams(max_tokens=200, ignore_eos=True), None))
    drafted = []
    for _ in range(steps):
        out = s.schedule()
        ids = list(out.num_scheduled_tokens)
        spec = out.scheduled_spec_decode_tokens
        sampled = [(list(spec.get(r, ())) if accept else []) + [9] for r in ids]
        CLOCK.now += 0.005 + 0.002 * out.total_num_scheduled_tokens
        s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                    sampled_token_ids=sampled))
        s.update_draft_token_ids(DraftTokenIds(ids, [[1, 2, 3, 4] for _ in ids]))
        if all(out.num_scheduled_tokens[r] == 1 + len(spec.get(r, ())) for r in ids):    # decode steps only
            drafted.append([len(spec.get(r, ())) for r in ids])
    return drafted


if __name__ == "__main__":
    print(json.dumps({mode: run(sys.argv[1], mode == "accept") for mode in ("accept", "reject")}))
