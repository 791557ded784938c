"""Step times from a profile measured on this engine (`tandem simulate calibrate`).

A profile file (JSON, format "tandem-sim-profile/1") holds the engine's configuration (block
size, KV blocks, host blocks, KV bytes per token), the measured samples (one per engine step:
its shape and its wall seconds, schedule + execute + update) and a fit over them:
    seconds = sum_f coef_f * feature_f(shape)
with non-negative coefficients, fitted by least squares on relative error. The features are
named in the file (see FEATURES), so that a profile says what it models. Swap time is the KV bytes
over the profile's measured copy bandwidth. Pure Python + numpy: fitting lives here too, and the
measuring (which needs torch) lives in tandem.bench.calibrate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tandem.sim.cost.base import Deployment, StepShape

FORMAT = "tandem-sim-profile/1"
DEFAULT_PROFILE = "cpu-smollm2-135m.json"
FEATURES: dict[str, Callable[[StepShape], float]] = {
    "const": lambda s: 1.0,
    "tokens": lambda s: float(s.num_tokens),
    "tokens_over_64": lambda s: float(max(0, s.num_tokens - 64)),
    # Steps of up to ~32 rows pay more per row (8-bit kernels at 1-16 rows, partly filled panels):
    # without this term the fit underestimates short prefills.
    "tokens_upto_32": lambda s: float(min(s.num_tokens, 32)),
    "seqs": lambda s: float(s.num_seqs),
    "logit_rows": lambda s: float(s.num_logit_rows),
    "context_ktokens": lambda s: s.context_tokens / 1e3,
    "attention_mpairs": lambda s: s.attention_pairs / 1e6,
}
SHAPE_FIELDS = ("num_seqs", "num_tokens", "num_logit_rows", "num_prefill_tokens", "context_tokens",
                "attention_pairs")


def shape_from_sample(sample: dict[str, Any]) -> StepShape:
    return StepShape(**{k: int(sample[k]) for k in SHAPE_FIELDS})


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (drop the most negative feature and refit)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def fit(samples: list[dict[str, Any]], features: tuple[str, ...] = tuple(FEATURES)) -> dict[str, Any]:
    """Coefficients minimising relative error over the samples, and the fit's errors. One trimming
    pass drops outliers (steps off by more than 3x the median error and 30%: a GC pause, a noisy
    neighbour) and refits; how many were dropped is recorded."""
    shapes = [shape_from_sample(s) for s in samples]
    y = np.array([s["seconds"] for s in samples])
    x = np.array([[FEATURES[f](sh) for f in features] for sh in shapes])
    w = 1.0 / y                                       # relative error: every step counts alike
    coef = nonnegative_lstsq(x * w[:, None], y * w)
    rel = np.abs(x @ coef - y) / y
    keep = rel <= max(0.3, 3 * float(np.median(rel)))
    coef = nonnegative_lstsq(x[keep] * w[keep, None], y[keep] * w[keep])
    rel = np.abs(x @ coef - y) / y
    return {"features": list(features), "coef": [float(c) for c in coef], "num_outliers": int((~keep).sum()),
            "rel_error_mean": float(rel[keep].mean()), "rel_error_median": float(np.median(rel[keep])),
            "rel_error_max": float(rel[keep].max())}


@dataclass
class CalibratedCost:
    profile: dict[str, Any]
    name: str = "calibrated"
    # The machine's speed now relative to the profile, for steps that prefill and for decode-only
    # steps (tandem.bench.calibrate.levels_of measures them on recorded steps); 1.0: the profile at face value.
    prefill_level: float = 1.0
    decode_level: float = 1.0
    _terms: list[tuple[Callable[[StepShape], float], float]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.profile.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} profile (format {self.profile.get('format')!r})")
        f = self.profile["fit"]
        self._terms = [(FEATURES[n], c) for n, c in zip(f["features"], f["coef"]) if c]
        self.name = f"calibrated:{self.profile.get('model', '?')}"
        eng = self.profile["engine"]
        self.block_size = int(eng["block_size"])
        self.kv_bytes_per_token = int(eng["kv_bytes_per_token"])
        self.copy_bytes_per_s = float(self.profile.get("copy_bytes_per_s", 5e9))

    def step_time_s(self, shape: StepShape) -> float:
        if shape.num_seqs == 0:
            return 0.0
        level = self.prefill_level if shape.num_prefill_tokens else self.decode_level
        return level * sum(c * feat(shape) for feat, c in self._terms)

    def verify_time_s(self, shape: StepShape, first: bool) -> float:
        """A further frontier pass costs a whole step of its shape: on this CPU the fitted per-step
        term is mostly the weights streamed through once per forward, which each pass repeats."""
        return self.step_time_s(shape)

    def draft_time_s(self, shape: StepShape) -> float:
        return 0.0          # profiles measure n-gram drafting, which costs no forward

    def concurrent_time_s(self, verify: StepShape, first: bool, draft: StepShape) -> float:
        return self.verify_time_s(verify, first)

    def swap_time_s(self, num_blocks: int) -> float:
        return num_blocks * self.block_size * self.swap_s_per_token

    @property
    def swap_s_per_token(self) -> float:
        return self.kv_bytes_per_token / self.copy_bytes_per_s

    def deployment(self) -> Deployment:
        eng = self.profile["engine"]
        cpu = self.profile.get("machine", {}).get("cpu", "?")
        desc = f"{self.profile.get('model', '?')} on {cpu} (calibrated)"
        host = int(eng.get("num_host_blocks", 0))
        return Deployment(int(eng["num_kv_blocks"]), host, self.swap_s_per_token, desc)


def load_profile(path: str | Path | None = None) -> dict[str, Any]:
    """A profile file, or the committed default (package data)."""
    if path is None:
        text = resources.files("tandem.sim").joinpath(f"profiles/{DEFAULT_PROFILE}").read_text()
    else:
        text = Path(path).read_text()
    return json.loads(text)
