"""`SimExecutor`: stands in for the model. For each plan it returns what the torch executor would:
a next token for every sampled sequence, draft outcomes for every sequence with draft slots, and
(on the side) how long the step took in virtual seconds, from a cost model.

Token ids carry no meaning here (output lengths come from the workload and requests run with
ignore_eos), so every sampled token is FILL_TOKEN. A sequence verifying k drafts accepts the
longest run of successes of position-dependent Bernoulli draws: draft m (1-based) is accepted with
probability base * decay^(m-1), the request's base acceptance drawn per workload kind, or base *
position[m-1] where the kind has a measured `DraftModel`; the target then adds one token, so k
drafts give `accepted + 1` tokens. A kind whose model has an offer chain (an n-gram proposer) also
reports, like the engine's runner, how many drafts each request can offer next round
(`StepResult.draft_available`, 0 on rounds where the lookup finds nothing), and the scheduler
plans no more. Each request draws from its own seeded RNG, so outcomes do not depend on what else
is batched with it. No torch, no clock.

With `frontier_size` F > 0 (FASER's early pruning; the plan's own `frontier_size` when the
scheduler chooses per step), verification runs in passes of F drafts and a rejection in one
frontier cancels the later ones (their drafts count as pruned): the step costs its drafting plus
one target forward per pass (`frontier_step`). With `overlap`, frontier f + 1
is drafted while pass f runs (`CostModel.concurrent_time_s`), so the step is frontier 0's
drafting plus the overlapped passes. The middle-layer early exit is not modelled.

Run-ahead (a sequence's `num_ahead_tokens` a > 0): while the step verifies, the drafter makes the
request's next a drafts on the guess that its k drafts and the bonus token match its own
continuation, i.e. that k + 1 draws pass (the bonus token as one more position). The request's
accepted count is the same draw cut at k, so its outcome is distributed as without run-ahead. If
the guess held, the next step verifies up to a drafts with no drafting in the open (reported in
`StepResult.draft_ready`). The step costs the open drafting, then the verification run at once
with all drafting ahead (`CostModel.concurrent_time_s`); the executor reports the drafting
ahead's own time and what it added beyond the verification.
"""

from __future__ import annotations

import dataclasses
import random

from tandem.sim.cost.base import CostModel, StepShape, frontier_step, shape_of
from tandem.sim.workload import DraftModel
from tandem.types import StepPlan, StepResult

FILL_TOKEN = 11


def draw_accepted(rng: random.Random, base: float, num_drafts: int, decay: float,
                  position: tuple[float, ...] = ()) -> int:
    """Accepted drafts out of `num_drafts`: stop at the first rejection. Draft m (0-based) passes
    with probability base * position[m] (capped at 1; the last ratio repeats past the list), or
    base * decay^m without a position list."""
    p = base
    for m in range(num_drafts):
        if position:
            p = min(1.0, base * position[min(m, len(position) - 1)])
        if rng.random() >= p:
            return m
        if not position:
            p *= decay
    return num_drafts


class _SimSeq:
    """One request's draft outcome state: base rate, kind model, own RNG, whether it offered last,
    drafts made ahead whose guess held."""
    __slots__ = ("base", "draft", "rng", "offering", "ready")

    def __init__(self, base: float, draft: DraftModel | None, rng: random.Random) -> None:
        self.base, self.draft, self.rng, self.offering, self.ready = base, draft, rng, False, 0

    def next_offer(self) -> int | None:
        """Drafts the proposer holds for the next round (None: whatever is asked, a draft model)."""
        d = self.draft
        if d is None or d.offer is None:
            return None
        rng = self.rng
        self.offering = rng.random() < d.offer[0 if self.offering else 1]
        if not self.offering:
            return 0
        u, acc = rng.random(), 0.0
        for n, p in enumerate(d.offer_lengths, start=1):
            acc += p
            if u < acc:
                return n
        return len(d.offer_lengths)


class SimExecutor:
    def __init__(self, cost: CostModel, seed: int = 0, position_decay: float = 0.97, frontier_size: int = 0,
                 overlap: bool = False, step_jitter: tuple[float, float] = (0.0, 1.0)) -> None:
        """`step_jitter` (p, x): each step takes x times its modelled time with probability p (a
        noisy neighbour, a GC pause, a slow host), drawn from an RNG of its own so that draft
        outcomes do not change; (0, 1): none."""
        if overlap and frontier_size < 1:
            raise ValueError("overlap drafts frontier f+1 while frontier f is verified: set frontier_size >= 1")
        self.cost = cost
        self.seed = seed
        self.position_decay = position_decay
        self.frontier_size = frontier_size
        self.overlap = overlap
        self._requests: dict[str, _SimSeq] = {}
        if not (0.0 <= step_jitter[0] <= 1.0 and step_jitter[1] > 0):
            raise ValueError(f"step_jitter needs 0 <= p <= 1 and x > 0, got {step_jitter}")
        self.step_jitter = step_jitter
        self._jitter_rng = random.Random(f"{seed}:jitter")
        self.last_duration_s = 0.0
        self.busy_s = 0.0                  # virtual seconds spent in steps
        self.ahead_drafted = 0             # drafts made ahead (run-ahead)
        self.ahead_verified = 0            # of them, verified in the next step (their guess held)

    def add_request(self, request_id: str, acceptance: float, draft: DraftModel | None = None) -> None:
        self._requests[request_id] = _SimSeq(acceptance, draft, random.Random(f"{self.seed}:{request_id}"))

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)

    def step(self, plan: StepPlan) -> tuple[StepResult, float]:
        """The step's outcome and its duration in seconds (compute + swaps)."""
        result = StepResult()
        decay = self.position_decay
        for rid in plan.preempted_ids + plan.released_ids:    # the drafter's state goes with the KV
            if rid in self._requests:
                self._requests[rid].ready = 0
        predrafted: set[str] = set()
        for s in plan.seqs:
            if not s.sample:
                continue
            k, a = s.num_draft_tokens, s.num_ahead_tokens
            accepted = 0
            seq = self._requests.get(s.request_id)
            if k and seq.ready >= k:
                predrafted.add(s.request_id)
                self.ahead_verified += k
            if k or a:
                draft = seq.draft
                drawn = draw_accepted(seq.rng, seq.base, k + 1 if a else k, decay, draft.position if draft else ())
                accepted = min(drawn, k)
                if a:
                    result.draft_ready[s.request_id] = a if drawn > k else 0
                    self.ahead_drafted += a
            if seq is not None:
                seq.ready = result.draft_ready.get(s.request_id, 0)
            if k:
                result.num_draft_tokens[s.request_id] = k
                result.num_accepted_tokens[s.request_id] = accepted
            result.sampled_token_ids[s.request_id] = [FILL_TOKEN] * (accepted + 1)
            if seq is not None and seq.draft is not None:
                offer = seq.next_offer()
                if offer is not None:
                    result.draft_available[s.request_id] = offer
        shape = shape_of(plan)
        size = self.frontier_size if plan.frontier_size is None else plan.frontier_size
        if size and result.num_draft_tokens:
            compute = self._frontier_time_s(plan, result, size)
        elif predrafted or any(s.num_ahead_tokens for s in plan.seqs):
            compute = self._run_ahead_time_s(plan, result, shape, predrafted)
        else:
            compute = self.cost.step_time_s(shape)
            self._report_drafting(result, shape)
        p, x = self.step_jitter
        if p and self._jitter_rng.random() < p:
            compute *= x
        duration = compute + self.cost.swap_time_s(shape.num_swap_blocks)
        self.last_duration_s = duration
        self.busy_s += duration
        return result, duration

    def _frontier_time_s(self, plan: StepPlan, result: StepResult, size: int) -> float:
        """Seconds of a step verified in frontiers of `size`; records each request's pruned drafts."""
        cost = self.cost
        step = frontier_step(plan, result.num_accepted_tokens, size, self.overlap)
        result.num_pruned_tokens.update(step.pruned)
        self._report_drafting(result, step.drafts[0])
        if not self.overlap:
            return cost.draft_time_s(step.drafts[0]) + sum(
                cost.verify_time_s(v, first=f == 0) for f, v in enumerate(step.verify))
        return cost.draft_time_s(step.drafts[0]) + sum(
            cost.concurrent_time_s(v, f == 0, d) for f, (v, d) in enumerate(zip(step.verify, step.drafts[1:])))

    def _run_ahead_time_s(self, plan: StepPlan, result: StepResult, shape: StepShape, predrafted: set[str]) -> float:
        """Seconds of a step whose drafts were partly made ahead and which drafts ahead: the open
        drafting (and the draft model's read of the step's prefill), then the verification at once
        with the drafting ahead."""
        cost = self.cost
        opened = shape_of(plan, {s.request_id: s.num_draft_tokens for s in plan.seqs
                                 if s.request_id not in predrafted})
        ahead = [(s, s.num_ahead_tokens) for s in plan.seqs if s.num_ahead_tokens]
        rows = tuple(sum(1 for _, a in ahead if a > p) for p in range(max((a for _, a in ahead), default=0)))
        # drafting ahead reads each request's context and the step's k + 1 new tokens first
        ctx = sum(s.start + s.num_tokens + s.num_draft_tokens + 1 for s, _ in ahead)
        drafted = StepShape(draft_rows=rows, draft_context_tokens=ctx)
        verify = cost.verify_time_s(shape, first=True)
        both = cost.concurrent_time_s(shape, True, drafted)
        self._report_drafting(result, opened)
        result.ahead_s = cost.draft_time_s(drafted)
        result.ahead_exposed_s = max(0.0, both - verify)
        return cost.draft_time_s(opened) + both

    def _report_drafting(self, result: StepResult, drafted: StepShape) -> None:
        """What the engine's runner measures of its proposer: the drafting done before the target's
        pass (`drafted`), and one draft forward's time. The simulated draft model reads prompts
        with the target's prefill, not lazily as the engine's does, so that forward stays in the
        target's share."""
        if drafted.draft_rows:
            result.draft_s = self.cost.draft_time_s(dataclasses.replace(drafted, num_prefill_tokens=0))
            result.draft_pass_s = result.draft_s / len(drafted.draft_rows)

    def execute(self, plan: StepPlan) -> StepResult:
        """The engine's Executor protocol (the duration is left in `last_duration_s`)."""
        return self.step(plan)[0]
