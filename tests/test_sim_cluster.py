"""The cluster scenario: N simulated replicas (real Scheduler + KV manager) behind tandem.router."""

from __future__ import annotations

import json

import pytest

from tandem.router import Router
from tandem.sim.build import SimConfig
from tandem.sim.cluster import simulate_cluster
from tandem.sim.cost import make_cost_model
from tandem.sim.metrics import SLO
from tandem.sim.scenarios.common import default_scheduler
from tandem.sim.sessions import build_sessions

COST = make_cost_model("A100-80GB", "llama2-13b")
CFG = SimConfig(scheduler=default_scheduler(), seed=0)
SLO_ = SLO(ttft_s=2.0)


def run(policy, workload="tools", n=4, sessions=24, rate=2.0, seed=0):
    return simulate_cluster(COST, CFG, build_sessions(workload, sessions, rate, seed), n, Router(policy, seed=seed), SLO_)


def test_sessions_resend_their_context():
    s = build_sessions("chat", 30, 1.0, 0)
    assert any(x.num_requests > 1 for x in s)
    tools = build_sessions("tools", 30, 1.0, 0)
    assert all(t.tool_followup for x in tools for t in x.turns[1:])
    assert all(not x.turns[0].tool_followup for x in tools)


def test_deterministic_for_a_seed():
    a, b = run("tandem"), run("tandem")
    def key(out):
        return [(r.request_id, r.first_token_s, r.finished_s) for r in out["records"]]

    assert key(a) == key(b)
    assert key(run("power_of_two", seed=0)) == key(run("power_of_two", seed=0))


def test_sessions_stick_under_tandem_when_not_overloaded():
    out = run("tandem")
    assert out["routing"]["followups"] > 0
    assert out["summary"]["followup_same_replica"] == 1.0
    # the follow-ups find their context cached: nearly all the resent tokens are hits
    assert out["summary"]["reuse_captured"] > 0.95
    rr = run("round_robin")
    assert rr["summary"]["followup_same_replica"] < 0.5
    assert rr["summary"]["cached_prompt_tokens"] < out["summary"]["cached_prompt_tokens"]


@pytest.mark.parametrize("policy", ["tandem", "round_robin", "power_of_two", "prefix"])
@pytest.mark.parametrize("workload", ["tools", "chat"])
def test_every_request_completes(policy, workload):
    out = run(policy, workload, sessions=12)
    s = out["summary"]
    expected = sum(x.num_requests for x in build_sessions(workload, 12, 2.0, 0))
    assert s["num_requests"] == s["completed"] <= expected
    assert s["num_requests"] >= expected * 0.9     # (a chat session stops before overflowing the context)


def test_cli_json_has_the_fields(tmp_path, capsys):
    from tandem.cli import main

    path = tmp_path / "c.json"
    rc = main(["simulate", "--scenario", "cluster", "--replicas", "2", "--rate", "0.5", "--requests", "3",
               "--workloads", "tools,chat", "--json", str(path)])
    assert rc == 0
    doc = json.loads(path.read_text())
    assert doc["scenario"] == "cluster"
    for w in doc["workloads"]:
        assert {r["policy"] for r in w["rows"]} == {"tandem", "round_robin", "power_of_two", "prefix"}
        for r in w["rows"]:
            s = r["summary"]
            for k in ("effective_throughput", "slo_attainment", "ttft_s", "prefix_hit_rate", "cached_prompt_tokens",
                      "reuse_captured", "followup_same_replica"):
                assert k in s, k
            assert len(r["per_replica"]) == 2
        assert "goodput_vs_power_of_two" in w["ratios"]["2"]
    assert "| replicas | router |" in capsys.readouterr().out
