"""The simulator's own speed on the augmented mixture (for `tandem simulate speed` and its test)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.sim.build import SimConfig
from tandem.sim.cost import make_cost_model
from tandem.sim.run import simulate
from tandem.sim.scenarios.common import default_scheduler
from tandem.sim.workload import WorkloadSpec, build_workload


def measure_speed(num_requests: int, rate: float, policy: str = "fcfs-discard", hardware: str = "H100-80GB",
                  model: str = "llama3-8b", seed: int = 0) -> dict[str, Any]:
    """Simulate `num_requests` of the augmented mixture at a Poisson `rate`; the run's figures and speed."""
    cost = make_cost_model(hardware, model)
    cfg = SimConfig(scheduler=dataclasses.replace(default_scheduler(), policy=policy), seed=seed)
    reqs = build_workload(WorkloadSpec(dataset="augmented", num_requests=num_requests, rate=rate), seed)
    return simulate(cost, cfg, reqs).as_dict()
