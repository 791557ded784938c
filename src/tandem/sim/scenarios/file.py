"""User scenarios from a JSON file: deployments x runs x request rates on one workload.

Schema (every key optional unless marked; defaults in brackets):

    {
      "name": "my-scenario",
      "seed": 0,
      "deployments": [                              # or "deployment": {...} for one
        {"hardware": "H100-80GB",                   # A100-80GB | H100-80GB | H200 | calibrated[:PATH] (req.)
         "model": "llama3-8b",                      # a known model or a dict of ModelArch fields (roofline)
         "draft_model": "qwen3-0.6b",               # modelled only in runs that speculate [none]
         "num_gpus": 1, "gpu_memory_utilization": 0.9, "swap_space_gb": 32}
      ],
      "scheduler": {"max_num_batched_tokens": 4096, "max_num_seqs": 256, "max_model_len": 8192,
                    "block_size": 16, "enable_prefix_caching": true, "watermark": 0.01,
                    "tool_time_hint": "oracle", "position_decay": 0.97},
      "workload": {"dataset": "augmented",          # augmented[:TYPE] | synthetic | a trace file
                   "num_requests": 1000, "arrival": "poisson",   # poisson | gamma | diurnal | trace | a file
                   "rate": 2.0, "cv": 2.0, "peak_valley_ratio": 35, "period_s": null,
                   "kinds": {...}, "acceptance": {"chat": [7, 3]}, "profiles": null, "abort_after_s": null},
                   # an acceptance entry is [a, b] (Beta of the base rate) or, as `tandem bench
                   # acceptance` fits it, {"beta": [a, b], "position": [...], "offer": [p, q],
                   # "offer_lengths": [...], "source": "..."}
      "rates": [1, 2, 4],                            # one run per rate [the workload's rate]
      "runs": [                                      # (required)
        {"label": "vllm", "policy": "fcfs-discard"},
        {"label": "sd-adaptive", "policy": "fcfs", "spec": {"policy": "adaptive", "max_draft_tokens": 8}}
      ],
      "slo": {"ttft_s": 2.0, "tpot_s": null, "e2e_s": null, "normalized_latency_s": 0.05}
    }

`policy` is a scheduling policy (fcfs, fcfs-discard, infercept, augserve-stage1, augserve-stage2,
augserve); `spec` holds SpecConfig fields (policy: adaptive | fixed | table | survival | none).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from tandem.config import SchedulerConfig, SpecConfig
from tandem.sim.build import SimConfig
from tandem.sim.cost import make_cost_model
from tandem.sim.metrics import SLO
from tandem.sim.scenarios.common import Log, RunSpec, run_one
from tandem.sim.workload import WorkloadSpec, parse_acceptance

SIM_KEYS = ("block_size", "enable_prefix_caching", "tool_time_hint", "position_decay")
DEPLOYMENT_KEYS = ("hardware", "model", "draft_model", "num_gpus", "gpu_memory_utilization", "swap_space_gb")


def _pick(d: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: d[k] for k in keys if k in d}


def parse_runs(doc: dict[str, Any]) -> list[RunSpec]:
    runs = doc.get("runs")
    if not runs:
        raise ValueError("a scenario needs a non-empty `runs` list")
    out = []
    for i, r in enumerate(runs):
        spec = r.get("spec")
        if spec is not None and spec.get("method", "draft") == "draft":
            spec = {"method": "draft", "draft_model": "simulated", **spec}
        out.append(RunSpec(r.get("label", f"run-{i}"), r.get("policy", "fcfs"),
                           SpecConfig(**spec) if spec is not None else None))
    return out


def parse_workload(doc: dict[str, Any]) -> WorkloadSpec:
    wl = dict(doc.get("workload", {}))
    if "acceptance" in wl:
        wl["acceptance"] = {k: v if isinstance(v, dict) else tuple(v) for k, v in wl["acceptance"].items()}
        for v in wl["acceptance"].values():
            parse_acceptance(v)                 # a malformed entry fails here, with its message
    known = {f.name for f in dataclasses.fields(WorkloadSpec)}
    unknown = set(wl) - known
    if unknown:
        raise ValueError(f"unknown workload keys {sorted(unknown)}; known: {sorted(known)}")
    return WorkloadSpec(**wl)


def parse_config(doc: dict[str, Any], seed: int) -> SimConfig:
    sched = dict(doc.get("scheduler", {}))
    sim = {k: sched.pop(k) for k in SIM_KEYS if k in sched}
    return SimConfig(scheduler=SchedulerConfig(**sched), seed=seed, **sim)


def run_file(path: str | Path, log: Log, seed: int | None = None,
             num_requests: int | None = None) -> dict[str, Any]:
    """Run a scenario file; `seed` and `num_requests` override the file's."""
    doc = json.loads(Path(path).read_text())
    seed = doc.get("seed", 0) if seed is None else seed
    deployments = doc.get("deployments") or [doc["deployment"]]
    runs, workload, base = parse_runs(doc), parse_workload(doc), parse_config(doc, seed)
    if num_requests is not None:
        workload = dataclasses.replace(workload, num_requests=num_requests)
    slo = SLO(**doc["slo"]) if doc.get("slo") else None
    rates = doc.get("rates") or [workload.rate]
    rows = []
    for dep in deployments:
        d = _pick(dep, DEPLOYMENT_KEYS)
        hw, draft = d.pop("hardware"), d.pop("draft_model", None)
        kw = dict(model=d.pop("model", None), block_size=base.block_size, **d)
        plain, spec = make_cost_model(hw, **kw), make_cost_model(hw, draft=draft, **kw)
        log(spec.deployment().description)
        for rate in rates:
            for run in runs:
                row = run_one(spec if run.spec else plain, base, run, workload, rate, seed, slo)
                s = row["summary"]
                log(f"  {rate:>7.3g} req/s {run.label:<16} out {s['output_throughput']:8.1f} tok/s  "
                    f"TTFT p50 {s['ttft_s']['p50']:.3f} s p99 {s['ttft_s']['p99']:.3f} s")
                rows.append(row)
    return {"scenario": doc.get("name", Path(path).stem), "file": str(path), "seed": seed,
            "slo": slo.as_dict() if slo else None, "rows": rows}
