"""What structured outputs cost per output token: the same concurrent requests with and without a
JSON-schema constraint, on the default model (issue 14's target: <= 10% of TPOT at 16 requests).

    .venv/bin/python scripts/structured_cost.py [--concurrency 16] [--max-tokens 128] [--repeats 3] [--json PATH]

Each repeat runs the plain batch, then the constrained one (alternating, so drift falls on both);
TPOT is a request's (finish - first token) / (output tokens - 1), the median over requests, then
over repeats. The schema asks for a list of records, long enough that no request ends early by the
grammar alone (20 records need ~300 tokens); both batches sample at temperature 1, and the plain one
ignores EOS, so that both keep all their requests running for the same number of steps (a plain
batch whose requests end early would run smaller, faster steps and flatter its TPOT).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tandem import LLM, SamplingParams, StructuredOutputs
from tandem.bench.common import machine_info

SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "minItems": 20, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "city": {"type": "string", "maxLength": 24}},
    "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}


def tpot_ms(outs) -> float:
    vals = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
            for o in outs if len(o.token_ids) > 1]
    return 1e3 * statistics.median(vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    llm = LLM(progress=False)
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List twenty people as JSON with their name, age and city."}])
    so = StructuredOutputs(json=SCHEMA)
    runs: dict[str, list[float]] = {"plain": [], "json_schema": []}
    counts: dict[str, list[int]] = {"plain": [], "json_schema": []}
    llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=8, structured_outputs=so))
    for r in range(a.repeats):
        for name, constraint in (("plain", None), ("json_schema", so)):
            params = [SamplingParams(max_tokens=a.max_tokens, temperature=1.0, seed=1000 * r + i,
                                     structured_outputs=constraint, ignore_eos=constraint is None)
                      for i in range(a.concurrency)]
            t = time.perf_counter()
            outs = llm.generate(prompt_token_ids=[prompt] * a.concurrency, sampling_params=params)
            wall = time.perf_counter() - t
            runs[name].append(tpot_ms(outs))
            tokens = sum(len(o.token_ids) for o in outs)
            counts[name].append(tokens)
            print(f"repeat {r + 1} {name:<11} TPOT p50 {runs[name][-1]:6.1f} ms, {tokens} tokens, "
                  f"{tokens / wall:6.1f} out tok/s", flush=True)
    plain, constrained = statistics.median(runs["plain"]), statistics.median(runs["json_schema"])
    print(f"median TPOT: plain {plain:.1f} ms, json_schema {constrained:.1f} ms: +{100 * (constrained / plain - 1):.1f}%")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine_info(), "concurrency": a.concurrency, "max_tokens": a.max_tokens,
                       "tpot_ms": runs, "output_tokens": counts, "median_tpot_ms": {"plain": plain, "json_schema": constrained}}, f, indent=1)


if __name__ == "__main__":
    main()
