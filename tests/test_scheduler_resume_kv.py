"""Re-admission after tool pauses when KV is tight (found by the simulator, fixed in the scheduler):

- a swapped request needs only its own blocks free to come back (the check counted them twice,
  so a request could never return once the cache was more than half full); a swap copies out and
  back only the blocks that others reused meanwhile;
- when nothing runs and the head of the queue does not fit, KV kept by other waiting (resumed
  after preserve) or paused requests is freed for recompute, instead of waiting forever;
- while others run, kept KV is never freed for the head; AugServe's policies admit the requests
  that kept it past a blocked head instead (freeing it tipped runs into a slow state: issue 49);
- AugServe's anti-starvation admits past-`max_wait_s` requests up to a share of the running batch.
"""

from __future__ import annotations

from tandem.config import SchedulerConfig
from tandem.kv import KVCacheManager
from tandem.sampling_params import SamplingParams
from tandem.sched.scheduler import Scheduler
from tandem.sched.pause_kv import FixedAction
from tandem.types import KVAction, Request, RequestStatus, StepResult

BS = 4


def make(num_blocks: int, action: KVAction, budget: int = 64) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=num_blocks * BS,
                          watermark=0.0)
    sched = Scheduler(cfg, KVCacheManager(num_blocks, BS, enable_prefix_caching=False, num_host_blocks=64))
    sched.pauses.policy = FixedAction(action)
    return sched


def req(rid: str, n_prompt: int, arrival: float = 0.0) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=50, ignore_eos=True),
                   arrival_time=arrival)


def run_step(sched: Scheduler, now: float = 0.0):
    plan = sched.schedule(now)
    sched.update(plan, StepResult({s.request_id: [7] for s in plan.seqs if s.sample}), now)
    return plan


def one_prefilled(action: KVAction, rid: str, n_prompt: int) -> tuple[Scheduler, Request]:
    """A 12-block scheduler pausing with `action`, whose one request has run its prefill step."""
    sched = make(num_blocks=12, action=action)
    r = req(rid, n_prompt)
    sched.add_request(r)
    run_step(sched)
    return sched, r


def test_swapped_request_comes_back_when_its_own_blocks_are_free():
    sched = make(num_blocks=12, action=KVAction.SWAP)
    a = req("a", 24)                               # 6 blocks
    sched.add_request(a)
    run_step(sched)
    assert sched.pause_request("a", 0.0, 1.0) is KVAction.SWAP
    hog = req("hog", 12, arrival=1.0)              # 3 blocks, 4 once it decodes: blocks never used before
    sched.add_request(hog)
    plans = [run_step(sched, 1.0), run_step(sched, 1.0)]
    assert not any(p.swap_out for p in plans)      # a's blocks were not reused: nothing copied out
    assert sched.kv.is_swapped("a") and sched.kv.num_free_blocks == 8
    sched.resume_request("a", [5, 5], 2.0)         # 27 tokens: 7 blocks, 6 of them its own
    plan = run_step(sched, 2.0)
    assert "a" in [s.request_id for s in plan.seqs]     # the old check wanted 7 + 6 = 13 free blocks
    assert plan.swap_in == [] and a.status is RequestStatus.RUNNING     # taken back as they were
    assert sched.kv.num_free_blocks == 1 and not sched.kv.is_swapped("a")


def test_a_swap_copies_out_only_the_blocks_that_are_reused_and_copies_back_only_those():
    sched = make(num_blocks=16, action=KVAction.SWAP)
    a = req("a", 24)                               # blocks 0-5
    sched.add_request(a)
    run_step(sched)
    assert sched.pause_request("a", 0.0, 1.0) is KVAction.SWAP
    own = sched.kv.pool.blocks[:6]
    hog = Request("hog", [3] * 44, SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=1.0)
    sched.add_request(hog)                         # 11 blocks: the 10 never used, then a's last one
    plan = run_step(sched, 1.0)
    host = sched.kv._swapped["a"]
    assert plan.swap_out == [(5, host[5])]         # copied out in the step that reuses it, before it computes
    assert hog.status is RequestStatus.FINISHED and sched.kv.num_free_blocks == 16
    sched.resume_request("a", [5, 5], 2.0)
    plan = run_step(sched, 2.0)
    table = sched.kv.block_ids("a")
    assert table[:5] == [b.block_id for b in own[:5]]            # its own blocks, untouched: no copy
    assert plan.swap_in == [(host[5], table[5])] and plan.swap_out == []
    assert sched.kv.num_free_host_blocks == 64


def test_head_of_queue_gets_kv_kept_by_waiting_requests_when_nothing_runs():
    sched, held = one_prefilled(KVAction.PRESERVE, "held", 28)    # 7 blocks, kept through its pause
    assert sched.pause_request("held", 0.0, 5.0) is KVAction.PRESERVE
    assert sched.pauses.num_held_blocks == 7
    sched.resume_request("held", [9] * 3, 0.5)     # waiting again, its 7 blocks kept
    assert sched.pauses.num_held_blocks == 0
    head = req("head", 24, arrival=-1.0)           # FCFS puts it first; needs 6 blocks, 5 are free
    sched.add_request(head)
    assert sched.waiting[0] is head and sched.kv.num_free_blocks == 5 and not sched.running
    plan = run_step(sched, 1.0)
    assert [s.request_id for s in plan.seqs] == ["head"]      # before the fix: an empty plan, forever
    assert held.num_computed_tokens == 0 and sched.kv.num_blocks_of("held") == 0   # recomputed later
    assert sched.stats().num_discarded_kept == 1
    while sched.has_unfinished():
        run_step(sched, 2.0)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_running_request_takes_kv_kept_by_a_waiting_request_before_preempting_itself():
    """A lone running request out of blocks while a waiting request (back from a preserved pause)
    keeps KV: the waiting request's KV goes, not the running one's. The old code preempted the
    runner and planned an empty step (the simulator then waited for an event that never came)."""
    sched = make(num_blocks=10, action=KVAction.PRESERVE, budget=8)
    held = req("held", 16)                         # 4 blocks, kept through its pause
    sched.add_request(held)
    for _ in range(2):
        run_step(sched)
    assert sched.pause_request("held", 0.0, 5.0) is KVAction.PRESERVE
    big = req("big", 24, arrival=0.5)              # 6 blocks for its prompt, a 7th when it decodes
    sched.add_request(big)
    for _ in range(3):
        run_step(sched, 1.0)                       # prefill in chunks of 8: 6 blocks, 0 free
    sched.resume_request("held", [9], 1.5)         # waiting, its 4 blocks (17 tokens: 5 needed) kept
    assert sched.kv.num_free_blocks == 0 and sched.waiting == [held]
    plan = run_step(sched, 2.0)
    assert not plan.preempted_ids and sched.num_preemptions == 0
    seqs = {s.request_id: s for s in plan.seqs}
    assert seqs["big"].num_tokens == 1             # big decodes on
    assert seqs["held"].start == 0                 # held's kept KV was freed: it recomputes from 0
    while sched.has_unfinished():
        run_step(sched, 3.0)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_anti_starvation_serves_the_longest_wait_first():
    """Stage II's bounded wait: among requests past max_wait_s, the one waiting longest goes first,
    not the one that arrived first (a request back from a tool call arrived long ago)."""
    from tandem.sched.ordering import AugServeOrdering
    from tandem.sched.predictor import OutputLengthPredictor, ToolStats

    ordering = AugServeOrdering(OutputLengthPredictor(), ToolStats(), stage2=True, max_wait_s=30.0)
    resumed, fresh = req("resumed", 8, arrival=0.0), req("fresh", 8, arrival=50.0)
    resumed.tool.last_resumed = 100.0                  # back from a tool at t=100, waiting 100 s at t=200
    resumed.rank.arrival_seq, fresh.rank.arrival_seq = 0, 1
    assert ordering.key(fresh, 200.0) < ordering.key(resumed, 200.0)          # fresh has waited 150 s
    assert ordering.key(resumed, 120.0)[0] == 1 and ordering.key(fresh, 120.0)[0] == 0


def test_vllm_like_baseline_queues_a_tool_continuation_as_a_new_arrival():
    """fcfs-discard is vLLM serving a client that runs the tool itself: the continuation is a new
    request, queued behind everything that arrived meanwhile. InferCept keeps the original arrival."""
    from tandem.sched.cost_model import StepCostModel
    from tandem.sched.policies import make_policy

    resumed, fresh = req("resumed", 8, arrival=0.0), req("fresh", 8, arrival=50.0)
    resumed.tool.last_resumed = 100.0
    resumed.rank.arrival_seq, fresh.rank.arrival_seq = 0, 1
    vllm_like = make_policy("fcfs-discard", 64, StepCostModel()).ordering
    infercept = make_policy("infercept", 64, StepCostModel()).ordering
    assert vllm_like.key(fresh, 120.0) < vllm_like.key(resumed, 120.0)
    assert infercept.key(resumed, 120.0) < infercept.key(fresh, 120.0)
    never_paused = req("plain", 8, arrival=10.0)
    assert vllm_like.key(never_paused, 120.0) == infercept.key(never_paused, 120.0) == (10.0, 0)


def test_aborting_a_paused_request_frees_its_kept_kv_and_the_stats_say_so():
    sched, held = one_prefilled(KVAction.PRESERVE, "held", 28)    # 7 blocks, kept through its pause
    assert sched.pause_request("held", 0.0, 5.0) is KVAction.PRESERVE
    before = sched.stats()
    assert (before.num_paused, before.num_free_blocks, before.num_running) == (1, 5, 0)
    assert (before.num_paused_kv_tokens, before.kv_actions["preserve"], before.kv_actions["discard"]) == (28, 1, 0)
    assert sched.abort_request("held") is held and held.status is RequestStatus.FINISHED
    after = sched.stats()
    assert (after.num_paused, after.num_free_blocks, after.num_paused_kv_tokens) == (0, 12, 0)
    assert sched.pauses.num_held_blocks == 0 and not sched.has_unfinished()


def test_the_next_plan_names_requests_whose_kv_a_pause_freed_or_moved():
    """The runner keeps per-request state tied to KV blocks (a draft model's own KV): a discard or
    a swap voids it, so the next plan says which requests lost their blocks; a preserve does not."""
    for action, released in ((KVAction.DISCARD, ["a"]), (KVAction.SWAP, ["a"]), (KVAction.PRESERVE, [])):
        sched, a = one_prefilled(action, "a", 24)
        a.draft.num_seen = 25
        assert sched.pause_request("a", 0.0, 1.0) is action
        sched.add_request(req("b", 4))
        assert sched.schedule(1.0).released_ids == released, action
        assert a.draft.num_seen == (0 if released else 25)
        assert sched.schedule(1.0).released_ids == []


def test_the_scheduler_counts_the_context_tokens_still_to_prefill():
    """Waiting requests count whole; a running one its prompt's uncomputed rest (the router's
    `waiting_tokens`)."""
    sched = make(num_blocks=12, action=KVAction.PRESERVE, budget=8)
    sched.add_request(req("a", 20))
    run_step(sched)                                  # 8 of a's 20 prompt tokens computed
    sched.add_request(req("b", 6))
    assert sched.pending_prefill_tokens() == (20 - 8 - 1) + 6


def kept_behind_a_runner(passes: bool, head_tokens: int) -> tuple[Scheduler, Request, object]:
    """12 blocks: `held` (7 blocks) came back from a preserved pause and waits with its KV kept,
    `runner` runs (3 blocks once it decodes), and `head`, ranked first, asks for `head_tokens`."""
    sched = make(num_blocks=12, action=KVAction.PRESERVE)
    sched.policy.kept_kv_passes = passes
    held = req("held", 28)
    sched.add_request(held)
    run_step(sched)
    assert sched.pause_request("held", 0.0, 5.0) is KVAction.PRESERVE
    sched.add_request(req("runner", 8, arrival=0.2))
    run_step(sched, 0.2)
    sched.resume_request("held", [9] * 3, 0.5)
    sched.add_request(req("head", head_tokens, arrival=-1.0))
    assert sched.waiting[0].request_id == "head" and sched.kv.num_blocks_of("held") == 7
    return sched, held, run_step(sched, 1.0)


def test_requests_that_kept_their_kv_pass_a_blocked_head_and_nothing_is_freed_while_others_run():
    """AugServe ranks a request that kept its KV by what it has left to do, often below newer
    ones; held back, that KV blocked the head while a few requests ran. Freeing it for the head
    (the old cure) made the request recompute its context later, which took the memory again:
    under pressure each reclaim brought on the next. Now nothing kept is freed while requests
    run; AugServe's policies run the kept request past the blocked head on the memory it holds,
    and FCFS policies (InferCept) wait at the head, as before."""
    from tandem.sched.cost_model import StepCostModel
    from tandem.sched.policies import make_policy

    # head: 24 tokens = 6 blocks, 2 free; held needs 1 block more for its 3 returned tokens.
    sched, held, plan = kept_behind_a_runner(passes=True, head_tokens=24)
    assert {s.request_id: s.start for s in plan.seqs} == {"runner": 8, "held": 28}
    assert sched.kv.num_blocks_of("held") == 8 and sched.waiting == [sched.requests["head"]]
    stats = sched.stats()
    assert stats.num_discarded_kept == 0 and stats.num_recompute_tokens == 0
    while sched.has_unfinished():
        run_step(sched, 2.0)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks

    sched, held, plan = kept_behind_a_runner(passes=False, head_tokens=24)
    assert [s.request_id for s in plan.seqs] == ["runner"] and sched.kv.num_blocks_of("held") == 7
    assert sched.stats().num_discarded_kept == 0

    cost = StepCostModel()
    assert not make_policy("infercept", 64, cost).kept_kv_passes
    assert not make_policy("fcfs-discard", 64, cost).kept_kv_passes
    assert all(make_policy(p, 64, cost).kept_kv_passes
               for p in ("augserve-stage1", "augserve-stage2", "augserve"))


def test_starving_requests_hold_at_most_their_share_of_the_batch():
    """Past max_wait_s a request goes first, but requests admitted that way hold at most
    `starving_share` of the running batch (at least one): under deep overload nearly everyone
    has waited that long, and serving them all first is FCFS, every request late."""
    from tandem.sched.cost_model import StepCostModel
    from tandem.sched.policies import make_policy

    def admitted(share: float) -> list[list[str]]:
        cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, watermark=0.0)
        policy = make_policy("augserve-stage2", 64, StepCostModel())
        policy.ordering.starving_share = share
        sched = Scheduler(cfg, KVCacheManager(64, BS, enable_prefix_caching=False), policy=policy)
        for i in range(3):
            sched.add_request(req(f"run{i}", 8, arrival=100.0))
        run_step(sched, 100.0)
        for i in range(3):
            sched.add_request(req(f"late{i}", 8, arrival=0.0))       # waited 100 s > max_wait_s
        for i in range(2):
            sched.add_request(req(f"new{i}", 8, arrival=99.5))
        steps = []
        for _ in range(2):
            plan = run_step(sched, 100.0)
            steps.append(sorted(s.request_id for s in plan.seqs if s.start == 0))
        return steps

    # 3 running: one starving admission (the longest wait), the new requests too; then 6 running,
    # the one starving admission is still a quarter of them.
    assert admitted(0.25) == [["late0", "new0", "new1"], []]
    assert admitted(1.0) == [["late0", "late1", "late2", "new0", "new1"], []]
