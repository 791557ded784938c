"""The per-step token budget.

`StaticBudget` is vLLM's fixed `max_num_batched_tokens`. `DynamicBudget` is AugServe's: the limit
follows free KV memory and the memory held by paused requests, within [min, max]. With plenty of
free memory a large budget admits new prefills quickly; as memory fills (or paused requests hold
KV they will need to grow when they resume), the budget shrinks so that steps stay short for the
running decodes and admissions do not run the cache into preemptions.
"""

from __future__ import annotations

from typing import Protocol


class TokenBudget(Protocol):
    def tokens(self, num_free_blocks: int, num_total_blocks: int, num_paused_blocks: int = 0) -> int:
        """Tokens the next step may compute."""
        ...


class StaticBudget:
    def __init__(self, max_num_batched_tokens: int) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens

    def tokens(self, num_free_blocks: int, num_total_blocks: int, num_paused_blocks: int = 0) -> int:
        return self.max_num_batched_tokens


class DynamicBudget:
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
