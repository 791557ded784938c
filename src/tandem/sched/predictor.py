"""Cheap online predictors for AugServe's Stage I: output length and tool-call statistics.

`OutputLengthPredictor` is a ridge regression of log(output tokens) on request features (a bias,
log prompt length, a hashed bag of the prompt's first tokens, and the request's declared tool set
or workload type when it has one), refit from its sufficient statistics as requests finish; until
it has seen a few requests it predicts a prior. `ToolStats` keeps per-tool (or per-workload-type)
moving averages of calls per request, call duration and returned tokens.

Both start cold, or warm from a state trained offline on a held-out trace of the same workload
family (`state()` / `from_state()`, plain JSON-able dicts; `tandem predictor train` writes one),
and keep learning online. Pure Python + numpy; no torch, no clock, no files.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

from tandem.types import Request

_BUCKETS = 32
_KEYS = 16
_HEAD = 64


def features(request: Request) -> np.ndarray:
    x = np.zeros(2 + _BUCKETS + _KEYS)
    x[0] = 1.0
    x[1] = math.log1p(request.num_prompt_tokens)
    head = request.prompt_token_ids[:_HEAD]
    for t in head:
        x[2 + (t * 2654435761 % 2**32) % _BUCKETS] += 1.0 / max(1, len(head))
    key = request.tool.key
    if key is not None:
        x[2 + _BUCKETS + zlib.crc32(str(key).encode()) % _KEYS] = 1.0
    return x


class OutputLengthPredictor:
    def __init__(self, prior_tokens: float = 128.0, ridge: float = 1.0, min_samples: int = 8) -> None:
        d = 2 + _BUCKETS + _KEYS
        self.prior = math.log(prior_tokens)
        self.a = np.eye(d) * ridge
        self.b = np.zeros(d)
        self.b[0] = ridge * self.prior
        self.w: np.ndarray | None = None
        self.n = 0
        self.min_samples = min_samples

    def predict(self, request: Request) -> float:
        if request.rank.predicted_output_tokens is not None:
            return request.rank.predicted_output_tokens
        y = self.prior if self.w is None else float(features(request) @ self.w)
        pred = float(math.exp(min(y, 12.0)))
        request.rank.predicted_output_tokens = pred
        return pred

    def observe(self, request: Request, output_tokens: int, refit: bool = True) -> None:
        x = features(request)
        self.a += np.outer(x, x)
        self.b += x * math.log(max(1, output_tokens))
        self.n += 1
        if refit:
            self.refit()

    def refit(self) -> None:
        if self.n >= self.min_samples:
            self.w = np.linalg.solve(self.a, self.b)

    def state(self) -> dict:
        """The sufficient statistics (JSON-able): `from_state` rebuilds an identical predictor."""
        return {"prior_log_tokens": self.prior, "min_samples": self.min_samples, "n": self.n,
                "a": self.a.tolist(), "b": self.b.tolist()}

    @classmethod
    def from_state(cls, state: dict) -> OutputLengthPredictor:
        p = cls(min_samples=int(state["min_samples"]))
        a, b = np.asarray(state["a"], dtype=float), np.asarray(state["b"], dtype=float)
        if a.shape != p.a.shape or b.shape != p.b.shape:
            raise ValueError(f"length predictor state has {b.shape[0]} features, this version uses {p.b.shape[0]}")
        p.prior, p.a, p.b, p.n = float(state["prior_log_tokens"]), a, b, int(state["n"])
        p.refit()
        return p


class ToolStats:
    """Moving averages per key (tool name, or the request's workload type)."""

    def __init__(self, alpha: float = 0.1, prior_duration_s: float = 1.0, prior_return_tokens: float = 32.0,
                 prior_calls: float = 1.0) -> None:
        self.alpha = alpha
        self.prior = (prior_duration_s, prior_return_tokens, prior_calls)
        self._duration: dict[str, float] = {}
        self._returned: dict[str, float] = {}
        self._calls: dict[str, float] = {}

    def _ema(self, table: dict[str, float], key: str, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + self.alpha * (value - old)

    def duration(self, key: str, default: float | None = None) -> float:
        """Key's average duration; unseen: `default`, else the prior."""
        return self._duration.get(key, self.prior[0] if default is None else default)

    def return_tokens(self, key: str) -> float:
        return self._returned.get(key, self.prior[1])

    def calls(self, key: str) -> float:
        return self._calls.get(key, self.prior[2])

    def observe_call(self, key: str, duration_s: float, return_tokens: int) -> None:
        self._ema(self._duration, key, duration_s)
        self._ema(self._returned, key, float(return_tokens))

    def observe_finish(self, key: str, num_calls: int) -> None:
        self._ema(self._calls, key, float(num_calls))

    def forget(self, key: str) -> None:
        """Drop key's averages (a key that will not come back, such as an ended session's)."""
        for table in (self._duration, self._returned, self._calls):
            table.pop(key, None)

    def state(self) -> dict:
        return {"alpha": self.alpha, "prior": list(self.prior), "duration_s": dict(self._duration),
                "return_tokens": dict(self._returned), "calls": dict(self._calls)}

    @classmethod
    def from_state(cls, state: dict) -> ToolStats:
        d, r, c = state["prior"]
        t = cls(alpha=float(state["alpha"]), prior_duration_s=d, prior_return_tokens=r, prior_calls=c)
        t._duration = {str(k): float(v) for k, v in state["duration_s"].items()}
        t._returned = {str(k): float(v) for k, v in state["return_tokens"].items()}
        t._calls = {str(k): float(v) for k, v in state["calls"].items()}
        return t


def kendall_tau(x: list[float], y: list[float]) -> float | None:
    """Kendall's tau-b between two rankings (ties in either count as neither concordant nor
    discordant); None with fewer than two pairs or a constant side (the rank correlation is undefined)."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if a.size < 2:
        return None
    iu = np.triu_indices(a.size, 1)
    da = np.sign(a[:, None] - a[None, :])[iu]
    db = np.sign(b[:, None] - b[None, :])[iu]
    denom = math.sqrt(float(np.count_nonzero(da)) * float(np.count_nonzero(db)))
    return float((da * db).sum() / denom) if denom > 0 else None
