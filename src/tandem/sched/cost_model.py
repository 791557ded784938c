"""Step-time models: how long one engine step takes as a function of the tokens it computes.

`StepCostModel` is learned online from (tokens, seconds) observations the caller measures: an
exponential moving average per token-count bucket (powers of two), interpolated linearly between
buckets and extrapolated with the last slope. Until a bucket has data, a prior line
(`base_s + per_token_s * tokens`) stands in. A calibrated profile (points measured offline) can
seed it. No clock here: durations come in from outside.
"""

from __future__ import annotations

import bisect


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


class StepCostModel:
    def __init__(self, base_s: float = 0.03, per_token_s: float = 0.0025, alpha: float = 0.1,
                 profile: list[tuple[int, float]] | None = None) -> None:
        self.base_s = base_s
        self.per_token_s = per_token_s
        self.alpha = alpha
        self._points: dict[int, float] = {}
        self._keys: list[int] = []
        for n, t in profile or []:
            self._set(_bucket(n), t)

    def _set(self, b: int, t: float) -> None:
        if b not in self._points:
            bisect.insort(self._keys, b)
        self._points[b] = t

    def observe(self, num_tokens: int, duration_s: float) -> None:
        if num_tokens <= 0 or duration_s <= 0:
            return
        b = _bucket(num_tokens)
        # Scale the observation to the bucket's token count along the prior slope before averaging.
        t = duration_s + (b - num_tokens) * self.slope_at(num_tokens)
        old = self._points.get(b)
        self._set(b, t if old is None else old + self.alpha * (t - old))

    def slope_at(self, n: int) -> float:
        keys = self._keys
        i = bisect.bisect_left(keys, n)
        if 0 < i < len(keys):
            lo, hi = keys[i - 1], keys[i]
            return max(0.0, (self._points[hi] - self._points[lo]) / (hi - lo))
        return self.per_token_s

    def time(self, num_tokens: int) -> float:
        """Predicted seconds for a step of `num_tokens` tokens (monotone non-decreasing)."""
        keys = self._keys
        if not keys:
            return self.base_s + self.per_token_s * num_tokens
        i = bisect.bisect_left(keys, num_tokens)
        if i < len(keys) and keys[i] == num_tokens:
            return self._points[num_tokens]
        if i == 0:
            k0 = keys[0]
            return max(1e-6, self._points[k0] - (k0 - num_tokens) * self.per_token_s)
        if i == len(keys):
            k1 = keys[-1]
            slope = self.slope_at(k1) if len(keys) > 1 else self.per_token_s
            return self._points[k1] + (num_tokens - k1) * max(slope, 0.0)
        lo, hi = keys[i - 1], keys[i]
        t_lo, t_hi = self._points[lo], max(self._points[hi], self._points[lo])
        return t_lo + (t_hi - t_lo) * (num_tokens - lo) / (hi - lo)

    def profile(self) -> list[tuple[int, float]]:
        return [(k, self._points[k]) for k in self._keys]
