"""Step-time model: how long one engine step takes as a function of the tokens it computes.

Learned online from (tokens, seconds) pairs the caller measures (the scheduler times its own steps;
the simulator passes virtual durations). Around a token count n the model is a local line
t(n + d) = a + b (n + d), fitted by least squares to the recent observations weighted by their
closeness to n in log scale, with the slope shrunk towards the global least-squares slope when
the neighbourhood holds too few distinct sizes to measure one. A local line, not bucket
interpolation, because the decision it serves (does one more draft token pay?) depends on the
*marginal* cost, which flat or noisy segments between buckets would get badly wrong. Calibrated
profile points are kept as permanent anchors; before any data the prior line stands in.

Drafting is measured, not inferred: the executor reports how long its proposer ran in the step
(`draft_s`) and how long one proposer forward pass took (`draft_pass_s`; 0 for n-gram lookups,
which run no forward). The local lines are fitted to the *target's* share, duration - draft_s, and
`draft_pass_s(rows)` is the weighted median of the reported pass times near a number of drafting
rows: with a draft model (or layer-skip drafting) every draft position costs one more pass
whatever the number of rows. A median, because a request's first drafting step also feeds the
draft model its whole prompt (a catch-up pass ten times the usual); what catching up costs per
token is learned apart (`catch_up_s_per_token`, from the draft time the passes do not explain).
Inferring the per-position cost from total step times cannot work: when every request drafts the
same k, tokens and depth move together and least squares cannot tell them apart (it chose 8
drafts at 4 streams where no draft pays). No clock here: durations come in from outside.

A verified draft is priced apart (`draft_times`): it is one more token *and* one more sampled
row (the LM head over the vocabulary, the sampler), so on a CPU it costs about twice a prefill
token. A line over tokens alone learns its slope near 64 decodes mostly from steps whose extra
tokens are a prefill chunk, and prices a verified row under its cost there. So what drafts add is measured where they run: each step that
verified drafts gives one sample, (its duration - the mean of the plain steps of the same size)
/ its drafts, keyed by its decode rows, and `draft_times` prices a draft at the weighted median
of the samples near a step's rows, never under the token line's own increment. (The token
line's time for the plain step would not do as the reference: the verification steps around it
pull it up, and drafts look cheaper than they are.) A second line over steps of sampled
rows only was tried and measured worse: at saturation every plain step has the same rows, so it
has no slope to learn, and anchored on plain decode steps it prices a draft as a new sequence
with its own KV reads, three times dearer on a GPU than it is.

Drafting run ahead (the next step's drafts made while this step verifies) is reported apart:
how long it took alone (`ahead_s`) and what it added to the step beyond the verification beside
it (`ahead_exposed_s`: 0 where it hid completely, more where the two share the machine). The
target's line is fitted to the step less both, its passes join the proposer's, and
`exposed_share(rows)` is the weighted median of exposed / alone near a number of rows drafting
ahead (`EXPOSED_PRIOR` until steps near that many rows are measured).
"""

from __future__ import annotations

import itertools
import math
from collections import deque

_SIGMA = 0.6           # neighbourhood width in log(tokens): ~x1.8 either side
_ANCHOR_WEIGHT = 5.0   # a profile point counts as this many observations
_CATCH_UP_MIN = 16     # steps whose proposer caught up on fewer tokens teach nothing about it
EXPOSED_PRIOR = 0.0    # share of drafting run ahead that shows in a step before any is measured: none


class StepCostModel:
    def __init__(self, base_s: float = 0.03, per_token_s: float = 0.0025, alpha: float = 0.2,
                 profile: list[tuple[int, float]] | None = None, window: int = 512) -> None:
        self.base_s = base_s
        self.per_token_s = per_token_s
        self.alpha = alpha                        # kept for callers that tune it; unused by the local fit
        self._anchors = [(float(n), float(t)) for n, t in (profile or []) if n > 0 and t > 0]
        self._anchors_lo = min((n for n, _ in self._anchors), default=0.0)
        self._anchors_hi = max((n for n, _ in self._anchors), default=0.0)
        self._obs: deque[tuple[float, float]] = deque(maxlen=window)          # (tokens, target s)
        self._passes: deque[tuple[float, float]] = deque(maxlen=window // 4)  # (drafting rows, s/pass)
        self._catch_up: deque[float] = deque(maxlen=64)                        # s per caught-up token
        self._version = 0
        self._cache: dict[tuple[int, int], tuple[float, float]] = {}
        self._global: tuple[int, tuple[float, float]] | None = None
        self._pass_cache: tuple[tuple[int, int], float] | None = None
        self._grouped: tuple[int, list[tuple[float, float, float, float]]] | None = None
        self._drafts: deque[tuple[float, float]] = deque(maxlen=window // 4)  # (decode rows, s per draft)
        self._draft_price: dict[int, float | None] = {}   # rows -> median of _drafts (cleared on a new sample)
        self._plain: dict[int, float] = {}     # tokens -> mean seconds of steps of that size without drafts
        self._exposed: deque[tuple[float, float]] = deque(maxlen=window // 4)  # (rows ahead, exposed share)

    def observe(self, num_tokens: int, duration_s: float, draft_s: float = 0.0, draft_pass_s: float = 0.0,
                draft_rows: int = 0, draft_depth: int = 0, catch_up_tokens: int = 0,
                verified_drafts: int = 0, decode_rows: int = 0, ahead_s: float = 0.0,
                ahead_exposed_s: float = 0.0, ahead_rows: int = 0, ahead_depth: int = 0) -> None:
        """One step: `num_tokens` computed by the target (drafts included) in `duration_s`, of which
        the proposer took `draft_s`: `draft_depth` passes of `draft_pass_s` each over `draft_rows`
        rows, after feeding it the `catch_up_tokens` it had not read. `verified_drafts` of the
        tokens were drafts verified beside `decode_rows` decodes (see `draft_times`). Drafting run
        ahead: `ahead_depth` passes over `ahead_rows` rows took `ahead_s` alone and added
        `ahead_exposed_s` to the step."""
        if num_tokens <= 0 or duration_s <= 0:
            return
        if ahead_s > 0 and ahead_rows > 0:
            self._exposed.append((float(ahead_rows), min(1.0, max(0.0, ahead_exposed_s) / ahead_s)))
            if ahead_depth > 0:
                self._passes.append((float(ahead_rows), ahead_s / ahead_depth))
        target_s = max(1e-6, float(duration_s) - max(0.0, draft_s) - max(0.0, ahead_exposed_s))
        if verified_drafts <= 0:
            old = self._plain.get(num_tokens)
            self._plain[num_tokens] = target_s if old is None else 0.8 * old + 0.2 * target_s
        elif decode_rows > 0 and (plain := self._plain.get(num_tokens - verified_drafts)) is not None:
            self._drafts.append((float(decode_rows), max(0.0, target_s - plain) / verified_drafts))
            self._draft_price.clear()
        self._obs.append((float(num_tokens), target_s))
        if draft_pass_s > 0 and draft_rows > 0:
            self._passes.append((float(draft_rows), float(draft_pass_s)))
            if catch_up_tokens >= _CATCH_UP_MIN:
                extra = draft_s - draft_depth * draft_pass_s
                self._catch_up.append(max(0.0, extra) / catch_up_tokens)
        self._version += 1

    @property
    def catch_up_s_per_token(self) -> float:
        """Seconds the proposer takes per token it catches up on (0 until measured; 0 for
        proposers that read nothing: n-gram lookups, layer-skip drafting on the target's KV)."""
        if not self._catch_up:
            return 0.0
        return sorted(self._catch_up)[len(self._catch_up) // 2]

    def draft_pass_s(self, rows: int) -> float:
        """Seconds of one proposer forward pass over `rows` drafting rows: what one more draft
        position adds to a step (0 until a pass is measured; 0 for n-gram drafting)."""
        if not self._passes or rows <= 0:
            return 0.0
        key = (rows, self._version)
        if self._pass_cache is not None and self._pass_cache[0] == key:
            return self._pass_cache[1]
        value = self._median_pass(rows)
        self._pass_cache = (key, value)
        return value

    def _median_pass(self, rows: int) -> float:
        return _weighted_median(self._passes, rows) or 0.0

    def exposed_share(self, rows: int) -> float:
        """What share of drafting run ahead over `rows` rows shows in a step's time."""
        if rows <= 0:
            return 0.0
        share = _weighted_median(self._exposed, rows, min_weight=4.0)
        return EXPOSED_PRIOR if share is None else share

    def measured(self, num_tokens: int, enough: int = 2, within: float = 1.25) -> bool:
        """Whether `enough` recent steps computed within a factor `within` of `num_tokens` tokens
        (a calibrated profile measures every size inside its range)."""
        if self._anchors and self._anchors_lo / within <= num_tokens <= self._anchors_hi * within:
            return True
        lo, hi, near = num_tokens / within, num_tokens * within, 0
        for n, _ in reversed(self._obs):            # the latest first: usually the same sizes
            if lo <= n <= hi:
                near += 1
                if near >= enough:
                    return True
        return False

    def _points(self) -> list[tuple[float, float, float, float]]:
        """(tokens, mean seconds, weight, log tokens) per distinct step size: a weighted least-squares
        line through these is the line through every observation (same normal equations)."""
        if self._grouped is not None and self._grouped[0] == self._version:
            return self._grouped[1]
        sums: dict[float, list[float]] = {}
        for n, t, w in itertools.chain(((n, t, _ANCHOR_WEIGHT) for n, t in self._anchors),
                                       ((n, t, 1.0) for n, t in self._obs)):
            acc = sums.setdefault(n, [0.0, 0.0])
            acc[0] += w
            acc[1] += w * t
        pts = [(n, wt / w, w, math.log(n)) for n, (w, wt) in sums.items()]
        self._grouped = (self._version, pts)
        return pts

    def _global_line(self) -> tuple[float, float]:
        if self._global is not None and self._global[0] == self._version // 16:
            return self._global[1]
        line = _fit([(n, t, w) for n, t, w, _ in self._points()], None) or (self.base_s, self.per_token_s)
        self._global = (self._version // 16, line)
        return line

    def line(self, num_tokens: int) -> tuple[float, float]:
        """(a, b) with t(n) ~ a + b n near `num_tokens` (b >= 0)."""
        if not self._anchors and len(self._obs) < 4:
            return self.base_s, self.per_token_s
        key = (round(4 * math.log2(max(1, num_tokens))), self._version // 8)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if len(self._cache) > 4096:
            self._cache.clear()
        ln = math.log(max(1, num_tokens))
        pts = [(n, t, w * math.exp(-((lg - ln) ** 2) / (2 * _SIGMA ** 2))) for n, t, w, lg in self._points()]
        line = _fit(pts, self._global_line()[1]) or self._global_line()
        self._cache[key] = line
        return line

    def time(self, num_tokens: int) -> float:
        """Predicted seconds for a step of `num_tokens` tokens."""
        a, b = self.line(num_tokens)
        return max(1e-6, a + b * num_tokens)

    def times(self, first: int, count: int) -> list[float]:
        """[time(first), time(first + 1), ...] for `count` sizes, one local fit per size bucket."""
        out: list[float] = []
        n = first
        while len(out) < count:
            upper = 2 ** ((round(4 * math.log2(max(1, n))) + 0.5) / 4)   # where line()'s bucket ends
            a, b = self.line(n)
            out.append(max(1e-6, a + b * n))
            n += 1
            while len(out) < count and n < upper:
                out.append(max(1e-6, a + b * n))
                n += 1
        return out

    def draft_times(self, num_base_tokens: int, num_rows: int, count: int) -> list[float]:
        """[t(0 drafts), t(1 draft), ...] for `count` sizes: a step of `num_base_tokens` tokens,
        `num_rows` of them decodes, plus m verified drafts, each draft at what drafts have added
        to measured steps of about `num_rows` decodes (the weighted median, once steps near
        that many decodes weigh 8 or more) and never under the token line's own increments
        (`times`); before that, the token line's."""
        times = self.times(num_base_tokens, count)
        if num_rows <= 0 or count <= 1:
            return times
        if num_rows not in self._draft_price:
            self._draft_price[num_rows] = _weighted_median(self._drafts, num_rows, min_weight=8.0)
        per = self._draft_price[num_rows]
        if per is None:
            return times
        return [times[0]] + [max(t, times[0] + m * per) for m, t in enumerate(times[1:], 1)]

    def profile(self) -> list[tuple[int, float]]:
        """The model sampled at powers of two (for reports and calibration files)."""
        top = max([p[0] for p in self._points()] or [1])
        out, n = [], 1
        while n <= max(2, top):
            out.append((n, self.time(n)))
            n *= 2
        return out


def _weighted_median(samples: deque[tuple[float, float]], rows: int, min_weight: float = 0.0) -> float | None:
    """The median of (rows, value) samples' values, each weighted by its closeness to `rows` in
    log scale (1 at `rows`, 0.6 at 1.8x off, 0.1 at 3.4x); None if their weights sum under
    `min_weight`."""
    if not samples:
        return None
    lr = math.log(rows)
    pts = sorted((s, math.exp(-((math.log(r) - lr) ** 2) / (2 * _SIGMA ** 2))) for r, s in samples)
    total = sum(w for _, w in pts)
    if total < max(min_weight, 1e-300):
        return None
    half, acc = total / 2, 0.0
    for s, w in pts:
        acc += w
        if acc >= half:
            return s
    return pts[-1][0]


def _fit(pts: list[tuple[float, float, float]], prior_slope: float | None) -> tuple[float, float] | None:
    """Weighted least-squares line; with `prior_slope`, the slope is shrunk towards it when the
    points' spread in n is small relative to their mean."""
    sw = sum(w for _, _, w in pts)
    if sw < 1e-9:
        return None
    mn = sum(w * n for n, _, w in pts) / sw
    mt = sum(w * t for _, t, w in pts) / sw
    sxx = sum(w * (n - mn) ** 2 for n, _, w in pts) / sw
    sxy = sum(w * (n - mn) * (t - mt) for n, t, w in pts) / sw
    if prior_slope is None:
        b = sxy / sxx if sxx > 1e-12 else 0.0
    else:
        kappa = (0.15 * mn) ** 2 / max(1.0, sw)
        b = (sxy + kappa * prior_slope) / (sxx + kappa)
    b = max(0.0, b)
    return mt - b * mn, b
