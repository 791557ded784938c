"""The admission pass of a step: which waiting requests join the batch, and whether prefills
behind a first token yield the step to new prompts.

Admission walks the waiting queue in the ordering's order and admits each request while the step's
token budget, `max_num_seqs` and free KV blocks allow: a request reuses its cached prefix, takes back
KV it kept or swapped across a pause, and gets a chunk of its prompt when chunked prefill is on. A
head that lacks blocks closes the queue, or, with a policy whose kept KV may pass
(`kept_kv_passes`), lets only requests that hold their KV past it. Starving requests (see
ordering.py) hold at most their share of the batch.

`Scheduler` (scheduler.py) is an `Admission`: the running pass, the step and the request
lifecycle live there, the admission pass here. No torch, no clock.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.config import SchedulerConfig
from tandem.kv import KVCacheManager
from tandem.sched.composition import FirstTokensFirst
from tandem.sched.ordering import Ordering
from tandem.sched.pauses import PauseBook
from tandem.sched.policies import SchedulingPolicy
from tandem.sched.retention import SessionBook
from tandem.types import Request, RequestStatus, ScheduledSeq, StepPlan


class Admission:
    """The scheduler's state the admission pass reads and changes (set by `Scheduler`)."""
    config: SchedulerConfig
    kv: KVCacheManager
    policy: SchedulingPolicy
    ordering: Ordering
    pauses: PauseBook
    sessions: SessionBook
    composition: FirstTokensFirst
    requests: dict[str, Request]
    waiting: list[Request]
    running: list[Request]
    num_scheduled_tokens: int

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self._starved: set[str] = set()     # running requests admitted while they starved
        self._watermark_blocks = int(config.watermark * kv.num_blocks)

    def _schedule_waiting(self, plan: StepPlan, budget: int, now: float, select: Callable[[Request], bool] | None = None,
                          gate: str = "open") -> tuple[int, str]:
        """Admit waiting requests in the ordering's order; `select(request)` False: leave it in the
        queue, unconsidered. `gate`: "open", or "blocked" (a higher-ranked request waits for free
        blocks: only requests holding KV pass) or "closed" (none may pass), as a previous pass left
        it. Returns the budget left and the gate."""
        self._starved &= {r.request_id for r in self.running}
        i = 0                                   # the next candidate
        blocked = gate == "blocked"
        if gate == "closed":
            return budget, gate
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[i]
            if select is not None and not select(request):
                i += 1
                continue
            if blocked and not self.kv.num_blocks_of(request.request_id):
                i += 1                          # only requests that hold their KV pass a blocked head
                continue
            cap = self.ordering.starving_slots(len(self.running), request, now)
            if cap is not None and len(self._starved) >= cap:
                i += 1                          # starving requests hold their share of the batch
                continue
            swapped = self.kv.is_swapped(request.request_id)
            if swapped and self.kv.drop_swapped_if_cached(request):
                swapped = False                 # its context is still in the device prefix cache
                if request.times.first_scheduled is None:
                    request.num_cached_tokens -= request.num_computed_tokens    # (counted below instead)
                request.num_computed_tokens = 0
            computed_blocks, num_cached = ([], 0) if swapped else self.kv.get_computed_blocks(request)
            base = request.num_computed_tokens + num_cached      # > 0 when resuming with kept KV
            num_new = request.num_tokens - base
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    return budget, "closed"
                num_new = budget
            watermark = self._watermark_blocks if self.running else 0
            # A swapped request holds no device blocks: this counts all of its context, including
            # the blocks swap_in will take (adding num_swapped_blocks would count them twice).
            need = self.kv.num_blocks_to_take(request, num_new, computed_blocks)
            if need + watermark > self.kv.num_free_blocks:
                if self._release_kv_for(request):
                    continue
                if not (self.policy.kept_kv_passes and self.running):
                    return budget, "closed"
                blocked = True
                i += 1
                continue
            self.waiting.pop(i)
            if cap is not None:
                self._starved.add(request.request_id)
            if swapped:
                plan.swap_in.extend(self.kv.swap_in(request))
            self.kv.allocate(request, num_new, computed_blocks)
            request.num_computed_tokens = base
            if request.times.first_scheduled is None:
                request.num_cached_tokens += num_cached     # (> 0 already: KV its session held)
                request.times.first_scheduled = now
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_to_plan(plan, request, num_new)
            budget -= num_new
        return budget, "blocked" if blocked else "open"

    def _settle_yielded(self, plan: StepPlan, held: list[Request], budget: int, admit: int, gate: str,
                        now: float) -> None:
        """The prefills that could yield (`held` running ones, and waiting ones left in the queue):
        if the step serves the first tokens of all prompts that await one, they wait one step; if
        not, they run now after all, within the step's `budget` left (and `admit` for admissions);
        a running one that finds no free blocks waits one step, as if deferred."""
        waiting = [r for r in self.waiting if self.composition.may_defer(r)]
        if self.composition.all_served((self.requests[s.request_id] for s in plan.seqs), self.waiting):
            for request in held + waiting:
                self.composition.defer(request)
            return
        for request in held:
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new > 0 and self.kv.try_allocate(request, num_new):
                self._add_to_plan(plan, request, num_new)
                budget -= num_new
                admit = min(admit, budget)
            else:       # (next step it runs at its rank, free to preempt for blocks)
                self.composition.defer(request)
        if waiting and len(self.running) < self.config.max_num_seqs:
            self._schedule_waiting(plan, admit, now, self.composition.may_defer, gate)

    def _release_kv_for(self, head: Request) -> bool:
        """The head lacks free blocks. If nothing runs, free KV that paused requests preserve or
        lower-ranked waiting ones kept (recomputed when they run), or the head waits forever. While
        requests run, never: the recompute takes the memory back, and under pressure each reclaim
        brought on the next (docs/benchmarks.md, AugServe's stability); with `kept_kv_passes` the
        requests that kept KV run past the head instead and free it by finishing. A context held
        for a session (no request waits on it) yields to the head either way."""
        if self.running:
            return self.sessions.evict_one()
        return self.pauses.discard_preserved() or self.pauses.evict_waiting(self.waiting, exclude=head)

    def _add_to_plan(self, plan: StepPlan, request: Request, num_new: int) -> None:
        plan.seqs.append(ScheduledSeq.next_chunk(request, num_new, self.kv.block_ids(request.request_id)))
        request.num_computed_tokens += num_new
        self.num_scheduled_tokens += num_new
