"""Figures of one load-generator run: latency percentiles, throughput and goodput (vLLM's definitions).

- TTFT, TPOT, ITL, E2E latency in milliseconds: mean, p50, p90, p99 over successful requests (ITL
  over all gaps of all successful requests).
- Throughput over the run's duration (first send to last completion): completed requests/s,
  output tokens/s, total (prompt + output) tokens/s.
- Goodput: successful requests that meet every given SLO (`ttft`, `tpot`, `e2el`, in ms), per second.
  A one-token output has TPOT 0 and so meets any TPOT SLO, as in vLLM.
Pure functions over RequestRecords; no I/O.
"""

from __future__ import annotations

from collections import Counter
from statistics import fmean
from typing import Any

from tandem.bench.common import percentile
from tandem.bench.serve_client import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` (or one space-separated string) -> {"ttft": 200.0, "tpot": 50.0} in ms."""
    slos: dict[str, float] = {}
    for spec in " ".join(specs or []).split():
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad SLO {spec!r}: expected NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError as e:
            raise ValueError(f"bad SLO {spec!r}: {value!r} is not a number of milliseconds") from e
        if slos[name] <= 0:
            raise ValueError(f"bad SLO {spec!r}: must be positive")
    return slos


def meets_slos(rec: RequestRecord, slos: dict[str, float]) -> bool:
    if not rec.success:
        return False
    values = {"ttft": rec.ttft_s, "tpot": rec.tpot_s, "e2el": rec.e2e_s}
    return all(values[k] is not None and values[k] * 1e3 <= slo for k, slo in slos.items())


def latency_stats(values_s: list[float]) -> dict[str, float | None]:
    ms = [v * 1e3 for v in values_s]
    out: dict[str, float | None] = {"mean": fmean(ms) if ms else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(ms, q)
    return out


def latency_values(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Per-metric latency samples in seconds over the successful requests."""
    ok = [r for r in records if r.success]
    return {"ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
            "tpot": [r.tpot_s for r in ok if r.tpot_s is not None and r.output_tokens > 1],
            "itl": [g for r in ok for g in r.itl_s],
            "e2el": [r.e2e_s for r in ok if r.e2e_s is not None]}


def summarize(records: list[RequestRecord], duration_s: float,
              slos: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    dur = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "duration_s": duration_s, "request_throughput": len(ok) / dur, "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur, "total_output_tokens": out_tokens,
        "total_input_tokens": in_tokens if any(r.prompt_tokens is not None for r in ok) else None,
        "errors": dict(Counter(_error_key(r) for r in records if not r.success)),
    }
    for name, values in latency_values(records).items():
        summary[f"{name}_ms"] = latency_stats(values)
    if slos:
        good = sum(1 for r in records if meets_slos(r, slos))
        summary.update({"slos_ms": dict(slos), "good_requests": good, "goodput": good / dur})
    if any(r.num_tool_calls for r in records):
        summary["tool_calls"] = sum(r.num_tool_calls for r in records)
        summary["tool_time_s"] = sum(r.tool_time_s for r in records)
    return summary


def _error_key(rec: RequestRecord) -> str:
    if rec.status is not None and rec.status != 200:
        return f"HTTP {rec.status}"
    return (rec.error or "unknown").split(":")[0]


def format_summary(label: str, s: dict[str, Any]) -> str:
    """A short human-readable block, in the spirit of vLLM's benchmark printout."""
    lines = [f"== {label} ==",
             f"completed {s['completed']}/{s['num_requests']} (failed {s['failed']}) "
             f"in {s['duration_s']:.2f} s",
             f"requests/s {s['request_throughput']:.2f}   output tok/s {s['output_throughput']:.1f}"]
    if "goodput" in s:
        lines.append(f"goodput {s['goodput']:.2f} req/s ({s['good_requests']} met {s['slos_ms']})")
    for name in ("ttft", "tpot", "itl", "e2el"):
        st = s[f"{name}_ms"]
        cells = "  ".join(f"{k} {_fmt(v)}" for k, v in st.items())
        lines.append(f"{name.upper():>5} ms: {cells}")
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    return "\n".join(lines)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"
