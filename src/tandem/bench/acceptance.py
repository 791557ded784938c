"""`tandem bench acceptance`: what a proposer's drafts are worth, per dataset, on the real engine,
measured in the form the simulator consumes.

Each request runs with a fixed draft length k (`--draft-tokens`, 8 by default) so every decode
round offers what the proposer has; the engine's per-request speculation counters are diffed after
every step, giving for each decode round (offered drafts, accepted drafts), with 0 offered where an
n-gram lookup found nothing. Acceptance does not depend on load (drafts and verification are
per sequence), so requests run a few at a time (`concurrency`) to save time.

`fit_rounds` turns those rounds into a workload kind's model (see tandem.sim.workload):
- `offer`: the probability that a round offers drafts after a round that did, and after one that
  did not (a two-state Markov chain; a model drafter always offers: [1, 1]);
- `offer_lengths`: how many drafts an offering round holds, P(1..k);
- `position`: conditional acceptance of draft m given drafts 1..m-1 were accepted, pooled over the
  kind's requests, as ratios to position 1, positions past the first one reached under
  MIN_REACHED times sharing one rate (`position_acceptance` keeps the raw values);
- `beta`: a Beta distribution over requests of the first draft's acceptance (method of moments,
  the binomial noise of each request's own count removed);
- `prompt` / `output`: lognormal [median, sigma, lo, hi] of the prompt and output lengths.
The per-dataset kinds of a JSON written here can be pasted into a scenario's `workload.kinds` and
`workload.acceptance`. Pure fitting below (`fit_rounds`, `fit_beta`, `fit_lognormal`): no torch.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Iterable

from tandem.bench.common import machine_info, write_json

MIN_REACHED = 20                        # rounds a position needs before its own rate is fitted
Rounds = list[tuple[int, int]]          # one request's decode rounds: (offered, accepted)


def fit_beta(successes: Iterable[int], trials: Iterable[int]) -> list[float] | None:
    """Beta(a, b) over requests of a per-request success probability, from each request's own
    (successes, trials): method of moments on the observed rates, their binomial sampling variance
    subtracted (so short requests do not widen it). None with fewer than two requests with trials."""
    pairs = [(s, n) for s, n in zip(successes, trials) if n > 0]
    if len(pairs) < 2:
        return None
    rates = [s / n for s, n in pairs]
    mean = statistics.fmean(rates)
    mean = min(max(mean, 1e-3), 1 - 1e-3)
    observed = statistics.pvariance(rates)
    noise = statistics.fmean(mean * (1 - mean) / n for _, n in pairs)
    var = max(observed - noise, 1e-4)
    var = min(var, mean * (1 - mean) * 0.95)       # a Beta needs var < m(1 - m)
    common = mean * (1 - mean) / var - 1
    return [round(mean * common, 4), round((1 - mean) * common, 4)]


def fit_lognormal(values: list[int]) -> list[float] | None:
    """[median, sigma, lo, hi] of a lognormal fitted to positive lengths (the observed range clips it)."""
    vals = [v for v in values if v > 0]
    if not vals:
        return None
    logs = [math.log(v) for v in vals]
    sigma = statistics.pstdev(logs) if len(logs) > 1 else 0.0
    return [round(math.exp(statistics.fmean(logs)), 1), round(sigma, 4), min(vals), max(vals)]


def fit_rounds(requests: list[Rounds], max_draft: int) -> dict[str, Any]:
    """A kind's draft model from its requests' decode rounds (see the module docstring)."""
    rounds = [r for req in requests for r in req]
    offered = [(o, a) for o, a in rounds if o > 0]
    # Offers as a Markov chain over rounds (within a request).
    trans = {True: [0, 0], False: [0, 0]}            # prev offered? -> [rounds, of which offered]
    for req in requests:
        for (o0, _), (o1, _) in zip(req, req[1:]):
            t = trans[o0 > 0]
            t[0] += 1
            t[1] += o1 > 0
    lengths = [0] * max_draft
    for o, _ in offered:
        lengths[min(o, max_draft) - 1] += 1
    # Conditional acceptance per position: of rounds that reached draft m (offered >= m and
    # accepted m - 1), the share that accepted it.
    reached, passed = [0] * max_draft, [0] * max_draft
    for o, a in offered:
        for m in range(min(o, max_draft)):
            if a < m:
                break
            reached[m] += 1
            passed[m] += a > m
    cond = [p / r if r else None for p, r in zip(passed, reached)]
    # The simulator's ratios: from the first position reached fewer than MIN_REACHED times on,
    # the deeper positions are pooled (one rate for the tail), so a handful of rounds does not
    # set a position to 0 or 1.
    pooled = list(cond)
    for m in range(max_draft):
        if reached[m] < MIN_REACHED:
            r, p = sum(reached[m:]), sum(passed[m:])
            pooled[m:] = [p / r if r else (pooled[m - 1] if m else None)] * (max_draft - m)
            break
    first = pooled[0] or 0.0
    ratios = [round(c / first, 4) if c is not None and first > 0 else 1.0 for c in pooled]
    firsts = [(sum(1 for o, a in req if o > 0 and a > 0), sum(1 for o, _ in req if o > 0)) for req in requests]
    n_off, n_acc = sum(o for o, _ in offered), sum(a for _, a in offered)
    return {
        "num_requests": len(requests), "num_rounds": len(rounds), "num_offering_rounds": len(offered),
        "offer_rate": round(len(offered) / len(rounds), 4) if rounds else 0.0,
        "offer": [round(trans[s][1] / trans[s][0], 4) if trans[s][0] else (1.0 if s else 0.0) for s in (True, False)],
        "offer_lengths": [round(n / len(offered), 4) for n in lengths] if offered else [],
        "mean_offered": round(n_off / len(offered), 3) if offered else 0.0,
        "acceptance_rate": round(n_acc / n_off, 4) if n_off else 0.0,
        "mean_accepted_length": round(1 + n_acc / len(offered), 4) if offered else 0.0,
        "position_acceptance": [None if c is None else round(c, 4) for c in cond],
        "position_reached": reached,
        "position": ratios,
        "beta": fit_beta([s for s, _ in firsts], [n for _, n in firsts]),
    }


def measure(llm, items: list[tuple[str, list[int], int]], temperature: float, concurrency: int = 8,
            seed: int = 0, log=print) -> list[dict[str, Any]]:
    """Run `items` (kind, prompt ids, max tokens); per request its kind, lengths and decode rounds."""
    from tandem.sampling_params import SamplingParams

    eng = llm.engine
    pending = list(enumerate(items))
    live: dict[str, dict[str, Any]] = {}
    done: list[dict[str, Any]] = []
    while pending or live:
        while pending and len(live) < concurrency:
            i, (kind, ids, max_tokens) = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
            rid = eng.add_request(prompt_token_ids=ids, params=params)
            live[rid] = {"kind": kind, "prompt_tokens": len(ids), "rounds": [], "_n": 0, "_d": 0, "_a": 0}
        for out in eng.step():
            st = live.get(out.request_id)
            if st is None:
                continue
            n = len(out.outputs[0].token_ids)
            spec = out.metrics.spec or {}
            d, a = spec.get("num_draft_tokens", 0), spec.get("num_accepted_tokens", 0)
            if n > st["_n"] and st["_n"] > 0:           # a decode round (the first token ends prefill)
                st["rounds"].append((d - st["_d"], a - st["_a"]))
            st["_n"], st["_d"], st["_a"] = n, d, a
            if out.finished:
                del live[out.request_id]
                done.append({k: v for k, v in st.items() if not k.startswith("_")} | {"output_tokens": n})
                if len(done) % 10 == 0:
                    log(f"  {len(done)}/{len(items)} requests")
    return done


def bench_acceptance(llm, datasets: list[str], num_requests: int, draft_tokens: int, temperature: float,
                     max_tokens: int, concurrency: int, json_path: str | None, seed: int = 0,
                     log=print) -> dict[str, Any]:
    from tandem.errors import ConfigError
    from tandem.llm import reconfigure_speculation
    from tandem.workload.datasets import load_dataset

    eng = llm.engine
    if eng.speculation is None:
        raise ConfigError("bench acceptance needs an engine built with speculation (LLM(speculative=...))")
    reconfigure_speculation(eng, dataclasses.replace(eng.speculation, policy="fixed", max_draft_tokens=draft_tokens,
                                                     frontier_size=0, overlap=False, early_exit_layer=None))
    tok = llm.tokenizer
    results: dict[str, Any] = {}
    for name in datasets:
        work = load_dataset(name, n=num_requests, seed=seed, count_tokens=lambda s: len(tok.encode(s)))
        items = [(w.kind if name == "prompts" else name, tok.apply_chat_template(w.messages),
                  min(w.max_tokens, max_tokens)) for w in work]
        t0 = time.perf_counter()
        log(f"{name}: {len(items)} requests, k = {draft_tokens}, temperature {temperature}")
        reqs = measure(llm, items, temperature, concurrency, seed, log)
        kinds: dict[str, Any] = {}
        for kind in sorted({r["kind"] for r in reqs}):
            mine = [r for r in reqs if r["kind"] == kind]
            fit = fit_rounds([r["rounds"] for r in mine], draft_tokens)
            fit["prompt"] = fit_lognormal([r["prompt_tokens"] for r in mine])
            fit["output"] = fit_lognormal([r["output_tokens"] for r in mine])
            kinds[kind] = fit
            log(f"  {kind:<10} offers {fit['offer_rate']:.0%} of rounds (persist {fit['offer'][0]:.2f}/"
                f"{fit['offer'][1]:.2f}), acceptance {fit['acceptance_rate']:.1%}, first draft "
                f"{fit['position_acceptance'][0] or 0:.2f}, tokens/round {fit['mean_accepted_length']:.2f}")
        results[name] = {"kinds": kinds, "wall_s": round(time.perf_counter() - t0, 1),
                         "requests": reqs}
    spec = eng.speculation
    data = {"machine": machine_info(), "method": spec.method, "draft_model": spec.draft_model,
            "draft_tokens": draft_tokens, "temperature": temperature, "max_tokens": max_tokens,
            "num_requests": num_requests, "seed": seed, "datasets": results}
    write_json(json_path, data)
    return data
