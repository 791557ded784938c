"""What Tandem's scheduler adds to vLLM's scheduler time per step: vLLM's `Scheduler` and
`tandem.integrations.vllm.TandemScheduler`, built in this process on the default model's config with
no model behind them, step through the same decode steps with the same requests running
(`schedule()` + `update_from_output()` with one sampled token per request, which is what the engine
core calls each step). The median per-step time over --steps steps, alternating the two schedulers in
rounds (--rounds), each round's first alternating, so drift and order fall on both; cProfile of Tandem's steps with --profile.

Run it in the vLLM environment (scripts/setup_vllm_env.sh), with this checkout on the path:

    PYTHONPATH=src ~/.cache/tandem-peers/vllm/bin/python scripts/vllm_plugin_overhead.py --running 64 \\
        --json docs/results/vllm_plugin/overhead.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tandem.integrations.vllm import TandemScheduler

BLOCK = 16


def build(cls, model_dir: Path, running: int, options: dict):
    model = ModelConfig(model=str(model_dir), dtype="float32", max_model_len=2048)
    sched = SchedulerConfig(max_num_seqs=max(running, 1), max_num_batched_tokens=8192, max_model_len=2048,
                            is_encoder_decoder=False, async_scheduling=False)
    num_blocks = running * 2048 // BLOCK + 64
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)   # (requests here carry no block hasher)
    cache.num_gpu_blocks = num_blocks            # what the engine core sets after profiling memory
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                        additional_config={"tandem": options})
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float16)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return cls(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
               block_size=BLOCK, log_stats=False)


def step(s) -> None:
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                sampled_token_ids=[[11] for _ in ids]))


def fill(s, running: int, prompt_len: int, max_tokens: int, tag: str) -> None:
    for i in range(running):
        prompt = [(i * 31 + j * 7) % 30000 + 10 for j in range(prompt_len)]
        s.add_request(Request(f"{tag}{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in s.requests.values()):   # prefill them all
        step(s)


def measure(s, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step(s)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="an HF model directory (default: Tandem's default model)")
    ap.add_argument("--running", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--waiting", type=int, default=0, help="requests left queued behind the running ones")
    ap.add_argument("--tandem-options", default="{}")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tandem.models.fetch import resolve_model

    model_dir = resolve_model(a.model, progress=False)
    options = json.loads(a.tandem_options)
    per = {"vllm": [], "tandem": []}
    for rnd in range(a.rounds):
        pair = (("vllm", Scheduler), ("tandem", TandemScheduler))
        for name, cls in (pair if rnd % 2 == 0 else pair[::-1]):       # who goes first alternates
            s = build(cls, model_dir, a.running, options)
            fill(s, a.running, a.prompt_len, a.steps * 2 + 8, f"r{rnd}-")
            for i in range(a.waiting):      # beyond max_num_seqs: they stay queued (and ranked every step)
                s.add_request(Request(f"w{rnd}-{i}", [5 + i] * a.prompt_len, SamplingParams(max_tokens=4), None))
            if name == "tandem" and a.profile and rnd == a.rounds - 1:
                prof = cProfile.Profile()
                prof.enable()
                per[name] += measure(s, a.steps)
                prof.disable()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
            else:
                per[name] += measure(s, a.steps)
    med = {k: statistics.median(v) * 1e6 for k, v in per.items()}
    result = {"running": a.running, "waiting": a.waiting, "steps": a.steps, "rounds": a.rounds,
              "median_step_us": med, "ratio": med["tandem"] / med["vllm"], "options": options}
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
