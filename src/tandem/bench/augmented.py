"""`tandem bench augmented`: tool-augmented serving on the real engine, per scheduling policy.

Workload: InferCept-style traces of the augmentation mixture (workload/augmented.py), replayed in
scripted mode: each request generates its segments' tokens (greedy, EOS ignored), pauses for the
trace's tool time and resumes with the trace's number of returned tokens, exactly where the trace
says. Arrivals: Poisson at each given rate, open loop, in real time; a request's clock starts at its
trace arrival time, even if a running step delays its submission (as a server would have received
it). Every policy replays the same trace; runs interleave policies within each rate.

SLO (a request "meets" it, for effective throughput): TTFT <= ttft_slo_s and normalized latency
(end-to-end minus time spent in tools, per output token) <= norm_slo_s. Effective throughput =
requests meeting the SLO / run duration (AugServe's metric). Also: TTFT p50/p99, normalized
latency, KV actions taken, preemptions, tokens recomputed, and the output-length predictor's
Kendall tau. `steps_path` records every step's scheduler state (`StepTrace`); `stall` stops the
engine once per run, to see whether a policy recovers from a disturbance.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import replace
from typing import Any

from tandem.bench.common import machine_info, percentile, write_json
from tandem.engine.tool_runtime import ToolOptions
from tandem.sampling_params import SamplingParams
from tandem.types import SchedulerStats
from tandem.workload.arrivals import poisson_arrivals
from tandem.workload.augmented import AugmentedRequest, Segment, sample_augmented


def scaled(req: AugmentedRequest, tokens: float, tool_time: float) -> AugmentedRequest:
    segs = [Segment(max(1, round(s.completion_tokens * tokens)), s.api_time_s * tool_time,
                    round(s.return_tokens * tokens)) for s in req.segments]
    return replace(req, segments=segs, prompt_tokens=max(4, round(req.prompt_tokens * tokens)))


def make_trace(n: int, rate: float, seed: int, tokens: float, tool_time: float) -> list[tuple[float, AugmentedRequest]]:
    rng = random.Random(seed)
    reqs = [scaled(r, tokens, tool_time) for r in sample_augmented(n, rng)]
    return list(zip(poisson_arrivals(rate, random.Random(seed + 1), n=n), reqs))


def prompt_ids(tok, req: AugmentedRequest, rng: random.Random) -> list[int]:
    words = tok.encode(" the of and a to in is it that for on with as at by this from or an be are we can", False)
    return [rng.choice(words) for _ in range(req.prompt_tokens)]


def train_predictor(tok, num_requests: int, seed: int, tokens: float, tool_time: float) -> dict[str, Any]:
    """AugServe's Stage I predictor trained on a held-out trace (`seed`: keep it off the runs'), its
    requests built as `run_policy` builds them (the same prompt words, tool keys and scaling)."""
    from tandem.sim.predictor import calls_of, fit
    from tandem.types import Request

    rng = random.Random(seed)
    samples = []
    for i, req in enumerate(scaled(r, tokens, tool_time) for r in sample_augmented(num_requests, random.Random(seed))):
        r = Request(f"train-{i}", prompt_ids(tok, req, rng), SamplingParams(max_tokens=req.output_tokens))
        r.tool.key = req.type
        samples.append((r, req.output_tokens, calls_of(req.segments)))
    state = fit(samples)
    state["trained_on"].update(dataset="augmented", seed=seed, builder="engine", token_scale=tokens,
                               time_scale=tool_time)
    return state


def run_policy(llm, policy: str, trace: list[tuple[float, AugmentedRequest]], slo: tuple[float, float],
               seed: int, trained: dict | None = None, steps: list | None = None,
               stall: tuple[float, float] | None = None) -> dict[str, Any]:
    """`steps`: a list to record the run's scheduled steps in (`StepTrace`s, `t` from the run's start).
    `stall` (seconds, at): once the run has lasted `at` s, the engine stops stepping for `seconds`
    (a slow host, a GC pause) while arrivals and tool results pile up: a disturbance that a stable
    scheduler absorbs and then recovers from."""
    eng, sched = llm.engine, llm.engine.scheduler
    sched.set_policy(policy, trained=trained)
    sched.trace = steps
    rng = random.Random(seed)
    pending = list(trace)
    info: dict[str, tuple[AugmentedRequest, int]] = {}
    records, t0 = [], eng.clock()
    preempt0, recompute0 = sched.num_preemptions, sched.num_recompute_tokens
    while pending or eng.has_unfinished_requests():
        now = eng.clock() - t0
        while pending and pending[0][0] <= now:
            at, req = pending.pop(0)
            script = [(s.completion_tokens, s.api_time_s, s.return_tokens) for s in req.segments]
            params = SamplingParams(max_tokens=req.output_tokens, temperature=0, ignore_eos=True)
            rid = eng.add_request(prompt_token_ids=prompt_ids(llm.tokenizer, req, rng), params=params,
                                  tool_options=ToolOptions(script=script, key=req.type), arrival_time=t0 + at)
            info[rid] = (req, 0)
        if stall is not None and now >= stall[1]:
            time.sleep(stall[0])
            stall = None
            continue
        outs = eng.step()
        if not outs and not sched.has_work():
            wait = 0.05 if not pending else max(0.0, min(0.05, pending[0][0] - (eng.clock() - t0)))
            eng.wait_for_tools(wait)
        for o in outs:
            if o.finished:
                records.append(_record(o, info.pop(o.request_id)[0], slo, t0))
    duration = eng.clock() - t0
    sched.trace = None
    if steps is not None:
        for s in steps:
            s.t -= t0
    summary = _summary(policy, records, duration, sched.stats(), preempt0)
    summary["recompute_tokens"] = sched.num_recompute_tokens - recompute0
    return summary


def _record(out, req: AugmentedRequest, slo: tuple[float, float], t0: float) -> dict[str, Any]:
    m = out.metrics
    tool_s = sum(t["duration_s"] for t in m.tool_calls)
    n = max(1, len(out.token_ids))
    norm = (m.e2e_latency - tool_s) / n
    return {"request_id": out.request_id, "arrival_s": m.arrival_time - t0, "prompt_tokens": req.prompt_tokens,
            "type": req.type, "output_tokens": len(out.token_ids), "ttft_s": m.ttft, "e2e_s": m.e2e_latency,
            "tool_s": tool_s, "norm_latency_s": norm, "calls": req.num_calls,
            "slo_met": m.ttft <= slo[0] and norm <= slo[1],
            "predicted_len": m.predicted_output_tokens}


def _summary(policy: str, records: list[dict], duration: float, stats: SchedulerStats,
             preempt0: int) -> dict[str, Any]:
    ttft = [r["ttft_s"] for r in records]
    norm = [r["norm_latency_s"] for r in records]
    pairs = [(r["predicted_len"], r["output_tokens"]) for r in records if r["predicted_len"] is not None]
    tau = None
    if len(pairs) >= 8:
        from scipy.stats import kendalltau
        tau = float(kendalltau([p for p, _ in pairs], [a for _, a in pairs])[0])
    return {"policy": policy, "num_requests": len(records), "duration_s": duration,
            "throughput_rps": len(records) / duration,
            "effective_throughput_rps": sum(r["slo_met"] for r in records) / duration,
            "slo_attainment": sum(r["slo_met"] for r in records) / max(1, len(records)),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "norm_latency_p50_s": percentile(norm, 50), "norm_latency_p99_s": percentile(norm, 99),
            "kv_actions": stats.kv_actions, "kept_kv_discarded": stats.num_discarded_kept,
            "preemptions": stats.num_preemptions - preempt0,
            "predictor_kendall_tau": tau, "records": records}


def bench_augmented(llm, policies: list[str], rates: list[float], num_requests: int, seed: int,
                    token_scale: float, time_scale: float, slo: tuple[float, float], repeats: int,
                    json_path: str | None, log=print, predictor: dict | None = None,
                    train_requests: int = 2000, steps_path: str | None = None,
                    stall: tuple[float, float] | None = None) -> dict[str, Any]:
    """`predictor`: a trained state the policies start from; None trains one on a held-out trace
    (seed + 1000, `train_requests` requests); {} runs them cold. `steps_path`: write every run's
    per-step trace there (JSON lines: rate, repeat, policy and its `StepTrace`s). `stall`: see
    `run_policy`."""
    if predictor is None:
        predictor = train_predictor(llm.tokenizer, train_requests, seed + 1000, token_scale, time_scale)
        log(f"Stage I predictor trained on {predictor['trained_on']}")
    results: dict[str, dict[str, list]] = {str(r): {p: [] for p in policies} for r in rates}
    if steps_path:
        open(steps_path, "w").close()               # each run appends its line below
    traces = {rate: make_trace(num_requests, rate, seed, token_scale, time_scale) for rate in rates}
    for rep in range(repeats):                      # the same trace each time: spread is the engine's
        for rate in rates:
            trace = traces[rate]
            for p in policies:
                steps: list | None = [] if steps_path else None
                res = run_policy(llm, p, trace, slo, seed, predictor or None, steps, stall)
                results[str(rate)][p].append(res)
                if steps is not None:
                    with open(steps_path, "a") as f:
                        f.write(json.dumps({"rate": rate, "repeat": rep, "policy": p,
                                            "steps": [dataclasses.asdict(s) for s in steps]}) + "\n")
                log(f"[{rep + 1}/{repeats}] rate {rate:<5} {p:<16} eff {res['effective_throughput_rps']:.3f} req/s "
                    f"(SLO {res['slo_attainment']:.0%}), TTFT p50 {res['ttft_p50_s']:.2f}s p99 {res['ttft_p99_s']:.2f}s, "
                    f"pauses {res['kv_actions']}, kept KV discarded {res['kept_kv_discarded']}, "
                    f"recomputed {res['recompute_tokens']} tokens")
    data = {"bench": "augmented", "machine": machine_info(), "policies": policies, "rates": rates,
            "num_requests": num_requests, "token_scale": token_scale, "time_scale": time_scale,
            "slo": {"ttft_s": slo[0], "norm_latency_s_per_token": slo[1]},
            "predictor": predictor.get("trained_on") if predictor else None,
            "stall": {"seconds": stall[0], "at_s": stall[1]} if stall else None, "results": results}
    write_json(json_path, data)
    return data
