"""What `LLM.generate` and the engine return (the vLLM shape, plus direct accessors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.types import TokenLogprob


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    spec: dict[str, Any] | None = None      # speculation counters (SpecStats.as_dict()), if it drafted
    tool_calls: list[dict[str, Any]] = field(default_factory=list)   # one entry per tool call it made
    predicted_output_tokens: float | None = None   # AugServe Stage I's output-length prediction, if made

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    delta_text: str = ""            # text new in this step (streaming)
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (vLLM's RequestOutput field)."""
        return self.metrics.num_cached_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
