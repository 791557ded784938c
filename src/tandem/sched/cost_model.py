"""Step-time model: how long one engine step takes as a function of the tokens it computes.

Learned online from (tokens, seconds) pairs the caller measures (the scheduler times its own steps;
the simulator passes virtual durations). Around a token count n the model is a local line
t(n + d) = a + b (n + d), fitted by least squares to the recent observations weighted by their
closeness to n in log scale, with the slope shrunk towards the global least-squares slope when
the neighbourhood holds too few distinct sizes to measure one. A local line, not bucket
interpolation, because the decision it serves (does one more draft token pay?) depends on the
*marginal* cost, which flat or noisy segments between buckets would get badly wrong. Calibrated
profile points are kept as permanent anchors; before any data the prior line stands in.
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
        self._obs: deque[tuple[float, float]] = deque(maxlen=window)
        self._version = 0
        self._cache: dict[tuple[int, int], tuple[float, float]] = {}
        self._global: tuple[int, tuple[float, float]] | None = None

    def observe(self, num_tokens: int, duration_s: float) -> None:
        if num_tokens <= 0 or duration_s <= 0:
            return
        self._obs.append((float(num_tokens), float(duration_s)))
        self._version += 1

    def _points(self):
        for n, t in self._anchors:
            yield n, t, _ANCHOR_WEIGHT
        for n, t in self._obs:
            yield n, t, 1.0

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
