"""Parity: one workload (tool pauses with preserve / swap / discard, speculation, preemptions under
a small KV cache) through the real `LLMEngine` and through the simulator gives the same plans.

The engine runs with an honest test double for its executor: the simulator's own `SimExecutor`
(same draws, same cost model) whose step durations advance the engine's clock, a virtual clock;
its tool runtime is the real one in scripted mode. So the only thing that differs between the two
runs is the driver: the engine's step loop against the simulator's event loop.
"""

from __future__ import annotations

import pytest

from tandem.bench.replay import VirtualClock, replay
from tandem.config import SchedulerConfig, SpecConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.tool_runtime import ToolRuntime
from tandem.sim.build import SimConfig, build_scheduler
from tandem.sim.cost import Deployment, make_cost_model
from tandem.sim.engine import SimEngine
from tandem.sim.executor import FILL_TOKEN, SimExecutor
from tandem.sim.workload import WorkloadSpec, build_workload
from tandem.tools.registry import ToolRegistry
from tandem.types import StepPlan

DEPLOYMENT = Deployment(num_kv_blocks=150, num_host_blocks=48, swap_s_per_token=2e-6, description="tiny")


class FillTokenizer:
    """Tool results as FILL tokens, like the simulator's (the scripted runtime only encodes filler text)."""

    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [FILL_TOKEN] * max(1, len(text.split()))


class ClockedExecutor:
    """The engine's executor: the simulator's draws, with its step time added to the virtual clock."""

    def __init__(self, sim: SimExecutor, clock: VirtualClock, log: list) -> None:
        self.sim, self.clock, self.log = sim, clock, log

    def execute(self, plan: StepPlan):
        self.log.append((self.clock.now(), digest(plan)))
        result, duration = self.sim.step(plan)
        self.clock.advance(duration)
        return result

    def release(self, request_ids: list[str]) -> None:
        self.sim.release(request_ids)


def digest(plan: StepPlan) -> tuple:
    return (tuple((s.request_id, s.start, s.num_tokens, s.num_draft_tokens) for s in plan.seqs),
            tuple(plan.swap_out), tuple(plan.swap_in), tuple(plan.preempted_ids))


def setup(policy: str, spec_policy: str):
    cost = make_cost_model("H100-80GB", "llama3-8b", "llama3-1b")
    sched = SchedulerConfig(max_num_batched_tokens=192, max_num_seqs=12, max_model_len=2048, policy=policy)
    spec = SpecConfig(method="draft", draft_model="simulated", policy=spec_policy, max_draft_tokens=4)
    cfg = SimConfig(scheduler=sched, spec=spec, seed=5)
    wl = WorkloadSpec(dataset="augmented", num_requests=24, rate=6.0, arrival="gamma", cv=2.0)
    return cost, cfg, build_workload(wl, seed=11)


def run_sim(cost, cfg, requests):
    log: list = []
    sched = build_scheduler(cfg, cost, DEPLOYMENT)
    engine = SimEngine(sched, SimExecutor(cost, cfg.seed, cfg.position_decay), cfg,
                       on_plan=lambda now, plan: log.append((now, digest(plan))))
    records = engine.run(requests)
    return log, records, sched


def run_engine(cost, cfg, requests):
    log: list = []
    clock = VirtualClock()
    sim = SimExecutor(cost, cfg.seed, cfg.position_decay)
    sched = build_scheduler(cfg, cost, DEPLOYMENT)
    tools = ToolRuntime(ToolRegistry(), FillTokenizer())
    engine = LLMEngine(sched, ClockedExecutor(sim, clock, log), None, vocab_size=10**6,
                       max_model_len=cfg.scheduler.max_model_len, clock=clock.now, tools=tools)
    try:
        records = replay(engine, requests, clock,
                         on_add=lambda r: sim.add_request(r.request_id, r.acceptance))
    finally:
        tools.shutdown()
    return log, records, sched


@pytest.mark.parametrize("policy,spec_policy", [("infercept", "adaptive"), ("augserve", "fixed")])
def test_engine_and_simulator_make_the_same_plans(policy, spec_policy):
    cost, cfg, requests = setup(policy, spec_policy)
    sim_log, sim_records, sim_sched = run_sim(cost, cfg, requests)
    eng_log, eng_records, eng_sched = run_engine(cost, cfg, requests)
    assert len(sim_log) > 200
    for i, (a, b) in enumerate(zip(sim_log, eng_log)):
        assert a == b, f"step {i} differs"
    assert len(sim_log) == len(eng_log)
    # The workload exercised what parity is about: every KV action, swaps, preemptions, drafts.
    actions = sim_sched.pauses.num_actions
    assert min(actions.values()) > 5 and sim_sched.num_preemptions > 20
    assert sum(len(d[2]) for _, d in sim_log) > 100 and sim_sched.spec_stats.num_accepted_tokens > 1000
    assert sim_sched.num_preemptions == eng_sched.num_preemptions
    assert actions == eng_sched.pauses.num_actions
    for s, e in zip(sim_records, eng_records):
        assert (s.request_id, s.output_tokens, s.first_token_s, s.finished_s, s.num_tool_calls) == \
            (e.request_id, e.output_tokens, e.first_token_s, e.finished_s, e.num_tool_calls)
