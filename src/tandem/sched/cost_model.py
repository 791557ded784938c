"""Step-time model: how long one engine step takes as a function of the tokens it computes.

Learned online from (tokens, seconds) pairs the caller measures (the scheduler times its own steps;
the simulator passes virtual durations). Around a token count n the model is a local line
t(n + d) = a + b (n + d), fitted by least squares to the recent observations weighted by their
closeness to n in log scale, with the slope shrunk towards the global least-squares slope when
the neighbourhood holds too few distinct sizes to measure one. A local line, not bucket
interpolation, because the decision it serves (does one more draft token pay?) depends on the
*marginal* cost, which flat or noisy segments between buckets would get badly wrong. Calibrated
profile points are kept as permanent anchors; before any data the prior line stands in.

Draft depth: with a draft model (or layer-skip drafting) every draft *position* costs one more
proposer pass whatever the number of rows, so a step's time also grows with its deepest draft d.
`depth_s` is that cost per position, fitted globally (t = a + b n + c d by least squares over the
window, c >= 0); the local lines are fitted to t - c d. With n-gram drafting c comes out ~0.
No clock here: durations come in from outside.
"""

from __future__ import annotations

import math
from collections import deque

_SIGMA = 0.6           # neighbourhood width in log(tokens): ~x1.8 either side
_ANCHOR_WEIGHT = 5.0   # a profile point counts as this many observations


class StepCostModel:
    def __init__(self, base_s: float = 0.03, per_token_s: float = 0.0025, alpha: float = 0.2,
                 profile: list[tuple[int, float]] | None = None, window: int = 512) -> None:
        self.base_s = base_s
        self.per_token_s = per_token_s
        self.alpha = alpha                        # kept for callers that tune it; unused by the local fit
        self._anchors = [(float(n), float(t)) for n, t in (profile or []) if n > 0 and t > 0]
        self._obs: deque[tuple[float, float, float]] = deque(maxlen=window)   # (tokens, s, depth)
        self._version = 0
        self._cache: dict[tuple[int, int], tuple[float, float]] = {}
        self._global: tuple[int, tuple[float, float]] | None = None
        self._depth: tuple[int, float] | None = None

    def observe(self, num_tokens: int, duration_s: float, depth: int = 0) -> None:
        """One step: `num_tokens` computed (drafts included) in `duration_s`, deepest draft `depth`."""
        if num_tokens <= 0 or duration_s <= 0:
            return
        self._obs.append((float(num_tokens), float(duration_s), float(max(0, depth))))
        self._version += 1

    @property
    def depth_s(self) -> float:
        """Seconds one more draft position adds to a step (>= 0; 0 until depths vary)."""
        if self._depth is not None and self._depth[0] == self._version // 16:
            return self._depth[1]
        c = _depth_coefficient(list(self._obs))
        self._depth = (self._version // 16, c)
        return c

    def _points(self):
        for n, t in self._anchors:
            yield n, t, _ANCHOR_WEIGHT
        c = self.depth_s
        for n, t, d in self._obs:
            yield n, t - c * d, 1.0

    def _global_line(self) -> tuple[float, float]:
        if self._global is not None and self._global[0] == self._version // 16:
            return self._global[1]
        line = _fit([(n, t, w) for n, t, w in self._points()], None) or (self.base_s, self.per_token_s)
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
        pts = [(n, t, w * math.exp(-((math.log(n) - ln) ** 2) / (2 * _SIGMA ** 2))) for n, t, w in self._points()]
        line = _fit(pts, self._global_line()[1]) or self._global_line()
        self._cache[key] = line
        return line

    def time(self, num_tokens: int) -> float:
        """Predicted seconds for a step of `num_tokens` tokens."""
        a, b = self.line(num_tokens)
        return max(1e-6, a + b * num_tokens)

    def profile(self) -> list[tuple[int, float]]:
        """The model sampled at powers of two (for reports and calibration files)."""
        top = max([n for n, _, _ in self._points()] or [1])
        out, n = [], 1
        while n <= max(2, top):
            out.append((n, self.time(n)))
            n *= 2
        return out


def _depth_coefficient(obs: list[tuple[float, float, float]]) -> float:
    """c in t = a + b n + c d, least squares (centred normal equations); 0 when d does not vary."""
    if len(obs) < 8:
        return 0.0
    k = len(obs)
    mn = sum(o[0] for o in obs) / k
    mt = sum(o[1] for o in obs) / k
    md = sum(o[2] for o in obs) / k
    snn = sum((n - mn) ** 2 for n, _, _ in obs)
    sdd = sum((d - md) ** 2 for _, _, d in obs)
    snd = sum((n - mn) * (d - md) for n, _, d in obs)
    snt = sum((n - mn) * (t - mt) for n, t, _ in obs)
    sdt = sum((d - md) * (t - mt) for _, t, d in obs)
    det = snn * sdd - snd * snd
    if sdd < 1e-9 or det <= 1e-12 * max(1.0, snn * sdd):
        return 0.0
    return max(0.0, (snn * sdt - snd * snt) / det)


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
