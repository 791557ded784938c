"""Scheduler policy driven by a fake executor: chunked prefill, token / seq limits, FCFS, preemption by
recompute, finish conditions, aborts, prefix caching and determinism. Pure Python, no torch."""

from __future__ import annotations

import pytest

from tandem.config import SchedulerConfig
from tandem.kv import KVCacheManager
from tandem.sampling_params import SamplingParams
from tandem.sched.scheduler import Scheduler
from tandem.types import FinishReason, Request, RequestStatus, StepPlan, StepResult

BS = 4


def next_token(last: int) -> int:
    return (last * 7 + 1) % 100


def chain(last: int, n: int) -> list[int]:
    """The n tokens the fake executor generates after a sequence ending in `last`."""
    out = []
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


class FakeExecutor:
    """Samples next_token(last token) for every sequence that reaches its end; records the plans."""

    def __init__(self) -> None:
        self.plans: list[StepPlan] = []

    def __call__(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        result = StepResult()
        for s in plan.seqs:
            if s.sample:
                result.sampled_token_ids[s.request_id] = [next_token(s.token_ids[-1])]
        return result


def make_sched(num_blocks=256, budget=32, max_num_seqs=8, max_model_len=None, prefix_caching=True,
               watermark=0.01) -> Scheduler:
    max_model_len = max_model_len or min(256, num_blocks * BS)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                          max_model_len=max_model_len, watermark=watermark)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS, prefix_caching))


def req(rid, prompt, max_tokens=8, arrival=0.0, eos=(), **sp) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **sp)
    return Request(rid, list(prompt), params, eos_token_ids=tuple(eos), arrival_time=arrival)


def step(sched: Scheduler, fake: FakeExecutor, now: float = 0.0) -> StepPlan:
    plan = sched.schedule(now)
    sched.update(plan, fake(plan), now)
    return plan


def run(sched: Scheduler, fake: FakeExecutor | None = None, max_steps: int = 2000) -> list[StepPlan]:
    """Step until nothing is unfinished; each chunk must continue where the last one ended."""
    fake = fake or FakeExecutor()
    done: dict[str, int] = {}
    plans = []
    while sched.has_unfinished():
        assert len(plans) < max_steps, "scheduler made no progress"
        plan = sched.schedule(float(len(plans)))
        for rid in plan.preempted_ids:
            done.pop(rid, None)
        for s in plan.seqs:
            if s.request_id in done:
                assert s.start == done[s.request_id], f"{s.request_id} skipped or repeated tokens"
            else:   # (re)admitted: starts after a cached prefix of whole blocks, if any
                assert s.start % BS == 0
            done[s.request_id] = s.start + s.num_tokens
        sched.update(plan, fake(plan), float(len(plans)))
        plans.append(plan)
    return plans


def trace(plans: list[StepPlan]) -> list[list[tuple[str, int, int]]]:
    return [[(s.request_id, s.start, s.num_tokens) for s in p.seqs] for p in plans]


def workload(n=6, max_tokens=12) -> list[Request]:
    return [req(f"r{i}", range(i * 100, i * 100 + 10 + 3 * i), max_tokens=max_tokens, ignore_eos=True)
            for i in range(n)]


# --- batching limits ---------------------------------------------------------------------------
def test_no_step_exceeds_token_budget():
    """Every step computes at most max_num_batched_tokens tokens, and the budget is used when needed."""
    sched = make_sched(budget=16)
    for r in workload():
        sched.add_request(r)
    plans = run(sched)
    assert all(0 < p.num_tokens <= 16 for p in plans)
    assert max(p.num_tokens for p in plans) == 16


def test_long_prompt_is_split_into_chunks():
    """A 50-token prompt under a 16-token budget runs as chunks 16+16+16+2; only the last samples."""
    sched = make_sched(budget=16)
    r = req("long", range(50), max_tokens=2, ignore_eos=True)
    sched.add_request(r)
    plans = run(sched)
    assert trace(plans) == [[("long", 0, 16)], [("long", 16, 16)], [("long", 32, 16)],
                            [("long", 48, 2)], [("long", 50, 1)]]
    assert [p.seqs[0].sample for p in plans] == [False, False, False, True, True]
    assert r.output_token_ids == chain(49, 2)


def test_running_decodes_are_scheduled_before_new_prefills():
    """A running request's decode comes first; a new prompt gets only the remaining budget."""
    sched, fake = make_sched(budget=16), FakeExecutor()
    sched.add_request(req("a", range(5), max_tokens=10, ignore_eos=True))
    step(sched, fake)
    sched.add_request(req("b", range(100, 140), max_tokens=2, ignore_eos=True))
    plan = step(sched, fake)
    assert trace([plan]) == [[("a", 5, 1), ("b", 0, 15)]]
    plan = step(sched, fake)                          # b is now running too: a, then b's next chunk
    assert trace([plan]) == [[("a", 6, 1), ("b", 15, 15)]]


def test_max_num_seqs_is_never_exceeded():
    """At most max_num_seqs requests run at once, and the limit is reached."""
    sched = make_sched(max_num_seqs=3, budget=64)
    for r in workload(8):
        sched.add_request(r)
    plans = run(sched)
    assert max(len(p.seqs) for p in plans) == 3
    assert all(len({s.request_id for s in p.seqs}) == len(p.seqs) for p in plans)


def test_fcfs_admits_in_arrival_order():
    """Admission follows arrival time, ties broken by submission order, not by add order."""
    sched = make_sched(max_num_seqs=1)
    for rid, arrival in [("c", 3.0), ("a", 1.0), ("b1", 2.0), ("b2", 2.0), ("d", 0.5)]:
        sched.add_request(req(rid, range(6), max_tokens=2, arrival=arrival, ignore_eos=True))
    order = []
    for p in run(sched):
        order += [s.request_id for s in p.seqs if s.request_id not in order]
    assert order == ["d", "a", "b1", "b2", "c"]


# --- preemption --------------------------------------------------------------------------------
def outputs_of(reqs):
    return {r.request_id: (r.output_token_ids, r.finish_reason) for r in reqs}


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_keeps_outputs_and_frees_all_blocks(prefix_caching):
    """With a KV pool too small for all requests, preemption by recompute gives the same outputs."""
    ample = make_sched(num_blocks=256, budget=32, prefix_caching=prefix_caching)
    ample_reqs = workload()
    for r in ample_reqs:
        ample.add_request(r)
    run(ample)
    assert ample.num_preemptions == 0

    small = make_sched(num_blocks=10, budget=32, prefix_caching=prefix_caching)  # largest needs 7
    small_reqs = workload()
    for r in small_reqs:
        small.add_request(r)
    run(small)
    assert small.num_preemptions > 0
    assert sum(r.num_preemptions for r in small_reqs) == small.num_preemptions
    assert outputs_of(small_reqs) == outputs_of(ample_reqs)
    assert all(r.finish_reason is FinishReason.LENGTH and r.num_output_tokens == 12 for r in small_reqs)
    assert small.kv.num_free_blocks == small.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in small.kv.pool.blocks)


def test_preemption_victim_is_latest_arrival():
    """When blocks run out, the latest-arrived running request is preempted and returns to waiting."""
    sched, fake = make_sched(num_blocks=4, budget=32, watermark=0.0), FakeExecutor()
    sched.add_request(req("early", range(7), max_tokens=8, ignore_eos=True, arrival=0.0))
    sched.add_request(req("late", range(50, 57), max_tokens=8, ignore_eos=True, arrival=1.0))
    plans = [step(sched, fake) for _ in range(3)]
    preempted = [rid for p in plans for rid in p.preempted_ids]
    assert preempted == ["late"]
    late = next(r for r in sched.waiting if r.request_id == "late")
    assert late.status is RequestStatus.WAITING and late.num_computed_tokens == 0


def test_admission_with_revived_cached_prefix_under_pressure():
    """A request whose cached prefix sits in the free queue waits (not crashes) when space is short."""
    sched, fake = make_sched(num_blocks=4, budget=64, watermark=0.0), FakeExecutor()
    sched.add_request(req("a", range(9), max_tokens=1, ignore_eos=True))
    step(sched, fake)                          # a finishes; its 2 full blocks stay cached in the free queue
    sched.add_request(req("c", [50] * 7, max_tokens=10, ignore_eos=True))
    step(sched, fake)                          # c takes the 2 uncached free blocks (its 8th token fits)
    assert sched.kv.num_free_blocks == 2
    sched.add_request(req("b", list(range(8)) + [70, 71, 72, 73], max_tokens=2, ignore_eos=True))
    plan = step(sched, fake)                   # b needs 2 revived + 1 new block, only 2 free
    assert [s.request_id for s in plan.seqs] == ["c"]
    assert [r.request_id for r in sched.waiting] == ["b"]


# --- finishing ---------------------------------------------------------------------------------
def finish(sched_kwargs=None, **req_kwargs) -> Request:
    sched = make_sched(**(sched_kwargs or {}))
    r = req("r", [1, 2, 3], **req_kwargs)     # after 3: 22, 55, 86, 3, 22, 55, ...
    sched.add_request(r)
    run(sched)
    assert r.status is RequestStatus.FINISHED and not sched.has_unfinished()
    return r


def test_max_tokens_finishes_with_length():
    r = finish(max_tokens=5, ignore_eos=True)
    assert r.output_token_ids == chain(3, 5) and r.finish_reason is FinishReason.LENGTH


def test_eos_token_finishes_with_stop():
    r = finish(max_tokens=10, eos=(55,))
    assert r.output_token_ids == [22, 55] and r.finish_reason is FinishReason.STOP


def test_stop_token_ids_finish_with_stop():
    r = finish(max_tokens=10, stop_token_ids=[86])
    assert r.output_token_ids == [22, 55, 86] and r.finish_reason is FinishReason.STOP


@pytest.mark.parametrize("min_tokens, expected", [(1, [22, 55]), (2, [22, 55, 86, 3, 22, 55])])
def test_min_tokens_suppresses_early_stop_token(min_tokens, expected):
    """A stop token stops only if at least min_tokens outputs precede it."""
    r = finish(max_tokens=10, eos=(55,), min_tokens=min_tokens)
    assert r.output_token_ids == expected and r.finish_reason is FinishReason.STOP


def test_ignore_eos_runs_to_max_tokens():
    r = finish(max_tokens=6, eos=(55,), ignore_eos=True)
    assert r.output_token_ids == chain(3, 6) and 55 in r.output_token_ids
    assert r.finish_reason is FinishReason.LENGTH


def test_ignore_eos_still_honours_stop_token_ids():
    r = finish(max_tokens=6, eos=(55,), ignore_eos=True, stop_token_ids=[86])
    assert r.output_token_ids == [22, 55, 86] and r.finish_reason is FinishReason.STOP


def test_max_model_len_finishes_with_length():
    r = finish({"max_model_len": 7}, max_tokens=100, ignore_eos=True)
    assert r.num_tokens == 7 and r.output_token_ids == chain(3, 4)
    assert r.finish_reason is FinishReason.LENGTH


# --- aborts ------------------------------------------------------------------------------------
def test_abort_waiting_request():
    """Aborting a waiting request removes it; it never gets scheduled."""
    sched, fake = make_sched(max_num_seqs=1), FakeExecutor()
    sched.add_request(req("a", range(6), max_tokens=3, ignore_eos=True))
    sched.add_request(req("b", range(10, 16), max_tokens=3, ignore_eos=True))
    step(sched, fake)
    b = sched.abort_request("b")
    assert b.status is RequestStatus.FINISHED and b.finish_reason is FinishReason.ABORT
    assert sched.num_waiting == 0 and "b" not in sched.requests
    plans = [step(sched, fake) for _ in range(5)]
    assert not sched.has_unfinished()
    assert all(s.request_id == "a" for p in plans for s in p.seqs)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_abort_running_request_frees_its_blocks():
    """Aborting a running request frees its blocks; a result arriving for it afterwards is ignored."""
    sched, fake = make_sched(), FakeExecutor()
    sched.add_request(req("a", range(10), max_tokens=8, ignore_eos=True))
    step(sched, fake)
    assert sched.kv.num_blocks_of("a") == 3
    plan = sched.schedule(1.0)
    a = sched.abort_request("a")
    assert a.finish_reason is FinishReason.ABORT and sched.num_running == 0
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.update(plan, fake(plan), 1.0) == []
    assert a.num_output_tokens == 1 and not sched.has_unfinished()


def test_abort_unknown_or_finished_returns_none():
    sched = make_sched()
    assert sched.abort_request("nope") is None
    sched.add_request(req("a", range(4), max_tokens=1))
    run(sched)
    assert sched.abort_request("a") is None


# --- prefix caching and determinism ------------------------------------------------------------
def prompt_tokens_computed(plans, reqs) -> int:
    lens = {r.request_id: r.num_prompt_tokens for r in reqs}
    return sum(max(0, min(s.start + s.num_tokens, lens[s.request_id]) - s.start) for p in plans for s in p.seqs)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_shared_prefix_is_computed_once(prefix_caching):
    """Two requests sharing a 32-token prefix, added together: the prefix is computed only once."""
    sched = make_sched(budget=128, prefix_caching=prefix_caching)
    prefix = list(range(200, 232))
    reqs = [req("a", prefix + [1, 2, 3], ignore_eos=True), req("b", prefix + [4, 5], ignore_eos=True)]
    for r in reqs:
        sched.add_request(r)
    plans = run(sched)
    total = sum(r.num_prompt_tokens for r in reqs)
    if prefix_caching:
        assert reqs[1].num_cached_tokens == 32
        assert prompt_tokens_computed(plans, reqs) == total - 32
    else:
        assert reqs[1].num_cached_tokens == 0
        assert prompt_tokens_computed(plans, reqs) == total
    assert reqs[0].num_cached_tokens == 0


def test_same_workload_gives_identical_plans():
    """Scheduling is deterministic: the same workload yields the same plans step by step."""
    def once():
        sched = make_sched(num_blocks=12, budget=16, max_num_seqs=4, prefix_caching=False)
        for r in workload(6):
            sched.add_request(r)
        plans = run(sched)
        return trace(plans), [p.preempted_ids for p in plans]

    first, second = once(), once()
    assert first == second
    assert any(first[1])                      # the workload is non-trivial: it preempts
