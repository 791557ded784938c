"""The per-step token budget. `StaticBudget` is vLLM's fixed `max_num_batched_tokens`."""

from __future__ import annotations

from typing import Protocol


class TokenBudget(Protocol):
    def tokens(self, num_free_blocks: int, num_total_blocks: int) -> int:
        """Tokens the next step may compute."""
        ...


class StaticBudget:
    def __init__(self, max_num_batched_tokens: int) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens

    def tokens(self, num_free_blocks: int, num_total_blocks: int) -> int:
        return self.max_num_batched_tokens
