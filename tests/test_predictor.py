"""AugServe's Stage I predictor trained offline: state round trip, held-out ranking quality, the
policies' warm start, Kendall tau against scipy, and the `tandem predictor train` command."""

from __future__ import annotations

import json
import random

import pytest

from tandem.sampling_params import SamplingParams
from tandem.sched.cost_model import StepCostModel
from tandem.sched.policies import make_policy
from tandem.sched.predictor import OutputLengthPredictor, ToolStats, kendall_tau
from tandem.sim.predictor import as_request, evaluate, train
from tandem.sim.workload import WorkloadSpec, build_workload

WL = WorkloadSpec(dataset="augmented", num_requests=600)


@pytest.fixture(scope="module")
def state():
    return train(WL, seed=1)


def test_kendall_tau_matches_scipy_with_ties():
    from scipy.stats import kendalltau

    rng = random.Random(0)
    x = [rng.randint(0, 9) for _ in range(200)]
    y = [xi + rng.randint(-4, 4) for xi in x]
    assert kendall_tau(x, y) == pytest.approx(kendalltau(x, y)[0], abs=1e-12)
    assert kendall_tau([1.0] * 5, [1, 2, 3, 4, 5]) is None       # a constant ranking: undefined
    assert kendall_tau([1.0], [2.0]) is None


def test_state_round_trip_predicts_the_same(state):
    again = OutputLengthPredictor.from_state(json.loads(json.dumps(state["lengths"])))
    fresh = OutputLengthPredictor.from_state(state["lengths"])
    reqs = build_workload(WL, seed=0)[:50]
    assert [again.predict(as_request(s, i)) for i, s in enumerate(reqs)] == \
           [fresh.predict(as_request(s, i)) for i, s in enumerate(reqs)]
    tools = ToolStats.from_state(json.loads(json.dumps(state["tools"])))
    assert tools.state() == ToolStats.from_state(state["tools"]).state()
    bad = dict(state["lengths"], b=state["lengths"]["b"][:-1])
    with pytest.raises(ValueError, match="features"):
        OutputLengthPredictor.from_state(bad)


def test_trained_predictor_ranks_a_held_out_trace_and_a_cold_one_cannot(state):
    quality = evaluate(state, WL, seed=0)
    assert quality["kendall_tau"] is not None and quality["kendall_tau"] > 0.3, quality
    cold = OutputLengthPredictor()
    reqs = build_workload(WL, seed=0)
    assert kendall_tau([cold.predict(as_request(s, i)) for i, s in enumerate(reqs)],
                       [s.output_tokens for s in reqs]) is None       # every request gets the prior


def test_policies_start_from_the_trained_state(state):
    cost = StepCostModel()
    aug = make_policy("augserve", 256, cost, trained=state)
    assert aug.lengths.n == state["lengths"]["n"] and aug.lengths.w is not None
    kinds = set(state["tools"]["duration_s"])
    assert kinds and all(aug.tools.duration(k) == state["tools"]["duration_s"][k] for k in kinds)
    infercept = make_policy("infercept", 256, cost, trained=state)
    assert all(infercept.tools.duration(k) == state["tools"]["duration_s"][k] for k in kinds)
    # Each policy gets its own copy: learning in one run does not leak into the next.
    r = as_request(build_workload(WL, seed=0)[0], 0)
    aug.lengths.observe(r, 5000)
    assert make_policy("augserve", 256, cost, trained=state).lengths.n == state["lengths"]["n"]
    assert make_policy("fcfs-discard", 256, cost, trained=state).lengths.n == 0


def test_predictor_train_command(tmp_path, capsys):
    from tandem.cli import main

    out = tmp_path / "pred.json"
    assert main(["predictor", "train", "--requests", "300", "--seed", "3", "--eval-seed", "4",
                 "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["trained_on"]["seed"] == 3 and saved["evaluation"]["seed"] == 4
    assert "Kendall tau" in capsys.readouterr().out
    assert main(["predictor", "train", "--seed", "2", "--eval-seed", "2", "--json", str(out)]) == 2
    assert "must differ" in capsys.readouterr().err


def test_engine_bench_trains_on_its_own_request_builder(tiny_llama):
    """`tandem bench augmented` trains on a held-out trace built as its runs are (prompt words from
    the model's tokenizer, tool keys, token scaling): its predictions rank a trace of another seed."""
    import random as _random

    from tandem.bench.augmented import make_trace, prompt_ids, train_predictor
    from tandem.engine.tokenizer import Tokenizer
    from tandem.types import Request

    tok = Tokenizer(tiny_llama)
    state = train_predictor(tok, 400, seed=1001, tokens=0.25, tool_time=0.25)
    assert state["trained_on"]["builder"] == "engine" and state["trained_on"]["num_requests"] == 400
    lengths = OutputLengthPredictor.from_state(state["lengths"])
    rng = _random.Random(1)
    predicted, actual = [], []
    for i, (_, req) in enumerate(make_trace(200, 1.0, 1, 0.25, 0.25)):
        r = Request(f"r{i}", prompt_ids(tok, req, rng), SamplingParams(max_tokens=req.output_tokens))
        r.tool.key = req.type
        predicted.append(lengths.predict(r))
        actual.append(req.output_tokens)
    assert kendall_tau(predicted, actual) > 0.3
