"""Simulated requests from tandem.workload: arrivals (Poisson, gamma, diurnal, trace files), lengths
(the augmented tool-call mixture, synthetic length distributions per kind, trace files) and each
request's draft-acceptance base rate (a Beta distribution per kind).

A `SimRequest` is an `AugmentedRequest` (what a client would send plus what the model would do:
prompt length, the segments to generate, the last one ending the request and the others a tool
call of `api_time_s` returning `return_tokens`, and the kind) with an arrival time and the base
acceptance rate of its drafts. Assumed length
and acceptance distributions are stated in DEFAULT_KINDS and DEFAULT_ACCEPTANCE; override them in
a scenario file. Seeded by `random.Random`; no torch, no clock.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.workload.arrivals import make_arrivals, trace_arrivals
from tandem.workload.augmented import AugmentedRequest, Segment, is_trace, load_profiles, parse_trace, \
    sample_augmented

# Synthetic lengths (assumptions, shaped like the FASER paper's datasets): lognormal with a median
# and sigma, clipped to [lo, hi]. chat ~ ShareGPT, code ~ HumanEval, summarize ~ LongBench.
DEFAULT_KINDS: dict[str, dict[str, Any]] = {
    "chat": {"weight": 0.6, "prompt": [180, 0.9, 4, 1024], "output": [200, 0.8, 4, 1024]},
    "code": {"weight": 0.25, "prompt": [130, 0.4, 32, 512], "output": [180, 0.5, 16, 512]},
    "summarize": {"weight": 0.15, "prompt": [1500, 0.5, 256, 4000], "output": [120, 0.5, 16, 512]},
}
# Base per-position acceptance of a 0.6B draft for a 32B target of the same family, per kind:
# Beta(a, b), mean a / (a + b): chat 0.70, code 0.82, summarize 0.74, others 0.70 (assumptions in
# the range reported for same-family draft/target pairs; code drafts better).
DEFAULT_ACCEPTANCE: dict[str, tuple[float, float]] = {"chat": (7.0, 3.0), "code": (9.0, 2.0),
                                                     "summarize": (7.4, 2.6), "default": (7.0, 3.0)}
LENGTH_COLUMNS = (("ContextTokens", "GeneratedTokens"), ("prompt_tokens", "output_tokens"),
                  ("input_tokens", "output_tokens"), ("prompt_len", "output_len"))


@dataclass(frozen=True)
class DraftModel:
    """How a kind's drafts behave beyond the per-request base rate (measured by `tandem bench
    acceptance`): `position[m]` scales the base for draft m + 1 (conditional on drafts 1..m being
    accepted; empty: the executor's geometric `position_decay`); `offer` = (P(offer | the last
    round offered), P(offer | it did not)) and `offer_lengths` = P(1..k drafts | offering), for a
    proposer that has nothing to offer at times (an n-gram lookup); None: always k."""
    position: tuple[float, ...] = ()
    offer: tuple[float, float] | None = None
    offer_lengths: tuple[float, ...] = ()


def parse_acceptance(value: Any) -> tuple[tuple[float, float], DraftModel | None]:
    """A kind's acceptance entry: [a, b] (the Beta of the base rate; drafts always offered, the
    geometric position decay), or {"beta": [a, b], "position": [...], "offer": [p_on, p_off],
    "offer_lengths": [...], "source": "..."} as `tandem bench acceptance` fits it."""
    if isinstance(value, dict):
        unknown = set(value) - {"beta", "position", "offer", "offer_lengths", "source"}
        if unknown or "beta" not in value:
            raise ValueError(f"an acceptance entry needs 'beta' and takes position, offer, offer_lengths, "
                             f"source; got {sorted(value)}")
        a, b = value["beta"]
        offer = value.get("offer")
        if offer is not None and (len(offer) != 2 or not all(0 <= p <= 1 for p in offer)):
            raise ValueError(f"acceptance 'offer' is [P(offer | offered), P(offer | not)], got {offer}")
        lengths = tuple(float(x) for x in value.get("offer_lengths", ()))
        if offer is not None and not lengths:
            raise ValueError("acceptance 'offer' needs 'offer_lengths' (P(1..k drafts | offering))")
        draft = DraftModel(tuple(float(x) for x in value.get("position", ())),
                           None if offer is None else (float(offer[0]), float(offer[1])), lengths)
        return (float(a), float(b)), draft
    a, b = value
    return (float(a), float(b)), None


@dataclass(frozen=True)
class SimRequest:
    """An `AugmentedRequest` (what the client sends and what the model will generate) as one
    simulated arrival: its id and arrival time, its drafts' base acceptance, and when its client
    gives up."""

    request_id: str
    arrival_s: float
    request: AugmentedRequest
    acceptance: float = 0.0              # base per-position draft acceptance
    abort_after_s: float | None = None   # the client gives up this long after arrival
    draft: DraftModel | None = None      # the kind's position and offer model (None: geometric, always offered)

    @property
    def prompt_tokens(self) -> int:
        return self.request.prompt_tokens

    @property
    def segments(self) -> list[Segment]:
        return self.request.segments

    @property
    def kind(self) -> str:
        return self.request.type

    @property
    def output_tokens(self) -> int:
        return self.request.output_tokens

    @property
    def has_tools(self) -> bool:
        return len(self.segments) > 1


@dataclass
class WorkloadSpec:
    dataset: str = "augmented"          # augmented[:TYPE] | synthetic | a trace file (lengths or segments)
    num_requests: int = 1000
    arrival: str = "poisson"            # poisson | gamma | diurnal | trace (dataset timestamps) | a file
    rate: float = 1.0                   # mean requests/s
    cv: float = 2.0                     # gamma: coefficient of variation of the gaps
    peak_valley_ratio: float = 35.0     # diurnal
    period_s: float | None = None       # diurnal: one "day" (default: the whole run)
    kinds: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(DEFAULT_KINDS))
    # kind -> [a, b] or a fitted draft model (parse_acceptance)
    acceptance: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_ACCEPTANCE))
    profiles: str | None = None         # augmentations.json to use (default: the bundled one)
    abort_after_s: float | None = None


def lognormal(spec: list[float], rng: random.Random) -> int:
    median, sigma, lo, hi = spec
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))))


def synthetic_lengths(n: int, kinds: dict[str, dict[str, Any]], rng: random.Random) -> list[AugmentedRequest]:
    names = list(kinds)
    weights = [float(kinds[k].get("weight", 1.0)) for k in names]
    out = []
    for _ in range(n):
        k = rng.choices(names, weights)[0]
        out.append(AugmentedRequest(k, lognormal(kinds[k]["prompt"], rng),
                                    [Segment(lognormal(kinds[k]["output"], rng))]))
    return out


def _read_records(path: Path) -> list[dict[str, Any]]:
    with open(path, newline="", encoding="utf-8") as f:
        if path.suffix in (".jsonl", ".ndjson"):
            return [json.loads(line) for line in f if line.strip()]
        return list(csv.DictReader(f))


def trace_lengths(path: Path) -> list[AugmentedRequest]:
    """Requests from a segments trace (JSON, InferCept schema) or a CSV/JSONL of lengths per request
    (Azure LLM trace columns ContextTokens/GeneratedTokens, or prompt_tokens/output_tokens, ...)."""
    if path.suffix == ".json":
        doc = json.loads(path.read_text())
        if not is_trace(doc):
            raise ValueError(f"{path}: not a segments trace")
        return parse_trace(doc)
    rows = _read_records(path)
    if not rows:
        raise ValueError(f"{path}: no rows")
    for p_col, o_col in LENGTH_COLUMNS:
        if p_col in rows[0] and o_col in rows[0]:
            return [AugmentedRequest(str(r.get("kind", "default")), max(1, int(float(r[p_col]))),
                                     [Segment(max(1, int(float(r[o_col]))))]) for r in rows]
    raise ValueError(f"{path}: no length columns (one of {LENGTH_COLUMNS})")


def _lengths(spec: WorkloadSpec, rng: random.Random) -> list[AugmentedRequest]:
    name = spec.dataset
    if name == "augmented" or name.startswith("augmented:"):
        kind = name.partition(":")[2] or "mixture"
        return sample_augmented(spec.num_requests, rng, kind, load_profiles(spec.profiles))
    if name == "synthetic":
        return synthetic_lengths(spec.num_requests, spec.kinds, rng)
    path = Path(name).expanduser()
    if not path.is_file():
        raise ValueError(f"unknown dataset {name!r}: augmented[:TYPE], synthetic, or a trace file")
    reqs = trace_lengths(path)
    return [reqs[i % len(reqs)] for i in range(spec.num_requests)]


def _arrivals(spec: WorkloadSpec, n: int, rng: random.Random) -> list[float]:
    if spec.arrival == "trace":
        times = trace_arrivals(spec.dataset, n=n)
    else:
        times = make_arrivals(spec.arrival, spec.rate, rng, n=n, cv=spec.cv,
                              peak_valley_ratio=spec.peak_valley_ratio, period_s=spec.period_s)
    if len(times) < n:
        raise ValueError(f"the arrival process gave {len(times)} arrivals for {n} requests")
    return times[:n]


def build_workload(spec: WorkloadSpec, seed: int) -> list[SimRequest]:
    """The workload's requests in arrival order; the same seed gives the same requests."""
    rng = random.Random(seed)
    lengths = _lengths(spec, rng)
    times = _arrivals(spec, len(lengths), random.Random(seed + 1))
    acc_rng = random.Random(seed + 2)
    models = {k: parse_acceptance(v) for k, v in spec.acceptance.items()}
    fallback = models.get("default", ((7.0, 3.0), None))
    out = []
    for i, (t, req) in enumerate(zip(times, lengths)):
        (a, b), draft = models.get(req.type, fallback)
        out.append(SimRequest(f"req-{i}", t, req, acc_rng.betavariate(a, b), spec.abort_after_s, draft))
    return out
