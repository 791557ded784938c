"""Per-request records of a simulated run, and the run's figures.

Definitions (seconds throughout; tables print ms):
- TTFT = first token - arrival; E2E = finish - arrival; TPOT = (E2E - TTFT) / (output tokens - 1).
- Normalized latency (AugServe, InferCept) = (E2E - the request's tool time) / output tokens, with
  tool time the trace's api_time of the calls it made (waiting after a tool returned counts as latency).
- Throughput over the run (first arrival to last finish): finished requests/s, output tokens/s.
- SLO attainment: share of all requests that finished and met every bound of the SLO; effective
  throughput (goodput) = those requests / the run's duration (first arrival to last finish), vLLM's
  definition, the same as the engine's benchmarks use.
No I/O, no clock.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import fmean
from typing import Any, NamedTuple

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default);
    None for no values. The engine's benchmarks use this one too (tandem.bench.common)."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class RequestRecord:
    request_id: str
    kind: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int = 0
    first_token_s: float | None = None
    finished_s: float | None = None
    finish_reason: str | None = None     # length | abort | rejected | ...
    tool_time_s: float = 0.0
    num_tool_calls: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0
    num_pruned_tokens: int = 0          # drafts cut from verification (frontiers)
    cached_tokens: int = 0              # prompt tokens it did not compute: prefix cache or held session KV

    @property
    def completed(self) -> bool:
        return self.finished_s is not None and self.finish_reason not in ("abort", "rejected")

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if not self.completed or self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def normalized_latency_s(self) -> float | None:
        if not self.completed or not self.output_tokens:
            return None
        return (self.e2e_s - self.tool_time_s) / self.output_tokens

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    normalized_latency_s: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.completed:
            return False
        for name in ("ttft_s", "tpot_s", "e2e_s", "normalized_latency_s"):
            bound, value = getattr(self, name), getattr(r, name)
            if bound is not None and value is not None and value > bound:
                return False
        return True

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def stats(values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {"mean": fmean(values) if values else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    return out


def summarize(records: list[RequestRecord], slo: SLO | None = None) -> dict[str, Any]:
    done = [r for r in records if r.completed]
    first = min((r.arrival_s for r in records), default=0.0)
    last_arrival = max((r.arrival_s for r in records), default=0.0)
    end = max((r.finished_s for r in records if r.finished_s is not None), default=first)
    duration, window = max(end - first, 1e-9), max(last_arrival - first, 1e-9)
    out_tokens = sum(r.output_tokens for r in done)
    s: dict[str, Any] = {
        "num_requests": len(records), "completed": len(done),
        "aborted": sum(r.finish_reason == "abort" for r in records),
        "rejected": sum(r.finish_reason == "rejected" for r in records),
        "duration_s": duration, "arrival_window_s": window,
        "offered_rate": (len(records) - 1) / window if len(records) > 1 else None,
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "total_output_tokens": out_tokens,
    }
    for name in ("ttft_s", "tpot_s", "e2e_s", "normalized_latency_s"):
        s[name] = stats([v for v in (getattr(r, name) for r in done) if v is not None])
    if slo is not None:
        good = sum(slo.met(r) for r in records)
        s.update({"slo": slo.as_dict(), "good_requests": good, "slo_attainment": good / max(1, len(records)),
                  "effective_throughput": good / duration})
    drafted = sum(r.num_draft_tokens for r in records)
    if drafted:
        steps = sum(r.num_spec_steps for r in records)
        accepted = sum(r.num_accepted_tokens for r in records)
        s["spec"] = {"draft_tokens": drafted, "accepted_tokens": accepted,
                     "pruned_tokens": sum(r.num_pruned_tokens for r in records),
                     "acceptance_rate": accepted / drafted, "mean_draft_length": drafted / steps,
                     "mean_accepted_length": 1 + accepted / steps}
    calls = sum(r.num_tool_calls for r in records)
    if calls:
        s["tool_calls"] = calls
        s["preemptions"] = sum(r.num_preemptions for r in records)
    return s


class AgentCall(NamedTuple):
    """One call of an agent session, as its replay timed it (the simulator's or the HTTP one)."""
    session: str
    latency_s: float                    # send (arrival) to last token; 0 if it never finished
    ttft_s: float | None
    tpot_s: float | None
    ok: bool                            # completed (or answered without error)


def session_figures(calls: list[AgentCall], duration_s: float, ttft_slo_s: float) -> dict[str, Any]:
    """An agent replay's per-session figures: LLM time per session (the sum of its calls'
    latencies, the agent's own waits excluded) mean / p50 / p99, TTFT and TPOT of the calls that
    completed, and the sessions whose every call completed within TTFT <= `ttft_slo_s`, in all and
    per hour of the replay."""
    by: dict[str, list[AgentCall]] = {}
    for c in calls:
        by.setdefault(c.session, []).append(c)
    llm = [sum(c.latency_s for c in cs) for cs in by.values()]
    ok = [c for c in calls if c.ok]
    ttft = [c.ttft_s for c in ok if c.ttft_s is not None]
    tpot = [c.tpot_s for c in ok if c.tpot_s is not None]
    good = sum(all(c.ok and c.ttft_s is not None and c.ttft_s <= ttft_slo_s for c in cs) for cs in by.values())
    return {"sessions": len(by), "calls": len(calls), "duration_s": duration_s,
            "llm_time_per_session_s": {"mean": fmean(llm) if llm else None, "p50": percentile(llm, 50),
                                       "p99": percentile(llm, 99)},
            "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
            "tpot_s": {"p50": percentile(tpot, 50)},
            "sessions_within_slo": good,
            "sessions_per_hour_within_slo": good / duration_s * 3600 if duration_s > 0 else 0.0}
