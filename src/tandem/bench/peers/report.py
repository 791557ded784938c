"""The report half of `tandem bench compare --peer vllm` (peers/vllm.py): the figures of the raw runs
present (from_raw), the markdown table of medians and Tandem / vLLM ratios (markdown), the medians
over seeds of served runs (serve_medians) and one served row (serve_row), for the other peers too."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

SERVE_METRICS = [("request_goodput", "goodput req/s", 1), ("request_throughput", "req/s", 1),
                 ("output_throughput", "output tok/s", 1), ("median_ttft_ms", "TTFT p50 ms", -1),
                 ("p99_ttft_ms", "TTFT p99 ms", -1), ("median_tpot_ms", "TPOT p50 ms", -1),
                 ("p99_tpot_ms", "TPOT p99 ms", -1), ("median_itl_ms", "ITL p50 ms", -1)]


def from_raw(a, raw: Path) -> dict:
    """The figures of the runs whose raw files exist (an interrupted comparison still reports)."""
    out: dict = {}
    offline = {}
    for engine in ("vllm", "tandem"):
        for t in ("0", "1"):
            f = raw / f"offline-{engine}-t{t}.json"
            if f.exists():
                offline[f"{engine}-t{t}"] = json.loads(f.read_text())["output_tok_s"]
    if offline:
        out["offline"] = offline
    prompts = {}
    for tag in ("vllm", "tandem", "vllm-ngram", "tandem-ngram"):
        f = raw / f"prompts-{tag}.json"
        if f.exists():
            d = json.loads(f.read_text())
            prompts[tag] = {m: d[m]["output_tok_s"] for m in ("sequential", "batch")}
    if prompts:
        out["prompts"] = prompts
    serve = {name: {str(r): [] for r in a.rates} for name in ("vllm", "tandem")}
    seeds = set()
    for name in serve:
        for rate in a.rates:
            for seed in a.seeds:
                f = raw / f"serve-{name}-rate{rate:g}-seed{seed}.json"
                if f.exists():
                    d = json.loads(f.read_text())
                    serve[name][str(rate)].append({k: d.get(k) for k, _, _ in SERVE_METRICS}
                                                  | {"completed": d.get("completed")})
                    seeds.add(seed)
    if seeds:
        out["serve"], out["seeds"] = serve, sorted(seeds)
    return out


def med(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def markdown(data: dict) -> str:
    model = Path(data.get("model", "")).name + (" (dummy weights)" if data.get("load_format") == "dummy" else "")
    lines = [f"Tandem vs vLLM {data['peer_version']} CPU build on {model}, same machine, one after the other "
             f"({data['machine']}, dtype {data['dtype']}); medians; ratio = Tandem / vLLM "
             f"(for latencies below 1 is better). vLLM's environment: {data.get('vllm_env') or 'default'}.", ""]
    if "offline" in data:
        o = data["offline"]
        lines += [f"Offline ShareGPT, {data['offline_prompts']} requests at once, reference output lengths, "
                  "ignore_eos (output tok/s):", "", "| sampling | vLLM | Tandem | Tandem / vLLM |",
                  "|---|---:|---:|---:|"]
        for t, label in (("0", "greedy"), ("1", "temperature 1")):
            v, m = o.get(f"vllm-t{t}"), o.get(f"tandem-t{t}")
            if v and m:
                lines.append(f"| {label} | {v:.1f} | {m:.1f} | {m / v:.2f} |")
        lines.append("")
    if "prompts" in data:
        p = data["prompts"]
        lines += ["The bundled prompt set (chat, rewrite, extract, code; "
                  f"{data.get('prompts_per_kind', 3)} of each), greedy, ending at EOS (output tok/s); "
                  "n-gram: vLLM's prompt lookup with k=4, Tandem's adaptive n-gram proposer:", "",
                  "| run | vLLM | Tandem | Tandem / vLLM |", "|---|---:|---:|---:|"]
        for mode, label in (("sequential", "one at a time"), ("batch", "all at once")):
            for suffix, spec in (("", "no speculation"), ("-ngram", "n-gram")):
                v, m = p.get("vllm" + suffix, {}).get(mode), p.get("tandem" + suffix, {}).get(mode)
                if v and m:
                    lines.append(f"| {label}, {spec} | {v:.1f} | {m:.1f} | {m / v:.2f} |")
            v, m = p.get("vllm", {}).get(mode), p.get("tandem-ngram", {}).get(mode)
            if v and m and p.get("vllm-ngram", {}).get(mode):
                best = max(v, p["vllm-ngram"][mode])
                lines.append(f"| {label}, Tandem n-gram vs vLLM's best | {best:.1f} | {m:.1f} | {m / best:.2f} |")
        lines.append("")
    if "serve" in data:
        s = data["serve"]
        lines += [f"`vllm bench serve`, ShareGPT, {data['num_prompts']} prompts, chat endpoint, seeds "
                  f"{data['seeds']}; goodput: TTFT <= {data['ttft_ms']} ms and TPOT <= {data['tpot_ms']} ms:", "",
                  "| rate | metric | vLLM | Tandem | Tandem / vLLM |", "|---:|---|---:|---:|---:|"]
        for rate in data["rates"]:
            for key, label, _ in SERVE_METRICS:
                v = med([r[key] for r in s["vllm"][str(rate)]])
                m = med([r[key] for r in s["tandem"][str(rate)]])
                lines.append(serve_row(rate, label, v, m))
    return "\n".join(lines) + "\n"


def serve_row(rate: float, label: str, peer: float | None, tandem: float | None) -> str:
    """One row of a served comparison: the rate, the metric, the peer's and Tandem's medians and
    Tandem / peer (n/a where a figure is missing or the peer's is 0)."""
    if peer is None or tandem is None:
        return f"| {rate:g} | {label} | {peer} | {tandem} | n/a |"
    ratio = f"{tandem / peer:.2f}" if peer else "n/a"
    return f"| {rate:g} | {label} | {peer:.2f} | {tandem:.2f} | {ratio} |"


def serve_medians(runs: dict[str, dict[str, list[dict]]], rates: list[float]) -> dict[str, dict[str, dict]]:
    """{rate: {server: {metric: median over seeds}}} of `serve_rounds`' runs, for the metrics of
    SERVE_METRICS that every seed's run reports."""
    return {str(r): {name: {key: statistics.median(x[key] for x in runs[name][str(r)])
                            for key, _, _ in SERVE_METRICS if all(x.get(key) is not None for x in runs[name][str(r)])}
                     for name in runs} for r in rates}
