"""The scheduler's side of speculative decoding: `Speculation` (draft-length policy, draft cap,
frontier chooser) as one value, built from a `SpecConfig` by `make_speculation`, and `DraftBook`,
which applies it to each step (draft slots in, verified drafts settled). The scheduler takes a
`Speculation` in its constructor and in `reconfigure_speculation`. Torch-free and clock-free."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config import SpecConfig
from tandem.kv import KVCacheManager
from tandem.sched.acceptance import AcceptanceModel
from tandem.sched.cost_model import StepCostModel
from tandem.sched.frontiers import FrontierChooser, make_frontier_chooser
from tandem.sched.run_ahead import RunAheadChooser
from tandem.sched.spec_length import DraftLengthPolicy, make_length_policy
from tandem.types import Request, ScheduledSeq, SpecStats, StepPlan, StepResult


@dataclass(frozen=True)
class Speculation:
    """Each request's draft length (`length`), the most drafts a request gets in a step
    (`max_draft_tokens`; 0 turns drafting off) and, when the scheduler picks frontier sizes per
    step, the chooser; when drafting may run ahead of verification, its chooser."""
    length: DraftLengthPolicy
    max_draft_tokens: int
    frontiers: FrontierChooser | None = None
    run_ahead: RunAheadChooser | None = None


def make_speculation(cfg: SpecConfig | None, cost: StepCostModel) -> Speculation | None:
    """What a `SpecConfig` asks of the scheduler (None: no speculation). The policies read `cost`,
    the scheduler's step-cost model, which the scheduler trains."""
    if cfg is None:
        return None
    length = make_length_policy(cfg, cost)
    acceptance = getattr(length, "acceptance", None)      # one owner: the choosers read it
    acceptance = acceptance if isinstance(acceptance, AcceptanceModel) else None
    run_ahead = None
    if cfg.run_ahead != "off" and acceptance is not None:   # (SpecConfig has checked the policy is adaptive)
        run_ahead = RunAheadChooser(acceptance, cost, cfg.max_draft_tokens, always=cfg.run_ahead == "always")
    return Speculation(length, 0 if cfg.policy == "none" else cfg.max_draft_tokens,
                       make_frontier_chooser(cfg, cost, acceptance), run_ahead)


class DraftBook:
    """The scheduler's draft bookkeeping under one `Speculation` (None: drafting off): which
    running decodes get draft slots in a step (`assign`), what the verification kept (`settle`),
    and the engine-wide counters (`stats`). The scheduler owns the requests and the KV; this owns
    the draft side of a step."""

    def __init__(self, speculation: Speculation | None, kv: KVCacheManager, max_model_len: int) -> None:
        self.length: DraftLengthPolicy | None = speculation.length if speculation else None
        self.max_draft_tokens = speculation.max_draft_tokens if speculation else 0
        self.frontiers: FrontierChooser | None = speculation.frontiers if speculation else None
        self.run_ahead: RunAheadChooser | None = speculation.run_ahead if speculation else None
        self.kv = kv
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self.catch_up = 0          # tokens the proposer must read before drafting, this step
        self.open_passes = (0, 0)  # (rows, depth) drafted in the open this step
        self.ahead_passes = (0, 0)  # (rows, depth) drafted ahead this step

    def assign(self, plan: StepPlan, requests: dict[str, Request], budget: int) -> int:
        """Let the draft-length policy give the plan's running decodes draft slots within `budget`
        and the KV; returns the number of draft tokens scheduled."""
        self.catch_up = 0
        self.open_passes = self.ahead_passes = (0, 0)
        if not self.max_draft_tokens:
            return 0
        seqs = [s for s in plan.seqs if s.num_tokens == 1 and s.sample]
        if not seqs:
            return 0
        reqs = [requests[s.request_id] for s in seqs]
        base = plan.num_tokens
        limits = [self.limit(r) for r in reqs]
        # Nothing to choose where no request can draft (a lookup proposer found no match)
        lengths = self.length.choose(reqs, limits, base) if any(limits) else [0] * len(reqs)
        ahead = [0] * len(reqs)
        if self.run_ahead is not None and any(limits):
            ready = [r.draft.ready for r in reqs]
            lengths, ahead = self.run_ahead.choose([r.request_id for r in reqs], limits, base, lengths, ready,
                                                   [self.limit(r, min(lim, rd) + 1) for r, lim, rd in
                                                    zip(reqs, limits, ready)])
        drafting: list[tuple[Request, int]] = []
        used = 0
        for seq, req, k, a in zip(seqs, reqs, lengths, ahead):
            seq.num_ahead_tokens = a
            k = min(k, budget - used)
            if k > 0 and not self.kv.can_allocate(req, k):
                k = 0
            if k > 0:
                self.catch_up += max(0, seq.start + seq.num_tokens - req.draft.num_seen)
                self.kv.allocate(req, k)
                req.num_computed_tokens += k          # tentative: settle() rolls back rejected slots
                seq.num_draft_tokens = k
                seq.block_ids = self.kv.block_ids(req.request_id)
                used += k
                drafting.append((req, k))
            req.draft.stats.chosen_lengths[k] = req.draft.stats.chosen_lengths.get(k, 0) + 1
            self.stats.chosen_lengths[k] = self.stats.chosen_lengths.get(k, 0) + 1
        opened = [k for r, k in drafting if r.draft.ready < k]
        self.open_passes = (len(opened), max(opened, default=0))
        self.ahead_passes = (sum(1 for a in ahead if a), max(ahead, default=0))
        if self.frontiers is not None and drafting:
            plan.frontier_size = self.frontiers.choose([r for r, _ in drafting], [k for _, k in drafting], base)
        return used

    def limit(self, r: Request, advance: int = 0) -> int:
        """Most draft tokens worth verifying for r: its proposer's offer and its remaining room
        (`advance` tokens from now: a step run ahead)."""
        if not r.sampling_params.speculation_ok:
            return 0
        room = min(r.max_tokens - r.num_output_tokens, self.max_model_len - r.num_tokens) - 1 - advance
        offer = self.max_draft_tokens if r.draft.available is None else r.draft.available
        return max(0, min(self.max_draft_tokens, offer, room))

    def settle(self, request: Request, seq: ScheduledSeq, result: StepResult) -> None:
        """Keep the KV of accepted drafts only; feed the outcome to the length policy."""
        rid = request.request_id
        drafted = result.num_draft_tokens.get(rid, 0)
        accepted = result.num_accepted_tokens.get(rid, 0)
        emitted = len(result.sampled_token_ids.get(rid, ())) or 1
        # Every emitted token but the last has its KV computed (the last is the next step's input).
        request.num_computed_tokens = seq.start + seq.num_tokens + emitted - 1
        request.draft.num_seen = request.num_computed_tokens     # the proposer read up to here
        self.kv.truncate(request, request.num_computed_tokens)
        pruned = result.num_pruned_tokens.get(rid, 0)
        request.draft.stats.record(drafted, accepted, pruned)
        self.stats.record(drafted, accepted, pruned)
        self.length.observe_request(request, drafted, accepted)
        if self.frontiers is not None:
            self.frontiers.observe_request(request, drafted, accepted)

    def forget(self, request_id: str) -> None:
        """A request left the scheduler: the policies drop what they learned of it."""
        if self.length is not None:
            self.length.forget(request_id)
        if self.frontiers is not None:
            self.frontiers.forget(request_id)
