"""AugServe's policy pieces on the real scheduler with a fake executor: min-waste KV choice, the
predictors, the dynamic budget, Stage I ordering, Stage II anti-starvation."""

from __future__ import annotations

import random

from scipy.stats import kendalltau

from tandem.config import SchedulerConfig
from tandem.kv import KVCacheManager
from tandem.sampling_params import SamplingParams
from tandem.sched.budget import DynamicBudget
from tandem.sched.cost_model import StepCostModel
from tandem.sched.ordering import AugServeOrdering
from tandem.sched.policies import make_policy
from tandem.sched.predictor import OutputLengthPredictor, ToolStats
from tandem.sched.scheduler import Scheduler
from tandem.sched.pause_kv import MinWaste, PauseContext
from tandem.types import KVAction, Request, StepResult


def cost() -> StepCostModel:
    return StepCostModel(profile=[(1, 0.02), (64, 0.05), (512, 0.3), (4096, 2.4)])


def test_min_waste_picks_each_action_where_it_wastes_least():
    mw = MinWaste(cost(), swap_s_per_token=1e-5)
    short = PauseContext(context_tokens=500, other_tokens=4000, expected_pause_s=0.001, num_blocks=32, can_swap=True)
    assert mw.decide(short) is KVAction.PRESERVE          # a calculator call: keep the KV
    long = PauseContext(context_tokens=500, other_tokens=4000, expected_pause_s=20.0, num_blocks=32, can_swap=True)
    assert mw.decide(long) is KVAction.SWAP               # a chatbot turn, and swapping is cheap
    no_swap = PauseContext(500, 4000, 20.0, 32, can_swap=False)
    assert mw.decide(no_swap) is KVAction.DISCARD         # no host space: recompute beats idling 20 s
    w = mw.wastes(long)
    assert w[KVAction.PRESERVE] == 20.0 * 500
    assert w[KVAction.DISCARD] == cost().time(500) * 4500


def test_output_length_predictor_learns_a_ranking():
    rng = random.Random(0)
    pred = OutputLengthPredictor()

    def req(i, n_prompt):
        return Request(f"r{i}", [rng.randrange(100) for _ in range(n_prompt)], SamplingParams())

    for i in range(200):                    # output length grows with prompt length, with noise
        n = rng.randrange(10, 400)
        pred.observe(req(i, n), int(n * 1.5 * rng.uniform(0.7, 1.3)) + 5)
    test = [(req(1000 + i, n), int(n * 1.5) + 5) for i, n in enumerate(rng.sample(range(10, 400), 60))]
    tau, _ = kendalltau([pred.predict(r) for r, _ in test], [y for _, y in test])
    assert tau > 0.7


def test_tool_stats_track_durations():
    ts = ToolStats(alpha=0.5)
    assert ts.duration("qa") == 1.0                        # the prior
    for _ in range(20):
        ts.observe_call("qa", 0.6, 120)
    assert abs(ts.duration("qa") - 0.6) < 1e-6 and abs(ts.return_tokens("qa") - 120) < 1e-6


def test_dynamic_budget_follows_free_memory_and_paused_kv():
    b = DynamicBudget(64, 512, full_at_free=0.5, paused_weight=0.5)
    assert b.tokens(1000, 1000) == 512
    assert b.tokens(250, 1000) == 64 + (512 - 64) * 0.5
    assert b.tokens(0, 1000) == 64
    assert b.tokens(500, 1000, num_paused_blocks=400) < b.tokens(500, 1000)


def test_the_dynamic_budget_bounds_admissions_not_the_running_requests_prefill():
    """Memory tight: the budget is down to 25 tokens. A running request's prefill (here a prompt;
    after a tool call, its result or a recomputed context) still gets the full 64: slowed down, it
    held its memory longer, which kept the budget down (the loop that tipped runs into a slow
    state). New arrivals are admitted only within the small budget, and within what the running
    requests leave of the full one."""
    from tandem.sched.pause_kv import FixedAction

    c = cost()
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=320),
                      KVCacheManager(20, 16, enable_prefix_caching=False), make_policy("augserve", 64, c),
                      cost=c)
    sched.pauses.policy = FixedAction(KVAction.PRESERVE)
    sched.add_request(Request("hog", [7] * 160, SamplingParams(max_tokens=9, ignore_eos=True)))
    while not sched.requests["hog"].num_output_tokens:    # 160 tokens (10 blocks), then a tool call
        plan = sched.schedule(0.0)
        sched.update(plan, StepResult({s.request_id: [1] for s in plan.seqs if s.sample}), 0.0)
    sched.pause_request("hog", 0.0, expected_s=5.0)
    assert sched.pauses.num_held_blocks == 10 and sched.kv.num_free_blocks == 10
    assert sched.budget.tokens(10, 20, 10) == 40
    sched.add_request(Request("big", [7] * 120, SamplingParams(max_tokens=4, ignore_eos=True)))
    plan = sched.schedule(0.1)
    assert [(s.request_id, s.num_tokens) for s in plan.seqs] == [("big", 40)]      # admitted within 40
    sched.update(plan, StepResult({}), 0.1)
    assert sched.budget.tokens(sched.kv.num_free_blocks, 20, 10) == 25
    sched.add_request(Request("new", [7] * 16, SamplingParams(max_tokens=4, ignore_eos=True)))
    plan = sched.schedule(0.2)
    assert [(s.request_id, s.num_tokens) for s in plan.seqs] == [("big", 64)]
    trace = []
    sched.trace = trace
    sched.update(plan, StepResult({}), 0.2)
    plan = sched.schedule(0.3)
    assert [(s.request_id, s.num_tokens) for s in plan.seqs] == [("big", 16), ("new", 16)]   # floor: 16
    row = trace[0]
    assert (row.budget, row.num_tokens, row.num_seqs, row.num_prefill_tokens) == (16, 32, 2, 32)
    assert (row.num_running, row.num_waiting, row.num_paused, row.queue) == (2, 0, 1, [])
    assert (row.num_free_blocks, row.num_paused_held_blocks, row.num_waiting_kept_blocks) == (1, 10, 0)


class Echo:
    """Fake executor: one token per sampled seq."""

    def __call__(self, plan) -> StepResult:
        return StepResult({s.request_id: [1] for s in plan.seqs if s.sample})


def run(sched: Scheduler, arrivals: list[tuple[float, Request]], step_s: float = 0.05, until: float = 1e9):
    pending = sorted(arrivals, key=lambda x: x[0])
    now, finish = 0.0, {}
    executor = Echo()
    while (pending or sched.has_unfinished()) and now < until:
        while pending and pending[0][0] <= now:
            sched.add_request(pending.pop(0)[1])
        plan = sched.schedule(now)
        now += step_s
        for u in sched.update(plan, executor(plan), now):
            if u.finished:
                finish[u.request.request_id] = now
    return finish


def test_stage1_runs_predicted_short_requests_first():
    c = cost()
    policy = make_policy("augserve-stage1", 64, c)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=512),
                      KVCacheManager(64, 16), policy, cost=c)
    for i in range(20):                                     # teach: long prompts -> long outputs
        r = Request(f"t{i}", [7] * (10 + 20 * (i % 2)), SamplingParams())
        policy.lengths.observe(r, 200 if i % 2 else 5)
    long_req = Request("long", [7] * 30, SamplingParams(max_tokens=50, ignore_eos=True), arrival_time=0.0)
    short_req = Request("short", [7] * 10, SamplingParams(max_tokens=5, ignore_eos=True), arrival_time=0.01)
    blocker = Request("blocker", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True), arrival_time=0.0)
    finish = run(sched, [(0.0, blocker), (0.0, long_req), (0.0, short_req)])
    assert finish["short"] < finish["long"]                 # SJF by predicted service time, not arrival


def test_anti_starvation_bounds_the_wait_of_a_long_request():
    """Short requests keep arriving; with one slot, SJF alone would never run the long one."""
    c = cost()
    results = {}
    for name in ("augserve-stage1", "augserve"):
        policy = make_policy(name, 64, c, max_wait_s=2.0)
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=512),
                          KVCacheManager(64, 16), policy, cost=c)
        for i in range(20):
            policy.lengths.observe(Request(f"t{i}", [7] * (10 + 20 * (i % 2)), SamplingParams()), 200 if i % 2 else 4)
        arrivals = [(0.0, Request("long", [7] * 30, SamplingParams(max_tokens=20, ignore_eos=True), arrival_time=0.0))]
        arrivals += [(0.1 * i, Request(f"s{i}", [7] * 10, SamplingParams(max_tokens=4, ignore_eos=True),
                                       arrival_time=0.1 * i)) for i in range(400)]
        results[name] = run(sched, arrivals, until=60.0)
    assert "long" not in results["augserve-stage1"] or results["augserve-stage1"]["long"] > 30.0
    # With Stage II the long request starts within max_wait (2 s) plus one short request's run.
    assert results["augserve"]["long"] <= 2.0 + 0.5 + 20 * 0.05 + 0.2


def test_stage1_ranks_by_engine_service_time_not_tool_wall_time():
    """A chat request whose one tool call is a 40 s human turn needs less of the engine than one
    whose tool returns 2,000 tokens to prefill; Stage I ranks it first. Returned tokens still
    count, and a weight of 1 restores wall-time ranking."""
    tools = ToolStats(alpha=1.0)
    tools.observe_call("chatbot", 40.0, 20)
    tools.observe_finish("chatbot", 1)
    tools.observe_call("retrieval", 0.1, 2000)
    tools.observe_finish("retrieval", 1)
    tools.observe_finish("plain", 0)

    def req(name, key, max_tokens, seq):
        r = Request(name, [7] * 10, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        r.tool.key, r.rank.arrival_seq = key, seq
        return r

    lengths = OutputLengthPredictor(min_samples=10**6)     # cold: every request predicts the prior
    chat, plain, retrieval = req("chat", "chatbot", 8, 0), req("plain", "plain", 8, 1), req("rag", "retrieval", 8, 2)
    wall = AugServeOrdering(lengths, tools, stage2=False, tool_time_weight=1.0, decode_token_s=0.03, prefill_token_s=0.003)
    engine = AugServeOrdering(lengths, tools, stage2=False, decode_token_s=0.03, prefill_token_s=0.003)
    assert engine.tool_time_weight == 0.0
    k = {n: engine.service_time(r, 10) for n, r in (("chat", chat), ("plain", plain), ("rag", retrieval))}
    assert k["plain"] < k["chat"] < k["rag"]                # 20 returned tokens < 2000 returned tokens
    assert abs(k["chat"] - k["plain"] - 20 * 0.003) < 1e-9  # the 40 s of waiting adds nothing
    assert wall.service_time(chat, 10) > wall.service_time(retrieval, 10)   # wall time: chat last
    assert sorted([chat, retrieval], key=lambda r: engine.key(r, 0.0))[0] is chat


def paused_after_first_token(policy: str, max_num_seqs: int = 8) -> Scheduler:
    """A scheduler under `policy` whose request "tool" has shown its first token and is paused for
    a tool call, its KV preserved."""
    from tandem.sched.pause_kv import FixedAction

    c = cost()
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_num_seqs, max_model_len=512),
                      KVCacheManager(64, 16, enable_prefix_caching=False), make_policy(policy, 64, c), cost=c)
    sched.pauses.policy = FixedAction(KVAction.PRESERVE)
    sched.add_request(Request("tool", [7] * 8, SamplingParams(max_tokens=20, ignore_eos=True)))
    plan = sched.schedule(0.0)
    sched.update(plan, Echo()(plan), 0.1)
    sched.pause_request("tool", 0.1, expected_s=0.5)
    return sched


def step(sched: Scheduler, now: float) -> list[tuple[str, int]]:
    plan = sched.schedule(now)
    sched.update(plan, Echo()(plan), now + 0.05)
    return sorted((s.request_id, s.num_tokens) for s in plan.seqs)


def test_a_step_that_serves_a_first_token_leaves_a_tool_result_for_the_next_one():
    """AugServe: a prompt's first token does not wait for another request's tool result in the same
    step; the tool result runs in the next step even if another prompt arrives (one step per resume).
    InferCept puts both in one step."""
    for policy, first, second in (
            ("augserve", [("new", 10)], [("new", 1), ("new2", 8), ("tool", 31)]),
            ("infercept", [("new", 10), ("tool", 31)], [("new", 1), ("new2", 8), ("tool", 1)])):
        sched = paused_after_first_token(policy)
        sched.resume_request("tool", [5] * 30, 0.2)
        sched.add_request(Request("new", [3] * 10, SamplingParams(max_tokens=20, ignore_eos=True), arrival_time=0.2))
        assert step(sched, 0.2) == first, policy
        sched.add_request(Request("new2", [4] * 8, SamplingParams(max_tokens=20, ignore_eos=True), arrival_time=0.3))
        assert step(sched, 0.3) == second, policy
    assert sched.composition.num_deferred == 0
    sched = paused_after_first_token("augserve")
    sched.resume_request("tool", [5] * 100, 0.2)     # with its last sampled token, 101 to compute: chunked
    assert step(sched, 0.2) == [("tool", 64)]
    sched.add_request(Request("new", [3] * 10, SamplingParams(max_tokens=20, ignore_eos=True), arrival_time=0.3))
    assert step(sched, 0.3) == [("new", 10)]                # the running chunk yields once
    assert step(sched, 0.4) == [("new", 1), ("tool", 37)]
    assert sched.composition.num_deferred == 1


def test_a_tool_result_yields_only_to_a_first_token_that_the_step_serves():
    """The batch is full (max_num_seqs 2): the new prompt cannot be admitted, so the running tool
    result's chunk runs in this step rather than waiting for nothing."""
    sched = paused_after_first_token("augserve", max_num_seqs=2)
    sched.add_request(Request("other", [9] * 8, SamplingParams(max_tokens=20, ignore_eos=True), arrival_time=0.1))
    assert step(sched, 0.1) == [("other", 8)]
    sched.resume_request("tool", [5] * 100, 0.2)
    assert step(sched, 0.2) == [("other", 1), ("tool", 63)]
    sched.add_request(Request("new", [3] * 10, SamplingParams(max_tokens=20, ignore_eos=True), arrival_time=0.3))
    assert step(sched, 0.3) == [("other", 1), ("tool", 38)]
    assert sched.composition.num_deferred == 0 and [r.request_id for r in sched.waiting] == ["new"]
