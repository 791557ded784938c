"""Scale out: N replicas (each the real Scheduler + KV manager under a cost model) behind a router
(tandem.router), on session workloads (tandem.sim.sessions: the augmented tool trace with the tool
loop on the client, and multi-turn chat). Compared: tandem vs round_robin vs power_of_two (Ray
Serve's default) vs prefix, on goodput (vLLM: requests within the SLO / run duration), SLO
attainment, TTFT p50/p99, the prefix-cache hit rate and the prompt tokens served from the cache.

Load: `rate` is new sessions per second PER REPLICA (the cluster gets rate x N), starting over an
arrival window of `window_s` (so rate x window_s x N sessions; later requests of a session follow
its earlier ones, past the window: a tool session lasts up to minutes). Unless given, it
is `load` x the capacity of one replica, measured first: the largest per-replica session rate at
which a single replica (which by construction keeps every session's KV: no routing choice exists)
keeps >= 90% of requests within the SLO (doubling, then two geometric bisections, on the same
window). So load 0.8 offers each replica 80% of what it sustains when its cache
serves every follow-up; a router that loses the prefixes has to recompute them on top.

SLO (per request): TTFT <= ttft_slo_s and TPOT <= tpot_factor x the unloaded decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.router import POLICIES, Router
from tandem.sim.build import SimConfig
from tandem.sim.cluster import simulate_cluster
from tandem.sim.cost import make_cost_model
from tandem.sim.metrics import SLO
from tandem.sim.run import timed
from tandem.sim.scenarios.common import Log, default_scheduler, find_capacity, unloaded_step_s
from tandem.sim.sessions import CHAT, build_sessions


@dataclass
class ClusterOptions:
    replicas: tuple[int, ...] = (8, 16, 64)
    workloads: tuple[str, ...] = ("tools", "chat")
    policies: tuple[str, ...] = POLICIES
    window_s: float = 40.0             # sessions start over this arrival window (Poisson)
    sessions_per_replica: int | None = None   # overrides rate x window_s
    rate: float | None = None          # sessions/s per replica; None: load x the probed capacity
    load: float = 0.8
    seed: int = 1
    model: str = "llama2-13b"
    hardware: str = "A100-80GB"
    num_gpus: int = 1
    ttft_slo_s: float = 2.0
    tpot_factor: float = 5.0
    attainment_for_capacity: float = 0.9
    start_rate: float = 1.0
    weights: dict[str, float] = field(default_factory=dict)


def _slo(cost, opts: ClusterOptions) -> SLO:
    return SLO(ttft_s=opts.ttft_slo_s, tpot_s=opts.tpot_factor * unloaded_step_s(cost))


def run_point(cost, cfg: SimConfig, workload: str, num_replicas: int, policy: str, rate: float,
              sessions_per_replica: int, seed: int, slo: SLO, weights: dict[str, float] | None = None) -> dict[str, Any]:
    """One run: `sessions_per_replica` x N sessions starting at `rate` x N per second."""
    sessions = build_sessions(workload, max(1, sessions_per_replica * num_replicas), rate * num_replicas, seed)
    out, wall_s = timed(simulate_cluster, cost, cfg, sessions, num_replicas, Router(policy, weights, seed=seed), slo)
    out.pop("records")
    out["wall_s"] = wall_s
    out["per_replica"] = out.pop("replicas")
    out.update({"workload": workload, "replicas": num_replicas, "policy": policy, "rate_per_replica": rate,
                "sessions": len(sessions)})
    return out


def probe_capacity(cost, cfg: SimConfig, workload: str, opts: ClusterOptions, slo: SLO, log: Log) -> float:
    def measure(rate: float) -> dict[str, Any]:
        return run_point(cost, cfg, workload, 1, "round_robin", rate, _sessions(opts, rate), opts.seed, slo)
    return find_capacity(measure, opts.start_rate, lambda s: s["slo_attainment"] >= opts.attainment_for_capacity, log)


def _sessions(opts: ClusterOptions, rate: float) -> int:
    return opts.sessions_per_replica or max(1, round(rate * opts.window_s))


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def run_cluster(opts: ClusterOptions, log: Log) -> dict[str, Any]:
    cost = make_cost_model(opts.hardware, opts.model, num_gpus=opts.num_gpus)
    slo = _slo(cost, opts)
    cfg = SimConfig(scheduler=default_scheduler(), seed=opts.seed)
    log(f"{cost.deployment().description}; SLO {slo.as_dict()}")
    out_wl = []
    for wl in opts.workloads:
        if opts.rate is None:
            cap = probe_capacity(cost, cfg, wl, opts, slo, log)
            rate = opts.load * cap
            log(f"{wl}: one replica's capacity {cap:.3g} sessions/s; running at {opts.load:g}x = {rate:.3g} per replica")
        else:
            cap, rate = None, opts.rate
        rows = []
        for n in opts.replicas:
            for policy in opts.policies:
                row = run_point(cost, cfg, wl, n, policy, rate, _sessions(opts, rate), opts.seed, slo, opts.weights)
                s = row["summary"]
                log(f"  {wl:<5} N={n:<3} {policy:<12} goodput {s['effective_throughput']:7.2f} req/s  "
                    f"SLO {s['slo_attainment']:5.0%}  TTFT p50 {s['ttft_s']['p50']:.3f} p99 {s['ttft_s']['p99']:.3f} s  "
                    f"hit {s['prefix_hit_rate']:.0%}  ({row['wall_s']:.0f} s)")
                rows.append(row)
        out_wl.append({"workload": wl, "capacity_per_replica": cap, "rate_per_replica": rate, "rows": rows,
                       "ratios": ratios(rows)})
    options = dict(opts.__dict__)
    return {"scenario": "cluster", "options": options, "deployment": cost.deployment().description,
            "slo": slo.as_dict(), "chat_generator": CHAT, "workloads": out_wl}


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per cluster size: tandem's goodput over each baseline's."""
    out: dict[str, dict[str, Any]] = {}
    for n in sorted({r["replicas"] for r in rows}):
        by = {r["policy"]: r["summary"] for r in rows if r["replicas"] == n}
        if "tandem" not in by:
            continue
        t = by["tandem"]["effective_throughput"]
        out[str(n)] = {f"goodput_vs_{p}": _ratio(t, s["effective_throughput"]) for p, s in by.items() if p != "tandem"}
    return out


def cluster_tables(res: dict[str, Any]) -> str:
    lines = [f"cluster: {res['deployment']}; SLO {res['slo']}"]
    for w in res["workloads"]:
        cap = w["capacity_per_replica"]
        lines.append(f"\n{w['workload']}: {w['rate_per_replica']:.3g} sessions/s per replica"
                     + (f" (one replica's capacity {cap:.3g})" if cap else ""))
        lines.append("| replicas | router | requests | goodput (req/s) | SLO | TTFT p50 (ms) | TTFT p99 (ms) | "
                     "prefix hit | cached prompt tokens | follow-up same replica | busy mean/max |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in w["rows"]:
            s = r["summary"]
            lines.append(f"| {r['replicas']} | {r['policy']} | {s['num_requests']} | {s['effective_throughput']:.2f} | "
                         f"{s['slo_attainment']:.1%} | {s['ttft_s']['p50'] * 1e3:.0f} | {s['ttft_s']['p99'] * 1e3:.0f} | "
                         f"{s['prefix_hit_rate']:.1%} | {s['cached_prompt_tokens']:,} | "
                         f"{s['followup_same_replica']:.0%} | {s['busy_mean']:.2f}/{s['busy_max']:.2f} |")
        for n, e in w["ratios"].items():
            lines.append(f"N={n}: tandem goodput / " + ", ".join(
                f"{k[len('goodput_vs_'):]} {v:.2f}x" for k, v in e.items() if v is not None))
    return "\n".join(lines)
