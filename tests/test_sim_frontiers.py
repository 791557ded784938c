"""The simulator's model of FASER's verification frontiers and of drafting overlapped with them."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.config import SchedulerConfig, SpecConfig
from tandem.sampling_params import SamplingParams
from tandem.sim import SimConfig, WorkloadSpec, build_workload, make_cost_model, simulate
from tandem.sim.cost import StepShape
from tandem.sim.cost.base import frontier_step, shape_of
from tandem.sim.executor import SimExecutor
from tandem.types import ScheduledSeq, StepPlan


def seq(rid: str, start: int, k: int, num_tokens: int = 1) -> ScheduledSeq:
    return ScheduledSeq(rid, [5] * num_tokens, start, [], True, SamplingParams(), 0, num_draft_tokens=k)


def test_a_rejection_cancels_the_later_frontiers():
    # A drafts 6 and accepts 1 (rejected in frontier 0); B drafts 6 and accepts all; C drafts none.
    plan = StepPlan([seq("A", 100, 6), seq("B", 200, 6), seq("C", 50, 0)])
    step = frontier_step(plan, {"A": 1, "B": 6}, 2, overlap=False)
    assert [v.num_tokens for v in step.verify] == [3 + 3 + 1, 2, 2]      # then B alone, twice
    assert [v.num_seqs for v in step.verify] == [3, 1, 1]
    # B's frontier 1 reads its context up to its 4th draft: start 200 + 1 committed + 2 drafts + 2.
    assert step.verify[1].context_tokens == 205
    assert step.verify[1].attention_pairs == 2 * 203 + 3
    assert step.verify[0].draft_rows == () and step.verify[0].num_logit_rows == 7
    assert step.pruned == {"A": 4, "B": 0}                              # A's frontiers 1 and 2
    # Without overlap every slot is drafted up front: the unsplit step's drafting.
    assert step.drafts == (StepShape(draft_rows=(2,) * 6, draft_context_tokens=302),)
    assert shape_of(plan).draft_rows == step.drafts[0].draft_rows


def test_overlap_drafts_each_next_frontier_for_the_sequences_still_alive():
    plan = StepPlan([seq("A", 100, 6), seq("B", 200, 5)])
    step = frontier_step(plan, {"A": 2, "B": 5}, 2, overlap=True)
    # A: frontier 0 accepted, rejection in frontier 1 -> 2 passes; B: all 3 passes.
    assert len(step.verify) == 3 and step.verify[2].num_tokens == 1      # B's last draft
    # Frontier 0 up front; frontier f+1 during pass f for those alive at its start; nothing after.
    assert [d.draft_rows for d in step.drafts] == [(2, 2), (2, 2), (2, 1), ()]
    assert step.drafts[1].draft_context_tokens == (100 + 1 + 2) + (200 + 1 + 2)


def test_one_frontier_holding_every_draft_costs_what_the_unsplit_step_costs():
    cost = make_cost_model("H100-80GB", "qwen3-32b", "qwen3-0.6b", num_gpus=2)
    plan = StepPlan([seq("A", 300, 4), seq("B", 900, 3), seq("C", 0, 0, num_tokens=64)])
    unsplit, frontiers = SimExecutor(cost), SimExecutor(cost, frontier_size=8)
    for ex in (unsplit, frontiers):
        ex.add_request("A", 0.7)
        ex.add_request("B", 0.7)
        ex.add_request("C", 0.7)
    a, t_a = unsplit.step(plan)
    b, t_b = frontiers.step(plan)
    assert a.num_accepted_tokens == b.num_accepted_tokens
    assert t_a == pytest.approx(t_b, rel=1e-12)
    assert b.num_pruned_tokens == {"A": 0, "B": 0}


def test_the_simulated_executor_reports_its_drafting_as_the_engine_runner_does():
    """Whole or in frontiers, a step reports the draft model's time (less its prompt forward, which
    the simulated draft model runs with the target's prefill) and one draft pass's: the step-cost
    model's pass cost comes from these."""
    cost = make_cost_model("H100-80GB", "qwen3-32b", "qwen3-0.6b", num_gpus=2)
    plan = StepPlan([seq("A", 300, 4), seq("B", 900, 3), seq("C", 0, 0, num_tokens=64)])
    decode_only = dataclasses.replace(shape_of(plan), num_prefill_tokens=0)
    for ex in (SimExecutor(cost), SimExecutor(cost, frontier_size=2)):
        for rid in "ABC":
            ex.add_request(rid, 0.7)
        result, duration = ex.step(plan)
        assert result.draft_s == pytest.approx(cost.draft_time_s(decode_only), rel=1e-12)
        assert result.draft_pass_s == pytest.approx(result.draft_s / 4, rel=1e-12)
        assert 0 < result.draft_s < duration
    plain = SimExecutor(cost)
    plain.add_request("C", 0.7)
    result, _ = plain.step(StepPlan([seq("C", 0, 0, num_tokens=64)]))
    assert result.draft_s == 0.0 and result.draft_pass_s == 0.0


def test_concurrent_pass_hides_a_small_drafter_but_not_a_bandwidth_bound_one():
    cost = make_cost_model("H100-80GB", "qwen3-32b", "qwen3-0.6b", num_gpus=2)
    verify = StepShape(8, 24, 24, 0, 8 * 1000, 8 * 1000)
    draft = StepShape(draft_rows=(8, 8), draft_context_tokens=8 * 1000)
    t_v, t_d = cost.verify_time_s(verify, True), cost.draft_time_s(draft)
    both = cost.concurrent_time_s(verify, True, draft)
    assert max(t_v, t_d) <= both < t_v + t_d
    assert both == pytest.approx(t_v, rel=0.02)        # a 0.6B drafter fits beside a 32B verifier
    # Two equal bandwidth-bound passes cannot overlap: their bytes together take the sum.
    same = make_cost_model("H100-80GB", "qwen3-32b", "qwen3-32b", num_gpus=2)
    d = StepShape(draft_rows=(8,), draft_context_tokens=8 * 1000)
    v = StepShape(8, 8, 8, 0, 8 * 1000, 8 * 1000)
    assert same.concurrent_time_s(v, False, d) > 1.8 * same.forward_s(same.model, 8, 8, 8000, 8000)


def test_overlap_without_frontiers_is_refused():
    cost = make_cost_model("H100-80GB", "qwen3-32b", "qwen3-0.6b", num_gpus=2)
    with pytest.raises(ValueError, match="frontier_size"):
        SimExecutor(cost, overlap=True)


def run(frontier_size: int = 0, overlap: bool = False, acceptance_scale: float = 1.0, auto: bool = False):
    cost = make_cost_model("H100-80GB", "qwen3-32b", "qwen3-0.6b", num_gpus=2)
    spec = SpecConfig(method="draft", draft_model="x", policy="fixed", max_draft_tokens=8,
                      frontier_size=frontier_size, overlap=overlap, adaptive_frontiers=auto)
    cfg = SimConfig(scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=4096),
                    spec=spec)
    wl = WorkloadSpec(dataset="synthetic", num_requests=60, rate=2.0)
    reqs = [dataclasses.replace(r, acceptance=r.acceptance * acceptance_scale) for r in build_workload(wl, 0)]
    return simulate(cost, cfg, reqs)


def test_frontiers_prune_and_overlap_hides_drafting_end_to_end():
    plain, split, both = run(), run(frontier_size=2), run(frontier_size=2, overlap=True)
    for r in (plain, split, both):
        assert r.summary["completed"] == 60
    # Same acceptance draws (per-request seeded), so the same tokens are accepted.
    assert split.summary["spec"]["accepted_tokens"] == plain.summary["spec"]["accepted_tokens"]
    assert plain.summary["spec"]["pruned_tokens"] == 0 < split.summary["spec"]["pruned_tokens"]
    # Overlap hides frontier f+1's drafting behind pass f: less busy time than frontiers alone.
    assert both.counters["busy_s"] < split.counters["busy_s"]


def test_faser_scenario_reports_the_frontier_ablation():
    from tandem.sim.report import faser_tables
    from tandem.sim.scenarios.faser import ABLATION, RUNS, FaserOptions, run_faser

    res = run_faser(FaserOptions(num_requests=60, saturation_requests=60), log=lambda _: None)
    assert [r["label"] for r in res["rows"]] == [r.label for r in RUNS]
    assert [r["label"] for r in res["ablation"]] == [r.label for r in ABLATION]
    by = {r["label"]: r for r in res["rows"] + res["ablation"]}
    assert by["fixed-8"]["summary"]["spec"]["pruned_tokens"] == 0
    assert by["fixed-8+frontiers"]["summary"]["spec"]["pruned_tokens"] > 0
    assert "adaptive+frontiers" not in res["headline"]["ours"]["vs"]
    assert "fixed-8+frontiers+overlap" in faser_tables(res)


def test_frontiers_chosen_per_step_keep_light_load_steps_whole():
    # At 2 requests/s the 32B target is weight-streaming-bound: a frontier pass costs a whole forward.
    plain, split, auto = run(), run(frontier_size=2), run(frontier_size=2, auto=True)
    assert auto.summary["tpot_s"]["mean"] <= 1.05 * plain.summary["tpot_s"]["mean"]
    assert split.summary["tpot_s"]["mean"] > 2 * plain.summary["tpot_s"]["mean"]
    assert auto.summary["spec"]["accepted_tokens"] == plain.summary["spec"]["accepted_tokens"]
