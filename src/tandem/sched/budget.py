"""The per-step token budget.

`StaticBudget` is vLLM's fixed `max_num_batched_tokens`. `DynamicBudget` is AugServe's: the limit
follows free KV memory and the memory held by paused requests, within [min, max]. With plenty of
free memory a large budget admits new prefills quickly; as memory fills (or paused requests hold
KV they will need to grow when they resume), the budget shrinks so that admissions do not run the
cache into preemptions.

The scheduler applies a budget's `tokens()` to the whole step, running requests and admissions
together, except for a budget that says `admissions_only`: then running requests get `max_tokens`
and `tokens()` bounds the tokens of the requests the step admits. A dynamic budget must be of that
kind: applied to running requests, it closes a loop that tips a server into a slow state that outlasts
its cause (docs/benchmarks.md, AugServe's stability): full memory -> a small budget -> the running
requests' prefill chunks (tool results, recomputed contexts) advance a few tokens per step, and each
step still reads all the weights -> they hold their memory longer -> memory stays full.

`TpotGuard` caps whichever budget is in force so that running requests' mean time per output
token holds a target while prompts are prefilled (`SchedulerConfig.target_tpot_s`, `--target-tpot-ms`).
"""

from __future__ import annotations

from typing import Protocol


class TokenBudget(Protocol):
    max_tokens: int
    admissions_only: bool       # tokens() bounds admissions; running requests get max_tokens

    def tokens(self, num_free_blocks: int, num_total_blocks: int, num_paused_blocks: int = 0) -> int:
        """Tokens the next step may compute."""
        ...


class StaticBudget:
    admissions_only = False

    def __init__(self, max_num_batched_tokens: int) -> None:
        self.max_tokens = max_num_batched_tokens

    def tokens(self, num_free_blocks: int, num_total_blocks: int, num_paused_blocks: int = 0) -> int:
        return self.max_tokens


class DynamicBudget:
    admissions_only = True      # running requests drain at max_tokens (see the module's docstring)

    def __init__(self, min_tokens: int, max_tokens: int, full_at_free: float = 0.5, paused_weight: float = 0.5) -> None:
        if not 1 <= min_tokens <= max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        self.full_at_free = full_at_free      # free fraction at (and above) which the budget is max
        self.paused_weight = paused_weight    # share of paused requests' KV counted as spoken for

    def tokens(self, num_free_blocks: int, num_total_blocks: int, num_paused_blocks: int = 0) -> int:
        free = (num_free_blocks - self.paused_weight * num_paused_blocks) / max(1, num_total_blocks)
        f = min(1.0, max(0.0, free / self.full_at_free))
        return int(self.min_tokens + (self.max_tokens - self.min_tokens) * f)


class TpotGuard:
    """Holds running requests' time per output token (TPOT) to a target while prompts are prefilled:
    a cap on the step's token budget, applied on top of any budget above (Sarathi-Serve's idea,
    with the slack spent rather than fixed).

    TPOT, as vLLM's benchmark reports it, is a request's *mean* time between output tokens, so a
    step may run over the target as long as the steps around it run under. The guard keeps an
    exponential average `A` (horizon `horizon` steps) of the duration of steps that carry decodes and
    allows the next such step `T + (horizon - 1) (T - A)` seconds: the most that keeps the average
    within the target T. The step's tokens are the most whose predicted time (the scheduler's step
    cost model) fits, but at least the decodes plus `min_chunk` prefill tokens, so prompts always
    advance. Decode-only steps earn the slack that prefill chunks spend; with no decode running
    nobody's TPOT is at stake and the budget stands. Neither does it bind once a prompt has waited
    `ttft_guard_s` for its first token: past that, its time to first token is at risk and prefill
    runs at full speed (which is also where an overloaded machine ends up: the static budget).
    Where steps are fast (a GPU, a small batch) the allowance exceeds the full budget's step time
    and the guard changes nothing. No clock: durations and waits arrive from the scheduler."""

    def __init__(self, target_tpot_s: float, cost, ttft_guard_s: float = 1.0, horizon: int = 32,
                 min_chunk: int = 16) -> None:
        if target_tpot_s <= 0 or horizon < 1 or min_chunk < 1 or ttft_guard_s <= 0:
            raise ValueError("need target_tpot_s > 0, ttft_guard_s > 0, horizon >= 1 and min_chunk >= 1")
        self.target_s = target_tpot_s
        self.cost = cost                    # StepCostModel: predicted seconds for a step of n tokens
        self.ttft_guard_s = ttft_guard_s
        self.horizon = horizon
        self.min_chunk = min_chunk
        self.average_s: float | None = None   # of steps that carried decodes
        self.num_capped = 0                  # steps whose budget the guard lowered

    def allowance_s(self) -> float:
        """Seconds the next step with decodes may take and keep the average within the target."""
        if self.average_s is None:
            return self.target_s
        return self.target_s + (self.horizon - 1) * (self.target_s - self.average_s)

    def cap(self, budget: int, num_decodes: int, oldest_wait_s: float) -> int:
        """The step's budget: `budget` lowered to what fits the allowance (see the class)."""
        if num_decodes == 0 or oldest_wait_s >= self.ttft_guard_s:
            return budget
        floor = min(budget, num_decodes + self.min_chunk)
        allowance = self.allowance_s() * (1 + 1e-9)       # (a step predicted exactly on it fits)
        if self.cost.time(budget) <= allowance:
            return budget
        lo, hi = floor, budget            # largest n in [floor, budget] predicted to fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost.time(mid) <= allowance:
                lo = mid
            else:
                hi = mid - 1
        self.num_capped += lo < budget
        return lo

    def observe(self, duration_s: float, had_decodes: bool) -> None:
        """A step's measured duration (only steps that carried decodes count towards TPOT)."""
        if not had_decodes or duration_s <= 0:
            return
        if self.average_s is None:
            self.average_s = duration_s
        else:
            self.average_s += (duration_s - self.average_s) / self.horizon
