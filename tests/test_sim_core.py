"""The simulator's own guarantees: it imports and runs with torch blocked and reads no clock in the
simulated world; same seed, same results (a different seed differs); aborts, rejections and
deadlock reporting; the cost models' sanity; user scenario files; and its speed on 2,000
augmented requests (the 10,000-request figure is in docs/simulator.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import tandem
from tests.doubles import run_without_torch
from tandem.config import SchedulerConfig, SpecConfig
from tandem.sim import SLO, SimConfig, WorkloadSpec, build_workload, make_cost_model, simulate
from tandem.sim.cost import StepShape
from tandem.sim.speed import measure_speed

SIM = Path(tandem.__file__).resolve().parent / "sim"
CLOCK = re.compile(r"^\s*(?:import\s+time\b|from\s+time\s+import\b)"
                   r"|\btime\.(?:time|monotonic|perf_counter)\(", re.MULTILINE)
TORCH = re.compile(r"^\s*(?:import|from)\s+torch\b|\bimport_module\(\s*['\"]torch", re.MULTILINE)

NO_TORCH_SCRIPT = """
    import tandem.sim, tandem.sim.scenarios.faser, tandem.sim.scenarios.augserve, tandem.sim.scenarios.file
    import tandem.sim.cli_args, tandem.sim.report, tandem.sim.speed
    from tandem.config import SchedulerConfig, SpecConfig
    from tandem.sim import SimConfig, WorkloadSpec, build_workload, make_cost_model, simulate

    cost = make_cost_model("H100-80GB", "qwen3-8b", "qwen3-0.6b")
    sched = SchedulerConfig(max_num_batched_tokens=1024, max_model_len=4096, policy="augserve")
    cfg = SimConfig(scheduler=sched,
                    spec=SpecConfig(method="draft", draft_model="x", policy="survival", max_draft_tokens=4))
    run = simulate(cost, cfg, build_workload(WorkloadSpec(num_requests=30, rate=4.0), seed=0))
    wl = WorkloadSpec(dataset="synthetic", num_requests=10, rate=1.0)
    calibrated = simulate(make_cost_model("calibrated"), SimConfig(), build_workload(wl, seed=0))
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
    assert not heavy, heavy
    print("ok", run.summary["completed"], calibrated.summary["completed"])
"""


def test_sim_imports_and_runs_without_torch():
    proc = run_without_torch(NO_TORCH_SCRIPT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "30", "10"]


@pytest.mark.parametrize("path", sorted(SIM.rglob("*.py")), ids=lambda p: p.relative_to(SIM).as_posix())
def test_sim_sources_use_no_torch_and_no_clock_in_the_simulated_world(path):
    text = path.read_text()
    assert not TORCH.search(text), f"{path.name} imports torch"
    if path.name not in ("run.py",):        # run.py times the simulator itself (events/s), nothing inside it
        assert not CLOCK.search(text), f"{path.name} reads the wall clock"


def small_run(seed: int, spec: str | None = "adaptive", policy: str = "infercept"):
    cost = make_cost_model("A100-80GB", "llama3-8b", "llama3-1b" if spec else None)
    sched = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=4096, policy=policy)
    cfg = SimConfig(scheduler=sched, seed=seed,
                    spec=SpecConfig(method="draft", draft_model="x", policy=spec) if spec else None)
    wl = WorkloadSpec(dataset="augmented", num_requests=60, rate=3.0, arrival="gamma", cv=3.0)
    return simulate(cost, cfg, build_workload(wl, seed), SLO(ttft_s=1.0, normalized_latency_s=0.03))


def test_same_seed_same_results_and_another_seed_differs():
    a, b, c = small_run(1), small_run(1), small_run(2)
    assert a.summary == b.summary and a.counters == b.counters
    assert [r.as_dict() for r in a.records] == [r.as_dict() for r in b.records]
    assert a.summary != c.summary
    assert a.summary["completed"] == 60 and a.summary["spec"]["accepted_tokens"] > 0


def test_step_jitter_slows_the_steps_it_hits_and_is_seeded():
    """`step_jitter` (p, x): every step x times as long at p = 1; at p < 1 seeded, and a step that
    it slows slows everything behind it."""
    from tandem.sim.executor import SimExecutor

    cost = make_cost_model("H100-80GB", "llama3-8b")
    wl = build_workload(WorkloadSpec(dataset="augmented", num_requests=30, rate=4.0), 0)

    def run(jitter):
        sched = SchedulerConfig(max_num_batched_tokens=512, max_model_len=4096, policy="augserve")
        return simulate(cost, SimConfig(scheduler=sched, step_jitter=jitter), wl)

    calm, doubled, noisy, again = run((0.0, 1.0)), run((1.0, 2.0)), run((0.1, 10.0)), run((0.1, 10.0))
    assert 1.3 * calm.counters["busy_s"] < noisy.counters["busy_s"] < 3 * calm.counters["busy_s"]
    assert doubled.counters["busy_s"] > 1.5 * calm.counters["busy_s"]
    assert noisy.summary == again.summary and noisy.counters == again.counters
    assert noisy.summary["ttft_s"]["p99"] > calm.summary["ttft_s"]["p99"]
    with pytest.raises(ValueError):
        SimExecutor(cost, step_jitter=(1.5, 2.0))


def test_workload_is_seeded_and_shaped():
    wl = WorkloadSpec(dataset="synthetic", arrival="diurnal", rate=5.0, num_requests=400,
                      peak_valley_ratio=35)
    x, y = build_workload(wl, 3), build_workload(wl, 3)
    assert x == y and x != build_workload(wl, 4)
    assert {r.kind for r in x} == {"chat", "code", "summarize"}
    assert all(0 < r.acceptance < 1 for r in x)
    code = [r.acceptance for r in x if r.kind == "code"]
    chat = [r.acceptance for r in x if r.kind == "chat"]
    assert sum(code) / len(code) > sum(chat) / len(chat)      # code drafts better (Beta means 0.82, 0.70)


def test_aborts_and_rejections_are_recorded():
    cost = make_cost_model("H100-80GB", "llama3-8b")
    cfg = SimConfig(scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=1024))
    wl = WorkloadSpec(dataset="augmented:chatbot", num_requests=20, rate=2.0, abort_after_s=30.0)
    run = simulate(cost, cfg, build_workload(wl, 0))
    reasons = {r.finish_reason for r in run.records}
    assert "abort" in reasons and run.summary["aborted"] > 0
    assert all(r.finished_s is not None for r in run.records)
    kinds = {"long": {"weight": 1, "prompt": [2000, 0.1, 1500, 3000], "output": [10, 0.1, 5, 20]}}
    long = WorkloadSpec(dataset="synthetic", num_requests=30, rate=2.0, kinds=kinds)
    run = simulate(cost, cfg, build_workload(long, 0))
    assert run.summary["rejected"] == 30 and run.summary["completed"] == 0


def test_roofline_is_memory_bound_at_decode_and_compute_bound_at_prefill():
    cost = make_cost_model("H100-80GB", "llama3-8b")
    decode = [cost.step_time_s(StepShape(b, b, b, 0, 512 * b, 512 * b)) for b in (1, 8, 64)]
    assert decode[0] < decode[1] < decode[2] < 2 * decode[0]       # batching decode is nearly free
    prefill = [cost.step_time_s(StepShape(1, t, 1, t, t, t * t // 2)) for t in (1024, 4096)]
    assert 3.0 < prefill[1] / prefill[0] < 4.5                      # prefill scales with tokens
    h100 = cost.step_time_s(StepShape(1, 1, 1, 0, 512, 512))
    a100 = make_cost_model("A100-80GB", "llama3-8b").step_time_s(StepShape(1, 1, 1, 0, 512, 512))
    h200 = make_cost_model("H200", "llama3-8b").step_time_s(StepShape(1, 1, 1, 0, 512, 512))
    assert h200 < h100 < a100                                       # bandwidth order at decode
    with pytest.raises(ValueError, match="does not fit"):
        make_cost_model("A100-80GB", "llama3-70b").deployment()
    assert make_cost_model("A100-80GB", "llama3-70b", num_gpus=4).deployment().num_kv_blocks > 0


def test_calibrated_fit_recovers_small_step_cost_and_levels_scale_by_step_class():
    from tandem.sim.cost.calibrated import FEATURES, CalibratedCost, fit

    true = {"const": 4e-3, "tokens": 6e-4, "tokens_upto_32": 4e-4, "logit_rows": 7e-4}

    def sample(seqs: int, tokens: int, prefill: int) -> dict:
        shape = StepShape(seqs, tokens, seqs, prefill, tokens, tokens)
        secs = sum(c * FEATURES[f](shape) for f, c in true.items())
        return {"num_seqs": seqs, "num_tokens": tokens, "num_logit_rows": seqs, "num_prefill_tokens": prefill,
                "context_tokens": tokens, "attention_pairs": tokens, "seconds": secs}

    samples = [sample(1, t, t) for t in (8, 24, 48, 96, 200, 400)] + [sample(b, b, 0) for b in (1, 4, 16, 64)]
    got = fit(samples, ("const", "tokens", "tokens_upto_32", "logit_rows"))
    assert got["coef"] == pytest.approx([true[f] for f in got["features"]], rel=1e-6)
    assert got["rel_error_max"] < 1e-9

    profile = {"format": "tandem-sim-profile/1", "model": "m", "fit": got,
               "engine": {"block_size": 16, "kv_bytes_per_token": 1024}}
    prefill, decode = StepShape(1, 100, 1, 100, 100, 5050), StepShape(4, 4, 4, 0, 400, 400)
    base = CalibratedCost(profile)
    leveled = CalibratedCost(profile, prefill_level=1.2, decode_level=0.9)
    assert leveled.step_time_s(prefill) == pytest.approx(1.2 * base.step_time_s(prefill))
    assert leveled.step_time_s(decode) == pytest.approx(0.9 * base.step_time_s(decode))
    assert base.step_time_s(StepShape(1, 20, 1, 20, 20, 210)) - base.step_time_s(StepShape(1, 10, 1, 10, 10, 55)) \
        == pytest.approx(10 * (true["tokens"] + true["tokens_upto_32"]))     # below 32 rows, the steeper slope
    assert base.step_time_s(StepShape(1, 60, 1, 60, 60, 1830)) - base.step_time_s(StepShape(1, 50, 1, 50, 50, 1275)) \
        == pytest.approx(10 * true["tokens"])


def test_draft_model_time_grows_with_draft_positions():
    cost = make_cost_model("H100-80GB", "qwen3-32b", "qwen3-0.6b", num_gpus=2)
    base = StepShape(32, 32, 32, 0, 32 * 600, 32 * 600)
    drafted = StepShape(32, 160, 160, 0, 32 * 604, 32 * 604, (32, 32, 32, 32), 32 * 600)
    assert cost.step_time_s(drafted) - cost.step_time_s(base) > 4 * cost.hardware.draft_overhead_s


def test_scenario_file_runs(tmp_path):
    doc = {"name": "t", "deployment": {"hardware": "H200", "model": "qwen3-4b", "draft_model": "qwen3-0.6b"},
           "scheduler": {"max_num_batched_tokens": 1024, "max_model_len": 4096},
           "workload": {"dataset": "synthetic", "num_requests": 40, "arrival": "gamma", "cv": 2.0,
                        "acceptance": {"chat": [8, 2]}},
           "rates": [1.0, 4.0], "slo": {"ttft_s": 1.0},
           "runs": [{"label": "plain"}, {"label": "sd", "spec": {"policy": "fixed", "max_draft_tokens": 3}}]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    from tandem.sim.report import file_tables
    from tandem.sim.scenarios.file import run_file

    res = run_file(path, log=lambda m: None)
    assert [(r["rate"], r["label"]) for r in res["rows"]] == \
        [(1.0, "plain"), (1.0, "sd"), (4.0, "plain"), (4.0, "sd")]
    assert res["rows"][1]["summary"]["spec"]["mean_draft_length"] == pytest.approx(3.0, abs=0.2)
    assert "plain" in file_tables(res)


def test_speed_run_reports_its_figures():
    """What `tandem simulate speed` reports (its pace is a benchmark there, not a timed test here):
    every request completes, and the events and wall time are counted."""
    res = measure_speed(300, rate=20.0)
    s = res["sim"]
    assert res["summary"]["completed"] == 300 and res["summary"]["total_output_tokens"] > 0
    assert s["events"] > 300 and s["wall_s"] > 0
    assert s["events_per_s"] == pytest.approx(s["events"] / s["wall_s"])
