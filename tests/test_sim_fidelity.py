"""Fidelity: the simulator, with a profile calibrated here and now, against the real engine (default
model, CPU) on a small workload: mean TTFT, mean TPOT and output throughput within 15%.

Nothing recorded on another machine is used:
1. the test profiles the engine it replays (`tandem simulate calibrate --quick`: prefill chunks,
   decode batches, verification, one mixed batch and single prompts again at its end; ~20 s);
2. the replayed workload is another one (Poisson arrivals, chat lengths, 48 requests). Its rate is
   set from the calibration: RHO over the mean time one request takes alone, as the profile
   predicts it, so the test runs at half load on any machine (near saturation, queueing amplifies
   every jitter and the test would measure the machine's noise, not the simulator);
3. a shared VM's speed drifts by 10-40% within minutes, and prefill and decode steps drift apart,
   so the simulator runs at the speed the machine ran the replay's own steps: two levels,
   the recorded steps' seconds over the profile's prediction for them (`levels_of`), one for
   steps that prefill and one for decode-only steps. Two scalars say how fast the machine was; what
   is checked is everything they do not fix: which steps the scheduler builds, how requests queue
   and batch, and the profile's relative costs of step shapes. Probes run around the replay
   instead left the 2-core VM's drift during the replay itself unmeasured (TPOT errors of -40% to
   +25% at probe levels near 1.0, with the replays' own TPOT moving 12-17 ms between rounds).
The errors are the medians of three rounds; a miss is measured once more, afresh. They are printed
(run with -s), with the errors at the profile's face value, and recorded in docs/simulator.md.
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from tandem.bench.calibrate import StepRecorder, levels_of, profile_engine
from tandem.bench.replay import WallClock, replay
from tandem.config import SchedulerConfig
from tandem.sim import SimConfig, WorkloadSpec, build_workload, simulate
from tandem.sim.cost import CalibratedCost
from tandem.sim.metrics import summarize

KINDS = {"chat": {"weight": 1.0, "prompt": [120, 0.6, 24, 400], "output": [40, 0.3, 16, 64]}}
WORKLOAD = WorkloadSpec(dataset="synthetic", num_requests=48, rate=1.0, arrival="poisson", kinds=KINDS)
RHO = 0.5           # offered load: arrival rate x the mean time one request takes alone
TOLERANCE = 0.15


def simulate_with(profile: dict, requests, levels: tuple[float, float] = (1.0, 1.0)) -> dict:
    """The simulator's summary for the workload, at `levels` (prefill steps, decode steps)."""
    eng = profile["engine"]
    sched = SchedulerConfig(max_num_batched_tokens=eng["max_num_batched_tokens"],
                            max_num_seqs=eng["max_num_seqs"], max_model_len=eng["max_model_len"])
    cfg = SimConfig(scheduler=sched, block_size=eng["block_size"], seed_step_cost=False)
    cost = CalibratedCost(profile, prefill_level=levels[0], decode_level=levels[1])
    return simulate(cost, cfg, requests).summary


def paced_workload(profile: dict, seed: int = 0) -> list:
    """The workload at offered load RHO on this machine: its requests served one at a time (the
    simulator on the fresh profile) give the mean time alone, and the rate is RHO over it. WORKLOAD
    draws its arrivals at 1 req/s, so dividing them by the rate paces them."""
    requests = build_workload(WORKLOAD, seed=seed)
    alone = [dataclasses.replace(r, arrival_s=1000.0 * i) for i, r in enumerate(requests)]
    rate = RHO / simulate_with(profile, alone)["e2e_s"]["mean"]
    print(f"\npaced at {rate:.2f} req/s (offered load {RHO} of one-at-a-time service)")
    return [dataclasses.replace(r, arrival_s=r.arrival_s / rate) for r in requests]


def errors_of(sim: dict, real: dict) -> dict[str, float]:
    return {"ttft_mean": sim["ttft_s"]["mean"] / real["ttft_s"]["mean"] - 1,
            "tpot_mean": sim["tpot_s"]["mean"] / real["tpot_s"]["mean"] - 1,
            "output_throughput": sim["output_throughput"] / real["output_throughput"] - 1}


def measure(engine, cost, profile, requests) -> tuple[dict[str, float], list[tuple[float, float]]]:
    """Three replay rounds; the median errors of the simulator at each round's levels, measured on
    the round's own steps."""
    at_calibration = simulate_with(profile, requests)      # the profile at face value (printed)
    leveled, levels = [], []
    for _ in range(3):
        engine.scheduler.kv.reset_prefix_cache()              # each replay computes its prompts afresh
        with StepRecorder(engine) as recorder:
            real = summarize(replay(engine, requests, WallClock()))
        assert real["completed"] == len(requests)
        level = levels_of(recorder.samples, cost)
        sim = simulate_with(profile, requests, level)
        assert sim["completed"] == len(requests)
        leveled.append(errors_of(sim, real))
        levels.append(level)
        print(f"\nreal: TTFT {real['ttft_s']['mean'] * 1e3:.0f} ms, TPOT {real['tpot_s']['mean'] * 1e3:.1f} ms, "
              f"{real['output_throughput']:.1f} tok/s over {len(recorder.samples)} steps; sim at their levels "
              f"prefill x{level[0]:.2f}, decode x{level[1]:.2f}: TTFT {sim['ttft_s']['mean'] * 1e3:.0f} ms, "
              f"TPOT {sim['tpot_s']['mean'] * 1e3:.1f} ms, {sim['output_throughput']:.1f} tok/s; errors " +
              ", ".join(f"{k} {v:+.1%}" for k, v in leveled[-1].items()) + " (at x1.00: " +
              ", ".join(f"{v:+.1%}" for v in errors_of(at_calibration, real).values()) + ")")
    return {k: statistics.median(e[k] for e in leveled) for k in leveled[0]}, levels


@pytest.mark.slow
def test_simulator_matches_the_engine_within_15_percent():
    from tandem import LLM

    engine = LLM(progress=False).engine
    profile = profile_engine(engine, "SmolLM2-135M-Instruct", quick=True, log=lambda _: None)
    requests = paced_workload(profile)
    cost = CalibratedCost(profile)
    # A miss is measured once more, afresh, before it counts.
    for attempt in range(2):
        errors, levels = measure(engine, cost, profile, requests)
        if all(abs(e) <= TOLERANCE for e in errors.values()):
            return
        print(f"\nattempt {attempt + 1} missed: {errors} at levels {levels}")
    pytest.fail(f"simulator vs engine beyond {TOLERANCE:.0%}: {errors} (levels {levels})")
