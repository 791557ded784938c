"""What to do with a paused request's KV while its tool runs: preserve, swap or discard.

InferCept's minimal-waste rule, in token-seconds of KV memory (per-token memory cancels out):
  preserve: the idle KV is held for the whole pause          W_p = T_pause * C
  discard:  recomputing C tokens on resume stalls the batch  W_d = T_recompute(C) * (C + C_other)
  swap:     copying out and back in stalls the batch twice   W_s = 2 * T_swap(C) * (C + C_other)
with C the request's context, C_other the running batch's contexts, T_pause the expected pause
(from the tool statistics), T_recompute from the step-cost model, T_swap = C * seconds per token
of host transfer. Swapping is limited by a per-step budget of blocks (transfers must hide behind
compute) and by free host blocks. Fixed policies (always discard = vLLM, always preserve, always
swap) are the baselines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tandem.sched.cost_model import StepCostModel
from tandem.types import KVAction


@dataclass(frozen=True)
class PauseContext:
    context_tokens: int          # the paused request's computed tokens
    other_tokens: int            # computed tokens of the running batch
    expected_pause_s: float
    num_blocks: int              # device blocks the request holds
    can_swap: bool               # host space and this step's swap budget allow it
    can_preserve: bool = True    # False: device memory may not hold it (a session over its share)


class KVPausePolicy(Protocol):
    def decide(self, ctx: PauseContext) -> KVAction: ...


class FixedAction:
    def __init__(self, action: KVAction) -> None:
        self.action = action

    def decide(self, ctx: PauseContext) -> KVAction:
        action = self.action
        if action is KVAction.PRESERVE and not ctx.can_preserve:
            action = KVAction.SWAP
        if action is KVAction.SWAP and not ctx.can_swap:
            return KVAction.DISCARD
        return action


class MinWaste:
    def __init__(self, cost: StepCostModel, swap_s_per_token: float) -> None:
        self.cost = cost
        self.swap_s_per_token = swap_s_per_token

    def wastes(self, ctx: PauseContext) -> dict[KVAction, float]:
        c, batch = ctx.context_tokens, ctx.context_tokens + ctx.other_tokens
        w = {KVAction.DISCARD: self.cost.time(c) * batch}
        if ctx.can_preserve:
            w[KVAction.PRESERVE] = ctx.expected_pause_s * c
        if ctx.can_swap:
            w[KVAction.SWAP] = 2 * c * self.swap_s_per_token * batch
        return w

    def decide(self, ctx: PauseContext) -> KVAction:
        w = self.wastes(ctx)
        return min(w, key=w.get)


def fit_tool_result(token_ids: list[int], num_tokens: int, max_model_len: int) -> list[int]:
    """The part of a tool result's tokens a paused request's context takes back: all of them while
    the context stays below `max_model_len`, else as many as leave room for one generated token
    (the request then ends at its length limit). The engine and the simulator both cut here."""
    if num_tokens + len(token_ids) < max_model_len:
        return token_ids
    return token_ids[:max(0, max_model_len - num_tokens - 1)]
