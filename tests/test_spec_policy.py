"""The draft-length policies: FASER's adaptive controller pays only when speculation pays, gives
longer drafts to requests that keep accepting, and does not flap; the baselines do what they say."""

from __future__ import annotations

from tandem.sampling_params import SamplingParams
from tandem.sched.cost_model import StepCostModel
from tandem.sched.spec_length import AcceptanceModel, AdaptiveLength, BatchSizeTable, FixedLength
from tandem.types import Request


def reqs(n: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100)) for i in range(n)]


def teach(policy: AdaptiveLength, r: Request, drafted: int, accepted: int, times: int = 20) -> None:
    for _ in range(times):
        policy.observe_request(r, drafted, accepted)


def flat_cost() -> StepCostModel:
    """Memory-bound regime: a step costs about the same whatever its size (low load on a big machine)."""
    return StepCostModel(profile=[(1, 0.030), (8, 0.031), (16, 0.032), (64, 0.034)])


def steep_cost() -> StepCostModel:
    """Compute-bound regime: every extra token costs as much as a whole request's decode."""
    return StepCostModel(profile=[(1, 0.030), (8, 0.24), (16, 0.48), (64, 1.92)])


def test_zero_drafts_when_verification_costs_more_than_it_returns():
    policy = AdaptiveLength(8, steep_cost())
    rs = reqs(16)
    for r in rs:
        teach(policy, r, 4, 1)                       # mediocre acceptance
    assert policy.choose(rs, [8] * 16, num_base_tokens=16) == [0] * 16


def test_longer_drafts_for_requests_that_keep_accepting():
    policy = AdaptiveLength(8, flat_cost())
    good, bad = reqs(2)
    teach(policy, good, 8, 8)
    teach(policy, bad, 8, 0)
    k_good, k_bad = policy.choose([good, bad], [8, 8], num_base_tokens=2)
    assert k_good == 8 and k_bad < k_good
    # Same history, steep cost: the good request may still pay; the bad one never does.
    policy.cost = steep_cost()
    policy._last.clear()
    k_good2, k_bad2 = policy.choose([good, bad], [8, 8], num_base_tokens=2)
    assert k_bad2 == 0 and k_good2 <= k_good


def test_lengths_respect_limits():
    policy = AdaptiveLength(8, flat_cost())
    rs = reqs(3)
    for r in rs:
        teach(policy, r, 8, 8)
    assert policy.choose(rs, [0, 2, 8], num_base_tokens=3) == [0, 2, 8]


def test_no_flapping_under_steady_load():
    """Acceptance noise around a steady mean must not flip lengths step to step."""
    policy = AdaptiveLength(8, StepCostModel(profile=[(1, 0.03), (8, 0.04), (16, 0.06), (32, 0.1), (64, 0.2)]))
    rs = reqs(8)
    for r in rs:
        teach(policy, r, 6, 3)
    history = []
    for step in range(60):
        for i, r in enumerate(rs):                    # accepted 2, 3 or 4 of 6: the same mean
            policy.observe_request(r, 6, 2 + (step + i) % 3)
        history.append(tuple(policy.choose(rs, [8] * 8, num_base_tokens=8)))
    changes = sum(a != b for a, b in zip(history, history[1:]))
    assert changes <= 6, f"{changes} changes in 60 steady steps"


def test_cost_model_learns_online_and_is_monotone():
    cost = StepCostModel(base_s=0.5, per_token_s=0.5)     # a bad prior
    for _ in range(50):
        for n, t in [(1, 0.03), (4, 0.032), (16, 0.05), (64, 0.15)]:
            cost.observe(n, t)
    assert abs(cost.time(1) - 0.03) < 0.005 and abs(cost.time(64) - 0.15) < 0.01
    times = [cost.time(n) for n in range(1, 100)]
    assert all(a <= b + 1e-12 for a, b in zip(times, times[1:]))


def test_fixed_length_is_capped_by_limits():
    assert FixedLength(4).choose(reqs(3), [8, 2, 0], 3) == [4, 2, 0]


def test_batch_size_table_uses_hysteresis():
    table = BatchSizeTable(((1, 8), (4, 4), (16, 1), (32, 0)), hysteresis=0.25)
    assert table.choose(reqs(2), [8] * 2, 2) == [8, 8]
    assert table.choose(reqs(4), [8] * 4, 4) == [8] * 4          # 4 < 4 * 1.25: stays on the row
    assert table.choose(reqs(5), [8] * 5, 5) == [4] * 5          # 5 >= 4 * 1.25: moves
    assert table.choose(reqs(4), [8] * 4, 4) == [4] * 4
    assert table.choose(reqs(3), [8] * 3, 3) == [4] * 3          # 3 >= 4 * 0.75: stays
    assert table.choose(reqs(2), [8] * 2, 2) == [8] * 2          # 2 < 3: back
    assert table.choose(reqs(40), [8] * 40, 40) == [0] * 40


def test_cost_model_separates_the_per_position_draft_cost():
    """Steps cost 10 ms + 1 ms per token + 5 ms per draft position (one draft-model pass each)."""
    cost = StepCostModel()
    for i in range(200):
        n, d = 8 + (i * 7) % 120, i % 5
        cost.observe(n + d * 4, 0.010 + 0.001 * (n + d * 4) + 0.005 * d, depth=d)
    assert abs(cost.depth_s - 0.005) < 2e-4
    a, b = cost.line(64)
    assert abs(b - 0.001) < 1e-4 and abs(a - 0.010) < 1e-3
    flat = StepCostModel()                  # n-gram drafting: depth costs nothing extra
    for i in range(200):
        n, d = 8 + (i * 7) % 120, i % 5
        flat.observe(n, 0.010 + 0.001 * n, depth=d)
    assert flat.depth_s < 1e-6


def test_adaptive_drafts_shallower_when_each_position_costs_a_draft_pass():
    """Same acceptance, same per-token cost: a per-position cost (a draft model's forward) must cut
    the chosen depth, and a large one must switch speculation off."""
    def trained(depth_s: float) -> StepCostModel:
        cost = StepCostModel()
        for i in range(200):
            n, d = 8 + (i * 7) % 120, i % 5
            cost.observe(n, 0.030 + 0.0001 * n + depth_s * d, depth=d)
        return cost

    rs = reqs(8)
    lengths = {}
    for depth_s in (0.0, 0.004, 0.05):
        policy = AdaptiveLength(8, trained(depth_s))
        for r in rs:
            for accepted in (2, 5, 8, 3, 6, 1, 7, 4):   # survival falls gradually with depth
                teach(policy, r, 8, accepted, times=3)
        lengths[depth_s] = policy.choose(rs, [8] * 8, num_base_tokens=8)
    assert max(lengths[0.0]) > max(lengths[0.004]) > 0
    assert lengths[0.05] == [0] * 8


def test_untried_deeper_positions_inherit_the_requests_own_acceptance():
    """A request that accepted every draft at positions 1-4 is expected to keep accepting at 5-8
    (a copy run), not to fall back to the batch's prior there; a request that keeps rejecting at
    position 1 is expected to reject deeper too."""
    model = AcceptanceModel(8, prior=0.5, explore=0.0)
    for _ in range(20):
        model.observe("run", num_drafted=4, num_accepted=4)
        model.observe("miss", num_drafted=4, num_accepted=0)
    run, miss = model.estimates("run"), model.estimates("miss")
    assert min(run[4:]) > 0.8 and max(miss[1:]) < 0.2
    policy = AdaptiveLength(8, flat_cost())
    for _ in range(20):
        policy.observe_request(reqs(1)[0], num_drafted=4, num_accepted=4)
    assert policy.choose(reqs(1), [8], num_base_tokens=1) == [8]


def saturated_gpu_cost() -> StepCostModel:
    """A big batch on a GPU: a forward costs 10 ms plus 0.1 ms per token (compute-bound)."""
    return StepCostModel(profile=[(n, 0.010 + 0.0001 * n) for n in (1, 16, 64, 256, 1024, 2048, 4096)])


def test_frontiers_chosen_only_where_pruning_pays():
    from tandem.sched.spec_length import frontier_pays

    rejecting = [[0.3] * 8] * 256          # drafts past the first few are almost never accepted
    accepting = [[0.98] * 8] * 256
    ks = [8] * 256
    # Compute-bound and most drafts rejected: frontiers of 2 skip most of the 8 x 256 draft rows.
    assert frontier_pays(rejecting, ks, 2, 256, saturated_gpu_cost())
    # Nothing to prune: every pass is paid and no rows are saved.
    assert not frontier_pays(accepting, ks, 2, 256, saturated_gpu_cost())
    # Weight-streaming-bound (flat cost): an extra pass costs a whole step, pruned rows almost nothing.
    assert not frontier_pays(rejecting[:4], [8] * 4, 2, 4, flat_cost())
    # Drafts no longer than one frontier: one pass either way.
    assert not frontier_pays(rejecting, [2] * 256, 2, 256, saturated_gpu_cost())


def test_frontier_chooser_learns_acceptance_and_forgets_finished_requests():
    from tandem.sched.spec_length import FrontierChooser

    chooser = FrontierChooser(2, 8, saturated_gpu_cost())
    rs = reqs(256)
    for r in rs:
        for _ in range(20):
            chooser.observe_request(r, 8, 8)                 # every draft accepted: nothing to prune
    assert chooser.choose(rs, [8] * 256, 256) == 0
    for r in rs:
        for _ in range(20):
            chooser.observe_request(r, 8, 0)                 # now every first draft is rejected
    assert chooser.choose(rs, [8] * 256, 256) == 2
    assert (chooser.num_split, chooser.num_whole) == (1, 1)
    chooser.forget(rs[0].request_id)
    assert rs[0].request_id not in chooser.acceptance._acc
