"""The cost-model interface: a step's shape (from its plan) in, virtual seconds out.

`shape_of(plan)` reduces a `StepPlan` to what costs time: tokens computed, sequences, logit rows,
KV read by attention, query-key pairs, draft rows per draft position, swapped blocks. A
`CostModel` turns a shape into seconds (target forward + draft-model forwards) and swapped blocks
into transfer seconds, and states the deployment it models (KV blocks, host blocks, swap cost per
token). Knows nothing of the event loop or of scheduling.
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

    def swap_time_s(self, num_blocks: int) -> float:
        """Seconds to copy `num_blocks` KV blocks between device and host memory."""
        ...

    def deployment(self) -> Deployment:
        ...
