"""PNG plots of scenario results (matplotlib, Agg backend), for docs/simulator.md.

- faser.png: saturation throughput per policy; mean/p99 E2E latency over the diurnal day; mean
  latency by time of day against the arrival curve.
- augserve.png: one row per deployment: effective throughput, TTFT p50 and TTFT p99 against the
  request rate, one line per policy.
- scenario.png (file scenarios): output throughput and TTFT p99 against the rate per run.
Reads the result dictionaries; computes nothing the JSON does not hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_faser(res: dict[str, Any], out_dir: Path) -> Path:
    plt = _pyplot()
    rows = res["rows"]
    labels = [r["label"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    a.bar(labels, [r["saturation_tok_s"] for r in rows], color="tab:blue")
    a.set_ylabel("output tokens/s at saturation")
    a.tick_params(axis="x", rotation=35)
    x = range(len(rows))
    b.bar([i - 0.2 for i in x], [r["summary"]["e2e_s"]["mean"] for r in rows], 0.4, label="mean")
    b.bar([i + 0.2 for i in x], [r["summary"]["e2e_s"]["p99"] for r in rows], 0.4, label="p99")
    b.set_xticks(list(x), labels, rotation=35)
    b.set_ylabel("E2E latency over the diurnal day (s)")
    b.legend(fontsize=8)
    for r in rows:
        t = r["timeline"]
        xs = [(i + 0.5) * t["bin_s"] for i in range(len(t["mean_e2e_s"]))]
        c.plot(xs, t["mean_e2e_s"], marker=".", label=r["label"])
    twin = c.twinx()
    t0 = rows[0]["timeline"]
    twin.bar([(i + 0.5) * t0["bin_s"] for i in range(len(t0["arrivals"]))], t0["arrivals"], t0["bin_s"] * 0.9,
             color="grey", alpha=0.2)
    twin.set_ylabel("arrivals per bin (grey)")
    c.set_xlabel("arrival time (s of the compressed day)")
    c.set_ylabel("mean E2E latency (s)")
    c.legend(fontsize=7, ncol=2)
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    return _save(plt, fig, out_dir / "faser.png", f"FASER scenario: {res['description']}")


def _save(plt: Any, fig: Any, path: Path, title: str | None, dpi: int = 110) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _by_label(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["label"], []).append(r)
    return {k: sorted(v, key=lambda r: r["rate"]) for k, v in out.items()}


def plot_augserve(res: dict[str, Any], out_dir: Path) -> Path:
    plt = _pyplot()
    deps = res["deployments"]
    fig, axes = plt.subplots(len(deps), 3, figsize=(15, 3.6 * len(deps)), squeeze=False)
    for row_axes, d in zip(axes, deps):
        for label, runs in _by_label(d["rows"]).items():
            rates = [r["rate"] for r in runs]
            row_axes[0].plot(rates, [r["summary"]["effective_throughput"] for r in runs], "o-", label=label)
            row_axes[1].plot(rates, [r["summary"]["ttft_s"]["p50"] for r in runs], "o-", label=label)
            row_axes[2].plot(rates, [r["summary"]["ttft_s"]["p99"] for r in runs], "o-", label=label)
        row_axes[0].set_ylabel("effective throughput (req/s in SLO)")
        row_axes[1].set_ylabel("TTFT p50 (s)")
        row_axes[2].set_ylabel("TTFT p99 (s)")
        row_axes[0].set_title(d["description"], fontsize=9, loc="left")
        for ax in row_axes:
            ax.set_xlabel("request rate (req/s)")
            ax.grid(alpha=0.3)
        row_axes[1].set_yscale("log")
        row_axes[2].set_yscale("log")
        row_axes[0].legend(fontsize=7)
    return _save(plt, fig, out_dir / "augserve.png", None, dpi=100)


def plot_file(res: dict[str, Any], out_dir: Path) -> Path:
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for dep in sorted({r["deployment"] for r in res["rows"]}):
        for label, runs in _by_label([r for r in res["rows"] if r["deployment"] == dep]).items():
            rates = [r["rate"] for r in runs]
            a.plot(rates, [r["summary"]["output_throughput"] for r in runs], "o-", label=f"{label} @ {dep}")
            b.plot(rates, [r["summary"]["ttft_s"]["p99"] for r in runs], "o-", label=f"{label} @ {dep}")
    a.set_ylabel("output tokens/s")
    b.set_ylabel("TTFT p99 (s)")
    for ax in (a, b):
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, out_dir / "scenario.png", f"scenario {res['scenario']}")


def plot_results(res: dict[str, Any], out_dir: str | Path) -> list[str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kind = res.get("scenario")
    if kind == "faser":
        return [str(plot_faser(res, out))]
    if kind == "augserve":
        return [str(plot_augserve(res, out))]
    return [str(plot_file(res, out))]
