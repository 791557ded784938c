"""Where a decode step's time goes, on the default model (docs/benchmarks.md, "Decode attention and KV
block size", quotes one breakdown).

Wraps the model's parts with wall-clock timers (CPU ops run synchronously, so a timer around a
call is its cost): the layers' linear projections (qkv, o, gate_up, down), the LM head, paged
attention, the fused element-wise kernels (RMSNorm, RoPE, SiLU*mul), the embedding; "engine" is
the rest of the step (scheduling, input building, sampling, detokenization, Python overhead).
Then runs a batch of C requests to the end and reports the shares of the decode steps.

    .venv/bin/python scripts/profile_step.py --concurrency 1,32 [--model M [--load-format dummy]] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from tandem import LLM, SamplingParams
from tandem.models.llama import Linear

TIMES: dict[str, float] = defaultdict(float)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - t
    return wrapper


def instrument(llm: LLM) -> None:
    runner = llm.engine.executor                  # the TorchExecutor
    model = runner.model
    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            label = "lm_head" if name == "lm_head" else "linear (qkv, o, gate_up, down)"
            mod.forward = timed(label, mod.forward)
    ops = model.ops
    for op in ("add_rms_norm", "rope_", "silu_and_mul"):
        setattr(ops, op, timed("norm / rope / silu", getattr(ops, op)))
    attn = runner.attn
    attn.forward = timed("attention", attn.forward)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=0,
                    help="pad the prompt to about this many tokens (ShareGPT contexts reach 1-2k); "
                         "the warm-up caches it, so the timed run is decode at that context")
    ap.add_argument("--model", default=None, help="a model as `tandem serve --model` takes it (default: the default model)")
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                    help="dummy: random weights from the model's config (a shape such as llama-3.2-1b)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    llm = LLM(a.model, load_format=a.load_format) if a.model else LLM()
    instrument(llm)
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    if a.context:
        filler = "The keeper climbed the stairs at dusk and lit the lamp, as every night before. "
        n = len(llm.tokenizer.encode(filler))
        prompt = filler * max(0, (a.context - 20) // n) + prompt
    out = {}
    for c in [int(x) for x in a.concurrency.split(",")]:
        params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([prompt] * c, params, use_tqdm=False)            # warm-up
        TIMES.clear()
        t = time.perf_counter()
        llm.generate([f"{prompt} ({i})" for i in range(c)], params, use_tqdm=False)
        wall = time.perf_counter() - t
        parts = dict(TIMES)
        parts["engine (schedule, inputs, sampling, detok)"] = wall - sum(parts.values())
        steps = a.max_tokens
        print(f"\nC={c}: {wall:.2f} s, {1e3 * wall / steps:.1f} ms per step ({c * steps / wall:.1f} tok/s)")
        for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"  {k:<44} {1e3 * v / steps:7.2f} ms/step  {100 * v / wall:5.1f}%")
        out[c] = {"wall_s": wall, "ms_per_step": 1e3 * wall / steps,
                  "shares": {k: v / wall for k, v in parts.items()}}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
