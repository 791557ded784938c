"""Continuum, the agents baseline (sched/continuum.py): the TTL maximizes P(gap <= tau) * B - m *
E[min(gap, tau)] over the gaps seen (an exponential prior before enough are seen), a session's
context stays on the device until its TTL runs out, and calls rank by their session's first arrival."""

from __future__ import annotations

import pytest

from tandem.config import RetentionConfig, SchedulerConfig
from tandem.kv import KVCacheManager
from tandem.sampling_params import SamplingParams
from tandem.sched.continuum import ContinuumTTL, ProgramFCFS
from tandem.sched.cost_model import StepCostModel
from tandem.sched.policies import make_policy
from tandem.sched.scheduler import Scheduler
from tandem.types import KVAction, Request, RequestStatus, SessionInfo, StepResult

COST = StepCostModel(base_s=0.03, per_token_s=0.0025)     # recomputing 1,000 tokens: 2.53 s


def test_the_ttl_weighs_the_chance_of_a_return_against_the_memory_it_pins():
    rule = ContinuumTTL(COST, prior_mean_s=60.0)
    b = COST.time(1000)
    assert b == pytest.approx(2.53)
    # cold: exponential prior, J = (1 - e^(-tau/60)) (B - m 60): pin to the ceiling or not at all
    assert rule.ttl_s(1000, share=0.5, usage=0.0, ceiling_s=600) == 600     # an idle cache loses nothing
    assert rule.ttl_s(1000, share=0.5, usage=1.0, ceiling_s=600) == 0       # 2.53 < 0.5 * 60
    for gap in [1.0] * 9 + [100.0]:
        rule.observe(gap)
    # J(1) = 0.9 B - 0.5 * 1 = 1.777;  J(100) = B - 0.5 * (0.9 + 10) = -2.92: wait for the short gaps only
    assert rule.ttl_s(1000, share=0.5, usage=1.0, ceiling_s=600) == 1.0
    assert rule.ttl_s(1000, share=0.5, usage=0.0, ceiling_s=600) == 100.0   # free memory: wait for all
    assert rule.ttl_s(1000, share=0.5, usage=0.0, ceiling_s=50) == 1.0      # never past the ceiling
    assert rule.ttl_s(10, share=0.5, usage=1.0, ceiling_s=600) == 0         # cheaper to recompute


BS = 4


def make(num_blocks: int = 32) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=num_blocks * BS, watermark=0.0,
                          policy="continuum", retention=RetentionConfig())
    return Scheduler(cfg, KVCacheManager(num_blocks, BS, enable_prefix_caching=False, num_host_blocks=64),
                     policy=make_policy("continuum", 256, COST))


def call(rid, tokens, at, key="s1"):
    return Request(rid, list(tokens), SamplingParams(max_tokens=2, ignore_eos=True), arrival_time=at,
                   session=SessionInfo(key, "k", None))


def run(sched, now):
    while sched.has_work():
        plan = sched.schedule(now)
        sched.update(plan, StepResult({s.request_id: [7] for s in plan.seqs if s.sample}), now)


def test_a_pinned_context_stays_on_the_device_until_its_ttl_runs_out():
    sched = make()
    ttl = sched.policy.hold_ttl
    for _ in range(8):
        ttl.observe(1.0)                              # every gap so far: 1 s
    c0 = call("c0", range(1, 23), 0.0)
    sched.add_request(c0)
    run(sched, 0.0)
    assert c0.status is RequestStatus.FINISHED and sched.sessions.num_held == 1
    assert sched.pauses.num_actions[KVAction.PRESERVE] == 1 and sched.kv.num_blocks_of("c0") == 6
    # B = 0.0875 s for 23 tokens, m = 6/32 of the cache x 6/32 used: J(1) = 0.0875 - 0.035 > 0
    sched.expire_sessions(0.9)
    assert sched.sessions.num_held == 1               # inside its TTL (1 s)
    sched.expire_sessions(1.1)
    assert sched.sessions.num_held == 0 and sched.kv.num_free_blocks == 32 and sched.sessions.num_expired == 1
    c1 = call("c1", c0.token_ids + [50], 1.5)         # too late: recomputed, and its gap is learned
    sched.add_request(c1)
    assert c1.num_computed_tokens == 0 and list(ttl.gaps)[-1] == pytest.approx(1.5 - 0.0)


def test_calls_rank_by_their_sessions_first_arrival():
    sched = make()
    a0 = call("a0", range(1, 9), 0.0, key="a")
    sched.add_request(a0)
    run(sched, 0.0)
    b0 = call("b0", range(100, 108), 1.0, key="b")     # a new program, arrived before a's next call
    a1 = call("a1", a0.token_ids + [9], 2.0, key="a")
    sched.add_request(b0)
    sched.add_request(a1)
    assert a1.times.program_start == 0.0 and b0.times.program_start == 1.0
    assert [r.request_id for r in sched.waiting] == ["a1", "b0"]
    order = ProgramFCFS()
    assert order.key(a1, 2.0) < order.key(b0, 2.0)
