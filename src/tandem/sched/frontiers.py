"""FASER's early pruning per load level: whether a step's drafts are verified in frontiers.

Verifying in frontiers of F drafts runs frontier f + 1 only for the requests whose drafts all
survived frontier f, so rejected suffixes cost no compute, at the price of one more target pass
per frontier. `frontier_pays` prices both ways with the scheduler's step-cost model and each
request's acceptance; `FrontierChooser` makes that call every step (`SpecConfig.adaptive_frontiers`).
Pure Python, like the rest of tandem.sched: the simulator runs the same choice.
"""

from __future__ import annotations

from tandem.config import SpecConfig
from tandem.sched.cost_model import StepCostModel
from tandem.sched.acceptance import AcceptanceModel
from tandem.types import Request


def frontier_pays(est: list[list[float]], ks: list[int], size: int, num_base_tokens: int,
                  cost: StepCostModel, overlap: bool = False, margin: float = 0.02) -> bool:
    """Whether verifying this step's drafts in frontiers of `size` is expected to be faster than
    one pass. Request i's drafts before position fF all survive with probability s_i(fF) =
    prod_{m<=fF} est[i][m-1]; pass f > 0 runs iff some request survives to it (probability
    P_f = 1 - prod_i (1 - s_i(fF))) and then computes E_f / P_f tokens on average, E_f =
    sum_i s_i(fF) min(F, k_i - fF). So, with t(n) the step-cost model's time for n tokens,
        one pass:  t(T + sum_i k_i)
        frontiers: t(T + sum_i min(k_i, F)) + sum_{f>0} P_f t(E_f / P_f)  [- hidden drafting]
    where with `overlap` the drafting of positions past F, (max k - F) proposer passes, hides
    behind the passes. Splitting must win by `margin` (a pass costs more than its tokens: launches, syncs)."""
    def t(n: float) -> float:
        a, b = cost.line(max(1, round(n)))
        return a + b * n

    total = sum(ks)
    depth = max(ks, default=0)
    if depth <= size:
        return False
    one_pass = t(num_base_tokens + total)
    split = t(num_base_tokens + sum(min(k, size) for k in ks))
    survive = [1.0] * len(ks)
    for f in range(1, -(-depth // size)):
        none_alive, tokens = 1.0, 0.0
        for i, k in enumerate(ks):
            if k <= f * size:
                continue
            for m in range((f - 1) * size, f * size):     # positions of frontier f - 1
                survive[i] *= est[i][m]
            none_alive *= 1.0 - survive[i]
            tokens += survive[i] * min(size, k - f * size)
        reach = 1.0 - none_alive
        if reach > 1e-9:
            split += reach * t(tokens / reach)
    if overlap:
        split -= cost.draft_pass_s(sum(1 for k in ks if k > size)) * (depth - size)
    return split < one_pass * (1.0 - margin)


class FrontierChooser:
    """FASER's early pruning per load level: each step, verify in frontiers of `size` only where the
    cost model expects it to pay (`frontier_pays`), else in one pass. When the step is bound by
    streaming the weights (light load; any CPU) a pass costs nearly a whole step and pruning saves
    little, so steps stay whole; when it is compute-bound (heavy load on a GPU) and drafts are
    likely to be cut, frontiers save the rejected suffixes' compute. Reads the length policy's
    per-request acceptance (`acceptance`, owned and trained by the policy) without its exploration
    bonus or optimistic start; with a length policy that keeps none (fixed k, the batch-size
    table) it learns its own."""

    def __init__(self, size: int, max_len: int, cost: StepCostModel, overlap: bool = False,
                 acceptance: AcceptanceModel | None = None) -> None:
        self.size, self.cost, self.overlap = size, cost, overlap
        self.owns_acceptance = acceptance is None
        self.acceptance = acceptance or AcceptanceModel(max_len, explore=0.0, optimistic=False)
        self.num_split = self.num_whole = 0

    def choose(self, requests: list[Request], ks: list[int], num_base_tokens: int) -> int:
        """The frontier size for this step: `size`, or 0 for one pass."""
        est = [self.acceptance.estimates(r.request_id, explore=0.0, optimistic=False) for r in requests]
        if frontier_pays(est, ks, self.size, num_base_tokens, self.cost, self.overlap):
            self.num_split += 1
            return self.size
        self.num_whole += 1
        return 0

    def observe_request(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        if self.owns_acceptance:              # else the length policy, its owner, has observed it
            self.acceptance.observe(request.request_id, num_drafted, num_accepted)

    def forget(self, request_id: str) -> None:
        if self.owns_acceptance:
            self.acceptance.forget(request_id)


def make_frontier_chooser(cfg: SpecConfig, cost: StepCostModel,
                          acceptance: AcceptanceModel | None = None) -> FrontierChooser | None:
    """A chooser when the config asks the scheduler to pick frontiers per step (`adaptive_frontiers`);
    `acceptance`: the length policy's, to read instead of learning a second copy."""
    if not cfg.adaptive_frontiers:
        return None
    return FrontierChooser(cfg.frontier_size, cfg.max_draft_tokens, cost, cfg.overlap, acceptance)
