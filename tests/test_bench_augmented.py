"""`tandem bench augmented` on a tiny model: every request of the trace completes under each policy,
the summary counts recomputed tokens, `--step-trace` writes one line of per-step scheduler state
per run, `--stall` stops the engine once in each run, and TTFT counts from the trace's arrival."""

from __future__ import annotations

import json

import pytest

from tandem.bench.augmented import bench_augmented, make_trace
from tandem.llm import LLM


def test_bench_augmented_completes_the_trace_and_writes_the_step_trace(tiny_llama, tmp_path):
    llm = LLM(model=str(tiny_llama), tools=True, max_num_batched_tokens=64, kv_cache_memory_gb=0.002)
    steps = tmp_path / "steps.jsonl"
    data = bench_augmented(llm, ["infercept", "augserve"], [20.0], num_requests=6, seed=3, token_scale=0.05,
                           time_scale=0.01, slo=(5.0, 1.0), repeats=1, json_path=str(tmp_path / "out.json"),
                           log=lambda *_: None, predictor={}, steps_path=str(steps), stall=(0.3, 0.0))
    lines = [json.loads(x) for x in steps.read_text().splitlines()]
    assert [(x["rate"], x["repeat"], x["policy"]) for x in lines] == [(20.0, 0, "infercept"), (20.0, 0, "augserve")]
    for line in lines:
        res = data["results"]["20.0"][line["policy"]][0]
        assert res["num_requests"] == 6 and res["recompute_tokens"] >= 0
        rows = line["steps"]
        assert sum(r["num_tokens"] for r in rows) > 0             # (a step may only copy swapped KV)
        assert all(r["num_seqs"] <= r["num_running"] and r["num_tokens"] >= r["num_seqs"] for r in rows)
        assert all(0.0 <= a["t"] <= b["t"] for a, b in zip(rows, rows[1:]))
        assert rows[0]["t"] >= 0.3                      # the stall came first
        assert rows[-1]["num_waiting"] == 0 and len(rows[0]["queue"]) <= 8
    # a request's clock starts at its trace arrival, not when the (stalled) loop got to submit it
    arrivals = sorted(at for at, _ in make_trace(6, 20.0, 3, 0.05, 0.01))
    for res in (data["results"]["20.0"][p][0] for p in ("infercept", "augserve")):
        records = sorted(res["records"], key=lambda r: r["arrival_s"])
        assert [r["arrival_s"] for r in records] == pytest.approx(arrivals, abs=1e-6)
        assert all(r["arrival_s"] + r["ttft_s"] >= 0.3 for r in records)
        assert len({r["request_id"] for r in records}) == 6
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["results"]["20.0"]["augserve"][0]["num_requests"] == 6
    assert written["stall"] == {"seconds": 0.3, "at_s": 0.0}


def test_repeats_replay_the_same_trace(tiny_llama):
    """`--repeats N` runs the command N times: the same arrivals and requests in every repeat (a
    different trace is another `--trace-seed`)."""
    llm = LLM(model=str(tiny_llama), tools=True, max_num_batched_tokens=64, kv_cache_memory_gb=0.002)
    data = bench_augmented(llm, ["augserve"], [20.0], num_requests=4, seed=5, token_scale=0.05, time_scale=0.01,
                           slo=(5.0, 1.0), repeats=2, json_path=None, log=lambda *_: None, predictor={})
    runs = data["results"]["20.0"]["augserve"]
    arrivals = sorted(at for at, _ in make_trace(4, 20.0, 5, 0.05, 0.01))
    assert len(runs) == 2
    for res in runs:
        got = sorted((r["arrival_s"], r["prompt_tokens"], r["type"]) for r in res["records"])
        assert [a for a, _, _ in got] == pytest.approx(arrivals, abs=1e-6)
    first, second = (sorted((r["prompt_tokens"], r["type"]) for r in res["records"]) for res in runs)
    assert first == second
