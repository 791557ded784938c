"""Orderings of requests: who is admitted first from the waiting queue, who is preempted first.

An ordering maps a request to a sort key (smaller runs first; the running request with the
largest key is the preemption victim). FCFS is the baseline: arrival time, ties broken by
submission order; preempted requests keep their key, so they return first.

AugServe orders by predicted *service time* (what is left to do: generation, prefill of pending
tokens, remaining tool calls with their durations and returned tokens), so that requests that
will finish sooner go first even if their text is longer. Stage I keys are fixed at arrival from
static predictions; Stage II re-keys every step from live signals: actual pending tokens (e.g. a
tool's real return length), output already generated, memory pressure (under pressure, admissions
that need much new KV are deferred), and optionally time waited (`aging`, off by default); a
request that has waited `max_wait_s` jumps ahead of everything (anti-starvation), but requests
admitted that way hold at most `starving_share` of the running batch.

`aging` 0 and `starving_share` 0.25 were chosen on a held-out trace before the scenario's own
trace was run (docs/simulator.md, AugServe at paper scale).
"""

from __future__ import annotations

from typing import Protocol

from tandem.sched.predictor import OutputLengthPredictor, ToolStats
from tandem.types import Request


class Ordering(Protocol):
    dynamic: bool   # True if keys change over time (the queue is re-keyed every step)

    def key(self, request: Request, now: float) -> tuple:
        ...

    def observe_memory(self, kv_usage: float) -> None:
        """The KV cache's usage in [0, 1] before this step's keys are read."""
        ...

    def starving_slots(self, num_running: int, request: Request, now: float) -> int | None:
        """How many running requests may have been admitted while they starved, if `request`
        starves now (None: it does not, or the ordering sets no bound)."""
        ...


class FCFS:
    """First come, first served. With `resubmit_on_resume` (vLLM's behaviour when a client runs a
    tool and sends the conversation back), a request returning from a tool call queues as a new
    arrival, at its resume time, behind everything that arrived meanwhile; without it (InferCept,
    which treats the pause as part of one request), it keeps its original arrival time."""

    dynamic = False

    def __init__(self, resubmit_on_resume: bool = False) -> None:
        self.resubmit_on_resume = resubmit_on_resume

    def observe_memory(self, kv_usage: float) -> None:
        pass                                # arrival order does not depend on memory

    def starving_slots(self, num_running: int, request: Request, now: float) -> int | None:
        return None                         # arrival order is its own anti-starvation

    def key(self, request: Request, now: float) -> tuple:
        since = request.arrival_time
        if self.resubmit_on_resume and request.tool.last_resumed is not None:
            since = request.tool.last_resumed
        return (since, request.rank.arrival_seq or 0)


def tool_key(request: Request) -> str:
    """Which tool statistics describe this request: its workload type or tool, if known."""
    return "default" if request.tool.key is None else str(request.tool.key)


class AugServeOrdering:
    """AugServe's two-stage ordering. Stage I ranks by predicted *engine* service time: decode
    steps left, prompt and pending tokens to prefill, and per predicted tool call the prefill of
    its returned tokens. A tool call's wall time is weighted by `tool_time_weight`, 0 by default:
    while a request waits on a tool it holds no compute, and neither the SLO (normalized latency
    excludes tool time, TTFT ends before the first call) nor goodput's duration depends on it, so
    ranking a chat request with a 37 s human turn behind every short one only made it miss its
    TTFT. Chosen on held-out traces, on the engine and in the simulator (docs/simulator.md). The
    predicted duration still decides what a pause does with its KV (`MinWaste`)."""

    def __init__(self, lengths: OutputLengthPredictor, tools: ToolStats, stage2: bool = True,
                 max_wait_s: float = 30.0, aging: float = 0.0, decode_token_s: float = 0.03,
                 prefill_token_s: float = 0.003, starving_share: float = 0.25,
                 tool_time_weight: float = 0.0) -> None:
        self.lengths = lengths
        self.tools = tools
        self.dynamic = stage2
        self.max_wait_s = max_wait_s
        self.starving_share = starving_share
        self.aging = aging
        self.tool_time_weight = tool_time_weight
        self.decode_token_s = decode_token_s
        self.prefill_token_s = prefill_token_s
        self.memory_pressure = 0.0          # KV usage in [0, 1], from the scheduler each step

    def observe_memory(self, kv_usage: float) -> None:
        self.memory_pressure = kv_usage

    def starving_slots(self, num_running: int, request: Request, now: float) -> int | None:
        """Requests that waited `max_wait_s` go first, but at most `starving_share` of the
        running batch (at least one) may be requests admitted that way: under deep overload
        nearly everyone has waited that long, and serving them all first would be FCFS (every
        request late) instead of a bounded wait for a few."""
        if not self.dynamic or self.starving_share >= 1.0 or now - self._since(request) < self.max_wait_s:
            return None
        return max(1, int(num_running * self.starving_share))

    @staticmethod
    def _since(r: Request) -> float:
        return r.tool.last_resumed if r.tool.last_resumed is not None else r.arrival_time

    def service_time(self, r: Request, pending_tokens: int) -> float:
        remaining = max(1.0, self.lengths.predict(r) - r.num_output_tokens)
        k = tool_key(r)
        calls_left = max(0.0, self.tools.calls(k) - r.tool.num_calls)
        per_call = self.tool_time_weight * self.tools.duration(k) + self.tools.return_tokens(k) * self.prefill_token_s
        return remaining * self.decode_token_s + pending_tokens * self.prefill_token_s + calls_left * per_call

    def key(self, r: Request, now: float) -> tuple:
        seq = r.rank.arrival_seq or 0
        if not self.dynamic:
            if r.rank.stage1_s is None:
                r.rank.stage1_s = self.service_time(r, r.num_prompt_tokens)
            return (1, r.rank.stage1_s, seq)
        since = self._since(r)
        waited = now - since
        if waited >= self.max_wait_s:
            # Longest wait first. (By arrival time, requests resuming from tools, which arrived
            # long ago, would keep overtaking new ones that had waited longer: unbounded waits.)
            return (0, since, seq)
        pending = r.num_tokens - r.num_computed_tokens
        v = self.service_time(r, pending) - self.aging * waited
        v += self.memory_pressure ** 2 * pending * self.prefill_token_s * 4
        return (1, v, seq)


def make_ordering(name: str) -> Ordering:
    if name == "fcfs":
        return FCFS()
    raise ValueError(f"unknown ordering {name!r}")
