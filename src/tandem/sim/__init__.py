"""Discrete-event simulator of a Tandem deployment (no torch, no wall clock in the simulated world).

The SAME scheduler, KV manager, draft-length and scheduling policies as the engine, driven by an
event loop in virtual time; a `SimExecutor` draws what the model would do (draft acceptance from
per-request profiles, output lengths from the workload) and a cost model says how long each step
takes (calibrated to this engine on this machine, or an analytic roofline for A100/H100/H200).

    from tandem.sim import SimConfig, WorkloadSpec, build_workload, make_cost_model, simulate
    cost = make_cost_model("H100-80GB", "llama3-8b")
    run = simulate(cost, SimConfig(), build_workload(WorkloadSpec(rate=5.0, num_requests=500), seed=0))
    run.summary["ttft_s"]["p99"]
"""

from __future__ import annotations

from tandem.sim.build import SimConfig, build_scheduler
from tandem.sim.cost import CostModel, make_cost_model
from tandem.sim.engine import SimEngine
from tandem.sim.executor import SimExecutor
from tandem.sim.metrics import SLO, RequestRecord, summarize
from tandem.sim.run import SimRun, saturation_capacity, simulate
from tandem.sim.workload import SimRequest, WorkloadSpec, build_workload

__all__ = ["SimConfig", "build_scheduler", "CostModel", "make_cost_model", "SimEngine", "SimExecutor", "SLO",
           "RequestRecord", "summarize", "SimRun", "saturation_capacity", "simulate", "SimRequest",
           "WorkloadSpec", "build_workload"]
