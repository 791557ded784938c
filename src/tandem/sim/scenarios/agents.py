"""Agents whose tools run on the client, replayed from real sessions (tandem.workload.agent_sessions)
on one simulated replica, whole token counts: each call is a new request that carries the session's
whole context, and the next call follows its wait after the previous one finished (closed loop per
session; sessions start as a Poisson process). Policies, all on the same Scheduler:

    vllm-lru    every call a new request; the prefix cache (LRU) keeps what it keeps; FCFS
    continuum   the session's KV pinned on the device for a TTL from Continuum's rule; program FCFS
    infercept   the session's KV held between calls by the min-waste rule; FCFS
    tandem      held by the min-waste rule, plus AugServe's ordering and token budget

Per policy and load: LLM time per session (the sum of its calls' latencies, the agent's waits
excluded) mean / p50 / p99; TTFT per call p50 / p99; TPOT p50; sessions per hour within the SLO
(every call's TTFT <= ttft_slo_s); prompt tokens recomputed (context a call shared with its
session's previous call and computed again); the prefix hit rate (prompt tokens not computed);
the device KV held for waiting sessions (time-weighted mean and peak, share of the cache).

Load: `rates` (sessions/s), or `loads` x the capacity of `vllm-lru`: the largest session rate at
which it keeps `attainment` of calls within TTFT <= ttft_slo_s (doubling, then bisection).
Sessions come from the trace's report part (`part`; see agent_sessions.split), the first
`num_sessions` of it in file order, each cut after `max_calls` calls if given.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

from tandem.config import SchedulerConfig
from tandem.router import Router
from tandem.sim.build import SimConfig
from tandem.sim.cluster import Cluster
from tandem.sim.cost import make_cost_model
from tandem.sim.metrics import AgentCall, RequestRecord, session_figures
from tandem.sim.run import timed
from tandem.sim.scenarios.common import Log, find_capacity
from tandem.sim.sessions import Session, Turn
from tandem.workload.agent_sessions import AgentSession, load_sessions, replay_plan, split
from tandem.workload.arrivals import make_arrivals

POLICIES = {"vllm-lru": ("fcfs", False), "continuum": ("continuum", True), "infercept": ("infercept", True),
            "tandem": ("augserve", True)}


@dataclass
class AgentOptions:
    trace: str = "../shared/workloads/agent-sessions/claude-code-opus.jsonl"
    part: str = "report"                 # report | fit | all
    num_sessions: int = 40
    max_calls: int | None = None         # cut each session after this many calls
    policies: tuple[str, ...] = tuple(POLICIES)
    rates: tuple[float, ...] = ()        # sessions/s; empty: loads x vllm-lru's capacity
    loads: tuple[float, ...] = (0.25, 0.5, 1.0, 1.5, 2.0)
    attainment: float = 0.9
    start_rate: float = 0.05
    model: str = "llama3-8b"
    hardware: str = "H100-80GB"
    window: int = 131072
    swap_space_gb: float = 256.0
    gpu_memory_utilization: float = 0.9
    person_wait: str = "cap:60"
    ttft_slo_s: float = 5.0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 128
    seed: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def pick_sessions(opts: AgentOptions) -> list[AgentSession]:
    sessions = load_sessions(opts.trace)
    if opts.part != "all":
        fit, report = split(sessions)
        sessions = {"fit": fit, "report": report}.get(opts.part)
        if sessions is None:
            raise ValueError(f"part must be report, fit or all, got {opts.part!r}")
    sessions = sessions[:opts.num_sessions]
    if opts.max_calls is not None:
        sessions = [dataclasses.replace(s, calls=s.calls[:opts.max_calls]) for s in sessions]
    return sessions


def build(agent: list[AgentSession], rate: float, opts: AgentOptions, block_size: int) -> list[Session]:
    """The replay's sessions: turns from `replay_plan`, Poisson starts at `rate`."""
    times = make_arrivals("poisson", rate, random.Random(opts.seed + 1), n=len(agent))
    heads: dict[tuple[int, int], int] = {}
    out = []
    for i, (a, t0) in enumerate(zip(agent, times)):
        plan = replay_plan(a, opts.person_wait, opts.window)
        turns = tuple(Turn(c.new_tokens, c.output_tokens, c.wait_s, c.after_tool, c.keep_tokens if n else None)
                      for n, c in enumerate(plan))
        head_id = heads.setdefault((a.system_tokens, a.tool_tokens), len(heads))
        n_head = (a.system_tokens + a.tool_tokens) // block_size * block_size
        out.append(Session(a.session_id, i, t0, "agent", turns, head=(n_head, head_id)))
    return out


def run_point(cost, agent: list[AgentSession], policy: str, rate: float, opts: AgentOptions) -> dict[str, Any]:
    name, retain = POLICIES[policy]
    sched = SchedulerConfig(max_num_batched_tokens=opts.max_num_batched_tokens, max_num_seqs=opts.max_num_seqs,
                            max_model_len=opts.window, policy=name)
    cfg = SimConfig(scheduler=sched, seed=opts.seed, tool_time_hint="predicted")
    sessions = build(agent, rate, opts, cfg.block_size)
    cluster = Cluster(cost, cfg, 1, Router("round_robin", seed=opts.seed), retain_sessions=retain)
    replica = next(iter(cluster.replicas.values()))
    held = HeldKV(replica.scheduler)
    replica.on_plan = held.sample
    res, wall_s = timed(cluster.run, sessions)
    summary = summarize_agents(res.records, sessions, opts.ttft_slo_s, res.virtual_end_s)
    summary["held_kv_share"] = held.result(res.virtual_end_s)
    stats = replica.scheduler.stats()
    summary["kv_actions"] = stats.kv_actions
    summary["adopted_tokens"] = stats.num_adopted_tokens
    summary["preemptions"] = stats.num_preemptions
    return {"policy": policy, "rate": rate, "sessions": len(sessions), "calls": len(res.records),
            "summary": summary, "wall_s": wall_s, "events": res.num_events}


class HeldKV:
    """Time-weighted share of the device cache held for waiting sessions, sampled at every step."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.area = self.peak = 0.0
        self.last_t: float | None = None
        self.last = 0.0

    def sample(self, now: float, plan) -> None:
        if self.last_t is not None:
            self.area += self.last * (now - self.last_t)
        kv = self.scheduler.kv
        self.last = self.scheduler.sessions.num_held_blocks()[0] / kv.num_blocks
        self.peak = max(self.peak, self.last)
        self.last_t = now

    def result(self, end_s: float) -> dict[str, float]:
        return {"mean": self.area / end_s if end_s > 0 else 0.0, "peak": self.peak}


def summarize_agents(records: list[RequestRecord], sessions: list[Session], ttft_slo_s: float,
                     end_s: float) -> dict[str, Any]:
    calls = [AgentCall(r.request_id.rsplit("-", 1)[0], (r.finished_s or r.arrival_s) - r.arrival_s, r.ttft_s,
                       r.tpot_s, r.completed) for r in records]
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    out = session_figures(calls, end_s, ttft_slo_s)
    out.update({
        "completed_calls": sum(c.ok for c in calls),
        "calls_within_ttft_slo": sum(c.ok and c.ttft_s is not None and c.ttft_s <= ttft_slo_s for c in calls)
        / max(1, len(records)),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "recomputed_tokens": max(0, _reusable_tokens(records, sessions) - cached),
    })
    return out


def _reusable_tokens(records: list[RequestRecord], sessions: list[Session]) -> int:
    """Prompt tokens each call shared with its session's previous call (what an ideal cache
    serves): the previous context, or the part kept, as planned."""
    turns = {s.session_id: s.turns for s in sessions}
    total = 0
    for r in records:
        sid, n = r.request_id.rsplit("-", 1)
        n = int(n)
        if n:
            total += r.prompt_tokens - turns[sid][n].new_tokens
    return total


def run_agents(opts: AgentOptions, log: Log) -> dict[str, Any]:
    for p in opts.policies:
        if p not in POLICIES:
            raise ValueError(f"unknown agents policy {p!r}: one of {', '.join(POLICIES)}")
    cost = make_cost_model(opts.hardware, opts.model, swap_space_gb=opts.swap_space_gb,
                           gpu_memory_utilization=opts.gpu_memory_utilization)
    dep = cost.deployment()
    agent = pick_sessions(opts)
    log(f"{dep.description}; {len(agent)} sessions ({opts.part} part of {opts.trace}); "
        f"window {opts.window}, person waits {opts.person_wait}")
    capacity = None
    rates = list(opts.rates)
    if not rates:
        def measure(rate: float) -> dict[str, Any]:
            return run_point(cost, agent, "vllm-lru", rate, opts)
        capacity = find_capacity(measure, opts.start_rate,
                                 lambda s: s["calls_within_ttft_slo"] >= opts.attainment, log)
        rates = [load * capacity for load in opts.loads]
        log(f"vllm-lru's capacity: {capacity:.3g} sessions/s ({opts.attainment:.0%} of calls within TTFT "
            f"<= {opts.ttft_slo_s:g} s)")
    rows = []
    for rate in rates:
        for p in opts.policies:
            row = run_point(cost, agent, p, rate, opts)
            s = row["summary"]
            log(f"  {rate:.3g} sessions/s {p:<10} LLM time/session mean {s['llm_time_per_session_s']['mean']:.1f} s, "
                f"TTFT p50 {s['ttft_s']['p50']:.2f} p99 {s['ttft_s']['p99']:.2f} s, "
                f"{s['sessions_per_hour_within_slo']:.1f} sessions/h in SLO, hit {s['prefix_hit_rate']:.0%} "
                f"({row['wall_s']:.0f} s)")
            rows.append(row)
    options = dataclasses.asdict(opts)
    return {"scenario": "agents", "options": options, "deployment": dep.description, "capacity": capacity,
            "rates": rates, "rows": rows, "ratios": ratios(rows)}


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per rate: each baseline's mean LLM time per session over tandem's, and tandem's sessions
    per hour within the SLO over each baseline's."""
    out: dict[str, dict[str, float | None]] = {}
    for rate in sorted({r["rate"] for r in rows}):
        by = {r["policy"]: r["summary"] for r in rows if r["rate"] == rate}
        t = by.get("tandem")
        if t is None:
            continue
        e: dict[str, float | None] = {}
        for p, s in by.items():
            if p == "tandem":
                continue
            tm, pm = t["llm_time_per_session_s"]["mean"], s["llm_time_per_session_s"]["mean"]
            e[f"llm_time_{p}_over_tandem"] = pm / tm if tm else None
            ps = s["sessions_per_hour_within_slo"]
            e[f"sessions_in_slo_tandem_over_{p}"] = t["sessions_per_hour_within_slo"] / ps if ps else None
        out[f"{rate:.4g}"] = e
    return out


def agents_tables(res: dict[str, Any]) -> str:
    lines = [f"agents: {res['deployment']}; window {res['options']['window']}; "
             f"person waits {res['options']['person_wait']}; TTFT SLO {res['options']['ttft_slo_s']} s"]
    if res["capacity"]:
        lines.append(f"vllm-lru's capacity: {res['capacity']:.3g} sessions/s")
    lines.append("| sessions/s | policy | LLM s/session mean | p50 | p99 | TTFT p50 s | TTFT p99 s | TPOT p50 ms | "
                 "sessions/h in SLO | prefix hit | recomputed tokens | held KV mean/peak |")
    lines.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["rows"]:
        s = r["summary"]
        llm, ttft = s["llm_time_per_session_s"], s["ttft_s"]
        tpot = s["tpot_s"]["p50"]
        lines.append(f"| {r['rate']:.3g} | {r['policy']} | {llm['mean']:.1f} | {llm['p50']:.1f} | {llm['p99']:.1f} | "
                     f"{ttft['p50']:.2f} | {ttft['p99']:.2f} | {(tpot or 0) * 1e3:.0f} | "
                     f"{s['sessions_per_hour_within_slo']:.1f} | {s['prefix_hit_rate']:.1%} | "
                     f"{s['recomputed_tokens']:,} | {s['held_kv_share']['mean']:.0%}/{s['held_kv_share']['peak']:.0%} |")
    for rate, e in res["ratios"].items():
        lines.append(f"{rate} sessions/s: " + ", ".join(f"{k} {v:.2f}x" for k, v in e.items() if v is not None))
    return "\n".join(lines)
