"""Step-time models: how long one engine step takes as a function of the tokens it computes.

`StepCostModel` is learned online from (tokens, seconds) observations the caller measures: an
exponential moving average per token count (exact counts up to 64, then rounded to multiples of
1/8 of the count's power of two), interpolated linearly between observed counts and extrapolated
with the slope of the last two. Until there is data, a prior line (`base_s + per_token_s *
tokens`) stands in; a calibrated profile (points measured offline) can seed it. No clock here:
durations come in from outside.
"""

from __future__ import annotations

import bisect


def _key(n: int) -> int:
    if n <= 64:
        return n
    step = 1 << max(0, n.bit_length() - 4)        # 8 keys per power of two
    return (n + step // 2) // step * step


class StepCostModel:
    def __init__(self, base_s: float = 0.03, per_token_s: float = 0.0025, alpha: float = 0.2,
                 profile: list[tuple[int, float]] | None = None) -> None:
        self.base_s = base_s
        self.per_token_s = per_token_s
        self.alpha = alpha
        self._points: dict[int, float] = {}
        self._keys: list[int] = []
        for n, t in profile or []:
            self._set(_key(n), t)

    def _set(self, k: int, t: float) -> None:
        if k not in self._points:
            bisect.insort(self._keys, k)
        self._points[k] = t

    def observe(self, num_tokens: int, duration_s: float) -> None:
        if num_tokens <= 0 or duration_s <= 0:
            return
        k = _key(num_tokens)
        old = self._points.get(k)
        self._set(k, duration_s if old is None else old + self.alpha * (duration_s - old))

    def time(self, num_tokens: int) -> float:
        """Predicted seconds for a step of `num_tokens` tokens (non-decreasing in the tokens)."""
        keys = self._keys
        if not keys:
            return self.base_s + self.per_token_s * num_tokens
        # A running maximum keeps the curve monotone despite noisy neighbouring points.
        i = bisect.bisect_right(keys, num_tokens)
        if i == 0:
            return max(1e-6, self._points[keys[0]] - (keys[0] - num_tokens) * self.per_token_s)
        lo = keys[i - 1]
        t_lo = max(self._points[k] for k in keys[:i])
        if i == len(keys):
            slope = self.per_token_s
            if len(keys) >= 2:
                a, b = keys[-2], keys[-1]
                slope = max(0.0, (self._points[b] - self._points[a]) / (b - a))
            return t_lo + (num_tokens - lo) * slope
        hi = keys[i]
        t_hi = max(t_lo, self._points[hi])
        return t_lo + (t_hi - t_lo) * (num_tokens - lo) / (hi - lo)

    def profile(self) -> list[tuple[int, float]]:
        return [(k, self._points[k]) for k in self._keys]
