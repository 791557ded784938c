"""Arrival processes: pure functions returning sorted arrival offsets in seconds from the start of a run.

- Poisson(rate): exponential gaps.
- Gamma(rate, cv or shape): gaps Gamma(shape k, scale 1/(rate k)), mean 1/rate, coefficient of
  variation 1/sqrt(k); cv > 1 is bursty, cv = 1 is Poisson, cv < 1 is smoother than Poisson.
- Diurnal: a non-homogeneous Poisson process whose rate follows a smooth day profile (raised cosine,
  the valley at phase 0) compressed into `period_s`, with peak/valley ratio up to the ~35x of the
  Azure LLM inference trace; sampled by thinning (Lewis & Shedler): candidates at the peak rate,
  each kept with probability rate(t) / peak.
- Trace files (CSV or JSONL) with a timestamp column (seconds, or ISO date-times as in the Azure
  trace), shifted to start at 0 and optionally sped up.

Every generator stops at `n` arrivals or at `duration_s`, whichever comes first (one is required).
Randomness comes from the `random.Random` passed in; no clock, no torch.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator

PROCESSES = ("poisson", "gamma", "diurnal")
TIMESTAMP_COLUMNS = ("timestamp", "arrival_time", "arrival_s", "time", "t")


def _collect(times: Iterator[float], n: int | None, duration_s: float | None) -> list[float]:
    if n is None and duration_s is None:
        raise ValueError("give the number of arrivals or a duration")
    out: list[float] = []
    for t in times:
        if (n is not None and len(out) >= n) or (duration_s is not None and t > duration_s):
            break
        out.append(t)
    return out


def _renewal(gap: Callable[[], float]) -> Iterator[float]:
    t = 0.0
    while True:
        t += gap()
        yield t


def poisson_arrivals(rate: float, rng: random.Random, n: int | None = None,
                     duration_s: float | None = None) -> list[float]:
    """Poisson arrivals at `rate` per second; an infinite rate sends all `n` at once."""
    if math.isinf(rate):
        if n is None:
            raise ValueError("an infinite rate needs a number of requests")
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    return _collect(_renewal(lambda: rng.expovariate(rate)), n, duration_s)


def gamma_arrivals(rate: float, rng: random.Random, cv: float | None = None, shape: float | None = None,
                   n: int | None = None, duration_s: float | None = None) -> list[float]:
    """Renewal arrivals with Gamma gaps of mean 1/rate and coefficient of variation `cv` (or `shape`)."""
    if rate <= 0 or math.isinf(rate):
        raise ValueError(f"gamma arrivals need a finite positive rate, got {rate}")
    if shape is None:
        if cv is None or cv <= 0:
            raise ValueError("gamma arrivals need cv > 0 or shape > 0")
        shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    return _collect(_renewal(lambda: rng.gammavariate(shape, scale)), n, duration_s)


@dataclass(frozen=True)
class DiurnalProfile:
    """A day's request-rate curve compressed into `period_s`: mean `mean_rate`, peak/valley `ratio`."""
    mean_rate: float
    peak_valley_ratio: float = 10.0
    period_s: float = 600.0
    phase: float = 0.0              # fraction of a period at t = 0 (0: valley, 0.5: peak)

    @property
    def peak_rate(self) -> float:
        return 2 * self.mean_rate * self.peak_valley_ratio / (1 + self.peak_valley_ratio)

    @property
    def valley_rate(self) -> float:
        return 2 * self.mean_rate / (1 + self.peak_valley_ratio)

    def rate(self, t: float) -> float:
        """Raised cosine between valley and peak: smooth, one peak a period, mean `mean_rate`."""
        x = (1 - math.cos(2 * math.pi * (t / self.period_s + self.phase))) / 2
        return self.valley_rate + (self.peak_rate - self.valley_rate) * x


def diurnal_arrivals(profile: DiurnalProfile, rng: random.Random, n: int | None = None,
                     duration_s: float | None = None) -> list[float]:
    """Non-homogeneous Poisson arrivals following `profile`, by thinning a peak-rate Poisson process."""
    if profile.mean_rate <= 0 or profile.peak_valley_ratio < 1:
        raise ValueError("a diurnal profile needs mean_rate > 0 and peak_valley_ratio >= 1")
    peak = profile.peak_rate

    def thinned() -> Iterator[float]:
        for t in _renewal(lambda: rng.expovariate(peak)):
            if rng.random() * peak < profile.rate(t):
                yield t

    return _collect(thinned(), n, duration_s)


def trace_arrivals(path: str | Path, column: str | None = None, speedup: float = 1.0,
                   n: int | None = None, duration_s: float | None = None) -> list[float]:
    """Arrival offsets from a CSV or JSONL trace's timestamp column (first one found if not named)."""
    path = Path(path)
    rows = _read_rows(path)
    if not rows:
        raise ValueError(f"{path}: no rows")
    col = column or _find_column(rows[0], path)
    stamps = sorted(_seconds(row[col], path) for row in rows if row.get(col) not in (None, ""))
    if not stamps:
        raise ValueError(f"{path}: column {col!r} is empty")
    offsets = [(t - stamps[0]) / speedup for t in stamps]
    return _collect(iter(offsets), n if n is not None else (len(offsets) if duration_s is None else None),
                    duration_s)


def _read_rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        if path.suffix in (".jsonl", ".ndjson", ".json"):
            return [json.loads(line) for line in f if line.strip()]
        return list(csv.DictReader(f))


def _find_column(row: dict, path: Path) -> str:
    lower = {k.lower().strip(): k for k in row}
    for name in TIMESTAMP_COLUMNS:
        if name in lower:
            return lower[name]
    raise ValueError(f"{path}: no timestamp column (looked for {', '.join(TIMESTAMP_COLUMNS)}); name it")


def _seconds(value: object, path: Path) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError as e:
        raise ValueError(f"{path}: timestamp {text!r} is neither seconds nor an ISO date-time") from e


def make_arrivals(process: str, rate: float, rng: random.Random, n: int | None = None,
                  duration_s: float | None = None, cv: float = 1.0, peak_valley_ratio: float = 10.0,
                  period_s: float | None = None) -> list[float]:
    """Arrivals by process name (poisson, gamma, diurnal) or trace-file path; a diurnal day spans the run."""
    if process == "poisson":
        return poisson_arrivals(rate, rng, n, duration_s)
    if process == "gamma":
        return gamma_arrivals(rate, rng, cv=cv, n=n, duration_s=duration_s)
    if process == "diurnal":
        period = period_s or duration_s or (n / rate if n else None)
        if period is None or math.isinf(period) or period <= 0:
            raise ValueError("a diurnal process needs a period, a duration or a finite rate with a count")
        return diurnal_arrivals(DiurnalProfile(rate, peak_valley_ratio, period), rng, n, duration_s)
    if Path(process).is_file():
        return trace_arrivals(process, n=n, duration_s=duration_s)
    raise ValueError(f"unknown arrival process {process!r}: one of {', '.join(PROCESSES)} or a trace file")
