"""PNG plots of load-generator results (matplotlib, Agg backend: no display needed).

- latency_cdf.png: empirical CDFs of TTFT, TPOT, ITL and E2E latency, one line per run.
- throughput_vs_rate.png (sweeps of two or more rates): output tokens/s, and completed requests/s
  with goodput, against the offered request rate.
Reads the run dictionaries that serve.py writes; computes nothing that the JSON does not hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_latencies_ms(run: dict[str, Any]) -> dict[str, list[float]]:
    """Latency samples (ms) of the successful requests of one run, per metric."""
    ok = [r for r in run["requests"] if r["success"]]
    return {"ttft": [r["ttft_s"] * 1e3 for r in ok if r["ttft_s"] is not None],
            "tpot": [r["tpot_s"] * 1e3 for r in ok if r["tpot_s"] is not None and r["output_tokens"] > 1],
            "itl": [g * 1e3 for r in ok for g in r["itl_s"]],
            "e2el": [r["e2e_s"] * 1e3 for r in ok if r["e2e_s"] is not None]}


def plot_latency_cdfs(runs: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for run in runs:
        samples = run_latencies_ms(run)
        for ax, (key, _) in zip(axes.flat, METRICS):
            values = sorted(samples[key])
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=run["label"])
    for ax, (_, name) in zip(axes.flat, METRICS):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"Latency CDFs {title}".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput_vs_rate(runs: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    plt = _pyplot()
    rates = [run["rate"] for run in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(rates, [run["summary"]["output_throughput"] for run in runs], "o-")
    left.set_xlabel("offered request rate (req/s)")
    left.set_ylabel("output tokens/s")
    right.plot(rates, [run["summary"]["request_throughput"] for run in runs], "o-", label="completed")
    if all("goodput" in run["summary"] for run in runs):
        right.plot(rates, [run["summary"]["goodput"] for run in runs], "s--", label="goodput (met SLOs)")
    right.plot(rates, rates, ":", color="grey", label="offered")
    right.set_xlabel("offered request rate (req/s)")
    right.set_ylabel("requests/s")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(f"Throughput against request rate {title}".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_serve_results(runs: list[dict[str, Any]], out_dir: str | Path, title: str = "") -> list[str]:
    """Write the plots for these runs into `out_dir`; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [plot_latency_cdfs(runs, out / "latency_cdf.png", title)]
    rated = [run for run in runs if run.get("rate") is not None and run["rate"] != float("inf")]
    if len(rated) >= 2:
        written.append(plot_throughput_vs_rate(sorted(rated, key=lambda r: r["rate"]),
                                               out / "throughput_vs_rate.png", title))
    return [str(p) for p in written]


def plot_agent_runs(runs: list[dict[str, Any]], path: str | Path) -> Path:
    """`tandem bench agents` results (one or more runs, e.g. one per server policy): CDFs of the LLM
    time per session and of TTFT per call."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for run in runs:
        per: dict[str, float] = {}
        for r in run["records"]:
            per[r["session"]] = per.get(r["session"], 0.0) + (r["e2e_s"] or 0.0)
        ttft = [r["ttft_s"] for r in run["records"] if r["ok"] and r["ttft_s"] is not None]
        for ax, values in ((a, per.values()), (b, ttft)):
            v = sorted(values)
            if v:
                ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post",
                        label=run.get("label") or run["target"])
    a.set_xlabel("LLM time per session (s)")
    a.set_ylabel("fraction of sessions")
    b.set_xlabel("TTFT per call (s)")
    b.set_ylabel("fraction of calls")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle("Agent sessions replayed over HTTP")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
