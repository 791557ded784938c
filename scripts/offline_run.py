"""Offline throughput of one engine on a fixed list of requests: all submitted at once, `ignore_eos`,
each with its reference output length (vLLM's `bench throughput` method).

Runs under either engine's interpreter, so both see the very same token ids:
    python scripts/offline_run.py --engine tandem --requests R.json --temperature 1 --json out.json
    $PEER/bin/python scripts/offline_run.py --engine vllm --model DIR --requests R.json ...
R.json: [{"prompt_token_ids": [...], "max_tokens": N}, ...] (scripts/compare_vllm.py writes it).
Prints and writes output tokens/s per repeat and their median.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time


def build(engine: str, model: str, dtype: str, max_model_len: int, vllm_memory_fraction: float):
    """A function running a batch of (ids, max_tokens, temperature) at once; returns output tokens."""
    if engine == "vllm":
        from vllm import LLM, SamplingParams, TokensPrompt

        llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, seed=0,
                  gpu_memory_utilization=vllm_memory_fraction)

        def run(reqs, temperature):
            prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
            params = [SamplingParams(temperature=temperature, max_tokens=r["max_tokens"], ignore_eos=True)
                      for r in reqs]
            outs = llm.generate(prompts, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)
        return run
    from tandem import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, progress=False)

    def run(reqs, temperature):
        params = [SamplingParams(temperature=temperature, max_tokens=r["max_tokens"], ignore_eos=True)
                  for r in reqs]
        outs = llm.generate(prompt_token_ids=[r["prompt_token_ids"] for r in reqs], sampling_params=params)
        return sum(len(o.outputs[0].token_ids) for o in outs)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("tandem", "vllm"), required=True)
    ap.add_argument("--model", required=True, help="HF model directory (the same for both engines)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--requests", required=True)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", required=True)
    ap.add_argument("--vllm-memory-fraction", type=float, default=0.5,
                    help="vLLM's gpu_memory_utilization: on CPU, the share of NUMA node 0's memory it reserves")
    a = ap.parse_args()
    reqs = json.load(open(a.requests))
    run = build(a.engine, a.model, a.dtype, a.max_model_len, a.vllm_memory_fraction)
    run(reqs[:2], a.temperature)                                  # warm-up
    runs = []
    for i in range(a.repeats):
        t0 = time.perf_counter()
        n = run(reqs, a.temperature)
        wall = time.perf_counter() - t0
        runs.append({"output_tokens": n, "wall_s": wall, "output_tok_s": n / wall})
        print(f"{a.engine} temperature {a.temperature} repeat {i + 1}: {n / wall:.1f} output tok/s", flush=True)
    data = {"engine": a.engine, "temperature": a.temperature, "num_requests": len(reqs), "dtype": a.dtype,
            "machine": platform.processor() or platform.machine(), "runs": runs,
            "output_tok_s": statistics.median(r["output_tok_s"] for r in runs)}
    with open(a.json, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
