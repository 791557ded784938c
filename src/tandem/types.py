"""Plain-Python data shared by the scheduler, the engine, the runner and the simulator (no torch).

A `Request` is the scheduler's view of one generation: token ids so far and how many of them have
KV computed. The step is data: `schedule()` returns a `StepPlan`, the executor returns a
`StepResult`, and `update()` turns it into `SeqUpdate`s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"          # not yet admitted (or preempted, to be recomputed)
    RUNNING = "running"          # holds KV blocks and is scheduled every step
    PAUSED_TOOL = "paused_tool"  # waiting for a tool result (AugServe)
    FINISHED = "finished"

    @property
    def is_finished(self) -> bool:
        return self is RequestStatus.FINISHED


class KVAction(str, enum.Enum):
    """What happens to a paused request's KV while its tool runs (InferCept / AugServe)."""

    PRESERVE = "preserve"    # keep the blocks in device memory
    SWAP = "swap"            # copy them to host memory, free the device blocks, copy back on resume
    DISCARD = "discard"      # free them; recompute the context on resume (chunked, prefix cache may help)


@dataclass
class PauseState:
    """A request paused on a tool call."""

    action: KVAction
    since: float
    expected_s: float
    tool: str = ""
    num_held_blocks: int = 0     # device blocks kept while paused (preserve)


@dataclass(frozen=True)
class SessionInfo:
    """Whom a request belongs to: the session whose context its KV is held for after it finishes
    (a client-side tool loop's next call resumes from it), the owner that session is scoped to and
    counted against (the API key), and the salt that keeps its prefix cache apart from other
    tenants' (vLLM's `cache_salt`)."""

    key: str | None = None       # None: nothing is held after the request finishes
    owner: str = ""
    cache_salt: str | None = None


class FinishReason(str, enum.Enum):
    STOP = "stop"            # EOS, a stop token id or a stop string
    LENGTH = "length"        # max_tokens or the model's context length
    ABORT = "abort"          # cancelled by the caller
    TOOL_LIMIT = "tool_limit"  # more tool calls than allowed
    TOOL_CALLS = "tool_calls"  # handed a tool call back to the client

    def __str__(self) -> str:
        return self.value


@dataclass
class SpecStats:
    """Speculative decoding counters of one request (or of the whole engine)."""

    num_steps: int = 0                  # verification rounds with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_pruned_tokens: int = 0          # draft rows cut from verification early (frontiers, early exit)
    accepted_per_position: list[int] = field(default_factory=list)   # [m]: rounds that accepted draft m+1
    drafted_per_position: list[int] = field(default_factory=list)    # [m]: rounds that drafted >= m+1
    chosen_lengths: dict[int, int] = field(default_factory=dict)     # draft length -> how many times chosen

    def record(self, num_drafted: int, num_accepted: int, num_pruned: int = 0) -> None:
        if num_drafted <= 0:
            return
        self.num_steps += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_pruned_tokens += num_pruned
        for lst, n in ((self.drafted_per_position, num_drafted), (self.accepted_per_position, num_accepted)):
            if len(lst) < num_drafted:
                lst.extend([0] * (num_drafted - len(lst)))
            for m in range(n):
                lst[m] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification round (accepted drafts + the one the target adds)."""
        return 1.0 + self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0

    def as_dict(self) -> dict:
        return {"num_steps": self.num_steps, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "num_pruned_tokens": self.num_pruned_tokens,
                "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length,
                "acceptance_per_position": [a / d if d else 0.0 for a, d in
                                            zip(self.accepted_per_position, self.drafted_per_position)],
                "chosen_lengths": dict(sorted(self.chosen_lengths.items()))}


@dataclass
class RequestTimes:
    """Timestamps (seconds, from the engine's clock) of a request's life."""

    arrival: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    program_start: float | None = None   # its session's first call's arrival (sched/retention.py)


@dataclass
class DraftState:
    """A request's speculative decoding: its counters and what its proposer has read and can offer."""

    stats: SpecStats = field(default_factory=SpecStats)
    available: int | None = None    # drafts the proposer can offer next step (None: unlimited)
    num_seen: int = 0               # tokens the proposer has read (a draft model catches up on the
                                    # rest, its whole prompt at first, before drafting)
    ready: int = 0                  # drafts made ahead during the last step whose guess held: the
                                    # next step verifies them without drafting (run-ahead)


@dataclass
class ToolState:
    """A request's server-side tool calls (AugServe): its tool family, the calls made so far and
    the tool results appended to its context (context, not output)."""

    key: str | None = None          # its tool family / workload type (predictor feature, stats key)
    num_calls: int = 0
    injected_spans: list[tuple[int, int]] = field(default_factory=list)   # (start, length) in token_ids
                                    # of each tool result appended to the context
    last_resumed: float | None = None   # when the last tool result arrived (Stage II signals)


@dataclass
class RankState:
    """What the scheduling policies keep about a request to order it: its admission order and
    AugServe Stage I's predictions, each made once."""

    arrival_seq: int | None = None  # admission order, set by the scheduler (the orderings' tie-break)
    predicted_output_tokens: float | None = None   # Stage I's output-length prediction
    stage1_s: float | None = None   # Stage I's predicted service time


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler tracks it.

    `token_ids` holds prompt + output. `num_computed_tokens` of them have KV in the cache; after a
    token is sampled it is appended and not yet computed, so a decode step computes exactly one token.

    The core every module reads is flat: identity, tokens, progress and the prefix-cache hashes.
    The rest is grouped by concern, each a typed part (no string keys):
      `times`   RequestTimes: timestamps of its life;
      `session` SessionInfo: whose context its KV is held for after it finishes;
      `pause`   PauseState, or None: the tool call (or session hold) it is paused on;
      `draft`   DraftState: speculative decoding counters and proposer progress;
      `tool`    ToolState: its tool family, tool calls and the tool results in its context;
      `rank`    RankState: what the policies order it by (admission order, Stage I predictions).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0     # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    block_hashes: list = field(default_factory=list)  # its full blocks' prefix-cache hashes so far
    times: RequestTimes = field(default_factory=RequestTimes)
    session: SessionInfo = SessionInfo()
    pause: PauseState | None = None
    draft: DraftState = field(default_factory=DraftState)
    tool: ToolState = field(default_factory=ToolState)
    rank: RankState = field(default_factory=RankState)

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
    def num_injected_tokens(self) -> int:
        return sum(n for _, n in self.tool.injected_spans)

    @property
    def num_output_tokens(self) -> int:
        """Tokens the model generated (tool results appended to the context do not count)."""
        return len(self.token_ids) - len(self.prompt_token_ids) - self.num_injected_tokens

    def append_output(self, new_ids: list[int], max_model_len: int) -> tuple[list[int], FinishReason | None]:
        """Append sampled tokens up to the first that ends the request: (the tokens taken, why it
        ended or None). It ends on a stop token (once `min_tokens` are out), at `max_tokens`, or at
        the context limit."""
        params = self.sampling_params
        for n, token in enumerate(new_ids, 1):
            num_before = self.num_output_tokens
            self.token_ids.append(token)
            if token in self.stop_token_ids and num_before >= params.min_tokens:
                return new_ids[:n], FinishReason.STOP
            if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
                return new_ids[:n], FinishReason.LENGTH
        return new_ids, None

    @property
    def generated_token_ids(self) -> list[int]:
        """The tokens the model generated, in order: the context after the prompt less the tool
        results (the one copy of a request's tokens; the engine's outputs read it)."""
        if not self.tool.injected_spans:
            return self.token_ids[len(self.prompt_token_ids):]
        out, at = [], len(self.prompt_token_ids)
        for start, n in self.tool.injected_spans:
            out.extend(self.token_ids[at:start])
            at = start + n
        out.extend(self.token_ids[at:])
        return out

    @property
    def output_token_ids(self) -> list[int]:
        """Tokens after the prompt (generated ones, and tool results if any were appended)."""
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


@dataclass
class ScheduledSeq:
    """One request's share of a step: compute `token_ids` at positions start..start+len-1.

    With speculation, `num_draft_tokens` more positions follow: the executor drafts that many
    tokens (or fewer) after `token_ids` and verifies them in the same pass. `history` is the
    request's whole token list (read-only), for proposers that look back (n-gram, draft models).
    """

    request_id: str
    token_ids: list[int]
    start: int                      # position of token_ids[0] (= KV already computed before)
    block_ids: list[int]            # the request's block table after allocation
    sample: bool                    # sample a token after this chunk (it reaches the sequence end)
    sampling_params: SamplingParams
    num_output_tokens: int          # output tokens so far (for min_tokens)
    stop_token_ids: frozenset[int] = frozenset()
    num_draft_tokens: int = 0
    # Run-ahead: drafts for the request's next step, made while this step verifies, on the guess
    # that all of this step's drafts and the bonus token match the drafter's own continuation.
    num_ahead_tokens: int = 0
    history: list[int] = field(default_factory=list)

    @classmethod
    def next_chunk(cls, request: Request, num_new: int, block_ids: list[int]) -> ScheduledSeq:
        """`request`'s next `num_new` tokens, from its first position without KV."""
        start = request.num_computed_tokens
        return cls(request_id=request.request_id, token_ids=request.token_ids[start:start + num_new], start=start,
                   block_ids=block_ids, sample=start + num_new == request.num_tokens,
                   sampling_params=request.sampling_params, num_output_tokens=request.num_output_tokens,
                   stop_token_ids=request.stop_token_ids, history=request.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Positions this step may compute (committed chunk + draft slots)."""
        return len(self.token_ids) + self.num_draft_tokens


@dataclass
class StepPlan:
    """What one model step computes, decided by the scheduler."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # KV freed or moved outside a preemption (a paused request's discard or swap, a waiting one's
    # freed): what the runner keeps per request and position (a draft model's own KV) is void.
    released_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, host block) copies
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (host block, device block) copies
    # Verification frontier the scheduler chose for this step's drafts (SpecConfig.adaptive_frontiers):
    # 0 one pass, F > 0 passes of F drafts; None leaves it to the executor's configured frontier_size.
    frontier_size: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.swap_out and not self.swap_in


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
    # Speculation: drafts actually verified, how many were accepted, how many rows were pruned
    # early, and how many drafts each request's proposer could offer next step.
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    num_pruned_tokens: dict[str, int] = field(default_factory=dict)
    draft_available: dict[str, int] = field(default_factory=dict)
    # Seconds the proposer ran in this step, and one proposer forward pass's (0: no forward, n-gram);
    # measured by the executor so that the step-cost model can tell drafting from verifying.
    draft_s: float = 0.0
    draft_pass_s: float = 0.0
    # Run-ahead: drafts made ahead whose guess held, per request (what the next step can verify
    # without drafting); seconds the drafting ahead took alone, and what it added to the step
    # beyond the verification running beside it (0 where it was hidden).
    draft_ready: dict[str, int] = field(default_factory=dict)
    ahead_s: float = 0.0
    ahead_exposed_s: float = 0.0


@dataclass(frozen=True)
class SchedulerStats:
    """`Scheduler.stats()`: counts now and counters since start."""
    num_running: int
    num_waiting: int
    num_paused: int                     # requests paused on a tool call (AugServe), held sessions included
    num_paused_kv_tokens: int           # device KV (in tokens of whole blocks) held by paused requests
    kv_actions: dict[str, int]          # pauses and session holds by KV action (preserve / swap / discard)
    num_preemptions: int
    num_steps: int
    kv_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int           # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int
    spec_num_drafts: int                # verification rounds with >= 1 draft token
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    num_discarded_kept: int = 0         # KV that waiting or paused requests kept, freed to make room
    num_recompute_tokens: int = 0       # computed tokens whose KV was freed (preempted, discarded, reclaimed)
    num_held_sessions: int = 0          # sessions holding the KV of their last call (sched/retention.py)
    num_adopted_tokens: int = 0         # context tokens a session's next call took over from its held KV


@dataclass
class SeqUpdate:
    """A request's change in one step, as `Scheduler.update` reports it to the engine."""

    request: Request
    new_token_ids: list[int]
    finished: bool
