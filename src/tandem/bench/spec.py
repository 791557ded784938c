"""`tandem bench spec`: speculative decoding policies across load levels, on the real engine.

For each concurrency C a closed loop keeps C requests in flight (natural lengths; greedy unless
`temperature` says otherwise) until max(requests_per_point, r x C) complete (r =
`requests_per_slot`, 3 by default), cycling through the prompt set (round-robin over kinds) or a
dataset (`dataset`: sharegpt, humaneval-edit, humaneval-tools, ...; its own kind); every policy
runs the same requests (speculation is lossless: greedy outputs and lengths are identical, and
sampled ones, each request seeded by its index, are distributed alike; a sampled text's length is
luck, and at a few dozen requests the luck moves tok/s more than the policy does, so
`ignore_eos` runs every request to its workload length). Policies are swapped on one
loaded engine and interleaved within each repeat (in reverse every other repeat), so machine noise and drift hit them alike; medians of
repeats are reported. Figures: output tokens/s, TPOT p50/p99, acceptance rate, mean accepted
length, draft-length histogram; plus a per-kind run at concurrency 1 and a PNG plot.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from tandem.bench.common import machine_info, median, percentile, write_json
from tandem.config import SpecConfig
from tandem.errors import ConfigError
from tandem.llm import reconfigure_speculation
from tandem.sampling_params import SamplingParams
from tandem.workload.datasets import load_dataset
from tandem.workload.prompts import load_prompt_set

POLICIES = {
    "no-sd": SpecConfig(policy="none"),
    "fixed-2": SpecConfig(policy="fixed", max_draft_tokens=2),
    "fixed-4": SpecConfig(policy="fixed", max_draft_tokens=4),
    "fixed-8": SpecConfig(policy="fixed", max_draft_tokens=8),
    "bs-table": SpecConfig(policy="table", max_draft_tokens=8),
    "survival": SpecConfig(policy="survival", max_draft_tokens=8),
    "adaptive": SpecConfig(policy="adaptive", max_draft_tokens=8),
}
# The ablation variants: a base policy plus (frontier size, middle-layer early exit, overlapped
# drafting, frontiers chosen per step). Frontiers of 4 rows; the early exit at the target's middle
# layer; overlap drafts frontier f+1 on a second thread while frontier f is verified (model
# drafters only); "auto" lets the scheduler pick frontiers or one pass each step. All lossless.
VARIANTS = {
    "adaptive+frontiers": ("adaptive", 4, False, False, False),
    "adaptive+auto-frontiers": ("adaptive", 4, False, False, True),
    "adaptive+early-exit": ("adaptive", 0, True, False, False),
    "adaptive+both": ("adaptive", 4, True, False, False),
    "adaptive+overlap": ("adaptive", 4, False, True, False),
    "fixed-8+frontiers": ("fixed-8", 4, False, False, False),
    "fixed-8+auto-frontiers": ("fixed-8", 4, False, False, True),
    "fixed-8+overlap": ("fixed-8", 4, False, True, False),
}
POLICIES.update({name: POLICIES[base] for name, (base, *_) in VARIANTS.items()})


def use_policy(llm, name: str, max_draft_tokens: int | None = None) -> None:
    """Switch a loaded engine to policy `name` (its proposer stays): the draft-length policy and,
    for the ablation variants, frontiers, early exit and overlap, all through one
    `reconfigure_speculation` call. `max_draft_tokens`: the cap of the policies that choose lengths
    themselves (adaptive, survival; default 8); fixed lengths and the table keep their own."""
    engine = llm.engine
    running = engine.speculation
    if running is None:
        raise ConfigError("bench spec needs an engine built with speculation (LLM(speculative=...))")
    base, frontier, early_exit, overlap, auto = VARIANTS.get(name, (name, 0, False, False, False))
    policy = POLICIES[base]
    num_layers = engine.executor.model.cfg.num_layers
    k = policy.max_draft_tokens if max_draft_tokens is None or policy.policy in ("fixed", "table") else max_draft_tokens
    cfg = dataclasses.replace(running, policy=policy.policy, max_draft_tokens=k,
                              length_table=policy.length_table, frontier_size=frontier,
                              adaptive_frontiers=auto, overlap=overlap, draft_threads=1,
                              early_exit_layer=num_layers // 2 if early_exit else None, early_exit_topk=8)
    reconfigure_speculation(engine, cfg)


def run_point(llm, items: list[tuple[str, list[int], int]], concurrency: int, num_requests: int,
              temperature: float = 0.0, ignore_eos: bool = False) -> dict[str, Any]:
    eng = llm.engine
    worker = eng.executor.spec.overlap if eng.executor.spec is not None else None
    overlapped_before = worker.num_overlapped if worker is not None else 0
    pending = [(i, *items[i % len(items)]) for i in range(num_requests)]
    kinds: dict[str, str] = {}
    records = []
    t0 = time.perf_counter()
    in_flight = 0
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, kind, ids, max_tokens = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i if temperature else None,
                                    ignore_eos=ignore_eos)
            rid = eng.add_request(prompt_token_ids=ids, params=params)
            kinds[rid] = kind
            in_flight += 1
        for out in eng.step():
            if out.finished:
                in_flight -= 1
                m = out.metrics
                n = len(out.token_ids)
                records.append({"kind": kinds.pop(out.request_id), "output_tokens": n, "ttft_s": m.ttft,
                                "e2e_s": m.e2e_latency,
                                "tpot_s": (m.e2e_latency - m.ttft) / (n - 1) if n > 1 else None,
                                "spec": m.spec})
    wall = time.perf_counter() - t0
    stats = eng.scheduler.spec_stats
    ee = eng.executor.spec.early_exit if eng.executor.spec is not None else None
    early_exit = None if ee is None else {"checked": ee.num_checked, "predicted_rejections": ee.num_predicted_rejections,
                                          "wrong_predictions": ee.num_wrong_predictions}
    tpots = [r["tpot_s"] for r in records if r["tpot_s"] is not None]
    return {"output_tok_s": sum(r["output_tokens"] for r in records) / wall, "wall_s": wall,
            "tpot_p50_ms": 1e3 * percentile(tpots, 50), "tpot_p99_ms": 1e3 * percentile(tpots, 99),
            "acceptance_rate": stats.acceptance_rate, "mean_accepted_length": stats.mean_accepted_length,
            "num_draft_tokens": stats.num_draft_tokens, "num_pruned_tokens": stats.num_pruned_tokens,
            "early_exit": early_exit,
            "overlapped_passes": worker.num_overlapped - overlapped_before if worker is not None else None,
            "chosen_lengths": dict(sorted(stats.chosen_lengths.items())),
            "records": records}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("output_tok_s", "tpot_p50_ms", "tpot_p99_ms", "acceptance_rate", "mean_accepted_length")
    out = {k: median([r[k] for r in runs if r[k] is not None]) for k in keys}
    out["chosen_lengths"] = runs[-1]["chosen_lengths"]
    out["runs"] = [{k: v for k, v in r.items() if k != "records"} for r in runs]
    return out


def bench_spec(llm, concurrencies: list[int], policies: list[str], repeats: int, requests_per_point: int,
               kinds: list[str] | None, kind_requests: int, json_path: str | None, plot_path: str | None,
               log=print, requests_per_slot: float = 3.0, max_tokens: int | None = None, dataset: str = "prompts",
               temperature: float = 0.0, ignore_eos: bool = False) -> dict[str, Any]:
    tok = llm.tokenizer
    if dataset == "prompts":
        source = [(p.kind, p.messages, p.max_tokens) for p in load_prompt_set()]
    else:
        n = max(requests_per_point, round(requests_per_slot * max(concurrencies)))
        source = [(dataset, it.messages, it.max_tokens)
                  for it in load_dataset(dataset, n, seed=0, count_tokens=lambda t: len(tok.encode(t)))]
    encoded = [(kind, tok.apply_chat_template(messages), min(m, max_tokens or m)) for kind, messages, m in source]
    by_kind = {k: [it for it in encoded if it[0] == k] for k in sorted({it[0] for it in encoded})}
    # Round-robin over kinds, so every run (even a short one) mixes chat, code, extract and rewrite.
    items = [lst[i] for i in range(max(map(len, by_kind.values()))) for lst in by_kind.values() if i < len(lst)]
    max_k = llm.engine.speculation.max_draft_tokens          # as the engine was built (suffix: its depth)
    use_policy(llm, "no-sd")
    run_point(llm, items[:1], 1, 1)                                     # warm-up
    sweep: dict[str, dict[int, list]] = {p: {c: [] for c in concurrencies} for p in policies}
    per_kind: dict[str, dict[str, list]] = {k: {p: [] for p in policies} for k in (kinds or [])}
    for rep in range(repeats):
        # ABBA: every other repeat runs the policies in reverse, so that a drift over the run (the
        # proposer's cache of earlier outputs grows; the machine warms) hits them alike
        order = policies if rep % 2 == 0 else policies[::-1]
        for c in concurrencies:
            for p in order:
                use_policy(llm, p, max_k)
                n = max(requests_per_point, round(requests_per_slot * c))    # with r = 3 the tail is a third
                res = run_point(llm, items, c, n, temperature, ignore_eos)
                sweep[p][c].append(res)
                log(f"[{rep + 1}/{repeats}] C={c:<3} {p:<9} {res['output_tok_s']:7.1f} tok/s  "
                    f"TPOT p50 {res['tpot_p50_ms']:6.1f} ms  accept {res['acceptance_rate']:.2f}")
        for k in kinds or []:
            for p in policies:
                use_policy(llm, p, max_k)
                res = run_point(llm, by_kind[k], 1, kind_requests, temperature, ignore_eos)
                per_kind[k][p].append(res)
                log(f"[{rep + 1}/{repeats}] kind={k:<8} C=1 {p:<9} {res['output_tok_s']:7.1f} tok/s")
    method = llm.engine.executor.spec.method
    data = {"bench": "spec", "dataset": dataset, "temperature": temperature, "ignore_eos": ignore_eos,
            "machine": machine_info(),
            "method": method, "max_draft_tokens": max_k,
            "requests_per_point": requests_per_point, "requests_per_slot": requests_per_slot,
            "max_tokens_cap": max_tokens, "kind_requests": kind_requests, "repeats": repeats,
            "concurrencies": concurrencies, "policies": policies,
            "sweep": {p: {str(c): _summary(sweep[p][c]) for c in concurrencies} for p in policies},
            "per_kind_c1": {k: {p: _summary(per_kind[k][p]) for p in policies} for k in per_kind}}
    write_json(json_path, data)
    if plot_path:
        plot_sweep(data, Path(plot_path))
    return data


def plot_sweep(data: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in data["policies"]:
        cs = data["concurrencies"]
        ax.plot(cs, [data["sweep"][p][str(c)]["output_tok_s"] for c in cs], marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Speculative decoding policies vs load ({data['method']} drafts, shared prompt set)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
