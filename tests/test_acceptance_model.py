"""The measured draft model: `tandem bench acceptance`'s fitting, its measurement on an engine, and
the simulator consuming it (position ratios, offer chain, scenario parsing)."""

from __future__ import annotations

import json
import random

import pytest

from tandem.bench.acceptance import MIN_REACHED, fit_beta, fit_lognormal, fit_rounds
from tandem.sampling_params import SamplingParams
from tandem.sim.executor import FILL_TOKEN, SimExecutor, draw_accepted
from tandem.sim.workload import DraftModel, WorkloadSpec, build_workload, parse_acceptance
from tandem.types import ScheduledSeq, StepPlan


def test_fit_rounds_counts_offers_positions_and_persistence():
    # Request A: offer 3 accept 2, no offer, offer 2 accept 0. Request B: offer 1 accept 1, offer 1 accept 1.
    fit = fit_rounds([[(3, 2), (0, 0), (2, 0)], [(1, 1), (1, 1)]], max_draft=3)
    assert fit["num_rounds"] == 5 and fit["num_offering_rounds"] == 4
    assert fit["offer_rate"] == 0.8
    # Transitions: A offered->none, none->offered; B offered->offered. P(offer|offered) = 1/2, P(offer|none) = 1.
    assert fit["offer"] == [0.5, 1.0]
    assert fit["offer_lengths"] == [0.5, 0.25, 0.25]
    # Position 1 reached by all 4 offering rounds, passed by 3 (A's first, both of B's); positions
    # 2 and 3 only by A's first round (A's third rejected draft 1), which accepted 2 of its 3.
    assert fit["position_reached"] == [4, 1, 1]
    assert fit["position_acceptance"] == [0.75, 1.0, 0.0]
    assert fit["acceptance_rate"] == round(4 / 7, 4)
    assert fit["mean_accepted_length"] == 2.0
    # Every position reached fewer than MIN_REACHED times: one pooled rate, flat ratios.
    assert fit["position"] == [1.0, 1.0, 1.0]
    # With position 1 well measured, positions 2..3 are pooled: 1 of 2 passed.
    fit = fit_rounds([[(1, 1)] * (MIN_REACHED - 2) + [(3, 2), (0, 0), (2, 0)]], max_draft=3)
    first = (MIN_REACHED - 1) / MIN_REACHED
    assert fit["position_reached"][0] == MIN_REACHED
    assert fit["position"] == [1.0, round(0.5 / first, 4), round(0.5 / first, 4)]


def test_fit_rounds_keeps_well_measured_positions_apart():
    rounds = [[(2, 2)] * MIN_REACHED + [(2, 1)] * MIN_REACHED]
    fit = fit_rounds(rounds, max_draft=2)
    assert fit["position_acceptance"] == [1.0, 0.5]
    assert fit["position"] == [1.0, 0.5]


def test_fit_beta_removes_binomial_noise():
    rng = random.Random(0)
    # Every request has the same rate 0.3: the spread is all sampling noise, so the Beta is tight.
    trials = [50] * 200
    succ = [sum(rng.random() < 0.3 for _ in range(n)) for n in trials]
    a, b = fit_beta(succ, trials)
    assert a / (a + b) == pytest.approx(0.3, abs=0.02)
    assert a + b > 100
    # Rates spread between requests: a wide Beta with the same mean.
    rates = [rng.betavariate(3, 7) for _ in range(400)]
    succ = [sum(rng.random() < p for _ in range(100)) for p in rates]
    a, b = fit_beta(succ, [100] * 400)
    assert a / (a + b) == pytest.approx(0.3, abs=0.03)
    assert 5 < a + b < 20
    assert fit_beta([1], [2]) is None


def test_fit_lognormal():
    med, sigma, lo, hi = fit_lognormal([10, 100, 1000])
    assert med == pytest.approx(100, rel=1e-3) and lo == 10 and hi == 1000
    assert sigma == pytest.approx(1.8802, abs=1e-3)
    assert fit_lognormal([0]) is None


def test_draw_accepted_with_position_ratios():
    rng = random.Random(1)
    # base 0.5, ratio 2 from position 2: after the first acceptance every draft passes.
    counts = [draw_accepted(rng, 0.5, 4, 0.97, (1.0, 2.0)) for _ in range(4000)]
    assert set(counts) == {0, 4}
    assert counts.count(4) / len(counts) == pytest.approx(0.5, abs=0.03)
    # No position list: the geometric decay as before.
    rng = random.Random(1)
    assert draw_accepted(rng, 1.0, 3, 0.0) == 1


class _Cost:
    def step_time_s(self, shape):
        return 0.01

    def swap_time_s(self, n):
        return 0.0

    def draft_time_s(self, shape):
        return 0.0


def _decode_plan(rid: str, k: int) -> StepPlan:
    return StepPlan(seqs=[ScheduledSeq(rid, [FILL_TOKEN], 10, [0], True, SamplingParams(), 0, num_draft_tokens=k)])


def test_sim_executor_reports_offers_from_the_chain():
    ex = SimExecutor(_Cost(), seed=3)
    never_after_offer = DraftModel(position=(1.0,), offer=(0.0, 1.0), offer_lengths=(0.0, 1.0))
    ex.add_request("r", 0.5, never_after_offer)
    offers = []
    for _ in range(6):
        result, _ = ex.step(_decode_plan("r", 0))
        offers.append(result.draft_available["r"])
    # Starts "not offering": offers 2 (P(offer | none) = 1, always 2 drafts), then none, and so on.
    assert offers == [2, 0, 2, 0, 2, 0]
    # A draft-model kind (no chain) reports nothing: the scheduler asks for what it wants.
    ex.add_request("m", 0.5, DraftModel(position=(1.0, 0.5)))
    result, _ = ex.step(_decode_plan("m", 2))
    assert "m" not in result.draft_available and result.num_draft_tokens["m"] == 2


def test_parse_acceptance_and_workload():
    assert parse_acceptance([7, 3]) == ((7.0, 3.0), None)
    entry = {"beta": [2, 8], "position": [1, 1.5], "offer": [0.4, 0.3], "offer_lengths": [0.5, 0.5], "source": "x"}
    (a, b), draft = parse_acceptance(entry)
    assert (a, b) == (2.0, 8.0) and draft == DraftModel((1.0, 1.5), (0.4, 0.3), (0.5, 0.5))
    with pytest.raises(ValueError, match="offer_lengths"):
        parse_acceptance({"beta": [2, 8], "offer": [0.4, 0.3]})
    with pytest.raises(ValueError, match="needs 'beta'"):
        parse_acceptance({"position": [1]})
    wl = WorkloadSpec(dataset="synthetic", num_requests=20,
                      kinds={"chat": {"weight": 1, "prompt": [50, 0.1, 4, 100], "output": [20, 0.1, 4, 40]}},
                      acceptance={"chat": entry})
    reqs = build_workload(wl, 0)
    assert all(r.draft == draft for r in reqs)
    assert 0 < sum(r.acceptance for r in reqs) / len(reqs) < 0.5


def test_faser_measured_kinds(tmp_path):
    from tandem.sim.scenarios.faser import measured_kinds

    fit = fit_rounds([[(3, 1), (0, 0), (2, 2)], [(1, 0), (4, 4)]], 4)
    fit.update(prompt=[40, 0.2, 10, 80], output=[30, 0.3, 5, 60])
    doc = {"method": "ngram", "draft_tokens": 4, "temperature": 1.0, "machine": {"cpu": "test-cpu"},
           "datasets": {"humaneval": {"kinds": {"humaneval": fit}}}}
    path = tmp_path / "acc.json"
    path.write_text(json.dumps(doc))
    kinds, acceptance, about = measured_kinds(path)
    assert kinds == {"humaneval": {"weight": 2, "prompt": [40, 0.2, 10, 80], "output": [30, 0.3, 5, 60]}}
    entry = acceptance["humaneval"]
    assert entry["offer"] == fit["offer"] and entry["position"] == fit["position"]
    assert "acc.json" in entry["source"] and "test-cpu" in entry["source"]
    assert parse_acceptance(entry)[1].offer == tuple(fit["offer"])
    assert about["method"] == "ngram"
    other = tmp_path / "other.json"
    other.write_text("[1, 2]")
    for bad in (tmp_path / "missing.json", other):      # the CLI turns ValueError into exit code 2
        with pytest.raises(ValueError, match="tandem bench acceptance"):
            measured_kinds(bad)


def test_measure_on_an_engine_records_every_decode_round(tiny_loopy):
    from tandem.bench.acceptance import measure
    from tandem.config import SpecConfig
    from tandem.llm import LLM

    llm = LLM(model=str(tiny_loopy), dtype="float32", progress=False,
              speculative=SpecConfig(method="ngram", policy="fixed", max_draft_tokens=4))
    items = [("a", [5, 6, 7, 8, 5, 6, 7], 24), ("b", [9, 10, 11, 9, 10], 20), ("a", [3, 4, 3, 4], 16)]
    reqs = measure(llm, items, temperature=0.0, concurrency=2, log=lambda *_: None)
    assert sorted((r["kind"], r["prompt_tokens"]) for r in reqs) == [("a", 4), ("a", 7), ("b", 5)]
    stats = llm.engine.scheduler.spec_stats
    assert sum(o for r in reqs for o, _ in r["rounds"]) == stats.num_draft_tokens > 0
    assert sum(a for r in reqs for _, a in r["rounds"]) == stats.num_accepted_tokens > 0
    for r in reqs:
        # Every token after the first comes from a decode round: its accepted drafts plus one.
        assert sum(a + 1 for _, a in r["rounds"]) == r["output_tokens"] - 1
        assert all(0 <= a <= o <= 4 for o, a in r["rounds"])


def test_gpu_faser_acceptance_is_the_published_profile():
    from tandem.sim.scenarios.faser import PUBLISHED_ACCEPTANCE
    from tandem.sim.workload import DEFAULT_KINDS

    assert set(PUBLISHED_ACCEPTANCE) == set(DEFAULT_KINDS)       # every kind the scenario draws
    for kind, entry in PUBLISHED_ACCEPTANCE.items():
        (a, b), draft = parse_acceptance(entry)
        assert 0.65 < a / (a + b) < 0.8 and "2601.11580" in entry["source"]
        assert draft.offer is None and len(draft.position) == 8 and draft.position[0] == 1.0
