"""Printed tables of scenario results (Markdown, also pasted into docs/simulator.md).

Reads the result dictionaries the scenarios return; computes nothing the JSON does not hold.
"""

from __future__ import annotations

from typing import Any


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (readable as plain text too)."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def _faser_row(r: dict[str, Any]) -> list[str]:
    s, spec = r["summary"], r["summary"].get("spec", {})
    return [r["label"], _f(r["saturation_rps"], ".2f"), _f(r["saturation_tok_s"], ".0f"),
            _f(s["e2e_s"]["mean"], ".2f"), _f(s["e2e_s"]["p99"], ".2f"), _f(s["tpot_s"]["mean"] * 1e3, ".1f"),
            _f(s["ttft_s"]["p99"], ".2f"), _f(spec.get("acceptance_rate"), ".2f"),
            _f(spec.get("mean_draft_length"), ".2f")]


ABLATION_BASES = ("adaptive", "fixed-8")


def faser_tables(res: dict[str, Any]) -> str:
    header = ["policy", "sat. req/s", "sat. tok/s", "E2E mean s", "E2E p99 s", "TPOT mean ms", "TTFT p99 s",
              "accept", "mean k"]
    h = res["headline"]["ours"]
    vs = [f"  {name} vs {b:<9} throughput x{v['throughput_x']:.2f}  latency: "
          f"mean x{v['mean_latency_x']:.2f}  p99 x{v['p99_latency_x']:.2f}  "
          f"valley x{v['valley_latency_x']:.2f}  peak x{v['peak_latency_x']:.2f}"
          for name, key in (("adaptive", "ours"), ("adaptive+run-ahead", "ours_run_ahead"))
          for b, v in res["headline"].get(key, {}).get("vs", {}).items()]
    tail = (f"  paper: up to x1.53 throughput, x1.92 lower latency; ours: up to x{h['max_throughput_x']:.2f} "
            f"throughput, x{h['max_mean_latency_x']:.2f} lower mean latency")
    body = table(header, [_faser_row(r) for r in res["rows"]])
    parts = [f"FASER scenario: {res['description']}", body] + vs + [tail]
    if res.get("ablation"):
        bases = [r for r in res["rows"] if r["label"] in ABLATION_BASES]
        rows = [_faser_row(r) + [_f(r["summary"].get("spec", {}).get("pruned_tokens"), "d")]
                for r in bases + res["ablation"]]
        parts += [f"\nablation: verification in frontiers of {res['frontier_size']} drafts (+ overlapped drafting)",
                  table(header + ["pruned"], rows)]
    return "\n".join(parts)


def _augserve_row(r: dict[str, Any]) -> list[str]:
    s, kv = r["summary"], r["counters"]["kv_actions"]
    norm = s["normalized_latency_s"]["p50"]
    return [r["load"], _f(r["rate"], ".2f"), r["label"], _f(s["effective_throughput"], ".2f"),
            _f(s["slo_attainment"], ".0%"), _f(s["ttft_s"]["p50"], ".3f"), _f(s["ttft_s"]["p99"], ".2f"),
            _f(norm * 1e3 if norm is not None else None, ".1f"), str(r["counters"]["preemptions"]),
            f"{kv['preserve']}/{kv['swap']}/{kv['discard']}"]


def augserve_tables(res: dict[str, Any]) -> str:
    header = ["load", "rate req/s", "policy", "eff. req/s", "SLO met", "TTFT p50 s", "TTFT p99 s",
              "norm. lat. p50 ms", "preempt", "KV p/s/d"]
    parts = []
    for d in res["deployments"]:
        slo = d["slo"]
        parts.append(f"{d['description']}; capacity {d['capacity_rps']:.2f} req/s; "
                     f"SLO TTFT <= {slo['ttft_s']} s, normalized latency <= "
                     f"{slo['normalized_latency_s'] * 1e3:.0f} ms\n"
                     + table(header, [_augserve_row(r) for r in d["rows"]]))
    o = res["headline"]["ours"]
    parts.append(f"headline (max over deployments and loads): augserve effective throughput "
                 f"x{_f(o['eff_vs_vllm'], '.2f')} vs fcfs-discard (paper x4.7), "
                 f"x{_f(o['eff_vs_infercept'], '.2f')} vs infercept (paper x3.3); TTFT p50 "
                 f"{_f(o['ttft_p50_reduction_max'], '.0%')} / p99 {_f(o['ttft_p99_reduction_max'], '.0%')} "
                 f"lower than fcfs-discard (paper: up to 96%)")
    return "\n\n".join(parts)


def _file_row(r: dict[str, Any]) -> list[str]:
    s = r["summary"]
    tpot = s["tpot_s"]["mean"]
    return [r["deployment"], _f(r["rate"], ".3g"), r["label"], f"{s['completed']}/{s['num_requests']}",
            _f(s["request_throughput"], ".2f"), _f(s["output_throughput"], ".0f"),
            _f(s["ttft_s"]["p50"], ".3f"),
            _f(s["ttft_s"]["p99"], ".2f"), _f(tpot * 1e3 if tpot is not None else None, ".1f"),
            _f(s["e2e_s"]["p99"], ".2f"), _f(s.get("slo_attainment"), ".0%")]


def file_tables(res: dict[str, Any]) -> str:
    header = ["deployment", "rate", "run", "done", "req/s", "out tok/s", "TTFT p50 s", "TTFT p99 s",
              "TPOT mean ms", "E2E p99 s", "SLO met"]
    return f"scenario {res['scenario']}\n" + table(header, [_file_row(r) for r in res["rows"]])
