"""Tandem alone, served, judged by `vllm bench serve`: named sets of `tandem serve` flags, one server
per (seed, set), the sets interleaved within each seed round so machine drift falls on all alike.

    .venv/bin/python scripts/serve_ab.py OUT RATES SEEDS NAME=FLAGS [NAME=FLAGS ...]
    .venv/bin/python scripts/serve_ab.py docs/results/budget_ab_avx2 0.25,2 0,1 "default=--max-num-batched-tokens 512" \\
        "b2048=--max-num-batched-tokens 2048" "b2048_tpot80=--max-num-batched-tokens 2048 --target-tpot-ms 80"

The seed rounds are `tandem bench compare --peer vllm`'s (tandem.bench.peers.vllm.serve_rounds: the
same prompts per (rate, seed) as its served part; 24 prompts per run, goodput TTFT <= 2 s and TPOT <= 100 ms). Writes OUT/ab.json and the raw
runs. Run it from a frozen clone: each server starts from this checkout's .venv.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from tandem.bench.peers.vllm import peer_dir, serve_rounds

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    if len(sys.argv) < 5:
        raise SystemExit(__doc__)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    a = SimpleNamespace(rates=[float(r) for r in sys.argv[2].split(",")], seeds=[int(s) for s in sys.argv[3].split(",")],
                        num_prompts=24, ttft_ms=2000, tpot_ms=100, warmup_requests=4)
    from tandem.models.fetch import resolve_model

    model_dir = resolve_model(None, False)
    tandem = str(ROOT / ".venv" / "bin" / "tandem")
    servers = {name: ([tandem, "serve", "--model", str(model_dir), "--port", "18001"] + flags.split(), 18001, None)
               for name, flags in (kv.split("=", 1) for kv in sys.argv[4:])}
    results = serve_rounds(a, peer_dir(), model_dir, servers, out)
    (out / "ab.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
