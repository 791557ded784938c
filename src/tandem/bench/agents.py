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

A soak (`soak_s`): sessions keep starting for `soak_s` seconds, cycling through the trace (each
pass under fresh session ids), and the server's /metrics is scraped every `sample_s` seconds:
resident memory (`process_resident_memory_bytes`), KV usage, sessions held and requests in flight.
When the last session ends, the scrape goes on until nothing is held or in flight (at most
`drain_s`: a server frees what sessions hold at its hold ceiling). The report says whether any
planned call was lost (failed, or never sent because its session failed), how much resident
memory grew after the warm-up (the first `warmup_share` of the soak), and whether the KV came back
to 0.
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
    soak_s: float | None = None          # keep starting sessions for this long (cycling the trace)
    sample_s: float = 5.0                # a soak scrapes /metrics this often
    drain_s: float = 660.0               # and waits at most this long for held KV to come back
    warmup_share: float = 0.1            # the soak's start that resident memory is judged after
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


def schedule(sessions: list[AgentSession], opts: ReplayOptions) -> list[tuple[str, AgentSession, float]]:
    """(session id, session, start s) for each session the run starts: the trace's sessions once at
    Poisson starts, or, in a soak, as many as start within `soak_s`, cycling through the trace."""
    rng = random.Random(opts.seed + 1)
    if opts.soak_s is None:
        starts = make_arrivals("poisson", opts.rate, rng, n=len(sessions))
        return [(s.session_id, s, t) for s, t in zip(sessions, starts)]
    starts = make_arrivals("poisson", opts.rate, rng, duration_s=opts.soak_s)
    return [(f"{sessions[i % len(sessions)].session_id}#{i // len(sessions)}", sessions[i % len(sessions)], t)
            for i, t in enumerate(starts)]


IN_FLIGHT = ("num_requests_running", "num_requests_waiting", "num_requests_paused")
HELD = ("kv_cache_usage_perc", "num_sessions_held") + IN_FLIGHT      # all 0: the server holds nothing
METRICS = ("process_resident_memory_bytes",) + HELD


async def scrape(client: httpx.AsyncClient, target: Target) -> dict[str, float] | None:
    """The server's figures named in METRICS (under the tandem: or vllm: prefix), or None if it
    serves no /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = await client.get(f"{target.base_url}/metrics", timeout=10.0)
        if resp.status_code != 200:
            return None
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(resp.text):
            name = family.name.split(":", 1)[-1]
            if name in METRICS and name not in found and family.samples:
                found[name] = float(family.samples[0].value)
        return found
    except (httpx.HTTPError, ValueError):
        return None


def _idle(m: dict[str, float]) -> bool:
    return all(m.get(k, 0.0) == 0.0 for k in HELD)


async def sample_metrics(client: httpx.AsyncClient, target: Target, opts: ReplayOptions, t0: float,
                         done: asyncio.Event, samples: list[dict[str, float]]) -> None:
    """Scrape every `sample_s` until `done`, then until the server holds nothing (or `drain_s`)."""
    drain_until = None
    while True:
        m = await scrape(client, target)
        if m is None:
            return
        samples.append({"t": time.perf_counter() - t0} | m)
        if done.is_set():
            drain_until = drain_until or time.perf_counter() + opts.drain_s
            if _idle(m) or time.perf_counter() >= drain_until:
                return
            await asyncio.sleep(min(opts.sample_s, 1.0))
            continue
        try:
            await asyncio.wait_for(done.wait(), opts.sample_s)
        except asyncio.TimeoutError:
            pass


async def replay(target: Target, sessions: list[AgentSession], opts: ReplayOptions
                 ) -> tuple[list[CallRecord], float, int, list[dict[str, float]]]:
    """Run the replay: the calls' records, the duration until the last session ended, the number of
    calls planned, and (in a soak) the server's scraped figures."""
    runs = schedule(sessions, opts)
    plans = {s.session_id: replay_plan(s, opts.person_wait, opts.window, opts.token_scale, opts.time_scale)
             for s in sessions}
    records: list[CallRecord] = []
    samples: list[dict[str, float]] = []
    width = max(16, min(len(runs), 256))
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    async with httpx.AsyncClient(timeout=opts.timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        done = asyncio.Event()
        sampler = (asyncio.create_task(sample_metrics(client, target, opts, t0, done, samples))
                   if opts.soak_s is not None else None)
        await asyncio.gather(*(
            run_session(client, target, sid, plans[s.session_id],
                        (round((s.system_tokens + s.tool_tokens) * opts.token_scale), (s.system_tokens, s.tool_tokens)),
                        start, t0, opts.seed, records)
            for sid, s, start in runs))
        duration = time.perf_counter() - t0
        done.set()
        if sampler is not None:
            await sampler
    return records, duration, sum(len(plans[s.session_id]) for _, s, _ in runs), samples


def soak_report(samples: list[dict[str, float]], opts: ReplayOptions, planned: int,
                records: list[CallRecord]) -> dict[str, Any]:
    """What a soak shows: calls lost, resident memory after the warm-up, KV at the end."""
    ok = sum(r.ok for r in records)
    out: dict[str, Any] = {"soak_s": opts.soak_s, "calls_planned": planned, "calls_answered": ok,
                           "calls_lost": planned - ok, "samples": samples}
    rss = [(m["t"], m["process_resident_memory_bytes"]) for m in samples if "process_resident_memory_bytes" in m]
    warm = [v for t, v in rss if t >= opts.warmup_share * (opts.soak_s or 0.0)]
    if warm:
        out["rss_after_warmup_bytes"] = warm[0]
        out["rss_max_bytes"] = max(warm)
        out["rss_end_bytes"] = warm[-1]
        out["rss_growth"] = max(warm) / warm[0] - 1
    if samples:
        last = samples[-1]
        out["kv_usage_end"] = last.get("kv_cache_usage_perc")
        out["sessions_held_end"] = last.get("num_sessions_held")
        out["in_flight_end"] = sum(last.get(k, 0.0) for k in IN_FLIGHT)
        out["drained"] = _idle(last)
        out["end_s"] = last["t"]
    return out


def summarize(records: list[CallRecord], duration_s: float, ttft_slo_s: float) -> dict[str, Any]:
    out = session_figures([AgentCall(r.session, r.e2e_s or 0.0, r.ttft_s, r.tpot_s, r.ok) for r in records],
                          duration_s, ttft_slo_s)
    out["failed_calls"] = sum(not r.ok for r in records)
    return out


def bench_agents(target: Target, sessions: list[AgentSession], opts: ReplayOptions, json_path: str | None,
                 label: str = "", log=print) -> dict[str, Any]:
    records, duration, planned, samples = asyncio.run(replay(target, sessions, opts))
    summary = summarize(records, duration, opts.ttft_slo_s)
    llm, ttft = summary["llm_time_per_session_s"], summary["ttft_s"]
    log(f"{label or target.base_url}: {summary['sessions']} sessions, {summary['calls']} calls "
        f"({summary['failed_calls']} failed) in {duration:.1f} s; LLM time/session mean {llm['mean'] or 0:.2f} s "
        f"p50 {llm['p50'] or 0:.2f} p99 {llm['p99'] or 0:.2f}; TTFT p50 {ttft['p50'] or 0:.3f} p99 {ttft['p99'] or 0:.3f} s; "
        f"{summary['sessions_per_hour_within_slo']:.0f} sessions/h within TTFT <= {opts.ttft_slo_s:g} s")
    data = {"bench": "agents", "label": label, "machine": machine_info(), "target": target.base_url,
            "model": target.model, "options": {k: v for k, v in opts.__dict__.items() if k != "extra"} | opts.extra,
            "summary": summary, "records": [r.__dict__ | {"tpot_s": r.tpot_s} for r in records]}
    if opts.soak_s is not None:
        soak = data["soak"] = soak_report(samples, opts, planned, records)
        growth = soak.get("rss_growth")
        log(f"soak {opts.soak_s:g} s: {soak['calls_lost']} of {planned} planned calls lost; resident memory "
            + (f"{soak['rss_after_warmup_bytes'] / 2**20:.0f} MiB after warm-up, max {soak['rss_max_bytes'] / 2**20:.0f} "
               f"({growth:+.1%}), end {soak['rss_end_bytes'] / 2**20:.0f}" if growth is not None else "not served")
            + (f"; at {soak['end_s']:.0f} s KV usage {soak['kv_usage_end']}, sessions held {soak['sessions_held_end']:g}, "
               f"in flight {soak['in_flight_end']:g}" if "end_s" in soak else "; no /metrics"))
    write_json(json_path, data)
    return data
