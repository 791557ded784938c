"""One simulated run end to end: wire the deployment, replay the workload, summarize; and the
saturation-capacity probe the scenarios use to place their request rates.

The only wall clock in tandem.sim is here, and it measures the simulator itself (events per
second), never the simulated world.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tandem.sim.build import SimConfig, build_scheduler
from tandem.sim.cost.base import CostModel
from tandem.sim.engine import SimEngine
from tandem.sim.executor import SimExecutor
from tandem.sim.metrics import SLO, RequestRecord, summarize
from tandem.sim.workload import SimRequest
from tandem.types import StepPlan


@dataclass
class SimRun:
    summary: dict[str, Any]
    counters: dict[str, Any]
    speed: dict[str, float]
    deployment: dict[str, Any]
    records: list[RequestRecord] = field(default_factory=list)

    def as_dict(self, keep_records: bool = False) -> dict[str, Any]:
        out = {"summary": self.summary, "counters": self.counters, "sim": self.speed,
               "machine": self.deployment}
        if keep_records:
            out["records"] = [r.as_dict() for r in self.records]
        return out


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """(fn(*args), the wall seconds it took): how long the simulator itself ran (this module is the
    one place that reads the wall clock; nothing inside the simulated world does)."""
    wall = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - wall


def simulate(cost: CostModel, cfg: SimConfig, requests: list[SimRequest], slo: SLO | None = None,
             on_plan: Callable[[float, StepPlan], None] | None = None) -> SimRun:
    """Run the workload on the modelled deployment; returns its figures, counters and speed."""
    dep = cost.deployment()
    scheduler = build_scheduler(cfg, cost, dep)
    spec = cfg.spec
    executor = SimExecutor(cost, cfg.seed, cfg.position_decay, spec.frontier_size if spec else 0,
                           spec.overlap if spec else False, cfg.step_jitter)
    engine = SimEngine(scheduler, executor, cfg, on_plan)
    wall = time.perf_counter()
    records = engine.run(requests)
    wall = time.perf_counter() - wall
    stats = scheduler.stats()
    counters = {"steps": engine.num_steps, "preemptions": scheduler.num_preemptions,
                "kv_actions": stats.kv_actions, "kept_kv_discarded": stats.num_discarded_kept,
                "recompute_tokens": stats.num_recompute_tokens,
                "busy_s": executor.busy_s, "virtual_end_s": engine.loop.now}
    chooser = scheduler.drafts.run_ahead
    if chooser is not None:
        counters["run_ahead"] = {"steps_ahead": chooser.num_ahead_steps, "steps_chosen": chooser.num_steps,
                                 "drafted": executor.ahead_drafted, "verified": executor.ahead_verified}
    speed = {"events": engine.loop.num_events, "wall_s": wall,
             "events_per_s": engine.loop.num_events / max(wall, 1e-9)}
    return SimRun(summarize(records, slo), counters, speed, dataclasses.asdict(dep), records)


def saturation_capacity(cost: CostModel, cfg: SimConfig, requests: list[SimRequest]) -> float:
    """Requests/s the deployment sustains when every request is queued at once: finished requests
    between the 10th and 90th percentile finish times, over that interval (ramp and tail left out)."""
    burst = [dataclasses.replace(r, arrival_s=0.0) for r in requests]
    ends = sorted(r.finished_s for r in simulate(cost, cfg, burst).records if r.completed)
    if len(ends) < 10:
        raise ValueError("capacity probe needs at least 10 finished requests")
    i, j = len(ends) // 10, (9 * len(ends)) // 10
    return (j - i) / max(ends[j] - ends[i], 1e-9)
