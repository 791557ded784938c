"""Scheduling policies by name, so baselines and AugServe run on the same engine and simulator.

    fcfs / fcfs-discard   vLLM: a tool call ends the request; its KV is discarded (the prefix cache keeps
                          what it keeps) and the continuation queues as a new arrival at its resume time
    infercept             FCFS by original arrival + min-waste KV handling during pauses (preserve /
                          swap / discard)
    augserve-stage1       Stage I ordering (predicted service time, fixed at arrival) + min-waste
    augserve-stage2       + Stage II live re-ordering with anti-starvation
    augserve              + the dynamic token budget and first tokens before tool results in a step
                          (the full system)
    continuum             program-level FCFS (a session's calls rank by its first arrival); a finished
                          call's KV pinned on the device for a time-to-live (sched/continuum.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config import POLICY_NAMES
from tandem.sched.budget import DynamicBudget, StaticBudget, TokenBudget
from tandem.sched.continuum import ContinuumTTL, ProgramFCFS
from tandem.sched.cost_model import StepCostModel
from tandem.sched.ordering import FCFS, AugServeOrdering, Ordering
from tandem.sched.predictor import OutputLengthPredictor, ToolStats
from tandem.sched.pause_kv import FixedAction, KVPausePolicy, MinWaste
from tandem.types import KVAction


@dataclass
class SchedulingPolicy:
    name: str
    ordering: Ordering
    budget: TokenBudget
    pause: KVPausePolicy
    lengths: OutputLengthPredictor = field(default_factory=OutputLengthPredictor)
    tools: ToolStats = field(default_factory=ToolStats)
    # When the head of the queue waits for free blocks while requests run, admit past it the waiting
    # requests that kept their KV across a tool call (AugServe: its orderings rank such a request by
    # what it has left to do, often below newer ones; held back, its KV blocks the head). FCFS
    # policies stop at the head (their kept-KV requests are old and near it).
    kept_kv_passes: bool = False
    # A finished request with a session key leaves its KV held for the session's next call, under
    # the pause rule (sched/retention.py). vLLM-like FCFS frees it (the prefix cache keeps what it keeps).
    holds_sessions: bool = False
    # How long a session's context is held on the device (Continuum's TTL rule); None: the pause
    # rule decides, as for a tool call.
    hold_ttl: ContinuumTTL | None = None
    # A step that serves a prompt's first token leaves out, for one step per resume, the prefills of
    # requests past their first token (tool results, recomputed contexts): sched/composition.py.
    first_tokens_first: bool = False


def make_policy(name: str, max_num_batched_tokens: int, cost: StepCostModel, swap_s_per_token: float = 5e-6,
                max_wait_s: float = 30.0, min_budget_tokens: int | None = None,
                trained: dict | None = None) -> SchedulingPolicy:
    """`trained`: predictor state trained offline (`tandem predictor train`: {"lengths", "tools"});
    AugServe's policies start from it, InferCept from its tool statistics (InferCept profiles tool
    durations offline too); without it they start cold. vLLM-like FCFS predicts nothing."""
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    static = StaticBudget(max_num_batched_tokens)
    if name in ("fcfs", "fcfs-discard"):
        return SchedulingPolicy(name, FCFS(resubmit_on_resume=True), static, FixedAction(KVAction.DISCARD))
    lengths = OutputLengthPredictor.from_state(trained["lengths"]) if trained else OutputLengthPredictor()
    tools = ToolStats.from_state(trained["tools"]) if trained else ToolStats()
    min_waste = MinWaste(cost, swap_s_per_token)
    if name == "infercept":
        return SchedulingPolicy(name, FCFS(), static, min_waste, tools=tools, holds_sessions=True)
    if name == "continuum":
        return SchedulingPolicy(name, ProgramFCFS(), static, FixedAction(KVAction.PRESERVE), tools=tools,
                                holds_sessions=True, hold_ttl=ContinuumTTL(cost))
    ordering = AugServeOrdering(lengths, tools, stage2=name != "augserve-stage1", max_wait_s=max_wait_s,
                                decode_token_s=cost.time(1), prefill_token_s=cost.per_token_s)
    budget: TokenBudget = static
    if name == "augserve":
        low = min(max_num_batched_tokens, min_budget_tokens or max(16, max_num_batched_tokens // 8))
        budget = DynamicBudget(low, max_num_batched_tokens)
    return SchedulingPolicy(name, ordering, budget, min_waste, lengths, tools, kept_kv_passes=True,
                            holds_sessions=True, first_tokens_first=name == "augserve")
