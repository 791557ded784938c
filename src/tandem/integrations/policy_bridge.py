"""Tandem's scheduling policies, packaged for a host engine's scheduler (vLLM's, through
`tandem.integrations.vllm`). No vLLM, torch or clock here: the host passes its requests' numbers
and the time, and gets back an order, a token cap, draft lengths and what to hold.

- **Ordering** (`ranked`): the policy's ordering (AugServe's Stage I predicted service time,
  Stage II live re-ranking with anti-starvation; or FCFS) over the host's waiting requests.
- **Token budget** (`step_tokens`): the step's token limit. Running requests get the host's full
  `max_num_batched_tokens`; the dynamic budget bounds only what the step admits, as in Tandem's
  scheduler (sched/budget.py: a budget that throttles running requests tips a full cache into a
  slow state).
- **Draft lengths** (`draft_lengths`): FASER's per-request, load-aware length, applied as a cut of
  the drafts the host's proposer made, from acceptance history (`observe_drafts`) and a step-cost
  model trained on the host's step times (`observe_step`).
- **Session holds** (`hold`, `returned`, `expired`, `victims`): a finished call of a client-side
  tool loop keeps its KV for the session's next call when InferCept's min-waste rule says keeping
  it wastes less than recomputing it, within a share of the cache and a ceiling on time; the
  expected gap is learned per session, with all sessions' gaps as the prior. A host without host
  swap can only preserve or free.

Each host request is shadowed by a Tandem `Request` that shares the host's token list, so the
policies read live lengths without copies; `sync` updates the computed-token count.
"""

from __future__ import annotations

import heapq
import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tandem.config import POLICY_NAMES, ConfigError, SpecConfig
from tandem.sampling_params import SamplingParams
from tandem.sched.cost_model import StepCostModel
from tandem.sched.policies import make_policy
from tandem.sched.retention import pop_due, remember
from tandem.sched.spec_length import DraftLengthPolicy, make_length_policy
from tandem.sched.pause_kv import MinWaste, PauseContext
from tandem.types import KVAction, Request

T = TypeVar("T")
_GAP_ALPHA = 0.5        # weight of a session's latest gap in its average (recent tool waits tell most)

DRAFT_POLICIES = ("adaptive", "host")      # host: the host's own draft length, uncut
ORDERINGS = ("fcfs", "augserve-stage1", "augserve-stage2", "augserve")


@dataclass(frozen=True)
class BridgeConfig:
    """What a host deployment chooses (vLLM: `--additional-config '{"tandem": {...}}'`).

    `policy`: fcfs | augserve-stage1 | augserve-stage2 | augserve (Stage I + II + dynamic budget).
    `predictor`: a JSON file from `tandem predictor train` (Stage I's lengths and tool statistics);
    without it Stage I starts cold and learns from finished requests.
    `draft_policy`: adaptive (FASER's lengths) | host (the host's own).
    `hold_sessions`: keep a finished call's KV for its session's next call (min-waste rule);
    `max_hold_s` and `max_hold_share` bound it."""

    policy: str = "augserve"
    predictor: str | None = None
    max_wait_s: float = 30.0
    min_budget_tokens: int | None = None
    draft_policy: str = "adaptive"
    hold_sessions: bool = True
    max_hold_s: float = 600.0
    max_hold_share: float = 0.5
    session_gap_prior_s: float = 5.0

    def __post_init__(self) -> None:
        if self.policy not in ORDERINGS:
            raise ConfigError(f"unknown policy {self.policy!r} for a host scheduler; known: {', '.join(ORDERINGS)}")
        if self.draft_policy not in DRAFT_POLICIES:
            raise ConfigError(f"unknown draft_policy {self.draft_policy!r}; known: {', '.join(DRAFT_POLICIES)}")
        if self.max_wait_s <= 0 or self.max_hold_s <= 0 or self.session_gap_prior_s < 0:
            raise ConfigError("max_wait_s and max_hold_s must be > 0, session_gap_prior_s >= 0")
        if not 0.0 <= self.max_hold_share <= 1.0:
            raise ConfigError(f"max_hold_share must be in [0, 1], got {self.max_hold_share}")
        if self.min_budget_tokens is not None and self.min_budget_tokens < 1:
            raise ConfigError(f"min_budget_tokens must be >= 1, got {self.min_budget_tokens}")

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> BridgeConfig:
        options = dict(options or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown tandem option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**options)


@dataclass
class Hold:
    """A finished call's KV kept for its session."""
    session: str
    request_id: str
    num_blocks: int
    since: float
    until: float
    expected_s: float


class PolicyBridge:
    def __init__(self, config: BridgeConfig, max_num_batched_tokens: int, max_draft_tokens: int = 0) -> None:
        assert config.policy in POLICY_NAMES
        self.config = config
        self.cost = StepCostModel()
        trained = json.loads(Path(config.predictor).read_text()) if config.predictor else None
        self.policy = make_policy(config.policy, max_num_batched_tokens, self.cost, max_wait_s=config.max_wait_s,
                                  min_budget_tokens=config.min_budget_tokens, trained=trained)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lengths_policy: DraftLengthPolicy | None = None
        if max_draft_tokens > 0 and config.draft_policy == "adaptive":
            self.lengths_policy = make_length_policy(SpecConfig(max_draft_tokens=min(32, max_draft_tokens)), self.cost)
        self.shadows: dict[str, Request] = {}
        self._seq = 0
        self.min_waste = MinWaste(self.cost, swap_s_per_token=0.0)
        self.holds: dict[str, Hold] = {}
        self._deadlines: list[tuple[float, str, str]] = []      # (until, request id, session)
        self._last_finish: OrderedDict[str, float] = OrderedDict()
        self._gap: OrderedDict[str, float] = OrderedDict()      # per session: moving average of its gaps
        self.mean_gap_s: float | None = None                    # every session's (the prior)
        self.num_held = self.num_adopted = self.num_expired = self.num_evicted = 0

    # --- requests -----------------------------------------------------------------------------

    def track(self, request_id: str, prompt_token_ids: list[int], all_token_ids: list[int], arrival_time: float,
              max_tokens: int, tool_key: str | None = None) -> Request:
        """A host request enters: its shadow shares `all_token_ids` (the host appends outputs)."""
        r = Request(request_id, prompt_token_ids, SamplingParams(max_tokens=max(1, max_tokens), ignore_eos=True),
                    arrival_time=arrival_time, token_ids=all_token_ids)
        r.tool.key = tool_key
        r.rank.arrival_seq = self._seq
        self._seq += 1
        self.shadows[request_id] = r
        return r

    @staticmethod
    def sync(shadow: Request, num_computed_tokens: int) -> None:
        shadow.num_computed_tokens = num_computed_tokens

    def finished(self, request_id: str, completed: bool) -> None:
        """A host request left; a completed one teaches Stage I its output length."""
        r = self.shadows.pop(request_id, None)
        if r is None:
            return
        if completed and self.config.policy != "fcfs":
            self.policy.lengths.observe(r, r.num_output_tokens)
        if self.lengths_policy is not None:
            self.lengths_policy.forget(request_id)

    # --- ordering and budget ------------------------------------------------------------------

    def ranked(self, items: Iterable[tuple[T, Request]], now: float, kv_usage: float) -> list[T]:
        """The host's waiting requests (host object, shadow) in the policy's order."""
        ordering = self.policy.ordering
        ordering.observe_memory(kv_usage)
        keyed = [(ordering.key(shadow, now), i, obj) for i, (obj, shadow) in enumerate(items)]
        keyed.sort(key=lambda t: (t[0], t[1]))
        return [obj for _, _, obj in keyed]

    def step_tokens(self, running_tokens: int, num_free_blocks: int, num_total_blocks: int) -> int:
        """The step's token limit, given the tokens the running requests want this step."""
        budget = self.policy.budget
        if not budget.admissions_only:
            return budget.tokens(num_free_blocks, num_total_blocks)
        admit = budget.tokens(num_free_blocks, num_total_blocks)
        return max(1, min(self.max_num_batched_tokens, running_tokens + admit))

    # --- speculation --------------------------------------------------------------------------

    def draft_lengths(self, shadows: Sequence[Request], proposed: Sequence[int], num_base_tokens: int) -> list[int]:
        """How many of each request's proposed drafts to verify (FASER's lengths; the host's own
        with `draft_policy` host)."""
        if self.lengths_policy is None:
            return list(proposed)
        if not any(proposed):
            return [0] * len(proposed)
        chosen = self.lengths_policy.choose(list(shadows), list(proposed), num_base_tokens)
        return [min(k, p) for k, p in zip(chosen, proposed)]

    def observe_drafts(self, shadow: Request, drafted: int, accepted: int) -> None:
        if self.lengths_policy is not None and drafted > 0:
            shadow.draft.stats.record(drafted, accepted)
            self.lengths_policy.observe_request(shadow, drafted, accepted)

    def observe_step(self, num_tokens: int, duration_s: float, verified_drafts: int = 0, decode_rows: int = 0) -> None:
        self.cost.observe(num_tokens, duration_s, verified_drafts=verified_drafts, decode_rows=decode_rows)

    # --- session holds ------------------------------------------------------------------------

    def hold(self, session: str, request_id: str, context_tokens: int, other_tokens: int, num_blocks: int,
             num_total_blocks: int, now: float) -> bool:
        """A call of `session` finished with `num_blocks` of KV: hold them for the next call?"""
        remember(self._last_finish, session, now)
        if not self.config.hold_sessions or num_blocks <= 0 or self.config.policy == "fcfs":
            return False
        held = sum(h.num_blocks for h in self.holds.values() if h.session != session)
        can_preserve = held + num_blocks <= self.config.max_hold_share * num_total_blocks
        if not can_preserve:
            return False
        prior = self.config.session_gap_prior_s if self.mean_gap_s is None else self.mean_gap_s
        expected = self._gap.get(session, prior)
        ctx = PauseContext(context_tokens, other_tokens, expected, num_blocks, can_swap=False)
        if self.min_waste.decide(ctx) is not KVAction.PRESERVE:
            return False
        until = now + self.config.max_hold_s
        self.holds[session] = Hold(session, request_id, num_blocks, now, until, expected)
        heapq.heappush(self._deadlines, (until, request_id, session))
        self.num_held += 1
        return True

    def arrived(self, session: str, now: float) -> Hold | None:
        """A call of `session` arrived: learn the gap since its last call, and return the hold to
        release once the call has taken the held blocks over (its prefix-cache hit)."""
        last = self._last_finish.pop(session, None)
        if last is not None:
            gap = max(0.0, now - last)
            old = self._gap.get(session)
            remember(self._gap, session, gap if old is None else old + _GAP_ALPHA * (gap - old))
            self.mean_gap_s = gap if self.mean_gap_s is None else self.mean_gap_s + 0.1 * (gap - self.mean_gap_s)
        h = self.holds.pop(session, None)
        self.num_adopted += h is not None
        return h

    def expired(self, now: float) -> list[Hold]:
        """Holds past their ceiling (released by the host)."""
        out = pop_due(self._deadlines, self.holds, now)
        self.num_expired += len(out)
        return out

    def victims(self, num_blocks: int, now: float) -> list[Hold]:
        """Holds to free so that `num_blocks` come free: those expected back last go first."""
        order = sorted(self.holds.values(), key=lambda h: h.since + h.expected_s, reverse=True)
        out, freed = [], 0
        for h in order:
            if freed >= num_blocks:
                break
            del self.holds[h.session]
            out.append(h)
            freed += h.num_blocks
            self.num_evicted += 1
        return out

    @property
    def num_held_blocks(self) -> int:
        return sum(h.num_blocks for h in self.holds.values())
