"""One Tandem replica against N on this machine, served, on the augmented multi-turn tool trace
(issue 13's real benchmark): `tandem serve` and `tandem serve --replicas N`, each in turn per seed
round (so machine drift falls on both alike), driven by `tandem bench serve --dataset augmented`:
each request is a chain of calls (generation, the tool's time on the client, the tool's return
appended, the next call), all calls of a chain carrying one OpenAI `user` field, so the cluster's
router keeps the session on the replica that holds its KV.

    .venv/bin/python scripts/replicas_ab.py OUT [--replicas 2] [--rate 0.2] [--num-requests 30] [--seeds 0,1]

Writes OUT/replicas.json (medians over seeds) and each run's JSON and server log. Run it from a
frozen clone with nothing else on the machine: each server starts from this checkout's .venv.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from tandem.bench.peers.vllm import Server, log, warm_up

ROOT = Path(__file__).resolve().parent.parent

PORT = 18011
SLOS = ("ttft:2000", "tpot:100")


def bench(url: str, rate: float, n: int, seed: int, out: Path) -> dict:
    tandem = str(ROOT / ".venv" / "bin" / "tandem")
    subprocess.run([tandem, "bench", "serve", "--url", url, "--dataset", "augmented", "--rate", str(rate),
                    "--num-requests", str(n), "--seed", str(seed), "--goodput", *SLOS, "--timeout", "1800",
                    "--no-progress", "--json", str(out)], check=True)
    return json.loads(out.read_text())["runs"][0]["summary"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rate", type=float, default=0.2)
    p.add_argument("--num-requests", type=int, default=30)
    p.add_argument("--seeds", default="0,1")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from tandem.models.fetch import resolve_model

    model_dir = resolve_model(None, False)
    tandem = str(ROOT / ".venv" / "bin" / "tandem")
    base = [tandem, "serve", "--model", str(model_dir), "--port", str(PORT)]
    configs = {"1 replica": base, f"{a.replicas} replicas": base + ["--replicas", str(a.replicas)]}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for seed in [int(s) for s in a.seeds.split(",")]:
        for name, cmd in configs.items():
            tag = name.replace(" ", "_")
            log(f"starting {name} (seed round {seed})")
            server = Server(name, cmd, PORT, out / f"server-{tag}-seed{seed}.log")
            try:
                warm_up(PORT, model_dir.name, 4)
                s = bench(f"http://127.0.0.1:{PORT}", a.rate, a.num_requests, seed, out / f"run-{tag}-seed{seed}.json")
            finally:
                server.stop()
            runs[name].append(s)
            log(f"  {name} seed {seed}: goodput {s['goodput']:.3f} req/s ({s['good_requests']}/{s['num_requests']}), "
                  f"{s['output_throughput']:.0f} tok/s, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
                  f"TPOT p50 {s['tpot_ms']['p50']:.0f} ms")
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("goodput", "output_throughput", "request_throughput")}
           | {f"{m}_p50_ms": statistics.median(r[f"{m}_ms"]["p50"] for r in rs) for m in ("ttft", "tpot")}
           | {f"{m}_p99_ms": statistics.median(r[f"{m}_ms"]["p99"] for r in rs) for m in ("ttft", "tpot")}
           for name, rs in runs.items()}
    from tandem.bench.common import machine_info

    result = {"machine": machine_info(), "options": vars(a), "slos": SLOS,
              "medians": med, "runs": runs}
    (out / "replicas.json").write_text(json.dumps(result, indent=1))
    for name, m in med.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.3g}" for k, v in m.items()))


if __name__ == "__main__":
    sys.exit(main())
