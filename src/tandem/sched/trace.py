"""What the scheduler shows of itself: `snapshot`, its counters now (`Scheduler.stats()`, what
engines report), and `trace_row`, a step's row of `Scheduler.trace`: the state a run was in when
the step was planned (budget, tokens, batch, queue, memory, and the counters of work thrown away),
for finding out why a run went slow. The trace is off unless the caller sets `Scheduler.trace` to
a list (`tandem bench augmented --step-trace`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.types import SchedulerStats, StepPlan

QUEUE_HEAD = 8      # waiting requests named per row, in order


@dataclass
class StepTrace:
    """One scheduled step, as `Scheduler.trace` records it (off unless a list is set): what a
    run's state was, for finding out why it went slow."""
    t: float                            # the scheduler's `now` for the step
    budget: int                         # the budget's tokens() this step (admissions, if admissions_only)
    num_tokens: int                     # tokens scheduled (prefill chunks, decodes, drafts)
    num_seqs: int
    num_prefill_tokens: int             # tokens of chunks longer than one token
    num_running: int
    num_waiting: int
    num_paused: int
    num_free_blocks: int
    num_paused_held_blocks: int         # device blocks paused requests preserve
    num_waiting_kept_blocks: int        # device blocks waiting requests kept across a tool call
    num_discarded_kept: int             # since the start: kept KV freed to make room
    num_preemptions: int                # since the start
    num_recompute_tokens: int           # since the start: computed tokens whose KV was freed
    queue: list[str] = field(default_factory=list)   # the first waiting requests, in order


def trace_row(sched, plan: StepPlan, now: float, budget: int) -> StepTrace:
    """`sched`: the Scheduler that planned `plan` with `budget` tokens at `now`."""
    kv, pauses = sched.kv, sched.pauses
    return StepTrace(
        t=now, budget=budget, num_tokens=plan.num_tokens, num_seqs=len(plan.seqs),
        num_prefill_tokens=sum(s.num_tokens for s in plan.seqs if s.num_tokens > 1),
        num_running=len(sched.running), num_waiting=len(sched.waiting), num_paused=pauses.num_paused,
        num_free_blocks=kv.num_free_blocks, num_paused_held_blocks=pauses.num_held_blocks,
        num_waiting_kept_blocks=sum(kv.num_blocks_of(r.request_id) for r in sched.waiting),
        num_discarded_kept=pauses.num_discarded_kept, num_preemptions=sched.num_preemptions,
        num_recompute_tokens=sched.num_recompute_tokens, queue=[r.request_id for r in sched.waiting[:QUEUE_HEAD]])


def snapshot(sched) -> SchedulerStats:
    """`sched`'s counters and its KV manager's, now."""
    kv, pauses, spec = sched.kv, sched.pauses, sched.spec_stats
    return SchedulerStats(
        num_running=len(sched.running), num_waiting=len(sched.waiting), num_paused=pauses.num_paused,
        num_paused_kv_tokens=pauses.num_held_blocks * kv.block_size,
        kv_actions={a.value: n for a, n in pauses.num_actions.items()},
        num_discarded_kept=pauses.num_discarded_kept, num_recompute_tokens=sched.num_recompute_tokens,
        num_held_sessions=sched.sessions.num_held, num_adopted_tokens=sched.sessions.num_adopted_tokens,
        num_preemptions=sched.num_preemptions, num_steps=sched.num_steps, kv_usage=kv.usage,
        num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_blocks,
        prefix_cache_queries=kv.num_query_tokens, prefix_cache_hits=kv.num_hit_tokens,
        spec_num_drafts=spec.num_steps, spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens)
