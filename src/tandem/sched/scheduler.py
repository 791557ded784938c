"""Token-count scheduling with chunked prefill, continuous batching, preemption by recompute,
speculative draft lengths and tool-call pauses.

Each step (`schedule(now)`): running requests first, in order, each gets the tokens it still lacks
(one for a decode, a chunk for a prefill) within the step's token budget; if KV blocks run out,
the lowest-ranked running request is preempted (its blocks freed, recomputed later from its
tokens, which are never lost). Then waiting requests are admitted in the ordering's order while
budget, `max_num_seqs` and KV blocks allow, reusing cached prefixes. `update()` appends sampled
tokens and decides which requests finish (stop token, max_tokens, context length).

With a TPOT target (`config.target_tpot_s`) a `TpotGuard` lowers the step's budget while decodes
run, so that prefill chunks spend only the slack their mean time per output token leaves.
Draft lengths (FASER) come from the draft-length policy and are charged to the budget. A tool
call pauses a request (`pause_request`); the scheduling policy decides what happens to its KV and,
with AugServe, the order of admission and the token budget of admissions (see policies.py, budget.py).
A request with a session key leaves its KV held, on the same path, for its session's next call
(a tool loop run by the client; see retention.py).

This module owns the request state machine. It knows nothing of torch, tokenizers or wall time.
"""

from __future__ import annotations

import bisect
import itertools

from tandem.config import SchedulerConfig
from tandem.errors import ConfigError
from tandem.kv import KVCacheManager
from tandem.sched.admission import Admission
from tandem.sched.budget import TpotGuard
from tandem.sched.composition import FirstTokensFirst
from tandem.sched.cost_model import StepCostModel
from tandem.sched.frontiers import FrontierChooser
from tandem.sched.ordering import tool_key
from tandem.sched.pauses import PauseBook
from tandem.sched.policies import SchedulingPolicy, make_policy
from tandem.sched.preemption import choose_victim
from tandem.sched.retention import SessionBook
from tandem.sched.spec_length import DraftLengthPolicy
from tandem.sched.drafts import DraftBook, Speculation
from tandem.sched.trace import snapshot, trace_row
from tandem.types import (FinishReason, KVAction, Request, RequestStatus, SchedulerStats, SeqUpdate,
                          SpecStats, StepPlan, StepResult)


class Scheduler(Admission):
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: SchedulingPolicy | None = None,
                 speculation: Speculation | None = None, cost: StepCostModel | None = None,
                 swap_s_per_token: float = 5e-6) -> None:
        """`speculation`: the draft-length side (tandem.sched.drafts); None: none. Built from
        configs by tandem.sched.build."""
        if config.max_model_len > kv.num_blocks * kv.block_size:
            raise ConfigError(f"max_model_len {config.max_model_len} exceeds the KV cache "
                              f"({kv.num_blocks * kv.block_size} tokens): a long request could never run")
        super().__init__(config, kv)
        self.config = config
        self.kv = kv
        self.cost = cost or StepCostModel()      # step time vs tokens, learned from the steps' durations
        self.swap_s_per_token = swap_s_per_token
        self.policy = policy or make_policy(config.policy, config.max_num_batched_tokens, self.cost, swap_s_per_token)
        self.ordering = self.policy.ordering
        self.budget = self.policy.budget
        self.pauses = PauseBook(kv, self.policy.pause, self.policy.tools)
        self.sessions = SessionBook(kv, self.pauses, config.retention, self.policy.hold_ttl)   # KV held between a session's calls
        self.composition = FirstTokensFirst()   # (used when the policy serves first tokens first)
        self.requests: dict[str, Request] = {}
        self.reconfigure_speculation(speculation)    # self.drafts
        self.tpot_guard = (TpotGuard(config.target_tpot_s, self.cost, config.ttft_guard_s)
                           if config.target_tpot_s else None)
        self._step_started: float | None = None
        self._step_had_decodes = False
        self.waiting: list[Request] = []      # kept sorted by the ordering's key
        self.running: list[Request] = []      # in admission order
        self._counter = itertools.count()
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_scheduled_tokens = 0     # tokens computed over the scheduler's life (prefill + decode)
        self._num_preempted_tokens = 0    # computed tokens freed by preemption (recomputed later)
        self.trace: list | None = None    # set a list to record a StepTrace per step (sched/trace.py)

    def reconfigure_speculation(self, speculation: Speculation | None) -> None:
        """Switch the draft-length side (None: off) and start its counters afresh. Only while no
        request is in the scheduler: a policy's per-request memory belongs to the policy that
        learned it."""
        if self.requests:
            raise RuntimeError(f"reconfigure_speculation with {len(self.requests)} requests in the scheduler")
        self.drafts = DraftBook(speculation, self.kv, self.config.max_model_len)

    @property
    def spec_policy(self) -> DraftLengthPolicy | None:
        return self.drafts.length

    @property
    def max_draft_tokens(self) -> int:
        return self.drafts.max_draft_tokens

    @property
    def frontiers(self) -> FrontierChooser | None:
        return self.drafts.frontiers

    @property
    def spec_stats(self) -> SpecStats:
        """Engine-wide speculation counters (since the last reconfigure_speculation)."""
        return self.drafts.stats

    # --- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.rank.arrival_seq is None:
            request.rank.arrival_seq = next(self._counter)
        self.requests[request.request_id] = request
        if request.session.key is not None:
            self.sessions.adopt(request, request.arrival_time)
        self._push_waiting(request, request.arrival_time)

    def abort_request(self, request_id: str) -> Request | None:
        """Cancel a request wherever it is; returns it (finished with ABORT) or None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish_request(request, FinishReason.ABORT)
        return request

    def finish_request(self, request: Request, reason: FinishReason, now: float | None = None) -> None:
        """`now` (a finish, not an abort): a request with a session key leaves its KV held for it."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.PAUSED_TOOL:
            self.pauses.drop(request)
        if reason is not FinishReason.ABORT:
            self.policy.lengths.observe(request, request.num_output_tokens)
            self.policy.tools.observe_finish(tool_key(request), request.tool.num_calls)
        if now is None or reason is FinishReason.ABORT or request.session.key is None or not self.policy.holds_sessions \
                or self.sessions.hold(request, now, sum(r.num_computed_tokens for r in self.running)) is None:
            self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self.drafts.forget(request.request_id)
        self.composition.forget(request.request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_paused(self) -> int:
        return self.pauses.num_paused

    def stats(self) -> SchedulerStats:
        """A snapshot of the scheduler's and its KV manager's counters (what engines report)."""
        return snapshot(self)

    @property
    def num_recompute_tokens(self) -> int:
        """Computed tokens whose KV was freed (preempted, discarded at a pause, reclaimed): done twice."""
        return self._num_preempted_tokens + self.pauses.num_recompute_tokens

    def pending_prefill_tokens(self) -> int:
        """Context tokens still to prefill: the waiting requests' whole contexts and the rest of
        running prefills (a router's load signal; a pass over every request, so not in stats(),
        which the serving loop takes after every step)."""
        return sum(max(0, r.num_tokens - r.num_computed_tokens) for r in self.waiting) + \
            sum(max(0, r.num_tokens - r.num_computed_tokens - 1) for r in self.running)

    def recent_prefix_hashes(self, n: int) -> list:
        """The KV manager's `n` most recently cached block hashes, most recent first."""
        return self.kv.recent_block_hashes(n)

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Something to compute now (paused requests wait for their tools, not for a step)."""
        return bool(self.running or self.waiting)

    def set_policy(self, policy: SchedulingPolicy | str, trained: dict | None = None) -> None:
        """Switch scheduling policies (a name or a built policy) between workloads: needs an idle
        scheduler. `trained`: predictor state a named policy starts from (see make_policy)."""
        if self.requests:
            raise RuntimeError("set_policy needs an idle scheduler")
        if isinstance(policy, str):
            policy = make_policy(policy, self.config.max_num_batched_tokens, self.cost, self.swap_s_per_token,
                                 trained=trained)
        self.policy, self.ordering, self.budget = policy, policy.ordering, policy.budget
        self.sessions.release_all()         # (held by the old policy's rule)
        self.pauses = PauseBook(self.kv, policy.pause, policy.tools)
        self.sessions = SessionBook(self.kv, self.pauses, self.config.retention, policy.hold_ttl)
        self.composition = FirstTokensFirst()

    # --- tool calls ----------------------------------------------------------------------------
    def pause_request(self, request_id: str, now: float, expected_s: float | None = None, tool: str = "") -> KVAction:
        """A running request stops for a tool call; the policy decides what happens to its KV."""
        r = self.requests[request_id]
        if r.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request_id!r} is {r.status.value}, not running")
        self.running.remove(r)
        others = sum(x.num_computed_tokens for x in self.running)
        return self.pauses.pause(r, now, expected_s, others, tool)

    def resume_request(self, request_id: str, token_ids: list[int], now: float) -> None:
        """The tool's result arrives: its tokens join the context and the request waits to run."""
        r = self.requests[request_id]
        if r.status is not RequestStatus.PAUSED_TOOL:
            raise ValueError(f"request {request_id!r} is {r.status.value}, not paused")
        self.pauses.resume(r, token_ids, now)
        self._push_waiting(r, now)

    def expire_sessions(self, now: float) -> None:
        """Free the contexts sessions hold past their ceiling (every step does; an idle engine
        calls this between steps)."""
        self.sessions.expire(now)

    # --- the step --------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        self.num_steps += 1
        self.sessions.expire(now)
        self.ordering.observe_memory(self.kv.usage)
        if self.ordering.dynamic:
            self.waiting.sort(key=lambda r: self.ordering.key(r, now))
        limit = self.budget.tokens(self.kv.num_free_blocks, self.kv.num_blocks, self.pauses.num_held_blocks)
        step = self.budget.max_tokens if self.budget.admissions_only else limit
        if self.tpot_guard is not None:
            num_decodes = sum(1 for r in self.running if r.times.first_token is not None)
            self._step_had_decodes = num_decodes > 0
            step = self.tpot_guard.cap(step, num_decodes, self._oldest_first_token_wait(now))
        plan = StepPlan()
        # Prefills behind a first token that may yield this step to prompts' first tokens (see
        # sched/composition.py): running ones are held here, waiting ones left in the queue.
        yielding = self.policy.first_tokens_first and self.composition.all_fit(
            self.waiting, self.running, self.config.max_num_seqs, step, limit)
        held: list[Request] = []
        budget = self._schedule_running(plan, step, now, held if yielding else None)
        drafted = self.drafts.assign(plan, self.requests, budget)
        self.num_scheduled_tokens += drafted
        budget -= drafted
        admit = min(budget, limit)          # (= budget unless admissions_only: then limit caps admissions)
        if not plan.preempted_ids or not self.running:   # (a step that preempted all still runs)
            select = self.composition.may_not_defer if yielding else None
            left, gate = self._schedule_waiting(plan, admit, now, select)
            budget -= admit - left
            if yielding:
                self._settle_yielded(plan, held, budget, min(budget, left), gate, now)
        elif held:
            self._settle_yielded(plan, held, budget, 0, "closed", now)
        if self.trace is not None:
            self.trace.append(trace_row(self, plan, now, limit))
        plan.released_ids = self.pauses.take_released()
        plan.swap_out = self.kv.take_due_copies()     # (copies out of blocks this step reuses)
        self.kv.end_step()
        self.pauses.end_step()
        self._step_started = now
        return plan

    def _oldest_first_token_wait(self, now: float) -> float:
        """Seconds the longest-waiting request without a first token has waited (0 if none)."""
        starts = [r.times.arrival for r in itertools.chain(self.waiting, self.running) if r.times.first_token is None]
        return now - min(starts) if starts else 0.0

    def _schedule_running(self, plan: StepPlan, budget: int, now: float,
                          held: list[Request] | None = None) -> int:
        """`held`: collects, instead of scheduling them, the running prefills that may yield."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0 or (held is not None and self.composition.may_defer(request)):
                if num_new > 0:
                    held.append(request)
                i += 1
                continue
            while not self.kv.try_allocate(request, num_new):
                # Cheapest first: KV a paused request keeps, then KV a waiting request kept
                # across its pause (both recomputed later), then a running request's.
                if self.pauses.discard_preserved() or self.pauses.evict_waiting(self.waiting):
                    continue
                victim = choose_victim(self.running[i:], self.ordering, now)
                self._preempt(victim, plan)
                if victim is request:
                    break
            else:
                self._add_to_plan(plan, request, num_new)
                budget -= num_new
                i += 1
        return budget

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self._num_preempted_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
        request.draft.num_seen = 0                # the runner drops its proposer state too
        request.draft.ready = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        plan.preempted_ids.append(request.request_id)
        self._push_waiting(request, request.arrival_time)

    def _push_waiting(self, request: Request, now: float) -> None:
        bisect.insort(self.waiting, request, key=lambda r: self.ordering.key(r, now))

    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[SeqUpdate]:
        """Append the step's sampled tokens; finish requests that hit a stop condition."""
        self._observe_step(plan, result, now)
        updates = []
        for seq in plan.seqs:
            request = self.requests.get(seq.request_id)
            if request is not None and seq.num_draft_tokens:
                self.drafts.settle(request, seq, result)
            new_ids = result.sampled_token_ids.get(seq.request_id)
            if request is None or not new_ids:
                continue
            accepted, reason = request.append_output(new_ids, self.config.max_model_len)
            if request.times.first_token is None:
                request.times.first_token = now
            if reason is not None:
                request.times.finished = now
                self.finish_request(request, reason, now)
            updates.append(SeqUpdate(request, accepted, reason is not None))
        return updates

    def _observe_step(self, plan: StepPlan, result: StepResult, now: float) -> None:
        for rid, n in result.draft_available.items():
            if rid in self.requests:
                self.requests[rid].draft.available = n
        for seq in plan.seqs:
            if seq.sample and (r := self.requests.get(seq.request_id)) is not None:
                r.draft.ready = result.draft_ready.get(seq.request_id, 0)
        if self._step_started is not None and self.tpot_guard is not None:
            self.tpot_guard.observe(now - self._step_started, self._step_had_decodes)
        if self._step_started is None or plan.frontier_size:
            return      # (a step verified in frontiers took extra passes its token count does not show)
        unused = sum(s.num_draft_tokens - result.num_draft_tokens.get(s.request_id, 0) for s in plan.seqs)
        verified = sum(result.num_draft_tokens.values())
        decodes = sum(1 for s in plan.seqs if s.num_tokens == 1 and s.sample)
        if self.drafts.run_ahead is None:
            rows, depth = len(result.num_draft_tokens), max(result.num_draft_tokens.values(), default=0)
        else:               # drafts made ahead were verified without passes in this step
            rows, depth = self.drafts.open_passes
        ahead_rows, ahead_depth = self.drafts.ahead_passes
        self.cost.observe(plan.num_tokens - unused, now - self._step_started, result.draft_s,
                          result.draft_pass_s, rows, depth, self.drafts.catch_up,
                          verified_drafts=verified, decode_rows=decodes, ahead_s=result.ahead_s,
                          ahead_exposed_s=result.ahead_exposed_s, ahead_rows=ahead_rows, ahead_depth=ahead_depth)
        self._step_started = None
