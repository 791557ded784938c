"""tandem.integrations.policy_bridge: Tandem's policies as a host scheduler (vLLM's) consumes them.
Pure: no vLLM, no clock. tests/test_vllm_plugin.py runs them inside a real `vllm serve`."""

from __future__ import annotations

import json

import pytest

from tandem.config import ConfigError
from tandem.integrations.policy_bridge import BridgeConfig, PolicyBridge


def bridge(**options) -> PolicyBridge:
    return PolicyBridge(BridgeConfig.from_options(options), max_num_batched_tokens=256, max_draft_tokens=4)


def track(b: PolicyBridge, rid: str, prompt_len: int, arrival: float = 0.0, max_tokens: int = 64):
    prompt = [(7 * i) % 50 + 1 for i in range(prompt_len)]
    return b.track(rid, prompt, list(prompt), arrival, max_tokens)


def test_options_are_checked():
    with pytest.raises(ConfigError, match="unknown tandem option"):
        BridgeConfig.from_options({"polcy": "augserve"})
    with pytest.raises(ConfigError, match="unknown policy"):
        BridgeConfig.from_options({"policy": "infercept"})     # needs tool pauses, which vLLM lacks
    with pytest.raises(ConfigError, match="draft_policy"):
        BridgeConfig.from_options({"draft_policy": "fixed"})
    assert BridgeConfig.from_options(None) == BridgeConfig()


def test_stage1_ranks_by_predicted_service_time_and_fcfs_by_arrival():
    for policy, expected in (("augserve-stage1", ["short", "mid", "long"]), ("fcfs", ["long", "short", "mid"])):
        b = bridge(policy=policy)
        items = [(rid, track(b, rid, n, arrival=t)) for rid, n, t in (("long", 300, 0.0), ("short", 10, 0.1),
                                                                       ("mid", 100, 0.2))]
        assert b.ranked(items, now=1.0, kv_usage=0.0) == expected


def test_stage2_lets_a_starving_request_go_first():
    b = bridge(policy="augserve", max_wait_s=30.0)
    items = [(rid, track(b, rid, n, arrival=t)) for rid, n, t in (("old-long", 300, 0.0), ("new-short", 10, 25.0))]
    assert b.ranked(items, now=29.0, kv_usage=0.0) == ["new-short", "old-long"]
    assert b.ranked(items, now=31.0, kv_usage=0.0) == ["old-long", "new-short"]


def test_stage1_learns_output_lengths_from_finished_requests(tmp_path):
    """A trained predictor (`tandem predictor train`'s JSON) is loaded; finished requests refit it."""
    b = bridge(policy="augserve-stage1")
    for i in range(12):
        r = track(b, f"f{i}", 20)
        r.token_ids.extend([5] * 40)
        b.finished(f"f{i}", completed=True)
    assert b.policy.lengths.n == 12
    assert b.shadows == {}
    path = tmp_path / "predictor.json"
    path.write_text(json.dumps({"lengths": b.policy.lengths.state(), "tools": b.policy.tools.state()}))
    warm = bridge(policy="augserve-stage1", predictor=str(path))
    assert warm.policy.lengths.n == 12
    assert warm.policy.lengths.predict(track(warm, "q", 20)) == pytest.approx(40, rel=0.05)


def test_dynamic_budget_bounds_admissions_only():
    b = bridge(policy="augserve")                 # budget floor max(16, 256 // 8) = 32
    assert b.step_tokens(running_tokens=3, num_free_blocks=0, num_total_blocks=100) == 3 + 32
    assert b.step_tokens(running_tokens=3, num_free_blocks=100, num_total_blocks=100) == 256
    assert b.step_tokens(running_tokens=300, num_free_blocks=0, num_total_blocks=100) == 256
    static = bridge(policy="augserve-stage2")
    assert static.step_tokens(running_tokens=3, num_free_blocks=0, num_total_blocks=100) == 256


def test_draft_lengths_measure_first_then_follow_acceptance():
    b = bridge()
    rs = [track(b, f"r{i}", 8) for i in range(2)]
    assert b.draft_lengths(rs, [4, 4], 2) == [0, 0]          # the plain step is not measured yet
    for _ in range(3):
        b.observe_step(2, 0.04)
    assert b.draft_lengths(rs, [4, 3], 2) == [4, 3]          # never more than the proposer made
    for _ in range(8):
        for r in rs:
            b.observe_drafts(r, 4, 0)
    assert b.draft_lengths(rs, [4, 4], 2) == [0, 0]          # nothing accepted: drafting cannot pay
    host = bridge(draft_policy="host")
    assert host.draft_lengths(rs, [4, 2], 2) == [4, 2]


def test_session_holds_follow_min_waste_within_the_share():
    b = bridge(max_hold_share=0.5, session_gap_prior_s=5.0)
    # recomputing 1000 tokens stalls a batch of 20,000 tokens: holding for ~5 s wastes less
    assert b.hold("a", "a1", 1000, other_tokens=20000, num_blocks=40, num_total_blocks=100, now=0.0)
    # alone on the server, recomputing stalls no one but itself: freed
    assert not b.hold("b", "b1", 1000, other_tokens=0, num_blocks=5, num_total_blocks=100, now=0.0)
    # past the share of the cache held sessions may keep
    assert not b.hold("c", "c1", 1000, other_tokens=20000, num_blocks=20, num_total_blocks=100, now=0.0)
    assert b.num_held_blocks == 40
    hold = b.arrived("a", now=3.0)
    assert hold is not None and hold.request_id == "a1"
    assert b.arrived("a", now=3.0) is None and b.holds == {}
    assert b.mean_gap_s == pytest.approx(3.0)      # learned: a's gap from its finish at 0 to its call at 3


def test_session_holds_expire_and_give_way_to_queued_work():
    b = bridge(max_hold_s=10.0)
    assert b.hold("x", "x1", 500, 20000, 10, 100, now=0.0)
    assert b.hold("y", "y1", 500, 20000, 10, 100, now=5.0)
    assert b.expired(9.0) == []
    assert [h.session for h in b.expired(10.0)] == ["x"]
    assert b.hold("z", "z1", 500, 20000, 10, 100, now=6.0)
    # z is expected back last (held latest with the same expected gap): it goes first
    assert [h.session for h in b.victims(5, now=7.0)] == ["z"]
    assert [h.session for h in b.victims(15, now=7.0)] == ["y"]
    assert b.holds == {}
    assert (b.num_held, b.num_expired, b.num_evicted) == (3, 1, 2)


def test_fcfs_holds_nothing():
    b = bridge(policy="fcfs")
    assert not b.hold("a", "a1", 1000, 20000, 10, 100, now=0.0)
