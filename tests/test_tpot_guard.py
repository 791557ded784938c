"""TpotGuard: the step budget lowered so that decodes' mean time per output token stays within the
target while prompts are prefilled; no cap without decodes, or once a prompt has waited past the
TTFT guard. Pure Python: a known step-cost line, virtual time."""

from __future__ import annotations

import pytest

from tandem.config import SchedulerConfig
from tandem.errors import ConfigError
from tandem.kv import KVCacheManager
from tandem.sampling_params import SamplingParams
from tandem.sched.budget import TpotGuard
from tandem.sched.cost_model import StepCostModel
from tandem.sched.scheduler import Scheduler
from tandem.types import Request, StepResult


def line_cost(base_s: float = 0.02, per_token_s: float = 0.001) -> StepCostModel:
    """A cost model that predicts exactly base + per_token * n (anchored at many sizes)."""
    return StepCostModel(profile=[(n, base_s + per_token_s * n) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)])


def test_no_decodes_no_cap():
    guard = TpotGuard(0.05, line_cost())
    assert guard.cap(512, num_decodes=0, oldest_wait_s=0.0) == 512
    assert guard.num_capped == 0


def test_the_first_step_fits_the_target():
    guard = TpotGuard(0.05, line_cost())                      # 0.02 + 0.001 n <= 0.05  ->  n <= 30
    assert guard.cap(512, num_decodes=4, oldest_wait_s=0.0) == 30
    assert guard.num_capped == 1


def test_slack_from_fast_steps_is_spent_on_prefill():
    guard = TpotGuard(0.05, line_cost(), horizon=8)
    for _ in range(200):
        guard.observe(0.03, had_decodes=True)                  # decode-only steps: 20 ms under target
    # allowance = T + (h - 1)(T - A) = 0.05 + 7 * 0.02 = 0.19 s  ->  n <= 170
    assert guard.allowance_s() == pytest.approx(0.19)
    assert guard.cap(512, num_decodes=4, oldest_wait_s=0.0) == 170
    assert guard.cap(100, num_decodes=4, oldest_wait_s=0.0) == 100    # a budget that fits stands


def test_steps_without_decodes_do_not_count():
    guard = TpotGuard(0.05, line_cost())
    guard.observe(5.0, had_decodes=False)
    assert guard.average_s is None


def test_prompts_always_advance():
    guard = TpotGuard(0.05, line_cost())
    for _ in range(100):
        guard.observe(0.5, had_decodes=True)                   # decodes alone are far over the target
    assert guard.allowance_s() < 0
    assert guard.cap(512, num_decodes=10, oldest_wait_s=0.0) == 10 + guard.min_chunk
    assert guard.cap(12, num_decodes=10, oldest_wait_s=0.0) == 12


def test_a_prompt_waiting_past_the_ttft_guard_lifts_the_cap():
    guard = TpotGuard(0.05, line_cost(), ttft_guard_s=1.0)
    assert guard.cap(512, num_decodes=4, oldest_wait_s=0.99) == 30
    assert guard.cap(512, num_decodes=4, oldest_wait_s=1.0) == 512


def test_the_mean_step_time_holds_the_target_while_prefill_demand_lasts():
    """Virtual time: decodes run every step, an endless queue of prompt tokens takes what the cap
    allows. The mean over steps stays within the target, and prefill still gets ~(T - t_decode) /
    per-token seconds of tokens per step on average."""
    cost = line_cost(0.02, 0.001)
    guard = TpotGuard(0.1, cost, horizon=16)
    decodes, durations, prefilled = 8, [], 0
    for _ in range(2000):
        n = guard.cap(512, num_decodes=decodes, oldest_wait_s=0.0)
        t = cost.time(n)
        guard.observe(t, had_decodes=True)
        durations.append(t)
        prefilled += n - decodes
    mean = sum(durations[200:]) / len(durations[200:])
    assert mean <= 0.1 * 1.01
    per_step = prefilled / len(durations)
    assert per_step > 0.9 * (0.1 - cost.time(decodes)) / 0.001


@pytest.mark.parametrize("kw", [dict(target_tpot_s=0.0), dict(target_tpot_s=-1.0), dict(ttft_guard_s=0.0)])
def test_bad_targets_are_config_errors(kw):
    with pytest.raises(ConfigError):
        SchedulerConfig(**kw)


def make(target_tpot_s, budget=512) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=1024,
                          target_tpot_s=target_tpot_s, ttft_guard_s=10.0)
    return Scheduler(cfg, KVCacheManager(512, 16, True), cost=line_cost())


def run_step(sched: Scheduler, now: float) -> int:
    """One step that takes exactly what the cost line says (so the learned model stays on it)."""
    plan = sched.schedule(now)
    result = StepResult()
    for s in plan.seqs:
        if s.sample:
            result.sampled_token_ids[s.request_id] = [7]
    sched.update(plan, result, now + line_cost().time(plan.num_tokens))
    return plan.num_tokens


@pytest.mark.parametrize("target, second_step_tokens", [(None, 1 + 400), (0.05, 30)])
def test_the_scheduler_caps_a_prefill_beside_a_decode(target, second_step_tokens):
    sched = make(target)
    params = SamplingParams(max_tokens=50, temperature=0.0)
    sched.add_request(Request("a", [1] * 100, params, arrival_time=0.0))
    assert run_step(sched, 0.0) == 100                    # alone: the whole prompt, nothing capped
    sched.add_request(Request("b", [2] * 400, params, arrival_time=0.02))
    assert run_step(sched, 0.02) == second_step_tokens    # a decodes; b's prompt is chunked to fit
    if target is not None:
        assert sched.tpot_guard.num_capped == 1
