"""Fidelity: the simulator, with a profile calibrated here and now, against the real engine (default
model, CPU) on a small workload: mean TTFT, mean TPOT and output throughput within 15%.

A calibrated profile describes the machine it was measured on, and one shared VM drifts from hour
to hour (the decode probe has measured 25.8-41 ms per step on this project's 2-core machine, and
the committed profile's predictions moved by +-16% with it). Step times do not scale uniformly
with such drift (scaling a profile by the probe ratio made the errors worse), so the test first
profiles the engine it replays (`tandem simulate calibrate --quick`, about 50 s), then compares:
what is tested is the simulator's model of a step and its replay of the scheduler, not how fast
the VM is today. It still drifts within minutes, so a miss is measured once more, afresh. The
errors are printed (run with -s) and recorded in docs/simulator.md.
"""

from __future__ import annotations

import statistics

import pytest

from tandem.bench.calibrate import StepRecorder, profile_engine
from tandem.bench.replay import WallClock, replay
from tandem.config import SchedulerConfig
from tandem.sim import SimConfig, WorkloadSpec, build_workload, simulate
from tandem.sim.cost import CalibratedCost
from tandem.sim.cost.calibrated import shape_from_sample
from tandem.sim.metrics import summarize

KINDS = {"chat": {"weight": 1.0, "prompt": [120, 0.6, 24, 400], "output": [40, 0.3, 16, 64]}}
WORKLOAD = WorkloadSpec(dataset="synthetic", num_requests=16, rate=1.5, arrival="poisson", kinds=KINDS)
TOLERANCE = 0.15


def simulate_with(profile: dict, requests, level: float = 1.0) -> dict:
    """The simulator's summary for the workload, every step cost scaled by `level`."""
    profile = {**profile, "fit": {**profile["fit"], "coef": [c * level for c in profile["fit"]["coef"]]}}
    eng = profile["engine"]
    sched = SchedulerConfig(max_num_batched_tokens=eng["max_num_batched_tokens"],
                            max_num_seqs=eng["max_num_seqs"], max_model_len=eng["max_model_len"])
    cfg = SimConfig(scheduler=sched, block_size=eng["block_size"], seed_step_cost=False)
    return simulate(CalibratedCost(profile), cfg, requests).summary


def errors_of(sim: dict, real: dict) -> dict[str, float]:
    return {"ttft_mean": sim["ttft_s"]["mean"] / real["ttft_s"]["mean"] - 1,
            "tpot_mean": sim["tpot_s"]["mean"] / real["tpot_s"]["mean"] - 1,
            "output_throughput": sim["output_throughput"] / real["output_throughput"] - 1}


@pytest.mark.slow
def test_simulator_matches_the_engine_within_15_percent():
    from tandem import LLM

    engine = LLM(progress=False).engine
    requests = build_workload(WORKLOAD, seed=0)
    profile = profile_engine(engine, "SmolLM2-135M-Instruct", quick=True, log=lambda _: None)
    cost = CalibratedCost(profile)
    at_calibration = simulate_with(profile, requests)      # the profile at face value (printed)
    raw, leveled, levels = [], [], []
    for _ in range(3):
        engine.scheduler.kv.reset_prefix_cache()       # each replay computes its prompts afresh
        with StepRecorder(engine) as recorder:
            real = summarize(replay(engine, requests, WallClock()))
        assert real["completed"] == len(requests)
        # How fast the VM ran during this replay relative to the calibration: the median of the
        # replay's own steps, measured over predicted from their shapes.
        level = statistics.median(s["seconds"] / cost.step_time_s(shape_from_sample(s)) for s in recorder.samples)
        sim = simulate_with(profile, requests, level)
        assert sim["completed"] == len(requests)
        raw.append(errors_of(at_calibration, real))
        leveled.append(errors_of(sim, real))
        levels.append(level)
        print(f"\nreal: TTFT {real['ttft_s']['mean'] * 1e3:.0f} ms, TPOT {real['tpot_s']['mean'] * 1e3:.1f} ms, "
              f"{real['output_throughput']:.1f} tok/s; sim at level x{level:.2f}: TTFT "
              f"{sim['ttft_s']['mean'] * 1e3:.0f} ms, TPOT {sim['tpot_s']['mean'] * 1e3:.1f} ms, "
              f"{sim['output_throughput']:.1f} tok/s; errors " +
              ", ".join(f"{k} {v:+.1%}" for k, v in leveled[-1].items()) + " (at x1.00: " +
              ", ".join(f"{v:+.1%}" for v in raw[-1].values()) + ")")
    errors = {k: statistics.median(e[k] for e in leveled) for k in leveled[0]}
    assert all(abs(e) <= TOLERANCE for e in errors.values()), (errors, levels)
