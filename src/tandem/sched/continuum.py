"""Continuum (arXiv 2511.02230), the agents baseline: pin a finished call's KV on the device for a
time-to-live, and order by program.

When a call of a session finishes, Continuum keeps its KV on the device for a TTL chosen from the
distribution of the gaps between a session's calls, and frees it when the TTL runs out (freed
blocks fall back to the prefix cache). The TTL tau maximizes

    J(tau) = P(gap <= tau) * B  -  m * E[min(gap, tau)]

B: what a kept context saves when its next call comes in time, here the seconds of recomputing it
(StepCostModel.time of its tokens; Continuum also counts the queueing that an evicted call meets,
which this reading leaves out). m: what pinning costs per second, here the share of the device
cache the context takes times the cache's usage now (an idle cache loses nothing to a pin). The
gap distribution is the empirical one of the gaps seen so far (every session's, the last
`max_samples`); with fewer than `min_samples`, an exponential one with mean `prior_mean_s`, for
which J is best at 0 or at the ceiling. The ordering is program-level first-come-first-served: a
call ranks by when its session's first call arrived.

Pure: no clock and no torch; times arrive as arguments.
"""

from __future__ import annotations

from collections import deque

from tandem.sched.cost_model import StepCostModel
from tandem.sched.ordering import FCFS
from tandem.types import Request


class ContinuumTTL:
    def __init__(self, cost: StepCostModel, prior_mean_s: float = 60.0, min_samples: int = 8,
                 max_samples: int = 512) -> None:
        self.cost = cost
        self.prior_mean_s = prior_mean_s
        self.min_samples = min_samples
        self.gaps: deque[float] = deque(maxlen=max_samples)

    def observe(self, gap_s: float) -> None:
        self.gaps.append(max(0.0, gap_s))

    def ttl_s(self, context_tokens: int, share: float, usage: float, ceiling_s: float) -> float:
        """The TTL for a context of `context_tokens` that takes `share` of the device cache, at
        cache usage `usage`; at most `ceiling_s`. 0: do not pin."""
        benefit = self.cost.time(context_tokens) if context_tokens > 0 else 0.0
        rate = share * usage                          # seconds of the device lost per second pinned
        if len(self.gaps) < self.min_samples:         # exponential prior: J = (1 - e^(-tau/mu)) (B - m mu)
            return ceiling_s if benefit > rate * self.prior_mean_s else 0.0
        gaps = sorted(self.gaps)
        n = len(gaps)
        best, best_tau = 0.0, 0.0
        below = 0.0                                   # sum of the gaps <= tau
        for i, tau in enumerate(gaps):
            if tau > ceiling_s:
                break
            below += tau
            waited = (below + tau * (n - i - 1)) / n  # E[min(gap, tau)]
            j = (i + 1) / n * benefit - rate * waited
            if j > best:
                best, best_tau = j, tau
        return best_tau


class ProgramFCFS(FCFS):
    """First come, first served by program: a call ranks by its session's first arrival (a call
    without a session, by its own), ties by submission order."""

    def key(self, request: Request, now: float) -> tuple:
        start = request.times.program_start
        return (request.arrival_time if start is None else min(start, request.arrival_time),
                request.rank.arrival_seq or 0)
