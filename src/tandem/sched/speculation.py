"""The scheduler's side of speculative decoding, as one value: `Speculation` (draft-length
policy, draft cap, frontier chooser), built from a `SpecConfig` by `make_speculation`. The
scheduler takes it in its constructor and in `reconfigure_speculation`. Torch-free and clock-free."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config import SpecConfig
from tandem.sched.cost_model import StepCostModel
from tandem.sched.frontiers import FrontierChooser, make_frontier_chooser
from tandem.sched.spec_length import AcceptanceModel, DraftLengthPolicy, make_length_policy


@dataclass(frozen=True)
class Speculation:
    """Each request's draft length (`length`), the most drafts a request gets in a step
    (`max_draft_tokens`; 0 turns drafting off) and, when the scheduler picks frontier sizes per
    step, the chooser."""
    length: DraftLengthPolicy
    max_draft_tokens: int
    frontiers: FrontierChooser | None = None


def make_speculation(cfg: SpecConfig | None, cost: StepCostModel) -> Speculation | None:
    """What a `SpecConfig` asks of the scheduler (None: no speculation). The policies read `cost`,
    the scheduler's step-cost model, which the scheduler trains."""
    if cfg is None:
        return None
    length = make_length_policy(cfg, cost)
    acceptance = getattr(length, "acceptance", None)      # one owner: the frontier chooser reads it
    return Speculation(length, 0 if cfg.policy == "none" else cfg.max_draft_tokens,
                       make_frontier_chooser(cfg, cost, acceptance if isinstance(acceptance, AcceptanceModel) else None))
