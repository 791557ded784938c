"""How much can any per-request draft-length policy gain in `tandem simulate --scenario faser`?

An oracle bound on the decode throughput of one step, per decode batch size B, on the scenario's
deployment (Qwen3-32B + Qwen3-0.6B draft on 2 x H100, the roofline cost model) with its published
acceptance (`faser.PUBLISHED_ACCEPTANCE`, kinds mixed by `DEFAULT_KINDS`' weights):

- no SD: B tokens per target forward without a draft model;
- best uniform k: every request drafts the same k (0..8), the k with the most tokens/s;
- vLLM's table: k from `SpecConfig.length_table` at B;
- oracle: each request's *true* acceptance is known (no estimation error); for every cap on the
  draft depth, (request, position) slots are admitted in order of their true survival
  probability, and the best prefix over all caps (and all uniform k) is kept, each priced by the
  cost model at its own shape, so every draft position's forward of the draft model counts;
- oracle + overlap: the same, with all drafting hidden behind verification as FASER's disjoint
  compute partitions would at best (`RooflineCost.concurrent_time_s`: no faster than either part
  alone, nor than their FLOPs and bytes together allow);
- run-ahead (issue 46): step t+1's drafts are made while step t verifies, on the guess that all
  of step t's drafts pass and the bonus token is the drafter's own next token. A request whose
  guess held verifies its k drafts with no drafting in the open; one whose guess failed decodes
  one token (while its next drafts are made, on the guess of that token). Per request this is a
  two-state chain: the guess holds after a drafting step with probability s(k+1) (survival to
  position k+1) and after a plain step with s(1), so it holds in a share
  pi = s(1) / (1 - s(k+1) + s(1)) of steps, which give 1 + sum_{j<=k} s(j) tokens, the rest 1.
  A step is one verification pass (the requests whose guess held verify their drafts) run at
  once with every running-ahead request's drafting (`concurrent_time_s`). The best uniform k and
  the oracle's per-request slots (with true acceptance) are both tried; each batch draws which
  requests' guesses held (common draws across candidates).

Expected tokens of a request drafting k: 1 + sum_{j<=k} prod_{m<=j} a(m), with a(m) = min(1, base
* position[m]) as the simulator's executor draws them. Drafting and verifying are sequential (the
scenario's main rows) except in the last column. Prefill is left out: no length policy changes it.
The oracle's tokens/s over the strongest of the other three bounds what per-request control can
add to a decode step; mean latency over the day and saturation throughput move by no more.

`--day` bounds what hiding the drafting can give over the scenario's whole day (prefill, the
draft model's smaller KV cache and queueing included): the scenario's saturation capacity and
diurnal day, with every draft-model forward free (`FreeDrafting`: a step costs its verification
alone), under the adaptive length and fixed k = 1, 2, 4. No scheme that drafts beside verification
(overlapped frontiers, run-ahead) can do better than these.

    python scripts/faser_headroom.py --json docs/results/faser_headroom.json
    python scripts/faser_headroom.py --day --json docs/results/faser_headroom_day.json     # ~1 min
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from statistics import fmean

from tandem.config import SpecConfig
from tandem.sampling_params import SamplingParams
from tandem.sched.spec_length import BatchSizeTable
from tandem.sim.cost import make_cost_model
from tandem.sim.cost.base import StepShape, shape_of
from tandem.sim.scenarios.faser import MAX_K, PUBLISHED_ACCEPTANCE
from tandem.sim.workload import DEFAULT_KINDS
from tandem.types import ScheduledSeq, StepPlan


def survival(base: float, position: list[float], k: int) -> list[float]:
    out, s = [], 1.0
    for m in range(k):
        s *= min(1.0, base * position[min(m, len(position) - 1)])
        out.append(s)
    return out


def decode_plan(b: int, context: int) -> StepPlan:
    """A decode step of b sequences: one committed token each after `context` KV tokens."""
    sp = SamplingParams()
    return StepPlan([ScheduledSeq(str(i), [0], context, [], True, sp, 0) for i in range(b)])


def shape(plan: StepPlan, ks: list[int]) -> StepShape:
    """The plan's shape with sequence i drafting ks[i] tokens."""
    return shape_of(plan, {s.request_id: k for s, k in zip(plan.seqs, ks)})


def table_k(b: int) -> int:
    """vLLM's table at decode batch size b (a fresh table: no hysteresis history)."""
    return BatchSizeTable(SpecConfig().length_table).choose([None] * b, [MAX_K] * b, 0)[0]


def one_batch(b: int, context: int, rng: random.Random, plain, spec) -> dict[str, float]:
    kinds = list(DEFAULT_KINDS)
    weights = [DEFAULT_KINDS[k]["weight"] for k in kinds]
    plan = decode_plan(b, context)
    surv = []
    for _ in range(b):
        acc = PUBLISHED_ACCEPTANCE[rng.choices(kinds, weights)[0]]
        surv.append(survival(rng.betavariate(*acc["beta"]), acc["position"], MAX_K + 1))
    # Common draws of whose run-ahead guess held, from their own stream (the other columns' draws
    # stay as they were without run-ahead)
    held_rng = random.Random(f"{b}:{surv[0][0]}")
    held_u = [held_rng.random() for _ in range(b)]

    def tok_s(ks: list[int], overlap: bool = False) -> float:
        tokens = sum(1 + sum(s[:k]) for s, k in zip(surv, ks))
        sh = shape(plan, ks)
        return tokens / (spec.concurrent_time_s(sh, True, sh) if overlap else spec.step_time_s(sh))

    out = {"no-sd": b / plain.step_time_s(shape(plan, [0] * b))}
    uniform = {k: tok_s([k] * b) for k in range(MAX_K + 1)}
    best_k = max(uniform, key=uniform.get)
    out.update({"best-uniform": uniform[best_k], "best-uniform-k": best_k, "table": uniform[table_k(b)]})
    # Each cap on the draft depth (each position is a draft forward): slots by true survival, best first
    ranked = [sorted(((s[p], i) for i, s in enumerate(surv) for p in range(depth)), reverse=True)
              for depth in range(1, MAX_K + 1)]

    def best_of(score) -> float:
        """The best tokens/s `score` gives any uniform k or any prefix of a depth cap's ranked slots."""
        best = max(score([k] * b) for k in range(MAX_K + 1))
        for slots in ranked:
            ks = [0] * b
            for _, i in slots:
                ks[i] += 1
                best = max(best, score(ks))
        return best

    def run_ahead_tok_s(ks: list[int]) -> float:
        tokens, held = 0.0, []
        for s, k, u in zip(surv, ks, held_u):
            pi = s[0] / (1.0 - s[k] + s[0]) if k else 0.0
            tokens += pi * (1 + sum(s[:k])) + (1 - pi)
            held.append(k if u < pi else 0)
        return tokens / spec.concurrent_time_s(shape(plan, held), True, shape(plan, ks))

    out["oracle"] = best_of(tok_s)
    out["oracle-overlap"] = best_of(lambda ks: tok_s(ks, True))
    out["run-ahead"] = best_of(run_ahead_tok_s)
    return out


class FreeDrafting:
    """A cost model whose draft-model forwards cost nothing (the bound of hidden drafting)."""

    def __init__(self, cost) -> None:
        self.cost = cost

    def __getattr__(self, name: str):
        return getattr(self.cost, name)

    def draft_time_s(self, shape: StepShape) -> float:
        return 0.0

    def step_time_s(self, shape: StepShape) -> float:
        return self.cost.verify_time_s(shape, first=True) if shape.num_seqs else 0.0

    def concurrent_time_s(self, verify: StepShape, first: bool, draft: StepShape) -> float:
        return self.cost.verify_time_s(verify, first)


def day_bound(seed: int) -> dict:
    """The FASER scenario's saturation and diurnal day with drafting free (see the module)."""
    from tandem.sim.build import SimConfig
    from tandem.sim.run import saturation_capacity
    from tandem.sim.scenarios.common import RunSpec, default_scheduler, run_config, run_one
    from tandem.sim.scenarios.faser import FaserOptions, diurnal_day, spec_config, timeline
    from tandem.sim.workload import WorkloadSpec, build_workload

    opts = FaserOptions(seed=seed)
    plain = make_cost_model(opts.hardware, opts.target, num_gpus=opts.num_gpus)
    free = FreeDrafting(make_cost_model(opts.hardware, opts.target, opts.draft, num_gpus=opts.num_gpus))
    base = SimConfig(scheduler=default_scheduler(), seed=seed)
    acc = {"acceptance": dict(PUBLISHED_ACCEPTANCE)}
    sat = build_workload(WorkloadSpec(dataset="synthetic", arrival="poisson",
                                      num_requests=opts.saturation_requests, **acc), seed)
    peak = saturation_capacity(plain, run_config(base, RunSpec("no-sd")), sat)
    day = diurnal_day(opts, peak, acc)
    period = day.period_s
    rows = []
    for run in (RunSpec("adaptive", spec=spec_config("adaptive")),
                *(RunSpec(f"fixed-{k}", spec=spec_config("fixed", k)) for k in (1, 2, 4))):
        row = run_one(free, base, run, day, None, seed, None, extra=lambda recs: timeline(recs, period, 24))
        rows.append({"label": run.label, "saturation_rps": saturation_capacity(free, run_config(base, run), sat),
                     "e2e_mean_s": row["summary"]["e2e_s"]["mean"], "e2e_p99_s": row["summary"]["e2e_s"]["p99"]})
        print(f"  drafting free, {run.label:<9} saturation {rows[-1]['saturation_rps']:6.2f} req/s "
              f"(no SD {peak:.2f})  day E2E mean {rows[-1]['e2e_mean_s']:.2f} s", flush=True)
    return {"no_sd_saturation_rps": peak, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--context", type=int, default=600, help="KV tokens per sequence (default 600)")
    ap.add_argument("--draws", type=int, default=20, help="random batches per size (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--day", action="store_true", help="bound the whole day with drafting free instead")
    args = ap.parse_args(argv)
    if args.day:
        out = {"command": " ".join(sys.argv), "seed": args.seed, **day_bound(args.seed)}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    plain = make_cost_model("H100-80GB", "qwen3-32b", num_gpus=2)
    spec = make_cost_model("H100-80GB", "qwen3-32b", "qwen3-0.6b", num_gpus=2)
    rng = random.Random(args.seed)
    rows = []
    print("    B    no-sd  best-k (k)    table   oracle  oracle/strongest  oracle+overlap  /no-sd"
          "  run-ahead  /strongest")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        draws = [one_batch(b, args.context, rng, plain, spec) for _ in range(args.draws)]
        row = {"batch": b, **{k: fmean(d[k] for d in draws)
                              for k in ("no-sd", "best-uniform", "table", "oracle", "oracle-overlap", "run-ahead")},
               "best_uniform_k": max(set(d["best-uniform-k"] for d in draws),
                                     key=[d["best-uniform-k"] for d in draws].count)}
        strongest = max(row["no-sd"], row["best-uniform"], row["table"])
        row["oracle_vs_strongest"] = row["oracle"] / strongest
        row["run_ahead_vs_strongest"] = row["run-ahead"] / strongest
        rows.append(row)
        print(f"{b:5d} {row['no-sd']:8.0f} {row['best-uniform']:8.0f} ({row['best_uniform_k']}) {row['table']:8.0f} "
              f"{row['oracle']:8.0f}  {row['oracle_vs_strongest']:16.3f}  {row['oracle-overlap']:14.0f}  "
              f"{row['oracle-overlap'] / row['no-sd']:.3f}  {row['run-ahead']:9.0f}  {row['run_ahead_vs_strongest']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "context": args.context, "draws": args.draws,
                       "seed": args.seed, "unit": "decode tokens/s", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
