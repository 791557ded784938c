"""Property test (hypothesis) of the scheduler and KV manager: random programs of arrivals, steps,
tool pauses (preserve / swap / discard, or each policy's own choice), resumes and aborts, on a KV
cache small enough to force preemption. After every operation:

- no request is lost: each live request is in exactly one of waiting / running / paused, and the
  scheduler tracks nothing else;
- no block is used twice: every block's reference count equals the number of block tables that
  hold it (prefix sharing is the only way to appear twice), free blocks are exactly those with no
  reference, and no table names a block twice;
- paused KV is accounted: blocks held by paused requests are those of the preserved ones, a
  discarded request holds none, a swapped one holds host blocks instead;
- each plan covers what it computes: a request appears once, with blocks for every position.
At the end every paused request resumes and the queue drains: every request not aborted finishes
with all its tokens, and every device and host block is free again.

Short in CI (TANDEM_FUZZ_EXAMPLES, default 150 programs); set it higher to run long.
"""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.config import SchedulerConfig
from tandem.kv import KVCacheManager
from tandem.sampling_params import SamplingParams
from tandem.sched.policies import POLICY_NAMES
from tandem.sched.scheduler import Scheduler
from tandem.sched.pause_kv import FixedAction
from tandem.types import FinishReason, KVAction, Request, RequestStatus, StepResult

BS = 4
EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "150"))

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 24), st.integers(1, 10), st.integers(0, 2)),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("pause"), st.integers(0, 63)),
    st.tuples(st.just("resume"), st.integers(0, 63), st.integers(0, 6)),
    st.tuples(st.just("abort"), st.integers(0, 63)),
), max_size=60)


def check_invariants(sched: Scheduler, live: set[str]) -> None:
    kv = sched.kv
    waiting = {r.request_id for r in sched.waiting}
    running = {r.request_id for r in sched.running}
    paused = set(sched.pauses.paused)
    assert not (waiting & running or waiting & paused or running & paused)
    assert waiting | running | paused == set(sched.requests) == live
    for rid, r in sched.requests.items():
        expected = {RequestStatus.WAITING: waiting, RequestStatus.RUNNING: running,
                    RequestStatus.PAUSED_TOOL: paused}[r.status]
        assert rid in expected
    tables = {rid: kv.block_ids(rid) for rid in kv._blocks}
    assert set(tables) <= live, "a finished request still holds blocks"
    uses = Counter(b for ids in tables.values() for b in ids)
    for ids in tables.values():
        assert len(ids) == len(set(ids)), "a block table names a block twice"
    for block in kv.pool.blocks:
        assert block.ref_cnt == uses.get(block.block_id, 0), f"block {block.block_id} miscounted"
    assert kv.num_free_blocks == sum(1 for b in kv.pool.blocks if b.ref_cnt == 0)
    held = 0
    for rid in paused:
        r = sched.requests[rid]
        if r.pause.action is KVAction.PRESERVE:
            held += kv.num_blocks_of(rid)
        elif r.pause.action is KVAction.DISCARD:
            assert kv.num_blocks_of(rid) == 0 and r.num_computed_tokens == 0
        else:
            assert kv.is_swapped(rid) and kv.num_blocks_of(rid) == 0
    assert sched.pauses.num_held_blocks == held


def step(sched: Scheduler, now: float, live: set[str], done: dict[str, Request]) -> None:
    plan = sched.schedule(now)
    ids = [s.request_id for s in plan.seqs]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    for s in plan.seqs:
        assert len(s.block_ids) * BS >= s.start + len(s.token_ids)
        assert s.block_ids == sched.kv.block_ids(s.request_id)
    result = StepResult({s.request_id: [7 + s.start % 5] for s in plan.seqs if s.sample})
    for u in sched.update(plan, result, now):
        if u.finished:
            live.discard(u.request.request_id)
            done[u.request.request_id] = u.request


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=ops, num_blocks=st.integers(14, 40), prefix_caching=st.booleans(),
       policy=st.sampled_from(POLICY_NAMES), action=st.sampled_from([None, *KVAction]),
       budget=st.sampled_from([8, 16, 64]))
def test_scheduler_invariants_hold_for_any_program(program, num_blocks, prefix_caching, policy, action, budget):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix_caching, num_host_blocks=24)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6, max_model_len=num_blocks * BS,
                          policy=policy)
    sched = Scheduler(cfg, kv)
    if action is not None:
        sched.pauses.policy = FixedAction(action)
    live: set[str] = set()
    done: dict[str, Request] = {}
    added: dict[str, Request] = {}
    aborted: set[str] = set()
    now = 0.0
    prefixes = [[900 + p] * 8 for p in range(3)]
    for op in program:
        now += 0.01
        kind = op[0]
        if kind == "add":
            _, n, max_tokens, p = op
            rid = f"r{len(added)}"
            prompt = (prefixes[p] + list(range(100, 100 + n)))[:max(1, n)]
            r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=now)
            sched.add_request(r)
            added[rid] = r
            live.add(rid)
        elif kind == "step":
            for _ in range(op[1]):
                step(sched, now, live, done)
        elif kind == "pause" and sched.running:
            r = sched.running[op[1] % len(sched.running)]
            # (as in the engine: right after the step that sampled the tool call's last token)
            if r.tool.num_calls < 2 and r.num_output_tokens > 0 and r.num_computed_tokens == r.num_tokens - 1:
                sched.pause_request(r.request_id, now, expected_s=0.5, tool="t")
        elif kind == "resume" and sched.pauses.paused:
            rids = sorted(sched.pauses.paused)
            sched.resume_request(rids[op[1] % len(rids)], list(range(300, 300 + op[2])), now)
        elif kind == "abort" and live:
            rid = sorted(live)[op[1] % len(live)]
            sched.abort_request(rid)
            live.discard(rid)
            aborted.add(rid)
        check_invariants(sched, live)
    for rid in sorted(sched.pauses.paused):
        sched.resume_request(rid, [301, 302], now)
    for _ in range(3000):
        if not sched.has_unfinished():
            break
        now += 0.01
        step(sched, now, live, done)
        check_invariants(sched, live)
    assert not sched.has_unfinished(), "the queue never drained"
    assert set(done) | aborted == set(added)
    for rid, r in done.items():
        assert r.finish_reason is FinishReason.LENGTH
        assert r.num_output_tokens == r.sampling_params.max_tokens
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.num_free_host_blocks == kv.num_host_blocks
