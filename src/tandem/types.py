"""Plain-Python data shared by the scheduler, the engine, the runner and the simulator (no torch).

A `Request` is the scheduler's view of one generation: token ids so far and how many of them have
KV computed. The step is data: `schedule()` returns a `StepPlan`, the executor returns a
`StepResult`, and `update()` turns it into `SeqUpdate`s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tandem.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"          # not yet admitted (or preempted, to be recomputed)
    RUNNING = "running"          # holds KV blocks and is scheduled every step
    PAUSED_TOOL = "paused_tool"  # waiting for a tool result (AugServe)
    FINISHED = "finished"

    @property
    def is_finished(self) -> bool:
        return self is RequestStatus.FINISHED


class FinishReason(str, enum.Enum):
    STOP = "stop"            # EOS, a stop token id or a stop string
    LENGTH = "length"        # max_tokens or the model's context length
    ABORT = "abort"          # cancelled by the caller
    TOOL_LIMIT = "tool_limit"  # more tool calls than allowed
    TOOL_CALLS = "tool_calls"  # handed a tool call back to the client

    def __str__(self) -> str:
        return self.value


@dataclass
class RequestTimes:
    """Timestamps (seconds, from the engine's clock) of a request's life."""

    arrival: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler tracks it.

    `token_ids` holds prompt + output. `num_computed_tokens` of them have KV in the cache; after a
    token is sampled it is appended and not yet computed, so a decode step computes exactly one token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    priority: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0     # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    times: RequestTimes = field(default_factory=RequestTimes)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.times.arrival = self.arrival_time
        sp = self.sampling_params
        stops = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stops.update(self.eos_token_ids)
        self.stop_token_ids: frozenset[int] = frozenset(stops)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


@dataclass
class ScheduledSeq:
    """One request's share of a step: compute `token_ids` at positions start..start+len-1."""

    request_id: str
    token_ids: list[int]
    start: int                      # position of token_ids[0] (= KV already computed before)
    block_ids: list[int]            # the request's block table after allocation
    sample: bool                    # sample a token after this chunk (it reaches the sequence end)
    sampling_params: SamplingParams
    num_output_tokens: int          # output tokens so far (for min_tokens)
    stop_token_ids: frozenset[int] = frozenset()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StepPlan:
    """What one model step computes, decided by the scheduler."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)   # (token id, logprob), best first


@dataclass
class StepResult:
    """What the executor returns: new tokens per sampled request (and their logprobs if asked)."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


@dataclass
class SeqUpdate:
    """A request's change in one step, as `Scheduler.update` reports it to the engine."""

    request: Request
    new_token_ids: list[int]
    finished: bool
