"""Run-ahead drafting (FASER's next lever): the next step's drafts made while this step verifies,
on the guess that every draft and the bonus token hold. The simulator's executor models it (guess,
cost, what it reports), the scheduler's chooser decides per step from acceptance and load, and the
engine refuses it with a clear error until its runner drafts ahead."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.config import SchedulerConfig, SpecConfig
from tandem.errors import ConfigError
from tandem.sampling_params import SamplingParams
from tandem.sched.cost_model import StepCostModel
from tandem.sched.run_ahead import RunAheadChooser
from tandem.sched.acceptance import AcceptanceModel
from tandem.sim import SimConfig, WorkloadSpec, build_workload, make_cost_model, simulate
from tandem.sim.cost import StepShape
from tandem.sim.cost.base import shape_of
from tandem.sim.executor import SimExecutor
from tandem.types import ScheduledSeq, StepPlan


def seq(rid: str, start: int, k: int, ahead: int = 0) -> ScheduledSeq:
    return ScheduledSeq(rid, [5], start, [], True, SamplingParams(), 0, num_draft_tokens=k, num_ahead_tokens=ahead)


def gpu():
    return make_cost_model("H100-80GB", "qwen3-32b", "qwen3-0.6b", num_gpus=2)


def test_a_guess_that_held_is_verified_next_step_without_drafting():
    cost = gpu()
    ex = SimExecutor(cost)
    ex.add_request("A", 1.0)          # every draft accepted: the guess always holds
    ex.add_request("B", 0.0)          # none accepted: it never holds
    first, t1 = ex.step(StepPlan([seq("A", 500, 0, ahead=3), seq("B", 500, 0, ahead=3)]))
    assert first.draft_ready == {"A": 3, "B": 0}
    assert first.sampled_token_ids == {"A": [11], "B": [11]}        # plain decodes this step
    # The step: verification with the drafting ahead beside it; no drafting in the open.
    plain = StepPlan([seq("A", 500, 0), seq("B", 500, 0)])
    ahead = StepShape(draft_rows=(2, 2, 2), draft_context_tokens=2 * 502)
    assert t1 == pytest.approx(cost.concurrent_time_s(shape_of(plain), True, ahead), rel=1e-12)
    assert first.ahead_s == pytest.approx(cost.draft_time_s(ahead), rel=1e-12)
    assert first.ahead_exposed_s == pytest.approx(t1 - cost.verify_time_s(shape_of(plain), True), rel=1e-9)
    assert first.draft_s == 0.0
    # Next step A verifies its 3 ready drafts (all accepted) at the price of verification alone.
    plan = StepPlan([seq("A", 501, 3)])
    second, t2 = ex.step(plan)
    assert second.num_accepted_tokens == {"A": 3} and len(second.sampled_token_ids["A"]) == 4
    assert t2 == pytest.approx(cost.verify_time_s(shape_of(plan), True), rel=1e-12)
    assert second.draft_s == 0.0 and ex.ahead_verified == 3 and ex.ahead_drafted == 6
    # Used up: the same drafts again would be drafted in the open.
    third, t3 = ex.step(StepPlan([seq("A", 505, 3)]))
    assert t3 == pytest.approx(cost.step_time_s(shape_of(StepPlan([seq("A", 505, 3)]))), rel=1e-12)
    assert third.draft_s > 0


def test_a_guess_holds_only_if_every_draft_and_the_bonus_token_pass():
    """Accepted counts are the run-ahead draw cut at k, so they are distributed as without it; the
    guess holds in the share of rounds where k + 1 positions pass."""
    cost = gpu()
    ex, held, accepted = SimExecutor(cost, seed=3), 0, []
    for i in range(3000):
        ex.add_request(f"r{i}", 0.8)
        result, _ = ex.step(StepPlan([seq(f"r{i}", 100, 2, ahead=2)]))
        held += result.draft_ready[f"r{i}"] == 2
        accepted.append(result.num_accepted_tokens[f"r{i}"])
    p = [0.8 * 0.97 ** m for m in range(3)]
    assert held / 3000 == pytest.approx(p[0] * p[1] * p[2], abs=0.03)
    assert accepted.count(2) / 3000 == pytest.approx(p[0] * p[1], abs=0.03)
    assert accepted.count(0) / 3000 == pytest.approx(1 - p[0], abs=0.03)


def test_a_preempted_or_released_request_loses_its_ready_drafts():
    ex = SimExecutor(gpu())
    ex.add_request("A", 1.0)
    assert ex.step(StepPlan([seq("A", 100, 0, ahead=2)]))[0].draft_ready == {"A": 2}
    ex.step(StepPlan(preempted_ids=["A"]))
    _, t = ex.step(StepPlan([seq("A", 0, 2)]))
    assert t > ex.cost.verify_time_s(shape_of(StepPlan([seq("A", 0, 2)])), True)   # drafted in the open


def chooser(pass_s: float, exposed: float | None, acceptance: float, rows: int = 64) -> RunAheadChooser:
    """A chooser over a cost model that has measured plain steps of `rows` decodes (10 ms + 0.1 ms a
    token), draft passes of `pass_s` and (unless None) run-ahead steps exposing `exposed` of their
    drafting, and requests that accepted a share `acceptance` of their drafts."""
    cost = StepCostModel()
    for i in range(40):
        n = rows + i % 8
        cost.observe(n, 0.010 + 0.0001 * n, draft_s=pass_s * 2, draft_pass_s=pass_s, draft_rows=rows, draft_depth=2)
        if exposed is not None:
            cost.observe(n, 0.010 + 0.0001 * n + exposed * pass_s * 2, ahead_s=pass_s * 2,
                         ahead_exposed_s=exposed * pass_s * 2, ahead_rows=rows, ahead_depth=2)
    model = AcceptanceModel(8, optimistic=False)
    for r in range(rows):
        for _ in range(30):
            model.observe(f"r{r}", 4, 4 if acceptance >= 0.9 else 0)
    return RunAheadChooser(model, cost, 8)


def test_running_ahead_pays_where_drafting_passes_are_dear_and_hide():
    rows = 64
    ids, limits, lengths = [f"r{i}" for i in range(rows)], [8] * rows, [8] * rows   # what pays in the open
    c = chooser(pass_s=0.004, exposed=0.0, acceptance=0.95)
    now, ahead = c.choose(ids, limits, rows, lengths, [0] * rows, [8] * rows)
    assert c.ahead and now == [0] * rows and all(a > 0 for a in ahead)      # nobody has drafts ready yet
    now, ahead = c.choose(ids, limits, rows, lengths, [3] * 32 + [0] * 32, [8] * rows)
    assert now == [3] * 32 + [0] * 32                                       # the ready ones verify them
    # The same drafts exposed in full (no concurrency): drafting in the open wins.
    c = chooser(pass_s=0.004, exposed=1.0, acceptance=0.95)
    assert c.choose(ids, limits, rows, lengths, [0] * rows, [8] * rows) == (lengths, [0] * rows)
    assert not c.ahead
    # Lookups cost no pass (n-gram, suffix): running ahead only loses drafts.
    c = chooser(pass_s=0.0, exposed=0.0, acceptance=0.95)
    assert c.choose(ids, limits, rows, lengths, [0] * rows, [8] * rows) == (lengths, [0] * rows)
    # Requests whose drafts are rejected: a failed guess is a plain step, nothing to gain.
    c = chooser(pass_s=0.004, exposed=0.0, acceptance=0.0)
    assert c.choose(ids, limits, rows, [0] * rows, [0] * rows, [8] * rows)[1] == [0] * rows


def test_the_chooser_keeps_its_mode_within_the_dead_band():
    rows = 64
    ids, limits, lengths = [f"r{i}" for i in range(rows)], [8] * rows, [2] * rows
    c = chooser(pass_s=0.004, exposed=0.0, acceptance=0.95)
    c.choose(ids, limits, rows, lengths, [0] * rows, [8] * rows)
    assert c.ahead
    tables = [c._survival(r) for r in ids]
    best = max(c._ahead_rate(tables, [k] * rows, rows) for k in range(1, 9))
    open_rate = c._open_rate(tables, lengths, rows)
    assert best > open_rate * 1.03
    c.dead_band = best / open_rate - 1 + 0.01         # the open mode is now within the band: stay ahead
    c.choose(ids, limits, rows, lengths, [0] * rows, [8] * rows)
    assert c.ahead
    c.ahead = False                                   # ... and from the open mode, do not switch
    c.choose(ids, limits, rows, lengths, [0] * rows, [8] * rows)
    assert not c.ahead


def test_run_ahead_needs_the_adaptive_policy_in_one_pass_and_the_engine_refuses_it():
    with pytest.raises(ConfigError, match="run_ahead must be one of"):
        SpecConfig(run_ahead="sometimes")
    with pytest.raises(ConfigError, match="adaptive length policy"):
        SpecConfig(policy="fixed", run_ahead="auto")
    with pytest.raises(ConfigError, match="adaptive length policy"):
        SpecConfig(frontier_size=4, run_ahead="always")
    from tandem.speculative.factory import make_spec_decoder

    with pytest.raises(ConfigError, match="simulator"):
        make_spec_decoder(SpecConfig(run_ahead="auto"), runner=None, target_vocab=100)


def run(run_ahead: str, rate: float, n: int = 80, seed: int = 0):
    spec = SpecConfig(method="draft", draft_model="x", policy="adaptive", max_draft_tokens=8, run_ahead=run_ahead)
    cfg = SimConfig(scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=256, max_model_len=8192),
                    spec=spec, seed=seed)
    wl = WorkloadSpec(dataset="synthetic", num_requests=n, rate=rate)
    return simulate(gpu(), cfg, build_workload(wl, seed))


def test_end_to_end_run_ahead_serves_every_token_and_is_deterministic():
    off, always = run("off", 1000.0), run("always", 1000.0)
    assert off.summary["completed"] == always.summary["completed"] == 80
    assert off.summary["total_output_tokens"] == always.summary["total_output_tokens"]
    ra = always.counters["run_ahead"]
    assert ra["steps_ahead"] == ra["steps_chosen"] > 0 and 0 < ra["verified"] < ra["drafted"]
    assert "run_ahead" not in off.counters
    again = run("always", 1000.0)
    assert [dataclasses.astuple(r) for r in again.records] == [dataclasses.astuple(r) for r in always.records]


def test_auto_runs_ahead_under_load_and_not_for_a_lone_request():
    busy = run("auto", 1000.0, n=200)
    assert busy.counters["run_ahead"]["steps_ahead"] > 0
    busy_off = run("off", 1000.0, n=200)
    assert busy.counters["busy_s"] < busy_off.counters["busy_s"]
    lone = run("auto", 0.05, n=6)             # one request at a time: a failed guess costs a plain step
    assert lone.counters["run_ahead"]["steps_ahead"] == 0
