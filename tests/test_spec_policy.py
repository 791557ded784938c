"""The draft-length policies: FASER's adaptive controller pays only when speculation pays, gives
longer drafts to requests that keep accepting, and does not flap; the baselines do what they say."""

from __future__ import annotations

import pytest

from tandem.sampling_params import SamplingParams
from tandem.sched.cost_model import StepCostModel
from tandem.sched.acceptance import AcceptanceModel
from tandem.sched.spec_length import AdaptiveLength, BatchSizeTable, FixedLength
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


def test_cost_model_learns_the_target_line_and_the_draft_pass_apart():
    """Steps cost 10 ms + 1 ms per target token, plus one draft pass per position (3 ms over one
    row, 5 ms over four); every fifth step's first pass also feeds the draft model a prompt. The
    draft time is reported, so the target line and the pass cost come out exactly, catch-ups aside."""
    cost = StepCostModel()
    for i in range(200):
        rows, d = (1, 4)[i % 2], 1 + i % 5
        n = rows * (1 + d) + (i * 7) % 60
        pass_s = 0.003 if rows == 1 else 0.005
        draft_s = pass_s * d + (0.040 if i % 5 == 0 else 0.0)
        cost.observe(n, 0.010 + 0.001 * n + draft_s, draft_s, pass_s if i % 5 else draft_s / d, rows)
    assert abs(cost.draft_pass_s(1) - 0.003) < 1e-9 and abs(cost.draft_pass_s(4) - 0.005) < 1e-9
    a, b = cost.line(32)
    assert abs(b - 0.001) < 1e-6 and abs(a - 0.010) < 1e-5
    ngram = StepCostModel()                 # n-gram drafting: lookups, no forward pass
    for i in range(50):
        ngram.observe(8 + i, 0.010 + 0.001 * (8 + i), draft_s=0.0001, draft_pass_s=0.0, draft_rows=4)
    assert ngram.draft_pass_s(4) == 0.0


def test_a_verified_draft_is_priced_at_what_drafts_added_to_measured_steps():
    """A CPU step costs 5 ms + 0.7 ms per token + 0.8 ms per sampled row. Near 64 decodes the steps
    whose size varies are prefill chunks (one sampled row each), so the token line's slope there is
    about a prefill token's 0.7 ms; a verified draft is a token and a sampled row, 1.5 ms, which is
    what the steps that verified drafts measure. Priced as a prefill token, first drafts accepted
    half the time look worth admitting at 64 decodes (a decode costs 1.6 ms per generated token
    there: every request drafted once); priced as measured, they are not."""
    def step(tokens: int, rows: int) -> float:
        return 0.005 + 0.0007 * tokens + 0.0008 * rows

    def learned(verify: bool) -> StepCostModel:
        cost = StepCostModel()
        for i in range(120):
            cost.observe(64, step(64, 64))                        # plain decode steps
            p = 8 + (i * 37) % 400                                # a prefill chunk beside 64 decodes
            cost.observe(64 + p, step(64 + p, 65))
            if verify and i % 4 == 0:
                k = 8 + i % 40                                    # drafts verified beside 64 decodes
                cost.observe(64 + k, step(64 + k, 64 + k), verified_drafts=k, decode_rows=64)
        return cost

    cost, unverified = learned(True), learned(False)
    token_line = unverified.times(64, 5)
    assert token_line[1] - token_line[0] < 0.0010                 # mostly the prefill token's price
    assert unverified.draft_times(64, 64, 5) == token_line      # nothing measured: the token line
    priced = cost.draft_times(64, 64, 5)
    assert [b - a for a, b in zip(priced, priced[1:])] == pytest.approx([0.0015] * 4, rel=1e-6)

    def choose(c: StepCostModel) -> int:
        policy = AdaptiveLength(8, c)
        rs = reqs(64)
        for r in rs:
            for _ in range(5):                                    # first drafts accepted half the time
                teach(policy, r, 4, 0, times=1)
                teach(policy, r, 4, 3, times=1)
        return sum(policy.choose(rs, [8] * 64, num_base_tokens=64))

    assert choose(unverified) > 0 and choose(cost) == 0


def test_adaptive_drafts_shallower_when_each_position_costs_a_draft_pass():
    """Same acceptance, same per-token cost: a per-position cost (a draft model's forward) must cut
    the chosen depth, and a large one must switch speculation off."""
    def trained(pass_s: float) -> StepCostModel:
        cost = StepCostModel()
        for i in range(200):
            n, d = 8 + (i * 7) % 120, i % 5
            cost.observe(n, 0.030 + 0.0001 * n + pass_s * d, pass_s * d, pass_s if d else 0.0, 8)
        return cost

    rs = reqs(8)
    lengths = {}
    for pass_s in (0.0, 0.004, 0.05):
        policy = AdaptiveLength(8, trained(pass_s))
        for r in rs:
            for accepted in (2, 5, 8, 3, 6, 1, 7, 4):   # survival falls gradually with depth
                teach(policy, r, 8, accepted, times=3)
        lengths[pass_s] = policy.choose(rs, [8] * 8, num_base_tokens=8)
    assert max(lengths[0.0]) > max(lengths[0.004]) > 0
    assert lengths[0.05] == [0] * 8


def test_adaptive_measures_the_plain_step_before_drafting():
    """A batch size the cost model has not measured runs plain: the decision compares drafting with
    the plain step's own time, not with an extrapolation from prefills."""
    cost = StepCostModel()
    for n in (120, 90, 110):                # prefills only (memory-bound: tokens are cheap)
        cost.observe(n, 0.010 + 0.0002 * n)
    policy = AdaptiveLength(8, cost)
    rs = reqs(4)
    for r in rs:
        teach(policy, r, 8, 8)
    assert policy.choose(rs, [8] * 4, num_base_tokens=4) == [0] * 4
    cost.observe(4, 0.011)
    assert policy.choose(rs, [8] * 4, num_base_tokens=4) == [0] * 4
    cost.observe(4, 0.011)
    assert max(policy.choose(rs, [8] * 4, num_base_tokens=4)) > 0   # measured; drafting is untried


def _draft_model_cost(plain_s: float, rows: int, verify: tuple[int, float], pass_s: float) -> StepCostModel:
    """A cost model that saw what the engine sees with a draft model: plain steps of `rows` tokens,
    verification steps of (tokens, target seconds) each after 8 draft passes, and prefills."""
    cost = StepCostModel()
    for i in range(30):
        cost.observe(rows, plain_s)
        n, t = verify
        cost.observe(n, t + 8 * pass_s, 8 * pass_s, pass_s, rows)
        if i % 10 == 0:
            cost.observe(100, 0.36)
    return cost


def test_adaptive_switches_a_draft_model_off_where_verification_is_compute_bound():
    """The self-drafter on 2 CPU cores (float32 target, Q4 drafter), measured: at 4 streams a plain
    step takes 26 ms, verifying 4 x 9 rows 174 ms and a draft pass 17 ms, so no length pays even at
    93% acceptance; at one stream (30 ms plain, 9 rows verified in 32 ms, 12 ms passes) drafting
    pays."""
    for rows, plain_s, verify, pass_s, drafts in ((4, 0.026, (36, 0.174), 0.017, False),
                                                  (1, 0.030, (9, 0.032), 0.012, True)):
        policy = AdaptiveLength(8, _draft_model_cost(plain_s, rows, verify, pass_s))
        rs = reqs(rows)
        for r in rs:
            for accepted in (8, 8, 5, 8, 7, 8, 8, 6):
                teach(policy, r, 8, accepted, times=3)
        ks = policy.choose(rs, [8] * rows, num_base_tokens=rows)
        assert (max(ks) > 0) == drafts, (rows, ks)


def test_a_draft_models_catch_up_is_learned_and_charged_to_a_requests_first_drafts():
    """The draft time the passes do not explain, per token the draft model had to read first, is
    the catch-up cost; a request whose prompt the drafter has not read pays it (amortized over its
    remaining tokens) before drafting pays, one it has read does not."""
    cost = StepCostModel()
    for i in range(40):
        cost.observe(1, 0.020)                                  # plain one-stream steps
        unread = 400 if i % 4 == 0 else 1                       # a new request every 4th step
        draft_s = 8 * 0.002 + 0.001 * unread
        cost.observe(9, 0.022 + draft_s, draft_s, 0.002, 1, 8, unread)
    assert cost.catch_up_s_per_token == pytest.approx(0.001)
    policy = AdaptiveLength(8, cost)
    new, old = (Request(rid, [1] * 400, SamplingParams(max_tokens=16)) for rid in ("new", "old"))
    for r in (new, old):
        r.num_computed_tokens = 400
        teach(policy, r, 8, 8)
    old.draft.num_seen = 400
    assert policy.choose([old], [8], num_base_tokens=1)[0] > 0
    assert policy.choose([new], [8], num_base_tokens=1) == [0]


def test_an_expensive_drafter_nobody_has_tried_is_tried_then_kept_or_dropped():
    """The self-drafter on an AVX512-BF16 CPU, measured: one stream's plain step 14.3 ms, 5 rows
    verified in 17.9 ms, a draft pass 7.9 ms. At the old prior (50% acceptance) no length pays,
    so the policy never drafted and never saw the 95% its drafts get; an untried drafter now
    counts as accepted, is tried, and is kept where it is accepted and dropped where it is not."""
    def cost() -> StepCostModel:
        c = StepCostModel()
        for _ in range(20):
            c.observe(1, 0.0143)
            c.observe(5, 0.0179 + 4 * 0.0079, 4 * 0.0079, 0.0079, 1, 4)
        return c

    cautious = AdaptiveLength(8, cost())
    cautious.acceptance.optimistic = False
    assert cautious.choose(reqs(1), [8], num_base_tokens=1) == [0]       # the old behaviour: never tried
    tried = {}
    for accepts in (True, False):               # every draft accepted, or the first one rejected
        policy = AdaptiveLength(8, cost())
        tried[accepts] = []
        for i in range(300):                    # requests one after another, one step each
            r = Request(f"q{i}", [1, 2, 3], SamplingParams(max_tokens=100))
            k = policy.choose([r], [8], num_base_tokens=1)[0]
            if k:
                tried[accepts].append(i)
                policy.observe_request(r, k, k if accepts else 0)
            policy.forget(r.request_id)
    assert tried[True] == list(range(300))      # kept
    # Dropped after its first rejections, then retried as the evidence ages, each failed retry
    # doubling the wait before the next: a handful of tries in 300 steps.
    fails = tried[False]
    assert fails[0] == 0 and 3 <= len(fails) <= 6
    gaps = [b - a for a, b in zip(fails[1:], fails[2:])]
    assert all(g2 > 1.5 * g1 for g1, g2 in zip(gaps, gaps[1:])) and gaps[0] >= 10


def test_early_rejections_do_not_stop_drafting_for_good():
    """Eight requests each reject their first drafts (a chat template's markers drafted wrongly),
    then their text turns to copying, where every draft would pass. With evidence that never aged
    the policy stopped drafting after that first step and never learned the copying; now the
    idle evidence ages, drafting is tried again within some dozens of steps and then kept."""
    cost = StepCostModel(profile=[(8, 0.020), (16, 0.022), (32, 0.026), (64, 0.034), (128, 0.050)])
    policy = AdaptiveLength(8, cost)
    rs = reqs(8)
    stopped = resumed = None
    for step in range(400):
        ks = policy.choose(rs, [8] * 8, num_base_tokens=8)
        if stopped is None and not any(ks):
            stopped = step                      # the rejections stopped drafting
        elif stopped is not None and resumed is None and any(ks):
            resumed = step
        for r, k in zip(rs, ks):
            if k:                               # rejected until drafting stopped, then copying
                policy.observe_request(r, k, 0 if stopped is None else k)
    assert stopped is not None and resumed is not None and resumed - stopped >= 5
    assert policy.choose(rs, [8] * 8, num_base_tokens=8) == [8] * 8     # the copying was learned


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
    from tandem.sched.frontiers import frontier_pays

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
    from tandem.sched.frontiers import FrontierChooser

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
