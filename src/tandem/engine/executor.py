"""The executor seam between the engine and whatever computes a step (the torch runner, a fake, the simulator)."""

from __future__ import annotations

from typing import Protocol

from tandem.types import StepPlan, StepResult


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult:
        """Compute the plan's tokens (writing their KV) and sample where the plan says so."""
        ...

    def release(self, request_ids: list[str]) -> None:
        """Drop per-request state of requests that finished or were aborted."""
        ...
