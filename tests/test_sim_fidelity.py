"""Fidelity: the simulator with the committed calibrated profile against the real engine (default
model, CPU) on the same small workload: mean TTFT, mean TPOT and output throughput within 15%.

The profile (src/tandem/sim/profiles/cpu-smollm2-135m.json) was measured with `tandem simulate
calibrate` on the project's 2-core machine; machines differ, and so does one shared VM from hour
to hour (the probe step measured 25.8 ms at a first calibration, 33.5 ms at the current one, and
35-41 ms on a slower afternoon, when the engine's TPOT on this workload varied 68-107 ms from run
to run). Step times do not scale
uniformly with such slowdowns (scaling the profile by the probe ratio made the errors worse), so
the test first times the probe here and skips, saying so, unless this machine is within 1.25x of
the profile: fidelity is a property of a profile on the machine it describes. The errors are
printed (run with -s) and recorded in docs/simulator.md.
"""

from __future__ import annotations

import statistics
import time

import pytest

from tandem.bench.replay import WallClock, replay
from tandem.config import SchedulerConfig
from tandem.sim import SimConfig, WorkloadSpec, build_workload, simulate
from tandem.sim.cost import CalibratedCost, load_profile
from tandem.sim.metrics import summarize

KINDS = {"chat": {"weight": 1.0, "prompt": [120, 0.6, 24, 400], "output": [40, 0.3, 16, 64]}}
WORKLOAD = WorkloadSpec(dataset="synthetic", num_requests=16, rate=1.5, arrival="poisson", kinds=KINDS)
TOLERANCE = 0.15


def probe_decode_s(engine) -> float:
    """Median step of one request decoding at ~64 tokens of context (what the profile's probe timed)."""
    from tandem.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine.add_request(prompt_token_ids=list(range(2000, 2064)), params=params)
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


@pytest.mark.slow
def test_simulator_matches_the_engine_within_15_percent():
    from tandem import LLM

    profile = load_profile()
    llm = LLM(progress=False)
    engine = llm.engine
    here, there = probe_decode_s(engine), profile["probe"]["decode_b1_ctx64_s"]
    if not 0.8 <= here / there <= 1.25:
        pytest.skip(f"this machine decodes at {here * 1e3:.0f} ms/step, the profile at {there * 1e3:.0f} "
                    f"ms/step (x{here / there:.2f}): a calibrated profile describes the machine it was "
                    f"measured on")
    requests = build_workload(WORKLOAD, seed=0)
    # The median of three replays per figure: single 15 s runs on a shared 2-core VM vary by +-15%.
    runs = []
    for _ in range(3):
        engine.scheduler.kv.reset_prefix_cache()       # each replay computes its prompts afresh
        runs.append(summarize(replay(engine, requests, WallClock())))
    real = {"completed": min(r["completed"] for r in runs),
            "ttft_s": {"mean": statistics.median(r["ttft_s"]["mean"] for r in runs)},
            "tpot_s": {"mean": statistics.median(r["tpot_s"]["mean"] for r in runs)},
            "output_throughput": statistics.median(r["output_throughput"] for r in runs)}
    eng = profile["engine"]
    sched = SchedulerConfig(max_num_batched_tokens=eng["max_num_batched_tokens"],
                            max_num_seqs=eng["max_num_seqs"], max_model_len=eng["max_model_len"])
    cfg = SimConfig(scheduler=sched, block_size=eng["block_size"], seed_step_cost=False)
    sim = simulate(CalibratedCost(profile), cfg, requests).summary
    errors = {
        "ttft_mean": sim["ttft_s"]["mean"] / real["ttft_s"]["mean"] - 1,
        "tpot_mean": sim["tpot_s"]["mean"] / real["tpot_s"]["mean"] - 1,
        "output_throughput": sim["output_throughput"] / real["output_throughput"] - 1,
    }
    print(f"\nreal: TTFT {real['ttft_s']['mean'] * 1e3:.0f} ms, TPOT {real['tpot_s']['mean'] * 1e3:.1f} ms, "
          f"{real['output_throughput']:.1f} tok/s; sim: TTFT {sim['ttft_s']['mean'] * 1e3:.0f} ms, "
          f"TPOT {sim['tpot_s']['mean'] * 1e3:.1f} ms, {sim['output_throughput']:.1f} tok/s; errors " +
          ", ".join(f"{k} {v:+.1%}" for k, v in errors.items()))
    assert real["completed"] == sim["completed"] == WORKLOAD.num_requests
    assert all(abs(e) <= TOLERANCE for e in errors.values()), errors
