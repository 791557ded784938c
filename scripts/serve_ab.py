"""Tandem alone, served, judged by `vllm bench serve`: named sets of `tandem serve` flags, one server
per (seed, set), the sets interleaved within each seed round so machine drift falls on all alike.

    .venv/bin/python scripts/serve_ab.py OUT RATES SEEDS NAME=FLAGS [NAME=FLAGS ...]
    .venv/bin/python scripts/serve_ab.py docs/results/budget_ab_avx2 0.25,2 0,1 "default=--max-num-batched-tokens 512" \
        "b2048=--max-num-batched-tokens 2048" "b2048_tpot80=--max-num-batched-tokens 2048 --target-tpot-ms 80"

Uses compare_vllm's server, warm-up and bench helpers (the same prompts per (rate, seed) as its
served part: 24 per run, goodput TTFT <= 2 s and TPOT <= 100 ms). Writes OUT/ab.json and the raw runs.
Run it from a frozen clone: each server starts from this checkout's .venv.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import compare_vllm as c


class Bench:          # the fields compare_vllm.bench_serve reads
    num_prompts = 24
    ttft_ms = 2000
    tpot_ms = 100


def main() -> None:
    if len(sys.argv) < 5:
        raise SystemExit(__doc__)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in sys.argv[2].split(",")]
    seeds = [int(s) for s in sys.argv[3].split(",")]
    configs = {name: flags.split() for name, flags in (kv.split("=", 1) for kv in sys.argv[4:])}
    peer = c.peer_dir()
    from tandem.models.fetch import resolve_model
    model_dir = resolve_model(None, False)
    dataset = c.sharegpt_json()
    tandem = str(c.ROOT / ".venv" / "bin" / "tandem")
    results: dict = {}
    for seed in seeds:
        for name, flags in configs.items():
            cmd = [tandem, "serve", "--model", str(model_dir), "--port", "18001"] + flags
            server = c.Server(name, cmd, 18001, out / f"server-{name}-seed{seed}.log")
            try:
                c.warm_up(18001, model_dir.name, 4)
                for i, rate in enumerate(rates):
                    res = c.bench_serve(Bench, peer, model_dir, dataset, 18001, rate, c.sample_seed(seed, i),
                                        out / f"serve-{name}-rate{rate:g}-seed{seed}.json")
                    results.setdefault(name, {}).setdefault(str(rate), []).append(res)
                    print(f"[{time.strftime('%H:%M:%S')}] {name} rate {rate:g} seed {seed}: goodput "
                          f"{res['request_goodput']:.3f}, {res['output_throughput']:.0f} tok/s, TTFT p50/p99 "
                          f"{res['median_ttft_ms']:.0f}/{res['p99_ttft_ms']:.0f}, TPOT p50/p99 "
                          f"{res['median_tpot_ms']:.0f}/{res['p99_tpot_ms']:.0f} ms", flush=True)
            finally:
                server.stop()
    (out / "ab.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
