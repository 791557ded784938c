"""Offline throughput of one engine on a fixed list of requests: all submitted at once (vLLM's
`bench throughput` method) or one after the other (`--modes sequential`: single-stream speed), each with
its max_tokens; `ignore_eos` unless `--stop-at-eos`; optionally with n-gram speculation
(`--ngram`: vLLM's prompt-lookup proposer with k=4, Tandem's adaptive n-gram proposer).

Runs under either engine's interpreter, so both see the very same token ids:
    python scripts/offline_run.py --engine tandem --requests R.json --temperature 0,1 --json out-t{t}.json
    $PEER/bin/python scripts/offline_run.py --engine vllm --model DIR --requests R.json ...
R.json: [{"prompt_token_ids": [...], "max_tokens": N}, ...] (`tandem bench compare --peer vllm` writes it).
Prints and writes output tokens/s per repeat and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time


def build(engine: str, model: str, dtype: str, max_model_len: int, vllm_memory_fraction: float,
          ngram: bool = False, ignore_eos: bool = True, quantization: str = "auto", block_size: int | None = None,
          load_format: str = "auto"):
    """A function running a batch of (ids, max_tokens, temperature) at once; returns output tokens."""
    blocks = {"block_size": block_size} if block_size else {}         # None: each engine's own default
    if engine == "vllm":
        from vllm import LLM, SamplingParams, TokensPrompt

        spec = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
                if ngram else None)
        llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, seed=0, load_format=load_format,
                  gpu_memory_utilization=vllm_memory_fraction, speculative_config=spec, **blocks)

        def run(reqs, temperature):
            prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
            params = [SamplingParams(temperature=temperature, max_tokens=r["max_tokens"], ignore_eos=ignore_eos)
                      for r in reqs]
            outs = llm.generate(prompts, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)
        return run
    from tandem import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, progress=False,
              speculative="ngram" if ngram else None, quantization=quantization, load_format=load_format, **blocks)

    def run(reqs, temperature):
        params = [SamplingParams(temperature=temperature, max_tokens=r["max_tokens"], ignore_eos=ignore_eos)
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
    ap.add_argument("--temperature", default="0", help="a temperature, or a comma list (then --json holds {t})")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="batch",
                    help="comma list: batch (all requests at once), sequential (one at a time: single stream)")
    ap.add_argument("--stop-at-eos", action="store_true", help="end requests at EOS (default: ignore_eos)")
    ap.add_argument("--ngram", action="store_true", help="n-gram speculation (vLLM: prompt lookup, k=4)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the engine's own)")
    ap.add_argument("--quantization", default="auto", help="Tandem only: auto | gguf | gguf-float | none")
    ap.add_argument("--load-format", default="auto", help="auto, or dummy: random weights from config.json (both)")
    ap.add_argument("--vllm-memory-fraction", type=float, default=0.5,
                    help="vLLM's gpu_memory_utilization: on CPU, the share of NUMA node 0's memory it reserves")
    a = ap.parse_args()
    reqs = json.load(open(a.requests))
    batch = build(a.engine, a.model, a.dtype, a.max_model_len, a.vllm_memory_fraction, a.ngram, not a.stop_at_eos,
                  a.quantization, a.block_size, a.load_format)
    temperatures = [float(t) for t in str(a.temperature).split(",")]
    if len(temperatures) > 1 and "{t}" not in a.json:
        raise SystemExit("with several temperatures, --json must contain {t}")
    batch(reqs[:2], temperatures[0])                              # warm-up
    for temperature in temperatures:
        data = {"engine": a.engine, "temperature": temperature, "num_requests": len(reqs), "dtype": a.dtype,
                "ngram": a.ngram, "ignore_eos": not a.stop_at_eos, "block_size": a.block_size,
                "load_format": a.load_format,
                "quantization": a.quantization if a.engine == "tandem" else None,
                "machine": platform.processor() or platform.machine(),
                "env": {k: os.environ[k] for k in ("LD_PRELOAD", "VLLM_CPU_NUM_OF_RESERVED_CPU") if k in os.environ}}
        for mode in a.modes.split(","):
            if mode not in ("batch", "sequential"):
                raise SystemExit(f"unknown mode {mode!r} (batch or sequential)")
            run = batch if mode == "batch" else (lambda rs, t: sum(batch([r], t) for r in rs))
            runs = []
            for i in range(a.repeats):
                t0 = time.perf_counter()
                n = run(reqs, temperature)
                wall = time.perf_counter() - t0
                runs.append({"output_tokens": n, "wall_s": wall, "output_tok_s": n / wall})
                print(f"{a.engine} {mode} temperature {temperature:g}{' ngram' if a.ngram else ''} "
                      f"repeat {i + 1}: {n / wall:.1f} output tok/s", flush=True)
            data[mode] = {"runs": runs, "output_tok_s": statistics.median(r["output_tok_s"] for r in runs)}
        data["output_tok_s"] = data[a.modes.split(",")[0]]["output_tok_s"]
        with open(a.json.replace("{t}", f"{temperature:g}"), "w") as f:
            json.dump(data, f, indent=1)

if __name__ == "__main__":
    main()
