"""Honest test doubles shared by tests: a canned model executor."""

from __future__ import annotations

from tandem.types import StepPlan, StepResult


class CannedModel:
    """Executor double: a request emits given tokens in order, one per sampled step (then `fill`).

    `queue[request_id]` holds a request's tokens; a request seen for the first time gets a copy of
    `default` (for requests whose ids are made elsewhere, e.g. by the HTTP server)."""

    def __init__(self, default: list[int] | None = None, fill: int = 0) -> None:
        self.queue: dict[str, list[int]] = {}
        self.default = default or []
        self.fill = fill

    def execute(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        for s in plan.seqs:
            if s.sample:
                q = self.queue.setdefault(s.request_id, list(self.default))
                result.sampled_token_ids[s.request_id] = [q.pop(0) if q else self.fill]
        return result

    def release(self, request_ids):
        for rid in request_ids:
            self.queue.pop(rid, None)
