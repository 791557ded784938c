"""Per-request draft lengths for speculative decoding (FASER's length policy and its baselines).

Decided inside `Scheduler.schedule()` and charged to the step's token budget, so the engine and
the simulator see the same decision. Pure Python: the step-cost model is the scheduler's, learned
from step durations the scheduler measures between `schedule(now)` and `update(now)`.

Adaptive (FASER): request i with per-position acceptance estimates a_i(m) and draft length k
expects E_i(k) = sum_{j<=k} prod_{m<=j} a_i(m) accepted tokens (+1 the target always adds). The
policy picks k_i (0 allowed) to maximise  sum_i (1 + E_i(k_i)) / step_time(T + sum_i k_i), where T
is the step's tokens without drafts and step_time comes from a cost model learned online from
the engine's own steps, each draft priced at what drafts added to measured steps of about as
many decodes (`StepCostModel.draft_times`: a verified draft is a token and a sampled row, about
twice a prefill token on a CPU). Adding one draft token to request i gains prod_{m<=k_i+1} a_i(m)
tokens and costs step_time(T+1) - step_time(T); the gains of one request shrink with k, so for m draft
tokens the m best-scored slots are the best choice, and the best m is found by scoring each.
With a draft model each draft position also costs one proposer pass (the deepest draft sets the
number of passes). A dead band keeps last step's lengths unless the new choice is clearly better
(no flapping), and a batch size the cost model has not measured yet runs plain first: drafting is
judged against the plain step's measured time, never an extrapolation.

Baselines: no speculation, a fixed length, vLLM's batch-size table ("dynamic SD") and vLLM's
survival-probability slot admission (`SurvivalAdmission`). `make_length_policy` builds one from a
`SpecConfig` (here, not in tandem.speculative, so that the simulator gets it without torch).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Protocol

from tandem.config import SpecConfig
from tandem.sched.acceptance import AcceptanceModel
from tandem.sched.cost_model import StepCostModel
from tandem.types import Request


class DraftLengthPolicy(Protocol):
    def choose(self, requests: list[Request], limits: list[int], num_base_tokens: int) -> list[int]:
        """Draft length for each request (<= its limit), given the step's tokens without drafts."""
        ...

    def observe_request(self, request: Request, num_drafted: int, num_accepted: int) -> None: ...

    def forget(self, request_id: str) -> None: ...


class _NoLearning:
    def observe_request(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


class NoSpeculation(_NoLearning):
    def choose(self, requests, limits, num_base_tokens):
        return [0] * len(requests)


class FixedLength(_NoLearning):
    """Every request drafts `k` tokens (fewer if its proposer or its remaining length has fewer)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, requests, limits, num_base_tokens):
        return [min(self.k, lim) for lim in limits]


class BatchSizeTable(_NoLearning):
    """vLLM-style dynamic SD: the decode batch size picks one length for all, with hysteresis.

    `table` is ((min_batch_size, length), ...). The row changes only when the decode-only batch
    size moves `hysteresis` (a fraction) beyond the row's bounds, so sizes hovering at a threshold
    do not flip the length every step.
    """

    def __init__(self, table: tuple[tuple[int, int], ...], hysteresis: float = 0.25) -> None:
        self.table = sorted(table)
        self.hysteresis = hysteresis
        self.row: int | None = None

    def _row_for(self, b: int) -> int:
        row = 0
        for i, (min_b, _) in enumerate(self.table):
            if b >= min_b:
                row = i
        return row

    def choose(self, requests, limits, num_base_tokens):
        b = len(requests)
        if not b:
            return []
        target = self._row_for(b)
        if self.row is None or target == self.row:
            self.row = target
        else:
            lo = self.table[self.row][0]
            hi = self.table[self.row + 1][0] if self.row + 1 < len(self.table) else None
            if b < lo * (1 - self.hysteresis) or (hi is not None and b >= hi * (1 + self.hysteresis)):
                self.row = target
        k = self.table[self.row][1]
        return [min(k, lim) for lim in limits]


def admit_slots(est: list[list[float]], limits: list[int], num_base_tokens: int,
                cost: StepCostModel, depth_aware: bool = False, start_s: list[float] | None = None,
                min_survival: float = 0.0) -> list[int]:
    """Draft lengths from admitting (request, position) slots best-first, as many as pay best.

    Slot (i, j) survives verification with probability prod_{m<=j} est[i][m-1]; a request's slots
    come in position order (the product only falls). Admitting the m best slots gives
    (n + G_m) / t(T + m) tokens per second (G_m their summed survival, T the step's tokens without
    drafts); the m with the highest rate wins, where t is the cost model's time at each size (its
    local line there, not the base size's line carried forward: verifying 36 rows on 2 cores
    costs twice what the line at 4 rows says).

    `depth_aware`: the step also costs one proposer pass, `cost.draft_pass_s(rows)`, per position
    of its deepest draft (a draft model runs once per position). Then each cap D on the depth is
    tried (the fixed part of the step grows by D passes) and the cap with the best tokens per
    second wins; the caps stop two past the best. `start_s[i]`: what drafting for request i at all
    adds to the step (its proposer's catch-up, amortized). Slots less likely to survive than
    `min_survival` are not considered.
    """
    slots = _ranked_slots(est, limits, min_survival)
    n = len(est)
    # times[m]: the step with m drafts; with `depth_aware`, each draft at its measured price
    times = (cost.draft_times(num_base_tokens, n, len(slots) + 1) if depth_aware
             else cost.times(num_base_tokens, len(slots) + 1))
    c = cost.draft_pass_s(sum(1 for lim in limits if lim > 0)) if depth_aware else 0.0
    start = start_s or [0.0] * n
    if c <= 0.0:
        return _best_prefix(slots, n, times, 0.0, None, start)[0]
    best, best_rate, worse = [0] * n, n / times[0], 0
    for cap in range(1, max(limits, default=0) + 1):
        ks, _ = _best_prefix(slots, n, times, c * cap, cap, start)
        rate = (n + _gain(est, ks)) / (times[sum(ks)] + c * max(ks, default=0) +
                                       sum(f for f, k in zip(start, ks) if k))
        if rate > best_rate:
            best, best_rate, worse = ks, rate, 0
        elif (worse := worse + 1) == 2:       # past the peak (tokens per second rise, then fall)
            break
    return best


MIN_SURVIVAL = 0.01     # the adaptive policy's floor: such a slot adds under 0.01 tokens, never worth its row


def _ranked_slots(est: list[list[float]], limits: list[int], min_survival: float = 0.0
                  ) -> list[tuple[float, int, int]]:
    """Every (survival, request, position) slot with survival >= `min_survival`, best first. A
    request's survival falls with position, so any prefix of this order holds prefixes of each
    request's drafts."""
    slots = []
    for i, (e, lim) in enumerate(zip(est, limits)):
        p = 1.0
        for j in range(lim):
            p *= e[j]
            if p < min_survival:
                break
            slots.append((p, i, j + 1))
    slots.sort(key=lambda x: -x[0])
    return slots


def _best_prefix(slots: list[tuple[float, int, int]], n: int, times: list[float], fixed_s: float,
                 cap: int | None, start_s: list[float]) -> tuple[list[int], float]:
    """The best prefix of the ranked slots (positions <= `cap`) for steps costing
    times[m] + fixed_s with m drafts, plus start_s[i] once request i drafts: (lengths, tokens per
    second). For m slots the m best-scored give the most tokens, so without start costs the best
    prefix is optimal for any step-time curve, convex or not (no scan that stops at the first
    slot that does not pay)."""
    kept = slots if cap is None else [x for x in slots if x[2] <= cap]
    gains = accumulate((x[0] for x in kept), initial=float(n))
    starts = accumulate((start_s[i] if j == 1 else 0.0 for _, i, j in kept), initial=fixed_s)
    rates = [g / (t + f) for g, t, f in zip(gains, times, starts)]
    top = max(rates)
    m = next(i for i, r in enumerate(rates) if r >= top * (1 - 1e-9))    # a tie drafts less
    ks = [0] * n
    for _, i, _ in kept[:m]:
        ks[i] += 1
    return ks, rates[m]


def _gain(est: list[list[float]], ks: list[int]) -> float:
    """Expected accepted drafts: sum_i sum_{j<=k_i} prod_{m<=j} est[i][m-1]."""
    gain = 0.0
    for e, k in zip(est, ks):
        p = 1.0
        for m in range(k):
            p *= e[m]
            gain += p
    return gain


class AdaptiveLength:
    """FASER's per-request, load-aware draft length (see the module docstring)."""

    def __init__(self, max_len: int, cost: StepCostModel, dead_band: float = 0.02, prior: float = 0.5,
                 measure_first: int = 2) -> None:
        self.max_len = max_len
        self.cost = cost
        self.dead_band = dead_band
        self.measure_first = measure_first      # plain steps near a step size before drafting there
        self.acceptance = AcceptanceModel(max_len, prior=prior)
        self._last: dict[str, int] = {}

    def choose(self, requests, limits, num_base_tokens):
        self.acceptance.end_step()
        if not requests:
            return []
        if not self.cost.measured(num_base_tokens, self.measure_first):
            # Measure before speculating: the choice compares drafting against the plain step, so
            # the plain step's time must be known, not extrapolated from verification steps (which
            # run more tokens) or prefills. A couple of plain steps per batch size settles it.
            return [0] * len(requests)
        est = [self.acceptance.estimates(r.request_id, upto=lim) for r, lim in zip(requests, limits)]
        start = self._start_costs(requests, est, limits)
        best = admit_slots(est, limits, num_base_tokens, self.cost, depth_aware=True, start_s=start,
                           min_survival=MIN_SURVIVAL)
        last = [min(self._last.get(r.request_id, 0), lim) for r, lim in zip(requests, limits)]
        if last != best and self._value(est, last, num_base_tokens, start) >= \
                self._value(est, best, num_base_tokens, start) * (1 - self.dead_band):
            best = last
        for r, k in zip(requests, best):
            self._last[r.request_id] = k
        idle = [r.request_id for r, k, lim in zip(requests, best, limits) if lim > 0 and k == 0]
        if idle:
            self.acceptance.age(idle, global_too=not any(best))
        return best

    def _start_costs(self, requests: list[Request], est: list[list[float]], limits: list[int]) -> list[float]:
        """What drafting for each request costs a step beyond its passes: a draft model first reads
        what it has not seen (a new request's whole prompt), a cost paid once and amortized here
        over the request's remaining steps (at most max_tokens - generated tokens, at the
        tokens per step its drafts would give)."""
        per_token = self.cost.catch_up_s_per_token
        if per_token <= 0.0:
            return [0.0] * len(requests)
        out = []
        for r, e, lim in zip(requests, est, limits):
            unread = max(0, r.num_computed_tokens + 1 - r.draft.num_seen)
            steps = max(1.0, (r.max_tokens - r.num_output_tokens) / (1.0 + _gain([e], [lim])))
            out.append(per_token * unread / steps)
        return out

    def _value(self, est: list[list[float]], ks: list[int], base: int, start: list[float]) -> float:
        gain = _gain(est, ks)
        depth = self.cost.draft_pass_s(sum(1 for k in ks if k)) * max(ks, default=0)
        fixed = depth + sum(f for f, k in zip(start, ks) if k)
        step = self.cost.draft_times(base, len(est), sum(ks) + 1)[-1]
        return (len(est) + gain) / max(1e-9, step + fixed)

    def observe_request(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        self.acceptance.observe(request.request_id, num_drafted, num_accepted)

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
        self._last.pop(request_id, None)


class SurvivalAdmission:
    """vLLM-style adaptive verification: draft slots admitted by survival probability.

    Each request keeps per-position acceptance estimates a_i(m), an EMA with retention `ema` (0.8)
    of that position's outcomes (1 accepted, 0 rejected; positions after the first rejection were
    not judged and keep their value). A new request starts from the batch-wide EMA of each position.
    Slot (i, j) scores its survival probability s_ij = prod_{m<=j} a_i(m); slots are admitted in
    score order while the step-cost profile says the marginal slot pays (`admit_slots`).
    Unlike `AdaptiveLength`: a plain EMA (no pooling with the global estimate, no count decay) and
    no dead band, so lengths follow the latest outcomes step by step.
    """

    def __init__(self, max_len: int, cost: StepCostModel, ema: float = 0.8, prior: float = 0.5) -> None:
        self.max_len = max_len
        self.cost = cost
        self.ema = ema
        self.global_est = [prior] * max_len
        self._est: dict[str, list[float]] = {}

    def estimates(self, request_id: str) -> list[float]:
        return self._est.get(request_id) or list(self.global_est)

    def choose(self, requests: list[Request], limits: list[int], num_base_tokens: int) -> list[int]:
        if not requests:
            return []
        est = [self.estimates(r.request_id) for r in requests]
        return admit_slots(est, limits, num_base_tokens, self.cost)

    def observe_request(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        est = self._est.setdefault(request.request_id, list(self.global_est))
        keep = self.ema
        for m in range(min(num_drafted, num_accepted + 1, self.max_len)):   # judged positions only
            hit = 1.0 if m < num_accepted else 0.0
            est[m] = keep * est[m] + (1 - keep) * hit
            self.global_est[m] = keep * self.global_est[m] + (1 - keep) * hit

    def forget(self, request_id: str) -> None:
        self._est.pop(request_id, None)


def make_length_policy(cfg: SpecConfig, cost: StepCostModel) -> DraftLengthPolicy:
    """The draft-length policy a `SpecConfig` names; `cost` is the scheduler's step-cost model
    (the adaptive and survival policies read it, the scheduler trains it)."""
    if cfg.policy == "adaptive":
        return AdaptiveLength(cfg.max_draft_tokens, cost)
    if cfg.policy == "survival":
        return SurvivalAdmission(cfg.max_draft_tokens, cost)
    if cfg.policy == "fixed":
        return FixedLength(cfg.max_draft_tokens)
    if cfg.policy == "table":
        return BatchSizeTable(cfg.length_table)
    return NoSpeculation()
