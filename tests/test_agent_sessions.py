"""Agent session traces (workload/agent_sessions.py): loading with clear errors, the fit/report
split, the replay plan's rules (continue / rewrite / compact, person waits capped or cut, scaling),
and the simulator's agents scenario on a tiny trace: every call completes under every policy, held
KV serves what the prefix cache would while memory is plenty, and more once it binds."""

from __future__ import annotations

import json

import pytest

from tandem.sim.cost import make_cost_model
from tandem.sim.scenarios.agents import AgentOptions, pick_sessions, run_point
from tandem.workload.agent_sessions import (AgentCall, AgentSession, TraceError, load_sessions, parse_person_wait,
                                             replay_plan, split)


def call(t, n_in, out, stop="tool_use", wait=0.0, reuse=0):
    return {"t": t, "in": n_in, "out": out, "stop": stop, "wait_s": wait, "api_s": 1.0, "blocks": n_in // 64,
            "reuse_blocks": reuse}


def session(sid, calls, system=640, tools=640):
    return {"id": sid, "family": "opus", "block_size": 64, "system_tokens": system, "tool_tokens": tools,
            "calls": calls}


def write(tmp_path, sessions):
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps(s) for s in sessions) + "\n")
    return p


def test_loading_checks_every_line_and_names_it(tmp_path):
    good = session("a", [call(0, 2000, 10), call(5, 2100, 10, wait=4, reuse=31)])
    p = write(tmp_path, [good])
    (s,) = load_sessions(p)
    assert s.calls[1] == AgentCall(5.0, 2100, 10, "tool_use", 4.0, 1.0, 32, 31)
    bad = dict(good, calls=[call(0, 2000, 10, stop="maybe")])
    with pytest.raises(TraceError, match=r"trace.jsonl:2 call 0: stop"):
        load_sessions(write(tmp_path, [good, bad]))
    with pytest.raises(TraceError, match=r"trace.jsonl:1: not a session"):
        load_sessions(write(tmp_path, [{"id": "x"}]))
    with pytest.raises(TraceError, match="in >= 1"):
        load_sessions(write(tmp_path, [session("y", [call(0, 0, 1)])]))


def test_the_split_is_stable_and_disjoint():
    ss = [AgentSession(f"s{i}", "", 64, 0, 0, (AgentCall(0, 10, 1, "", 0, 0, 0, 0),)) for i in range(200)]
    fit, report = split(ss, 0.3)
    assert len(fit) + len(report) == 200 and not {s.session_id for s in fit} & {s.session_id for s in report}
    assert 40 <= len(fit) <= 80 and split(ss, 0.3) == (fit, report)


def test_the_replay_plan_continues_rewrites_compacts_and_handles_person_waits():
    s = AgentSession("a", "", 64, 640, 640, (
        AgentCall(0, 2000, 100, "tool_use", 0, 0, 31, 0),
        AgentCall(9, 2300, 50, "end_turn", 7, 0, 35, 31),      # reuses all 31 full blocks: continues
        AgentCall(99, 2600, 20, "tool_use", 500, 0, 36, 20),   # a person's 500 s; reuses 20 of 35 blocks
        AgentCall(120, 9000, 30, "", 3, 0, 140, 40),           # grows past a window of 4000: compacted
        AgentCall(130, 9400, 30, "", 2, 0, 146, 140)))
    plan = replay_plan(s, "cap:60", window=4000)
    assert [(c.keep_tokens, c.new_tokens, c.output_tokens, c.wait_s, c.after_tool, c.context_tokens) for c in plan] == [
        (0, 2000, 100, 0.0, False, 2000),
        (None, 200, 50, 7.0, True, 2300),           # 2300 - (2000 + 100)
        (1280, 1320, 20, 60.0, False, 2600),        # 20 blocks kept; the person's wait capped at 60 s
        (1280, 1280 + 2000 - 1280, 30, 3.0, True, 3280),   # 1280 head + 2000 (half the window) tail
        (None, 400 - 30, 30, 2.0, False, 3680),     # later calls grow by the trace's deltas
    ]
    cut = replay_plan(s, "cut", window=4000)
    assert len(cut) == 2                            # ends at the first end_turn
    half = replay_plan(s, "cap:60", token_scale=0.5, time_scale=0.1)
    assert (half[0].context_tokens, half[1].new_tokens, half[1].wait_s) == (1000, 2300 // 2 - 1050, pytest.approx(0.7))
    assert parse_person_wait("cap:5") == 5.0 and parse_person_wait("cut") is None
    with pytest.raises(ValueError, match="person_wait"):
        parse_person_wait("forever")


def _trace(tmp_path, n_sessions=3, n_calls=4, start=6000):
    sessions = []
    for i in range(n_sessions):
        calls, ctx = [], start + 640 * i
        for k in range(n_calls):
            calls.append(call(k * 10, ctx, 40, wait=4.0 if k else 0.0, reuse=(ctx - 700) // 64 if k else 0))
            ctx += 700
        sessions.append(session(f"s{i}", calls))
    return write(tmp_path, sessions)


@pytest.mark.parametrize("utilization,binds", [(0.9, False), (0.24, True)])   # 450k and 18k tokens of KV
def test_the_agents_scenario_serves_every_call_and_held_kv_pays_when_memory_binds(tmp_path, utilization, binds):
    opts = AgentOptions(trace=str(_trace(tmp_path)), part="all", model="llama3-8b", hardware="A100-80GB",
                        window=12000, gpu_memory_utilization=utilization, swap_space_gb=8.0,
                        max_num_batched_tokens=2048)
    agent = pick_sessions(opts)
    cost = make_cost_model(opts.hardware, opts.model, swap_space_gb=opts.swap_space_gb,
                           gpu_memory_utilization=utilization)
    rows = {p: run_point(cost, agent, p, 5.0, opts) for p in ("vllm-lru", "infercept", "tandem")}
    for p, row in rows.items():
        s = row["summary"]
        assert (s["sessions"], s["calls"], s["completed_calls"]) == (3, 12, 12), p
    lru, held = rows["vllm-lru"]["summary"], rows["infercept"]["summary"]
    assert lru["adopted_tokens"] == 0 and sum(lru["kv_actions"].values()) == 0
    assert held["adopted_tokens"] > 0 and held["kv_actions"]["preserve"] + held["kv_actions"]["swap"] > 0
    if binds:
        assert held["cached_tokens"] > lru["cached_tokens"] and held["recomputed_tokens"] < lru["recomputed_tokens"]
    else:                                            # nothing evicted: held KV serves what the cache would
        assert held["cached_tokens"] == lru["cached_tokens"]


@pytest.mark.parametrize("args,message", [
    (["--trace", "/nonexistent.jsonl"], "no session trace"),
    (["--person-wait", "forever"], "person_wait"),
    (["--requests", "0"], "must be >= 1"),
    (["--rates", "0.1,-1"], "positive"),
    (["--policies", "vllm-lru,magic"], "unknown agents policy"),
])
def test_simulate_agents_rejects_bad_input_with_a_message(tmp_path, capsys, args, message):
    from tandem.cli import main

    trace = _trace(tmp_path)
    rc = main(["simulate", "--scenario", "agents", "--trace", str(trace), "--rates", "1", *args])
    assert rc == 2 and message in capsys.readouterr().err
