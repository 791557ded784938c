"""Pieces every scenario uses: named runs (a scheduling policy and a draft-length policy), a grid
of runs over request rates on one deployment, capacity search, and the SLO in use.

A row of results is a plain dict: deployment, rate, label, the run's summary, counters and the
simulator's speed; scenarios add their own comparisons on top. No I/O here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from tandem.config import SchedulerConfig, SpecConfig
from tandem.sim.build import SimConfig, typical_shape
from tandem.sim.cost.base import CostModel
from tandem.sim.metrics import SLO, RequestRecord
from tandem.sim.run import simulate
from tandem.sim.workload import WorkloadSpec, build_workload

Log = Callable[[str], None]
Extra = Callable[[list[RequestRecord]], dict[str, Any]]


@dataclass(frozen=True)
class RunSpec:
    label: str
    policy: str = "fcfs"                 # scheduling policy (tandem.sched.policies)
    spec: SpecConfig | None = None       # draft-length policy; None: no speculation (and no draft model)


def run_config(base: SimConfig, run: RunSpec) -> SimConfig:
    sched = dataclasses.replace(base.scheduler, policy=run.policy)
    return dataclasses.replace(base, scheduler=sched, spec=run.spec)


def run_one(cost: CostModel, base: SimConfig, run: RunSpec, workload: WorkloadSpec, rate: float | None,
            seed: int, slo: SLO | None, extra: Extra | None = None) -> dict[str, Any]:
    """One run: `rate` overrides the workload's (None keeps it); `extra(records)` adds fields."""
    wl = workload if rate is None else dataclasses.replace(workload, rate=rate)
    result = simulate(cost, run_config(base, run), build_workload(wl, seed), slo)
    row = {"deployment": cost.name, "rate": wl.rate, "label": run.label, "policy": run.policy,
           "spec_policy": run.spec.policy if run.spec else None, **result.as_dict()}
    if extra is not None:
        row.update(extra(result.records))
    return row


def unloaded_step_s(cost: CostModel, context_tokens: int = 512) -> float:
    """One decode step of one request: the deployment's floor on time per output token."""
    return cost.step_time_s(typical_shape(1, 1, context_tokens))


def scale_slo(cost: CostModel, ttft_s: float, norm_latency_factor: float) -> SLO:
    """TTFT <= ttft_s and normalized latency <= factor x the unloaded decode step."""
    return SLO(ttft_s=ttft_s, normalized_latency_s=norm_latency_factor * unloaded_step_s(cost))


def find_capacity(measure: Callable[[float], dict[str, Any]], start_rate: float, ok: Callable[[dict], bool],
                  log: Log, max_doublings: int = 8, refinements: int = 2) -> float:
    """The largest rate at which `ok(measure(rate)["summary"])` holds: double from `start_rate`
    until it fails, then bisect `refinements` times (geometrically) between the last good and bad rates."""
    good, bad = None, None
    rate = start_rate
    for _ in range(max_doublings):
        passed = ok(measure(rate)["summary"])
        log(f"  capacity probe: {rate:.3g} req/s -> {'ok' if passed else 'over'}")
        if passed:
            good, rate = rate, rate * 2
        else:
            bad = rate
            if good is not None:
                break
            rate = rate / 2
    if good is None:
        raise ValueError(f"no probed rate met the criterion (lowest tried {rate:.3g} req/s)")
    for _ in range(refinements if bad is not None else 0):
        mid = (good * bad) ** 0.5
        passed = ok(measure(mid)["summary"])
        log(f"  capacity probe: {mid:.3g} req/s -> {'ok' if passed else 'over'}")
        good, bad = (mid, bad) if passed else (good, mid)
    return good


def default_scheduler(max_num_batched_tokens: int = 4096, max_num_seqs: int = 256,
                      max_model_len: int = 8192) -> SchedulerConfig:
    """vLLM-like GPU serving defaults (chunked prefill, 256 sequences)."""
    return SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len)
