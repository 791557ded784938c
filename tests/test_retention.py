"""KV held for a session between its calls (sched/retention.py): a client-side tool loop's next call
takes over the previous call's KV, kept on the device or swapped to host, on the pause path every
tool call takes; the bounds (ceiling, share, per-owner cap) hold; owners and cache salts separate."""

from __future__ import annotations

import pytest

from tandem.config import ConfigError, RetentionConfig, SchedulerConfig
from tandem.kv import KVCacheManager
from tandem.sampling_params import SamplingParams
from tandem.sched.scheduler import Scheduler
from tandem.sched.pause_kv import FixedAction
from tandem.types import FinishReason, KVAction, Request, RequestStatus, SessionInfo, StepResult

BS = 4


def make(action: KVAction, num_blocks: int = 32, prefix: bool = False, **limits) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=num_blocks * BS,
                          watermark=0.0, retention=RetentionConfig(**limits))
    sched = Scheduler(cfg, KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix, num_host_blocks=64))
    sched.pauses.policy = FixedAction(action)
    sched.policy.holds_sessions = True            # (infercept's and augserve's policies hold; fcfs does not)
    return sched


def call(rid: str, tokens: list[int], out: int, at: float, key: str | None = "s1", owner: str = "k",
         salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=out, ignore_eos=True), arrival_time=at,
                   session=SessionInfo(key, owner, salt))


def run(sched: Scheduler, now: float) -> list:
    """Steps at `now` until nothing is left to run; returns the plans."""
    plans = []
    while sched.has_work():
        plan = sched.schedule(now)
        plans.append(plan)
        sched.update(plan, StepResult({s.request_id: [7] for s in plan.seqs if s.sample}), now)
    return plans


def first_call(sched: Scheduler, n: int = 22, out: int = 3, **kw) -> Request:
    r = call("c0", list(range(1, n + 1)), out, 0.0, **kw)
    sched.add_request(r)
    run(sched, 0.0)
    assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.LENGTH
    return r


@pytest.mark.parametrize("action", [KVAction.PRESERVE, KVAction.SWAP])
def test_the_next_call_takes_over_the_held_context_in_whole_blocks(action):
    sched = make(action)
    c0 = first_call(sched)                            # 22 + 3 tokens, 24 computed: 6 blocks
    assert sched.sessions.num_held == 1 and sched.pauses.num_actions[action] == 1
    assert c0.tool.num_calls == 0                     # a hold is not a tool call of the request
    if action is KVAction.SWAP:                       # (copies deferred until its blocks are reused)
        assert sched.kv.num_swapped_blocks("c0") == 6 and sched.kv.num_free_blocks == 32
    else:
        assert sched.kv.num_blocks_of("c0") == 6 and sched.kv.num_free_blocks == 26
    nxt = call("c1", c0.token_ids + [50, 51, 52], 2, 10.0)     # the context + a tool result
    sched.add_request(nxt)
    assert nxt.num_computed_tokens == 24 and sched.sessions.num_held == 0
    assert sched.sessions.num_adopted_tokens == 24 and sched.kv.num_blocks_of("c0") == 0
    plans = run(sched, 10.0)
    first = plans[0].seqs[0]
    assert (first.request_id, first.start, first.num_tokens) == ("c1", 24, 4)   # 25th token on: 4 to compute
    assert plans[0].swap_in == []                     # nobody reused the swapped blocks: taken back as they are
    assert nxt.status is RequestStatus.FINISHED and sched.sessions.num_held == 1     # c1 holds it now
    # the session's gap was learned: the next hold expects it
    assert sched.pauses.tools.duration("session:k:s1") == pytest.approx(10.0 - 0.0)


@pytest.mark.parametrize("evicted", [False, True])
def test_a_swapped_hold_resumes_from_the_device_prefix_cache_while_its_blocks_survive_there(evicted):
    """Host memory is the second tier: a swap-out leaves the device blocks in the prefix cache, and
    the next call reads them there without a copy back while nothing has reused them; once
    something has, it copies in the blocks that were reused (they were copied out when reused).
    (At low load that is every call: no copy back on its critical path.)"""
    sched = make(KVAction.SWAP, prefix=True)
    c0 = first_call(sched)                            # 24 computed: 6 full blocks, swapped out
    assert sched.kv.num_swapped_blocks("c0") == 6
    if evicted:                                       # a stranger takes 28 of the 32 blocks: c0's last two too
        filler = Request("x", list(range(200, 310)), SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=1.0)
        sched.add_request(filler)
        assert [len(p.swap_out) for p in run(sched, 1.0)] == [2]      # copied out before the filler writes them
    nxt = call("c1", c0.token_ids + [50, 51, 52], 2, 10.0)
    sched.add_request(nxt)
    plans = run(sched, 10.0)
    first = plans[0].seqs[0]
    assert (first.request_id, first.start, first.num_tokens) == ("c1", 24, 4)   # 24 tokens not computed, either way
    assert len(plans[0].swap_in) == (2 if evicted else 0)
    assert nxt.num_cached_tokens == 24                # (counted once, from whichever tier)
    assert sched.kv.num_free_host_blocks + sched.kv.num_swapped_blocks("c1") == 64    # c0's copy is released
    assert nxt.status is RequestStatus.FINISHED


def test_a_discarded_hold_and_a_diverging_context_take_nothing_over():
    sched = make(KVAction.DISCARD)
    c0 = first_call(sched)
    assert sched.kv.num_blocks_of("c0") == 0 and sched.kv.num_free_blocks == 32
    c1 = call("c1", c0.token_ids + [50], 2, 1.0)
    sched.add_request(c1)
    assert c1.num_computed_tokens == 0
    run(sched, 1.0)
    sched2 = make(KVAction.PRESERVE)
    c0 = first_call(sched2)
    compacted = c0.token_ids[:9] + [99] * 12          # the agent rewrote the context after token 9
    c1 = call("c1", compacted, 2, 1.0)
    sched2.add_request(c1)
    assert c1.num_computed_tokens == 8                 # two whole blocks in common
    assert sched2.kv.num_free_blocks == 30             # the rest of the held context is freed


def test_owners_and_salts_are_separate_and_nothing_is_held_without_a_key_or_under_fcfs():
    sched = make(KVAction.PRESERVE)
    c0 = first_call(sched, owner="alice")
    thief = call("t", c0.token_ids + [1], 2, 1.0, owner="bob")   # same key, other API key
    sched.add_request(thief)
    assert thief.num_computed_tokens == 0 and sched.sessions.num_held == 1
    salted = call("s", c0.token_ids + [1], 2, 1.0, owner="alice", salt="x")
    sched.add_request(salted)                          # alice's session, another salt: not resumed
    assert salted.num_computed_tokens == 0 and sched.kv.num_blocks_of("c0") == 0
    run(sched, 1.0)
    plain = make(KVAction.PRESERVE)
    first_call(plain, key=None)
    assert plain.sessions.num_held == 0 and plain.kv.num_free_blocks == 32
    fcfs = make(KVAction.PRESERVE)
    fcfs.policy.holds_sessions = False               # vLLM-like: the prefix cache keeps what it keeps
    first_call(fcfs)
    assert fcfs.sessions.num_held == 0 and fcfs.kv.num_free_blocks == 32 and sum(fcfs.pauses.num_actions.values()) == 0


def test_cache_salt_separates_the_prefix_cache():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = call("a", list(range(1, 14)), 1, 0.0, salt="tenant-a")
    kv.allocate(a, a.num_tokens)
    same = call("b", list(range(1, 14)), 1, 0.0, salt="tenant-a")
    other = call("c", list(range(1, 14)), 1, 0.0, salt="tenant-b")
    unsalted = call("d", list(range(1, 14)), 1, 0.0, salt=None)
    assert kv.get_computed_blocks(same)[1] == 12
    assert kv.get_computed_blocks(other)[1] == 0 and kv.get_computed_blocks(unsalted)[1] == 0


def test_the_ceiling_frees_a_held_context_and_forgets_its_session():
    sched = make(KVAction.PRESERVE, max_hold_s=5.0)
    first_call(sched)
    later = call("c9", list(range(100, 122)), 3, 3.0, key="s2")
    sched.add_request(later)
    run(sched, 3.0)                                     # s2 held at 3.0, s1 at 0.0
    sched.schedule(4.0)
    assert sched.sessions.num_held == 2
    sched.schedule(5.5)                                 # s1 past the ceiling, s2 not
    assert sched.sessions.num_held == 1 and sched.sessions.num_expired == 1 and sched.kv.num_free_blocks == 26
    assert sched.kv.num_blocks_of("c0") == 0 and sched.kv.num_blocks_of("c9") == 6
    sched.schedule(8.5)
    assert sched.sessions.num_held == 0 and sched.sessions.num_expired == 2 and sched.kv.num_free_blocks == 32
    assert sched.pauses.num_paused == 0


def test_held_sessions_keep_at_most_their_share_of_the_device_cache():
    sched = make(KVAction.PRESERVE, max_share=0.25)    # 8 of 32 blocks
    first_call(sched, key="s1")                        # 6 blocks held on the device
    r = call("c1", list(range(100, 122)), 3, 0.0, key="s2")
    sched.add_request(r)
    run(sched, 0.0)                                    # 6 more would pass 8: swapped instead
    assert sched.pauses.num_actions[KVAction.PRESERVE] == 1 and sched.pauses.num_actions[KVAction.SWAP] == 1
    assert sched.sessions.num_held_blocks() == (6, 6)


def test_an_owner_is_held_to_its_cap_and_others_are_not():
    sched = make(KVAction.PRESERVE, max_blocks_per_owner=8)
    first_call(sched, key="s1", owner="greedy")         # 6 blocks
    r = call("c1", list(range(100, 122)), 3, 0.0, key="s2", owner="greedy")
    sched.add_request(r)
    run(sched, 0.0)
    assert sched.sessions.num_held == 1 and sched.sessions.num_capped == 1    # 12 > 8: freed
    o = call("c2", list(range(200, 222)), 3, 0.0, key="s3", owner="polite")
    sched.add_request(o)
    run(sched, 0.0)
    assert sched.sessions.num_held == 2 and sched.kv.num_free_blocks == 32 - 12


def test_a_held_session_gives_way_to_a_live_request():
    sched = make(KVAction.PRESERVE, num_blocks=10, max_share=1.0)
    first_call(sched, n=30, out=3)                     # 8 of 10 blocks held
    big = call("big", list(range(100, 130)), 4, 1.0, key=None)   # needs 9 blocks
    sched.add_request(big)
    run(sched, 1.0)
    assert big.status is RequestStatus.FINISHED and big.num_preemptions == 0
    assert sched.pauses.num_discarded_kept == 1 and sched.kv.num_blocks_of("c0") == 0


def test_abort_frees_and_limits_are_checked():
    sched = make(KVAction.PRESERVE)
    r = call("c0", list(range(1, 23)), 3, 0.0)
    sched.add_request(r)
    sched.schedule(0.0)
    sched.abort_request("c0")
    assert sched.sessions.num_held == 0 and sched.kv.num_free_blocks == 32
    with pytest.raises(ConfigError):
        RetentionConfig(max_share=1.5)
    with pytest.raises(ConfigError):
        RetentionConfig(max_hold_s=0)


def test_a_held_session_yields_to_queued_work_while_requests_run():
    sched = make(KVAction.PRESERVE, num_blocks=16, max_share=1.0)
    first_call(sched, n=30, out=3)                     # 8 of 16 blocks held
    runner = call("runner", list(range(300, 308)), 20, 1.0, key=None)
    sched.add_request(runner)
    sched.update(sched.schedule(1.0), StepResult({"runner": [7]}), 1.0)
    head = call("head", list(range(400, 428)), 2, 1.5, key=None)   # 7 blocks; 5 are free
    sched.add_request(head)
    plan = sched.schedule(1.5)
    assert [s.request_id for s in plan.seqs] == ["runner", "head"]
    assert sched.pauses.num_discarded_kept == 1 and sched.kv.num_blocks_of("c0") == 0


def test_common_prefix_finds_the_first_difference():
    from tandem.sched.retention import common_prefix

    a = list(range(1000))
    for cut in (0, 1, 17, 500, 999):
        b = a[:cut] + [-1] + a[cut + 1:]
        assert common_prefix(a, b, 1000) == cut
    assert common_prefix(a, list(a), 1000) == 1000 and common_prefix(a, a[:10], 10) == 10
    assert common_prefix(a, a, 0) == 0
