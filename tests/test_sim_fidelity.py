"""Fidelity: the simulator, with a profile calibrated here and now, against the real engine (default
model, CPU) on a small workload: mean TTFT, mean TPOT and output throughput within 15%.

Nothing recorded on another machine is used, and nothing is fitted on the replay that is checked:
1. the test profiles the engine it replays (`tandem simulate calibrate --quick`: prefill chunks,
   decode batches, verification, one mixed batch and single prompts again at its end; ~20 s);
2. a shared VM drifts 10-40% within minutes, and prefills and decodes drift apart, so around each
   replay a short probe of its own (`speed_levels`: another seed, other prompt lengths, shaped
   like light serving, 2-3 s), once just before and once just after, measures how fast the
   machine runs now relative to the calibration, for prefill steps and decode steps apart;
3. the replayed workload is another one again (Poisson arrivals, chat lengths, 48 requests), and
   the simulator runs it at the probes' levels. Its rate is set from the calibration, not fixed:
   RHO over the mean time one request takes alone, as the profile predicts it. A fixed 1.5 req/s
   was half the capacity of a bf16 AVX-512 machine but 98% busy on an fp32 AVX2 one, where the
   replays' TPOT then swung 41-105 ms from one run of the same workload to the next (near
   saturation, queueing amplifies every jitter); the test measured the machine's noise, not the
   simulator. 48 requests, not 16: a request's TPOT is mostly the prefills of others that land in
   its decode, and with 16 requests back-to-back replays of one workload gave TPOT 8.3 and 6.3 ms.
The errors are the medians of three such rounds; a miss is measured once more, afresh (the VM's
speed has jumped by a third between back-to-back replays). They are printed (run with -s) and
recorded in docs/simulator.md.
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from tandem.bench.calibrate import profile_engine, speed_levels
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


def measure(engine, cost, profile, requests, attempt: int) -> tuple[dict[str, float], list[tuple[float, float]]]:
    """Three probe + replay rounds; the median errors of the simulator at each round's levels, the
    geometric means of a probe just before and one just after the replay (so drift during the
    replay is bracketed, and nothing is fitted on the replay itself)."""
    at_calibration = simulate_with(profile, requests)      # the profile at face value (printed)
    leveled, levels = [], []
    for round_ in range(3):
        seed = 10 * attempt + 2 * round_ + 1
        before = speed_levels(engine, cost, seed=seed)
        engine.scheduler.kv.reset_prefix_cache()              # each replay computes its prompts afresh
        real = summarize(replay(engine, requests, WallClock()))
        after = speed_levels(engine, cost, seed=seed + 1)
        assert real["completed"] == len(requests)
        level = ((before[0] * after[0]) ** 0.5, (before[1] * after[1]) ** 0.5)
        sim = simulate_with(profile, requests, level)
        assert sim["completed"] == len(requests)
        leveled.append(errors_of(sim, real))
        levels.append(level)
        print(f"\nreal: TTFT {real['ttft_s']['mean'] * 1e3:.0f} ms, TPOT {real['tpot_s']['mean'] * 1e3:.1f} ms, "
              f"{real['output_throughput']:.1f} tok/s; sim at the probes' levels prefill x{level[0]:.2f} "
              f"(x{before[0]:.2f} before, x{after[0]:.2f} after), decode x{level[1]:.2f} (x{before[1]:.2f}, "
              f"x{after[1]:.2f}): TTFT {sim['ttft_s']['mean'] * 1e3:.0f} ms, TPOT {sim['tpot_s']['mean'] * 1e3:.1f} ms, "
              f"{sim['output_throughput']:.1f} tok/s; errors " +
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
    # A shared VM's speed can jump by a third between two back-to-back replays (TPOT 92-134 ms
    # measured so): a miss is measured once more, afresh, before it counts.
    for attempt in range(2):
        errors, levels = measure(engine, cost, profile, requests, attempt)
        if all(abs(e) <= TOLERANCE for e in errors.values()):
            return
        print(f"\nattempt {attempt + 1} missed: {errors} at levels {levels}")
    pytest.fail(f"simulator vs engine beyond {TOLERANCE:.0%}: {errors} (levels {levels})")
