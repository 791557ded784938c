"""`tandem bench agents`: agent sessions whose tools run on the client, replayed over HTTP against any
OpenAI-compatible server, as the agent would drive it.

Sessions come from a trace of real sessions (tandem.workload.agent_sessions: its report part by
default) and start as a Poisson process at `rate` sessions/s. Each call is a streamed chat
completion carrying the session's context: a system message of the session's system prompt and
tool definitions (the same text for every session with the same sizes, so a prefix cache shares
it), then the conversation so far, each earlier reply resent as the server returned it, then the
call's new tokens (filler text of that many tokens) as a user message. A call that rewrites the
context (`keep_tokens`) keeps the system message and the user turns up to about that many tokens.
It asks for `max_tokens = out` with `ignore_eos`, and the next call follows its planned wait
(tool waits as traced, person waits capped or cut: `person_wait`) after the previous one finished.
Every call carries the session's id in the `x-session-id` header (servers that hold KV per session
use it; others ignore it). Token counts and waits are scaled by `token_scale` and `time_scale`.

Per run: LLM time per session (the sum of its calls' latencies, the agent's waits excluded) mean,
p50, p99; TTFT per call p50, p99; TPOT p50; sessions per hour within the SLO (every call's TTFT <=
ttft_slo_s); failed calls. Client-side only: what the server did with its KV is its own report.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tandem.bench.common import machine_info, write_json
from tandem.bench.serve_client import Target, request_body, stream_once
from tandem.sim.metrics import AgentCall, session_figures
from tandem.workload.agent_sessions import AgentSession, PlannedCall, replay_plan
from tandem.workload.arrivals import make_arrivals
from tandem.workload.augmented import synthetic_text


@dataclass
class CallRecord:
    session: str
    index: int
    send_s: float
    prompt_tokens_planned: int
    output_tokens_planned: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.e2e_s is None or self.ttft_s is None or self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class ReplayOptions:
    rate: float
    token_scale: float = 0.01
    time_scale: float = 0.05
    person_wait: str = "cap:60"
    window: int | None = None
    seed: int = 0
    ttft_slo_s: float = 5.0
    timeout_s: float = 600.0
    extra: dict[str, Any] = field(default_factory=dict)


class Conversation:
    """A session's messages, built so that every resent part is byte-identical to what was sent."""

    def __init__(self, head_tokens: int, head_key: tuple[int, int], rng: random.Random) -> None:
        self.rng = rng
        head = synthetic_text(head_tokens, random.Random(hash(head_key))) if head_tokens else "You are an agent."
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": head}]
        self.sizes: list[int] = [head_tokens]            # planned tokens per message

    def add_user(self, num_tokens: int) -> None:
        self.messages.append({"role": "user", "content": synthetic_text(num_tokens, self.rng)})
        self.sizes.append(num_tokens)

    def add_reply(self, text: str, num_tokens: int) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.sizes.append(num_tokens)

    def rewrite(self, keep_tokens: int) -> None:
        """Keep the system message and the messages that fit within `keep_tokens`."""
        kept, total = 1, self.sizes[0]
        while kept < len(self.messages) and total + self.sizes[kept] <= keep_tokens:
            total += self.sizes[kept]
            kept += 1
        del self.messages[kept:], self.sizes[kept:]


async def run_session(client: httpx.AsyncClient, target: Target, sid: str, plan: list[PlannedCall],
                      head: tuple[int, tuple[int, int]], start_s: float, t0: float, seed: int,
                      records: list[CallRecord]) -> None:
    await asyncio.sleep(max(0.0, t0 + start_s - time.perf_counter()))
    conv = Conversation(head[0], head[1], random.Random(f"{seed}:{sid}"))
    for k, call in enumerate(plan):
        if k:
            await asyncio.sleep(call.wait_s)
            if call.keep_tokens is not None:
                conv.rewrite(call.keep_tokens)
        conv.add_user(max(1, call.new_tokens - (head[0] if k == 0 else 0)))
        body = request_body(target, conv.messages, call.output_tokens)
        body["ignore_eos"] = True
        rec = CallRecord(sid, k, time.perf_counter() - t0, call.context_tokens, call.output_tokens)
        res = await stream_once(client, target, body, extra_headers={"x-session-id": sid})
        rec.ok, rec.error, rec.ttft_s = res.ok, res.error, res.ttft_s
        rec.e2e_s = (time.perf_counter() - t0) - rec.send_s
        rec.output_tokens = res.completion_tokens or res.num_chunks
        rec.prompt_tokens = res.prompt_tokens
        records.append(rec)
        if not res.ok:
            return                                   # a failed call ends its session (its context is gone)
        conv.add_reply(res.text, call.output_tokens)


async def replay(target: Target, sessions: list[AgentSession], opts: ReplayOptions) -> tuple[list[CallRecord], float]:
    plans = [replay_plan(s, opts.person_wait, opts.window, opts.token_scale, opts.time_scale) for s in sessions]
    starts = make_arrivals("poisson", opts.rate, random.Random(opts.seed + 1), n=len(sessions))
    records: list[CallRecord] = []
    limits = httpx.Limits(max_connections=max(16, len(sessions)), max_keepalive_connections=max(16, len(sessions)))
    async with httpx.AsyncClient(timeout=opts.timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(
            run_session(client, target, s.session_id, plan,
                        (round((s.system_tokens + s.tool_tokens) * opts.token_scale), (s.system_tokens, s.tool_tokens)),
                        start, t0, opts.seed, records)
            for s, plan, start in zip(sessions, plans, starts)))
        duration = time.perf_counter() - t0
    return records, duration


def summarize(records: list[CallRecord], duration_s: float, ttft_slo_s: float) -> dict[str, Any]:
    out = session_figures([AgentCall(r.session, r.e2e_s or 0.0, r.ttft_s, r.tpot_s, r.ok) for r in records],
                          duration_s, ttft_slo_s)
    out["failed_calls"] = sum(not r.ok for r in records)
    return out


def bench_agents(target: Target, sessions: list[AgentSession], opts: ReplayOptions, json_path: str | None,
                 label: str = "", log=print) -> dict[str, Any]:
    records, duration = asyncio.run(replay(target, sessions, opts))
    summary = summarize(records, duration, opts.ttft_slo_s)
    llm, ttft = summary["llm_time_per_session_s"], summary["ttft_s"]
    log(f"{label or target.base_url}: {summary['sessions']} sessions, {summary['calls']} calls "
        f"({summary['failed_calls']} failed) in {duration:.1f} s; LLM time/session mean {llm['mean'] or 0:.2f} s "
        f"p50 {llm['p50'] or 0:.2f} p99 {llm['p99'] or 0:.2f}; TTFT p50 {ttft['p50'] or 0:.3f} p99 {ttft['p99'] or 0:.3f} s; "
        f"{summary['sessions_per_hour_within_slo']:.0f} sessions/h within TTFT <= {opts.ttft_slo_s:g} s")
    data = {"bench": "agents", "label": label, "machine": machine_info(), "target": target.base_url,
            "model": target.model, "options": {k: v for k, v in opts.__dict__.items() if k != "extra"} | opts.extra,
            "summary": summary, "records": [r.__dict__ | {"tpot_s": r.tpot_s} for r in records]}
    write_json(json_path, data)
    return data
