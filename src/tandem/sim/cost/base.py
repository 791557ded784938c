"""The cost-model interface: a step's shape (from its plan) in, virtual seconds out.

`shape_of(plan)` reduces a `StepPlan` to what costs time: tokens computed, sequences, logit rows,
KV read by attention, query-key pairs, draft rows per draft position, swapped blocks. A
`CostModel` turns a shape into seconds (target forward + draft-model forwards; and, for
verification in frontiers, per pass, alone or overlapped with drafting: `frontier_step`) and
swapped blocks into transfer seconds, and states the deployment it models (KV blocks, host
blocks, swap cost per token). Knows nothing of the event loop or of scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tandem.types import StepPlan


@dataclass(frozen=True)
class StepShape:
    num_seqs: int = 0
    num_tokens: int = 0              # positions the target computes: committed chunks + verified drafts
    num_logit_rows: int = 0          # rows through the LM head: sampled sequences + verified drafts
    num_prefill_tokens: int = 0      # committed tokens of chunks longer than one (prefill, recompute)
    context_tokens: int = 0          # KV attention reads: sum over sequences of (start + positions)
    attention_pairs: int = 0         # query-key pairs: sum over sequences of n * (start + (n + 1) / 2)
    draft_rows: tuple[int, ...] = ()  # draft_rows[p]: sequences drafting at least p + 1 tokens
    draft_context_tokens: int = 0    # context of the drafting sequences (read by each draft forward)
    num_swap_blocks: int = 0

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.draft_rows)


def shape_of(plan: StepPlan, verified: dict[str, int] | None = None) -> StepShape:
    """The shape of a plan. Every draft slot is drafted and verified (a simulated draft model
    proposes as many tokens as asked) unless `verified` says how many each request verified."""
    tokens = rows = prefill = ctx = pairs = dctx = 0
    ks = [s.num_draft_tokens if verified is None else verified.get(s.request_id, 0) for s in plan.seqs]
    draft_rows = [0] * max(ks, default=0)
    for s, k in zip(plan.seqs, ks):
        n = s.num_tokens + k
        tokens += n
        if s.num_tokens > 1:
            prefill += s.num_tokens
        if s.sample:
            rows += 1 + k
        ctx += s.start + n
        pairs += n * s.start + n * (n + 1) // 2
        if k:
            dctx += s.start + s.num_tokens
            for p in range(k):
                draft_rows[p] += 1
    return StepShape(len(plan.seqs), tokens, rows, prefill, ctx, pairs, tuple(draft_rows), dctx,
                     len(plan.swap_out) + len(plan.swap_in))


@dataclass(frozen=True)
class FrontierStep:
    """A speculative step verified in frontiers of F drafts (FASER's early pruning), as passes.

    `verify[f]` is verification pass f: pass 0 computes every sequence's committed tokens and its
    first F drafts; pass f > 0 only the drafts [fF, (f+1)F) of the sequences whose drafts before fF
    were all accepted (a rejection in a frontier cancels the later ones). Without overlap the
    drafter drafts every slot up front: `drafts` is that one shape. With overlap, `drafts[0]` is
    frontier 0 drafted up front and `drafts[f + 1]` is frontier f + 1, drafted while pass f runs
    for the sequences still alive when pass f starts (its outcome is not known yet); an empty
    shape where nothing is left to draft. Draft shapes carry only draft fields (and the step's
    prefill tokens in the first, which the draft model also computes). `pruned[rid]`: drafts of a
    request that no pass verified."""
    verify: tuple[StepShape, ...]
    drafts: tuple[StepShape, ...]
    pruned: dict[str, int]


def frontier_step(plan: StepPlan, accepted: dict[str, int], frontier_size: int, overlap: bool) -> FrontierStep:
    """The passes of a plan's verification in frontiers of `frontier_size`, given each drafting
    sequence's accepted count (`accepted`; the plan's `num_draft_tokens` is what was drafted)."""
    size = frontier_size
    drafting = [s for s in plan.seqs if s.num_draft_tokens]
    # Passes each sequence takes part in: up to the frontier holding its first rejection.
    passes = {s.request_id: min(-(-s.num_draft_tokens // size), accepted[s.request_id] // size + 1)
              for s in drafting}
    first = shape_of(plan, {s.request_id: min(s.num_draft_tokens, size) for s in plan.seqs})
    verify = [StepShape(first.num_seqs, first.num_tokens, first.num_logit_rows, first.num_prefill_tokens,
                        first.context_tokens, first.attention_pairs, num_swap_blocks=first.num_swap_blocks)]
    for f in range(1, max(passes.values(), default=1)):
        tokens = ctx = pairs = seqs = 0
        for s in drafting:
            if passes[s.request_id] > f:
                n = min(size, s.num_draft_tokens - f * size)
                start = s.start + s.num_tokens + f * size
                seqs, tokens, ctx = seqs + 1, tokens + n, ctx + start + n
                pairs += n * start + n * (n + 1) // 2
        verify.append(StepShape(seqs, tokens, tokens, 0, ctx, pairs))

    def draft(seqs: list, lo: int, hi: int, prefill: int = 0) -> StepShape:
        """Drafting positions [lo, hi) of `seqs` (each up to its own draft length)."""
        rows = tuple(n for n in (sum(1 for s in seqs if s.num_draft_tokens > p) for p in range(lo, hi)) if n)
        dctx = sum(s.start + s.num_tokens + lo for s in seqs if s.num_draft_tokens > lo)
        return StepShape(num_prefill_tokens=prefill, draft_rows=rows, draft_context_tokens=dctx if rows else 0)

    pruned = {s.request_id: max(0, s.num_draft_tokens - passes[s.request_id] * size) for s in drafting}
    prefill = shape_of(plan).num_prefill_tokens
    if not overlap:
        depth = max((s.num_draft_tokens for s in drafting), default=0)
        return FrontierStep(tuple(verify), (draft(drafting, 0, depth, prefill),), pruned)
    drafts = [draft(drafting, 0, size, prefill)]
    for f in range(len(verify)):              # frontier f + 1, drafted while pass f runs
        alive = [s for s in drafting if passes[s.request_id] > f]
        drafts.append(draft(alive, (f + 1) * size, (f + 2) * size))
    return FrontierStep(tuple(verify), tuple(drafts), pruned)


@dataclass(frozen=True)
class Deployment:
    """What the modelled machine offers the scheduler."""
    num_kv_blocks: int
    num_host_blocks: int
    swap_s_per_token: float          # host-link seconds per token of KV (the min-waste rule's swap cost)
    description: str


class CostModel(Protocol):
    name: str

    def step_time_s(self, shape: StepShape) -> float:
        """Seconds of one engine step of this shape (target forward, plus draft forwards if a
        separate draft model is modelled), excluding swaps."""
        ...

    def verify_time_s(self, shape: StepShape, first: bool) -> float:
        """Seconds of one target forward over the shape (no drafting): the step's first pass, or a
        further verification frontier (`first` False: no per-step overheads again)."""
        ...

    def draft_time_s(self, shape: StepShape) -> float:
        """Seconds of the draft-model forwards the shape's draft fields describe (0 without one)."""
        ...

    def concurrent_time_s(self, verify: StepShape, first: bool, draft: StepShape) -> float:
        """Seconds of a verification pass and drafting run at once on disjoint compute."""
        ...

    def swap_time_s(self, num_blocks: int) -> float:
        """Seconds to copy `num_blocks` KV blocks between device and host memory."""
        ...

    def deployment(self) -> Deployment:
        ...
