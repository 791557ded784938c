"""vLLM-style survival-probability slot admission (`SurvivalAdmission`, spec policy "survival"):
per-position EMA 0.8 estimates, slots admitted best-first while the step-cost profile says they pay."""

from __future__ import annotations

import pytest

from tandem.config import SpecConfig
from tandem.errors import ConfigError
from tandem.sampling_params import SamplingParams
from tandem.sched.cost_model import StepCostModel
from tandem.sched.spec_length import SurvivalAdmission, make_length_policy
from tandem.types import Request


def reqs(n: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100)) for i in range(n)]


def flat_cost() -> StepCostModel:
    return StepCostModel(profile=[(1, 0.030), (8, 0.031), (16, 0.032), (64, 0.034)])


def steep_cost() -> StepCostModel:
    return StepCostModel(profile=[(1, 0.030), (8, 0.24), (16, 0.48), (64, 1.92)])


def test_estimates_are_an_ema_of_judged_positions_only():
    policy = SurvivalAdmission(4, flat_cost(), ema=0.8, prior=0.5)
    r = reqs(1)[0]
    policy.observe_request(r, num_drafted=4, num_accepted=1)    # 1 accepted, 2 rejected, 3-4 not judged
    est = policy.estimates(r.request_id)
    assert est[0] == pytest.approx(0.8 * 0.5 + 0.2)
    assert est[1] == pytest.approx(0.8 * 0.5)
    assert est[2:] == pytest.approx([0.5, 0.5])


def test_new_requests_start_from_the_batch_wide_estimate():
    policy = SurvivalAdmission(4, flat_cost())
    a, b = reqs(2)
    for _ in range(30):
        policy.observe_request(a, 4, 4)
    assert policy.estimates(b.request_id)[0] > 0.95          # learned from a's outcomes
    policy.forget(a.request_id)
    assert a.request_id not in policy._est


def test_slots_go_to_the_likeliest_survivors_first():
    policy = SurvivalAdmission(8, flat_cost())
    good, bad = reqs(2)
    for _ in range(20):
        policy.observe_request(good, 8, 8)
        policy.observe_request(bad, 8, 0)
    k_good, k_bad = policy.choose([good, bad], [8, 8], num_base_tokens=2)
    assert k_good == 8 and k_bad < k_good


def test_no_slots_when_the_marginal_slot_does_not_pay():
    policy = SurvivalAdmission(8, steep_cost())
    rs = reqs(16)
    for r in rs:
        for _ in range(10):
            policy.observe_request(r, 4, 1)
    assert policy.choose(rs, [8] * 16, num_base_tokens=16) == [0] * 16


def test_lengths_respect_limits_and_follow_outcomes_without_a_dead_band():
    policy = SurvivalAdmission(8, flat_cost())
    rs = reqs(3)
    for r in rs:
        for _ in range(20):
            policy.observe_request(r, 8, 8)
    assert policy.choose(rs, [0, 2, 8], num_base_tokens=3) == [0, 2, 8]
    policy.cost = StepCostModel(profile=[(n, 0.03 + 0.01 * n) for n in (1, 8, 16, 32, 64)])
    assert policy.choose(rs, [0, 2, 8], num_base_tokens=3) == [0, 2, 8]
    for _ in range(3):                                        # a few rejections cut the length at once
        policy.observe_request(rs[2], 8, 0)
    assert policy.estimates(rs[2].request_id)[0] < 0.6
    assert policy.choose(rs, [0, 2, 8], num_base_tokens=3)[2] < 8


def test_make_length_policy_knows_survival():
    policy = make_length_policy(SpecConfig(policy="survival", max_draft_tokens=4), flat_cost())
    assert isinstance(policy, SurvivalAdmission) and policy.max_len == 4
    with pytest.raises(ConfigError):
        SpecConfig(policy="nonsense")
