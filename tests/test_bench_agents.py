"""`tandem bench agents` against a live tiny server: every planned call is sent and answered, each
session's calls resend its context (so the server's held KV is taken over under a policy that holds
it), the report counts sessions, calls and the SLO, and runs plot side by side; bad input is a
message and exit status 2."""

from __future__ import annotations

import json

from server_helpers import LiveServer

from tandem import LLM
from tandem.config import RetentionConfig
from tandem.bench.agents import ReplayOptions, bench_agents
from tandem.bench.serve_client import Target
from tandem.engine.async_engine import AsyncLLMEngine
from tandem.server import create_app
from tandem.workload.agent_sessions import load_sessions, replay_plan


def _trace(tmp_path):
    def call(t, n_in, out, stop="tool_use", wait=0.0, reuse=0):
        return {"t": t, "in": n_in, "out": out, "stop": stop, "wait_s": wait, "api_s": 1.0,
                "blocks": n_in // 64, "reuse_blocks": reuse}
    sessions = [{"id": f"s{i}", "block_size": 64, "system_tokens": 2000, "tool_tokens": 1000,
                 "calls": [call(0, 4000, 300), call(5, 5000, 300, wait=1.0, reuse=62),
                           call(9, 6000, 200, "end_turn", wait=2.0, reuse=78)]} for i in range(2)]
    p = tmp_path / "agents.jsonl"
    p.write_text("\n".join(json.dumps(s) for s in sessions) + "\n")
    return p


def test_the_replay_sends_every_call_and_the_server_takes_over_held_contexts(tiny_llama, tmp_path):
    llm = LLM(model=str(tiny_llama), dtype="float32", progress=False, max_num_seqs=8, scheduling_policy="infercept")
    engine = AsyncLLMEngine(llm.engine)
    server = LiveServer(create_app(engine, "tiny"))
    try:
        sessions = load_sessions(_trace(tmp_path))
        opts = ReplayOptions(rate=50.0, token_scale=0.01, time_scale=0.01)
        data = bench_agents(Target(server.url, "tiny", ignore_eos=True), sessions, opts,
                            str(tmp_path / "out.json"), "infercept", log=lambda *_: None)
    finally:
        server.stop()
        engine.shutdown()
    s = data["summary"]
    assert (s["sessions"], s["calls"], s["failed_calls"]) == (2, 6, 0)
    plan = replay_plan(sessions[0], token_scale=0.01, time_scale=0.01)
    outs = sorted((r["session"], r["index"], r["output_tokens"]) for r in data["records"])
    assert outs == [(f"s{i}", k, plan[k].output_tokens) for i in range(2) for k in range(3)]
    assert s["sessions_within_slo"] == 2 and s["llm_time_per_session_s"]["mean"] > 0
    assert llm.engine.scheduler.sessions.num_adopted_tokens > 0
    assert json.loads((tmp_path / "out.json").read_text())["summary"]["calls"] == 6
    from tandem.bench.plots import plot_agent_runs

    png = plot_agent_runs([data, data | {"label": "again"}], tmp_path / "agents.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_short_soak_loses_no_call_and_gives_all_kv_back(tiny_llama, tmp_path):
    """The soak's CI version: sessions keep starting for a few seconds against a server that holds
    them; every planned call is answered, /metrics is scraped along the way, and once the last
    session has ended, what the sessions held comes back (here at a 1 s hold ceiling)."""
    llm = LLM(model=str(tiny_llama), dtype="float32", progress=False, max_num_seqs=8, scheduling_policy="infercept",
              session_retention=RetentionConfig(max_hold_s=1.0))
    engine = AsyncLLMEngine(llm.engine)
    server = LiveServer(create_app(engine, "tiny"))
    try:
        opts = ReplayOptions(rate=2.0, token_scale=0.01, time_scale=0.01, soak_s=4.0, sample_s=0.5, drain_s=30.0)
        data = bench_agents(Target(server.url, "tiny", ignore_eos=True), load_sessions(_trace(tmp_path)), opts,
                            None, "soak", log=lambda *_: None)
    finally:
        server.stop()
        engine.shutdown()
    soak = data["soak"]
    ids = {r["session"] for r in data["records"]}
    assert len(ids) >= 3 and {i.split("#")[0] for i in ids} == {"s0", "s1"}     # the trace, cycled
    assert soak["calls_lost"] == 0 and soak["calls_answered"] == soak["calls_planned"] == 3 * len(ids)
    assert max(m["num_sessions_held"] for m in soak["samples"]) >= 1            # sessions were held ...
    assert soak["drained"] and soak["kv_usage_end"] == 0 and soak["sessions_held_end"] == 0, soak["samples"][-3:]
    assert soak["rss_after_warmup_bytes"] > 0 and "rss_growth" in soak
    assert llm.engine.scheduler.sessions.num_expired >= 1


def test_bench_agents_rejects_bad_input_before_sending(tmp_path, capsys):
    from tandem.cli import main

    trace = _trace(tmp_path)
    other = tmp_path / "serve.json"
    other.write_text('{"bench": "serve"}')
    for args, message in ((["--person-wait", "soon"], "person_wait"), (["--num-sessions", "0"], ">= 1"),
                          (["--trace", str(tmp_path / "none.jsonl")], "No such file"),
                          (["--compare", str(other)], "--compare takes"), (["--soak-s", "0"], "--soak-s")):
        rc = main(["bench", "agents", "--url", "http://127.0.0.1:9", "--rate", "1", "--trace", str(trace), *args])
        assert rc == 2 and message in capsys.readouterr().err, args
