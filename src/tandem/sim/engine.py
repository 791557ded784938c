"""`SimEngine`: the real `Scheduler` driven by an event loop in virtual time, the way `LLMEngine`
drives it in real time.

The engine's step, `plan = schedule(now); result = execute(plan); update(plan, result, now')`,
becomes two events: STEP_START at `now` (apply queued aborts, resume tools whose results are due,
schedule) and STEP_DONE at `now + duration` (update, then pause requests whose segment ended on a
tool call, as the engine's scripted tool runtime does). A finished step starts the next one at
once; an idle engine wakes on the next arrival or tool return. Tool results resume at the start of
the first step at or after their deadline, like the engine's `poll(now)`; aborts take effect
between steps, like the async engine's. This module owns the replay of requests and tool scripts;
it makes no scheduling decision and knows nothing of torch or wall time.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

from tandem.sampling_params import SamplingParams
from tandem.sched.scheduler import Scheduler
from tandem.sched.pause_kv import fit_tool_result
from tandem.sim.build import SimConfig
from tandem.sim.events import (ORDER_ABORT, ORDER_ARRIVAL, ORDER_STEP_DONE, ORDER_STEP_START,
                               ORDER_TOOL_RETURN, Event, EventLoop, event)
from tandem.sim.executor import FILL_TOKEN, SimExecutor
from tandem.sim.metrics import RequestRecord
from tandem.sim.workload import SimRequest
from tandem.types import Request, StepPlan, StepResult
from tandem.workload.augmented import ScriptCursor, Segment

FIRST_PROMPT_TOKEN = 1000     # prompt i starts with token 1000 + i: no accidental prefix-cache sharing


def prompt_token_ids(index: int, num_tokens: int) -> list[int]:
    return [FIRST_PROMPT_TOKEN + index] + [FILL_TOKEN] * (num_tokens - 1)


class SimEngine:
    def __init__(self, scheduler: Scheduler, executor: SimExecutor, config: SimConfig,
                 on_plan: Callable[[float, StepPlan], None] | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.config = config
        self.on_plan = on_plan
        self.max_model_len = scheduler.config.max_model_len
        self.loop = EventLoop()
        self.records: dict[str, RequestRecord] = {}
        self._requests: dict[str, Request] = {}
        self._cursors: dict[str, ScriptCursor] = {}
        self._segments: dict[str, tuple[Segment, ...]] = {}
        self._tools: dict[str, int] = {}                   # rid -> return tokens of its running tool call
        self._deadlines: list[tuple[float, int, str]] = []   # heap of (deadline, start order, rid)
        self._tool_order = itertools.count()
        self._aborts: list[str] = []
        self._busy = False
        self._step_pending = False
        self.num_steps = 0

    # --- running ---------------------------------------------------------------------------
    def run(self, requests: list[SimRequest]) -> list[RequestRecord]:
        """Replay the requests (sorted by arrival) to the end; returns one record per request."""
        reqs = sorted(requests, key=lambda r: r.arrival_s)
        if reqs:
            self.loop.push([self._arrival(reqs, 0)])
        self.loop.run()
        stuck = [rid for rid, r in self._requests.items() if not r.is_finished]
        if stuck:
            s = self.scheduler
            raise RuntimeError(f"simulation ended with {len(stuck)} unfinished requests (e.g. {stuck[:3]}): "
                               f"waiting {s.num_waiting}, running {s.num_running}, paused {s.num_paused}, "
                               f"free KV blocks {s.kv.num_free_blocks}")
        return [self.records[r.request_id] for r in reqs]

    def _kick(self, now: float) -> list[Event]:
        if self._busy or self._step_pending:
            return []
        self._step_pending = True
        return [event(now, ORDER_STEP_START, self._on_step_start)]

    # --- arrivals and aborts ---------------------------------------------------------------
    def _arrival(self, reqs: list[SimRequest], i: int) -> Event:
        def handler(now: float) -> list[Event]:
            out = self._admit(reqs[i], i, now)
            if i + 1 < len(reqs):
                out.append(self._arrival(reqs, i + 1))
            return out
        return event(reqs[i].arrival_s, ORDER_ARRIVAL, handler)

    def _admit(self, spec: SimRequest, index: int, now: float) -> list[Event]:
        rid = spec.request_id
        rec = RequestRecord(rid, spec.kind, now, spec.prompt_tokens)
        self.records[rid] = rec
        if spec.prompt_tokens >= self.max_model_len:      # the engine rejects it (validate)
            rec.finish_reason, rec.finished_s = "rejected", now
            return []
        request = self._new_request(spec, index, now)
        if spec.has_tools:
            request.tool.key = spec.kind
            self._cursors[rid] = ScriptCursor(seg.completion_tokens for seg in spec.segments)
            self._segments[rid] = spec.segments
        self._requests[rid] = request
        self.executor.add_request(rid, spec.acceptance, spec.draft)
        self.scheduler.add_request(request)
        out = self._kick(now)
        if spec.abort_after_s is not None:
            out.append(event(now + spec.abort_after_s, ORDER_ABORT, lambda t, r=rid: self._on_abort(r, t)))
        return out

    def _new_request(self, spec: SimRequest, index: int, now: float) -> Request:
        """The engine's Request for an arrival (the cluster scenario gives prompts real prefixes)."""
        params = SamplingParams(max_tokens=max(1, spec.output_tokens), temperature=0.0, ignore_eos=True)
        return Request(spec.request_id, prompt_token_ids(index, spec.prompt_tokens), params, arrival_time=now)

    def _on_abort(self, rid: str, now: float) -> list[Event]:
        request = self._requests.get(rid)
        if request is None or request.is_finished:
            return []
        self._aborts.append(rid)
        return self._kick(now)

    def _apply_aborts(self, now: float) -> None:
        for rid in self._aborts:
            request = self._requests.get(rid)
            if request is None:               # finished meanwhile
                continue
            self.scheduler.abort_request(rid)
            self._tools.pop(rid, None)            # its deadline entry is skipped when popped
            self._close(request, now, "abort")
        self._aborts.clear()

    # --- the step --------------------------------------------------------------------------
    def _on_step_start(self, now: float) -> list[Event]:
        self._step_pending = False
        self._apply_aborts(now)
        self._resume_tools(now)
        if not self.scheduler.has_work():
            return []
        plan = self.scheduler.schedule(now)
        if plan.is_empty:                 # nothing fits until something changes: wait for an event
            return self._kick(now) if plan.preempted_ids else []   # (the engine's loop would retry)
        self.num_steps += 1
        if self.on_plan is not None:
            self.on_plan(now, plan)
        result, duration = self.executor.step(plan)
        self._busy = True
        return [event(now + duration, ORDER_STEP_DONE, lambda t: self._on_step_done(plan, result, t))]

    def _on_step_done(self, plan: StepPlan, result: StepResult, now: float) -> list[Event]:
        self._busy = False
        out: list[Event] = []
        cursors = self._cursors
        for u in self.scheduler.update(plan, result, now):
            if u.finished:
                self._close(u.request, now, str(u.request.finish_reason))
                continue
            cursor = cursors.get(u.request.request_id)
            if cursor is not None:
                ended = cursor.on_tokens(len(u.new_token_ids))
                if ended is not None:
                    segments = self._segments[u.request.request_id]
                    out.append(self._pause(u.request.request_id, segments[ended], now))
        return out + self._kick(now)

    # --- tool calls ------------------------------------------------------------------------
    def _pause(self, rid: str, seg: Segment, now: float) -> Event:
        hint = seg.api_time_s if self.config.tool_time_hint == "oracle" else None
        self.scheduler.pause_request(rid, now, hint, tool=self._requests[rid].tool.key)
        deadline = now + seg.api_time_s
        self._tools[rid] = seg.return_tokens
        heapq.heappush(self._deadlines, (deadline, next(self._tool_order), rid))
        rec = self.records[rid]
        rec.num_tool_calls += 1
        rec.tool_time_s += seg.api_time_s
        return event(deadline, ORDER_TOOL_RETURN, self._kick)

    def _resume_tools(self, now: float) -> None:
        """Resume every call due by `now`, in the order the calls started (the engine's poll order)."""
        due = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, order, rid = heapq.heappop(self._deadlines)
            if rid in self._tools:
                due.append((order, rid))
        for _, rid in sorted(due):
            n = self._tools.pop(rid)
            request = self._requests[rid]
            ids = fit_tool_result([FILL_TOKEN] * n, request.num_tokens, self.max_model_len)   # the engine's cut
            self.scheduler.resume_request(rid, ids, now)

    def _close(self, request: Request, now: float, reason: str) -> None:
        rid = request.request_id
        rec = self.records[rid]
        rec.first_token_s = request.times.first_token
        rec.finished_s, rec.finish_reason = now, reason
        rec.output_tokens = request.num_output_tokens
        rec.num_preemptions = request.num_preemptions
        rec.cached_tokens = request.num_cached_tokens
        spec = request.draft.stats
        rec.num_draft_tokens, rec.num_accepted_tokens, rec.num_spec_steps, rec.num_pruned_tokens = \
            spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_steps, spec.num_pruned_tokens
        self.executor.release([rid])
        self._cursors.pop(rid, None)
        self._segments.pop(rid, None)
        del self._requests[rid]
