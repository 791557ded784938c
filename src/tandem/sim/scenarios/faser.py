"""The FASER comparison at paper scale: a Qwen3-0.6B draft for a Qwen3-32B target on H100 presets
(2 GPUs by default: 65.5 GB of bf16 weights leave a single 80 GB GPU under 8 GB of KV), ShareGPT /
HumanEval / LongBench-shaped synthetic lengths (workload.DEFAULT_KINDS), draft acceptance per kind
from published profiles (PUBLISHED_ACCEPTANCE: EAGLE on ShareGPT, InstructCoder, CNN/DailyMail).

Policies: no speculation (no draft model loaded), fixed k = 2, 4, 8, vLLM's batch-size table
(dynamic SD), vLLM's survival-probability slot admission, and Tandem's adaptive per-request
length. Two measurements per policy:
- throughput: saturation capacity (every request queued at once; finished requests per second
  between the 10th and 90th percentile finish times) in requests/s and output tokens/s;
- latency: a diurnal day (raised-cosine rate, peak/valley 35x) whose peak is `peak_load` x the
  no-SD capacity: mean and p99 E2E latency, mean TPOT, p99 TTFT, and latency by time of day.
The headline compares adaptive with the best baseline on each figure. An ablation (`ABLATION`)
runs the same two measurements with verification in frontiers of 4 drafts, alone, with the next
frontier's drafting overlapped, and with both chosen per step by the scheduler, on top of adaptive
and of fixed k = 8.

`acceptance` (a `tandem bench acceptance` JSON) replaces the assumed kinds with measured ones: each
dataset's kinds with their fitted lengths, request weights, per-request Beta, per-position
conditional acceptance and offer chain (tandem.sim.workload.DraftModel), each entry citing the
file. With `hardware="calibrated:PATH"` (a `tandem simulate calibrate` profile of the machine) the
scenario is the engine's own CPU deployment: the proposer the measurement used (n-gram drafts cost
no forward, as the profile measures), the engine's step budget (512 tokens, 64 sequences).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from tandem.config import SpecConfig
from tandem.sim.build import SimConfig
from tandem.sim.cost import make_cost_model
from tandem.sim.metrics import RequestRecord
from tandem.sim.run import saturation_capacity
from tandem.sim.scenarios.common import Log, RunSpec, default_scheduler, run_config, run_one
from tandem.sim.workload import WorkloadSpec, build_workload

MAX_K = 8


FRONTIER = 4


def spec_config(policy: str, k: int = MAX_K, frontier_size: int = 0, overlap: bool = False, auto: bool = False,
                run_ahead: str = "off") -> SpecConfig:
    return SpecConfig(method="draft", draft_model="qwen3-0.6b", policy=policy, max_draft_tokens=k,
                      frontier_size=frontier_size, overlap=overlap, adaptive_frontiers=auto, run_ahead=run_ahead)


def measured_kinds(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(kinds, acceptance, about) from a `tandem bench acceptance` JSON: every dataset's kinds
    (ShareGPT and HumanEval are one kind each, the prompt set one per prompt kind) weighted by
    their request counts, with fitted lengths and draft models; `about` names the measurement."""
    try:
        doc = json.loads(Path(path).read_text())
        datasets = doc["datasets"].items()
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise ValueError(f"--acceptance {path}: not a `tandem bench acceptance` JSON ({e!r})") from e
    source = (f"{Path(path).name}: tandem bench acceptance, {doc.get('method')} drafts, k = {doc.get('draft_tokens')}, "
              f"temperature {doc.get('temperature')}, {doc.get('machine', {}).get('cpu', '?')}")
    kinds, acceptance = {}, {}
    for name, ds in datasets:
        for kind, fit in ds["kinds"].items():
            if not fit.get("prompt") or not fit.get("output") or not fit.get("num_offering_rounds"):
                continue
            kinds[kind] = {"weight": fit["num_requests"], "prompt": fit["prompt"], "output": fit["output"]}
            p = fit["position_acceptance"][0] or 0.0
            beta = fit.get("beta") or [max(p, 1e-3) * 50, max(1 - p, 1e-3) * 50]   # one request: a tight Beta
            entry = {"beta": beta, "position": fit["position"], "source": f"{source}, {name}/{kind}"}
            if doc.get("method") == "ngram":
                entry.update(offer=fit["offer"], offer_lengths=fit["offer_lengths"])
            acceptance[kind] = entry
    if not kinds:
        raise ValueError(f"{path}: no dataset kind with drafts to model")
    about = {"source": str(path), "method": doc.get("method"), "draft_tokens": doc.get("draft_tokens"),
             "temperature": doc.get("temperature"), "machine": doc.get("machine")}
    return kinds, acceptance, about


# Published acceptance for the GPU scenario, per kind: the profiled EAGLE acceptance of
# Llama-3.1-8B-Instruct on H100 in vLLM released with "Speculative Decoding: Performance or
# Illusion?" (Liu et al., arXiv 2601.11580; github.com/SpecDecode-Bench/simulator,
# data/llama3.1-8B/combined_{sharegpt,instructcoder,cnn}.jsonl: per output position, the tokens a
# round starting there yields). Fitted as `tandem bench acceptance` fits the engine's rounds: a
# per-request Beta of draft 1's acceptance (method of moments, binomial noise removed) and the
# pooled conditional acceptance of drafts 2..8 as ratios to draft 1. ShareGPT stands for chat,
# InstructCoder for code (the released data has no HumanEval) and CNN/DailyMail for summarize
# (none for LongBench). Pooled draft-1 acceptance 0.694 / 0.717 / 0.693; conditional acceptance is
# flat to rising along the draft, not decaying.
_SDB = "Liu et al. 2026 (arXiv 2601.11580), SpecDecode-Bench/simulator data, EAGLE, Llama-3.1-8B-Instruct, H100"
PUBLISHED_ACCEPTANCE: dict[str, Any] = {
    "chat": {"beta": [12.6986, 6.2928], "position": [1.0, 0.955, 0.994, 1.045, 1.095, 1.133, 1.147, 1.029],
             "source": f"{_SDB}, ShareGPT (310 requests)"},
    "code": {"beta": [16.9091, 4.8522], "position": [1.0, 1.011, 1.045, 1.081, 1.119, 1.144, 1.142, 0.916],
             "source": f"{_SDB}, InstructCoder (500 requests)"},
    "summarize": {"beta": [53.4853, 24.4586], "position": [1.0, 0.961, 0.958, 0.986, 1.025, 1.069, 1.081, 1.027],
                  "source": f"{_SDB}, CNN/DailyMail (300 requests)"},
}


RUNS = (RunSpec("no-sd"), RunSpec("fixed-2", spec=spec_config("fixed", 2)),
        RunSpec("fixed-4", spec=spec_config("fixed", 4)), RunSpec("fixed-8", spec=spec_config("fixed", 8)),
        RunSpec("bs-table", spec=spec_config("table")),
        RunSpec("survival", spec=spec_config("survival")), RunSpec("adaptive", spec=spec_config("adaptive")),
        RunSpec("adaptive+run-ahead", spec=spec_config("adaptive", run_ahead="auto")))
# FASER's verification frontiers (early pruning) and drafting overlapped with them, always or
# chosen per step by the scheduler ("auto": where its cost model expects them to pay), on top of
# the adaptive length and of fixed k = 8 (where there is most to prune): reported apart from the
# comparison with the baselines.
ABLATION = tuple(
    RunSpec(f"{label}+{'auto-' if auto else ''}frontiers{'+overlap' if overlap else ''}",
            spec=spec_config(policy, frontier_size=FRONTIER, overlap=overlap, auto=auto))
    for label, policy in (("adaptive", "adaptive"), ("fixed-8", "fixed"))
    for overlap, auto in ((False, False), (True, False), (True, True)))


@dataclass
class FaserOptions:
    num_requests: int = 2000
    saturation_requests: int = 1000
    hardware: str = "H100-80GB"
    num_gpus: int = 2
    target: str = "qwen3-32b"
    draft: str = "qwen3-0.6b"
    peak_valley_ratio: float = 35.0
    peak_load: float = 1.0               # diurnal peak rate / no-SD saturation capacity
    seed: int = 0
    num_bins: int = 24                   # latency by time of day: one bin per "hour"
    ablation: bool = True                # also run ABLATION (frontiers, overlap)
    acceptance: str | None = None        # a `tandem bench acceptance` JSON: measured kinds (else assumed)


def timeline(records: list[RequestRecord], period_s: float, bins: int) -> dict[str, Any]:
    """Mean E2E latency and arrivals by arrival time (`bins` slices of the day), and mean E2E latency
    of requests arriving in the valley (rate in the lowest quarter of its range) and at the peak
    (highest quarter)."""
    bin_s = period_s / bins
    bins = max(bins, 1 + int(max((r.arrival_s for r in records), default=0.0) / bin_s))   # past the day: more
    sums, counts = [0.0] * bins, [0] * bins
    phase: dict[str, list[float]] = {"valley": [], "peak": []}
    for r in records:
        if r.e2e_s is None:
            continue
        b = int(r.arrival_s / bin_s)
        sums[b] += r.e2e_s
        counts[b] += 1
        x = (1 - math.cos(2 * math.pi * r.arrival_s / period_s)) / 2     # 0 at the valley, 1 at the peak
        if x < 0.25 or x > 0.75:
            phase["valley" if x < 0.25 else "peak"].append(r.e2e_s)
    return {"timeline": {"bin_s": bin_s, "arrivals": counts,
                         "mean_e2e_s": [s / c if c else None for s, c in zip(sums, counts)]},
            "valley_e2e_mean_s": fmean(phase["valley"]) if phase["valley"] else None,
            "peak_e2e_mean_s": fmean(phase["peak"]) if phase["peak"] else None}


def _with_method(run: RunSpec, method: str) -> RunSpec:
    if run.spec is None or method == "draft":
        return run
    return RunSpec(run.label, run.policy, dataclasses.replace(run.spec, method=method, draft_model=None))


def diurnal_day(opts: FaserOptions, no_sd_capacity: float, workload_kw: dict[str, Any]) -> WorkloadSpec:
    """The scenario's day: a raised-cosine rate whose peak is `peak_load` x no SD's saturation
    capacity and whose valley is `peak_valley_ratio` times lower, `num_requests` over one period."""
    peak, ratio = opts.peak_load * no_sd_capacity, opts.peak_valley_ratio
    mean_rate = peak * (1 + ratio) / (2 * ratio)
    return WorkloadSpec(dataset="synthetic", arrival="diurnal", num_requests=opts.num_requests, rate=mean_rate,
                        peak_valley_ratio=ratio, period_s=opts.num_requests / mean_rate, **workload_kw)


def run_faser(opts: FaserOptions, log: Log) -> dict[str, Any]:
    cpu = opts.hardware.startswith("calibrated")
    plain = make_cost_model(opts.hardware, opts.target, num_gpus=opts.num_gpus)
    spec = make_cost_model(opts.hardware, opts.target, None if cpu else opts.draft, num_gpus=opts.num_gpus)
    sched = default_scheduler(512, 64) if cpu else default_scheduler()
    base = SimConfig(scheduler=sched, seed=opts.seed)
    log(f"{spec.deployment().description}")
    workload_kw: dict[str, Any] = {} if cpu else {"acceptance": dict(PUBLISHED_ACCEPTANCE)}
    measured = None
    method = "draft"
    if opts.acceptance:
        kinds, acceptance, measured = measured_kinds(opts.acceptance)
        workload_kw = {"kinds": kinds, "acceptance": acceptance}
        method = measured["method"] or "draft"
        log(f"  measured kinds ({opts.acceptance}): " + ", ".join(
            f"{k} (w {v['weight']}, first-draft acceptance {acceptance[k]['beta'][0] / sum(acceptance[k]['beta']):.2f})"
            for k, v in kinds.items()))
    sat_wl = WorkloadSpec(dataset="synthetic", arrival="poisson", num_requests=opts.saturation_requests, **workload_kw)
    sat_reqs = build_workload(sat_wl, opts.seed)
    mean_out = sum(r.output_tokens for r in sat_reqs) / len(sat_reqs)
    runs = tuple(_with_method(r, method) for r in RUNS + (ABLATION if opts.ablation else ()))
    capacity = {}
    for run in runs:
        cost = spec if run.spec else plain
        capacity[run.label] = saturation_capacity(cost, run_config(base, run), sat_reqs)
        c = capacity[run.label]
        log(f"  saturation {run.label:<9} {c:6.2f} req/s  {c * mean_out:8.0f} tok/s")
    peak = opts.peak_load * capacity["no-sd"]
    wl = diurnal_day(opts, capacity["no-sd"], workload_kw)
    mean_rate, period = wl.rate, wl.period_s
    log(f"  diurnal day: {opts.num_requests} requests over {period:.0f} s, mean {mean_rate:.2f} req/s, "
        f"peak {peak:.2f} req/s, valley {peak / opts.peak_valley_ratio:.3f} req/s")
    rows = []
    for run in runs:
        cost = spec if run.spec else plain
        row = run_one(cost, base, run, wl, None, opts.seed, None,
                      extra=lambda recs: timeline(recs, period, opts.num_bins))
        row["saturation_rps"] = capacity[run.label]
        row["saturation_tok_s"] = capacity[run.label] * mean_out
        s = row["summary"]
        log(f"  diurnal {run.label:<9} E2E mean {s['e2e_s']['mean']:6.2f} s p99 {s['e2e_s']['p99']:6.2f} s  "
            f"TPOT {s['tpot_s']['mean'] * 1e3:5.1f} ms  TTFT p99 {s['ttft_s']['p99']:6.2f} s  "
            f"({row['sim']['wall_s']:.1f} s)")
        rows.append(row)
    main, ablation = rows[:len(RUNS)], rows[len(RUNS):]
    return {"scenario": "faser", "options": dict(opts.__dict__), "description": spec.deployment().description,
            "diurnal": {"mean_rate": mean_rate, "peak_rate": peak, "period_s": period}, "rows": main,
            "ablation": ablation, "frontier_size": FRONTIER, "measured": measured,
            "workload": workload_kw,
            "headline": headline(main)}


OURS = ("adaptive", "adaptive+run-ahead")


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Tandem's adaptive length, without and with run-ahead drafting, against the best baseline
    (and each one) on throughput and latency."""
    out: dict[str, Any] = {"paper": {"throughput_x": 1.53, "latency_x": 1.92}}
    for label, key in zip(OURS, ("ours", "ours_run_ahead")):
        if any(r["label"] == label for r in rows):
            out[key] = _versus(rows, label)
    return out


def _versus(rows: list[dict[str, Any]], label: str) -> dict[str, Any]:
    a = next(r for r in rows if r["label"] == label)
    baselines = [r for r in rows if r["label"] not in OURS]
    ours: dict[str, Any] = {"vs": {}}
    for b in baselines:
        ours["vs"][b["label"]] = {
            "throughput_x": a["saturation_tok_s"] / b["saturation_tok_s"],
            "mean_latency_x": b["summary"]["e2e_s"]["mean"] / a["summary"]["e2e_s"]["mean"],
            "p99_latency_x": b["summary"]["e2e_s"]["p99"] / a["summary"]["e2e_s"]["p99"],
            "valley_latency_x": b["valley_e2e_mean_s"] / a["valley_e2e_mean_s"],
            "peak_latency_x": b["peak_e2e_mean_s"] / a["peak_e2e_mean_s"]}
    best_tp = max(baselines, key=lambda r: r["saturation_tok_s"])
    best_lat = min(baselines, key=lambda r: r["summary"]["e2e_s"]["mean"])
    ours["vs_best_throughput"] = {"baseline": best_tp["label"], **ours["vs"][best_tp["label"]]}
    ours["vs_best_latency"] = {"baseline": best_lat["label"], **ours["vs"][best_lat["label"]]}
    ours["max_throughput_x"] = max(v["throughput_x"] for v in ours["vs"].values())
    ours["max_mean_latency_x"] = max(v["mean_latency_x"] for v in ours["vs"].values())
    return ours
