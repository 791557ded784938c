"""Replay a simulator workload (`tandem.sim.workload.SimRequest`s) on a real `LLMEngine`.

Requests are added when the engine's clock reaches their arrival times, with the simulator's
prompt token ids, `max_tokens` from their segments, ignore_eos, and (with tool calls) the
engine's scripted tool mode; the engine is stepped until every request finishes. When a step runs
nothing, the clock waits for the next arrival or tool deadline. Two clocks: `WallClock` (real
time, for fidelity checks against the simulator) and `VirtualClock` (time advanced only by the
executor, for the engine-vs-simulator parity test). Owns the driving loop; decides nothing.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

from tandem.engine.llm_engine import LLMEngine
from tandem.engine.tool_runtime import ToolOptions
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.sim.engine import prompt_token_ids
from tandem.sim.metrics import RequestRecord
from tandem.sim.workload import SimRequest


class WallClock:
    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(min(delay, 0.05))


class VirtualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)


def _record(spec: SimRequest, out: RequestOutput) -> RequestRecord:
    m = out.metrics
    tools = m.tool_calls
    tool_time = sum(s.api_time_s for s in spec.segments[:len(tools)])
    return RequestRecord(spec.request_id, spec.kind, spec.arrival_s, m.num_prompt_tokens, m.num_output_tokens,
                         m.first_token_time, m.finished_time, out.outputs[0].finish_reason, tool_time,
                         len(tools), m.num_preemptions)


def replay(engine: LLMEngine, requests: list[SimRequest], clock: WallClock | VirtualClock,
           on_add: Callable[[SimRequest], None] | None = None) -> list[RequestRecord]:
    """Run the requests through the engine; one record per request, in arrival order."""
    engine.set_clock(clock.now)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    pending = deque(enumerate(order))      # (rank in arrival order, as the simulator numbers prompts; index)
    records: dict[str, RequestRecord] = {}
    by_id = {r.request_id: r for r in requests}
    while pending or engine.has_unfinished_requests():
        now = clock.now()
        while pending and requests[pending[0][1]].arrival_s <= now:
            rank, i = pending.popleft()
            _add(engine, requests[i], rank)
            if on_add is not None:
                on_add(requests[i])
        before = engine.last_step
        for out in engine.step():
            if out.finished:
                records[out.request_id] = _record(by_id[out.request_id], out)
        if engine.last_step is before:
            nxt = min(requests[pending[0][1]].arrival_s if pending else math.inf,
                      (engine.tools.next_deadline() if engine.tools else None) or math.inf)
            if math.isinf(nxt):
                if engine.has_unfinished_requests() and isinstance(clock, VirtualClock):
                    raise RuntimeError("the engine has unfinished requests but nothing to run or wait for")
                continue
            clock.wait_until(nxt)
    return [records[requests[i].request_id] for i in order]


def _add(engine: LLMEngine, spec: SimRequest, index: int) -> None:
    params = SamplingParams(max_tokens=max(1, spec.output_tokens), temperature=0.0, ignore_eos=True)
    tools = None
    if spec.has_tools:
        script = [(s.completion_tokens, s.api_time_s, s.return_tokens) for s in spec.segments]
        tools = ToolOptions(script=script, key=spec.kind)
    engine.add_request(prompt_token_ids=prompt_token_ids(index, spec.prompt_tokens), params=params,
                       request_id=spec.request_id, arrival_time=spec.arrival_s, tool_options=tools)
