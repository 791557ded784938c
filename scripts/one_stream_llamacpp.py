"""One stream, Tandem against llama.cpp on the same GGUF and the same token ids (issue 17's first
target). Both decode the first N bundled chat prompts, one request at a time, greedy, `max_tokens`
tokens each with the end-of-sequence token ignored; tokens/s counts generated tokens over the wall
time of the whole set, prefill included. Rounds alternate the two engines in one process.

    .venv/bin/python scripts/one_stream_llamacpp.py --rounds 3 --json out.json [--quantization auto]

llama.cpp comes from `llama-cpp-python` (not a Tandem dependency): install it into another venv,
built here (`CMAKE_ARGS=-DGGML_NATIVE=ON pip install --no-binary llama-cpp-python
llama-cpp-python==0.3.36`), and pass that venv's site-packages as `--llama-cpp-site`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from tandem import LLM, SamplingParams
from tandem.models.fetch import DEFAULT_GGUF_MEMBER, fetch_default_model
from tandem.workload.prompts import load_prompt_set


def chat_ids(llm: LLM, n: int) -> list[list[int]]:
    chats = [p for p in load_prompt_set() if p.kind == "chat"][:n]
    return [llm.tokenizer.apply_chat_template(p.messages) for p in chats]


def run_tandem(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = [llm.generate(prompt_token_ids=[ids], sampling_params=params)[0].token_ids for ids in prompts]
    return sum(map(len, outs)) / (time.perf_counter() - t0), outs


def run_llamacpp(model, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    outs = []
    t0 = time.perf_counter()
    for ids in prompts:
        model.reset()
        got: list[int] = []
        for tok in model.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            got.append(tok)
            if len(got) == max_tokens:
                break
        outs.append(got)
    return sum(map(len, outs)) / (time.perf_counter() - t0), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quantization", default="auto", help="Tandem's quantization (auto: the default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the rounds and medians here")
    ap.add_argument("--llama-cpp-site", help="site-packages holding llama_cpp, searched after this venv's own")
    ap.add_argument("--dump-ids", help="also write the prompts' token ids here (for scripts/one_stream_vllm.py)")
    a = ap.parse_args()
    if a.llama_cpp_site:
        sys.path.append(a.llama_cpp_site)
    from llama_cpp import Llama

    gguf = str(fetch_default_model(progress=False).parent / Path(DEFAULT_GGUF_MEMBER).name)
    lcp = Llama(model_path=gguf, n_ctx=2048, n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
    llm = LLM(quantization=a.quantization, progress=False)
    prompts = chat_ids(llm, a.prompts)
    if a.dump_ids:
        with open(a.dump_ids, "w") as f:
            json.dump(prompts, f)
    run_tandem(llm, prompts[:1], 8)                       # warm both
    run_llamacpp(lcp, prompts[:1], 8)
    rows = []
    for r in range(a.rounds):
        lcp_tps, lcp_ids = run_llamacpp(lcp, prompts, a.max_tokens)
        tan_tps, tan_ids = run_tandem(llm, prompts, a.max_tokens)
        agree = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
                 for p, q in zip(tan_ids, lcp_ids)]
        rows.append(dict(round=r, llamacpp_tok_s=lcp_tps, tandem_tok_s=tan_tps, ratio=tan_tps / lcp_tps,
                         common_prefix=agree))
        print(f"round {r}: llama.cpp {lcp_tps:.1f} tok/s  Tandem {tan_tps:.1f} tok/s  ({tan_tps / lcp_tps:.2f}x)  "
              f"common prefixes {agree}", flush=True)
    med_l = statistics.median(x["llamacpp_tok_s"] for x in rows)
    med_t = statistics.median(x["tandem_tok_s"] for x in rows)
    print(f"median: llama.cpp {med_l:.1f}, Tandem {med_t:.1f} tok/s: {med_t / med_l:.2f}x "
          f"(per-round median {statistics.median(x['ratio'] for x in rows):.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gguf=gguf, quantization=a.quantization, prompts=a.prompts, max_tokens=a.max_tokens,
                           threads=a.threads, machine=platform.processor() or platform.machine(), rounds=rows,
                           median_llamacpp=med_l, median_tandem=med_t, ratio=med_t / med_l), f, indent=1)


if __name__ == "__main__":
    main()
