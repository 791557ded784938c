"""Tool-augmented request traces: InferCept's six augmentation types, their sampling, the segment schema.

A request is a prompt, then `calls` rounds of (generate `gen_tokens` -> tool call lasting `api_time_s`
-> append `return_tokens`), then a final generation. Profiles come from augmentations.json (bundled
copy of the project's shared/workloads/augmentations.json, or a user file of the same shape): integer
ranges `[lo, hi]` are drawn uniformly (inclusive), tool times from `{"lognormal_median", "sigma"}`, a
`[lo, hi]` float range, or a constant. The mixture draws each request's type by the file's weights.

Import/export uses InferCept's per-request segment schema, one segment per generation:
{prompt_tokens, completion_tokens, api_time, api_token_length}, where `prompt_tokens` is the context
length at the segment's start (what a stateless resubmission would send: prompt + earlier completions
+ earlier tool returns) and the last segment has `api_time = api_token_length = 0`.

Seeded through the `random.Random` passed in; no torch, no clock.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

MIXTURE = "mixture"
_WORDS = ("the", "a", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as", "was", "at",
          "by", "this", "from", "or", "an", "be", "are", "we", "can", "not", "all", "one", "time", "data",
          "tool")


@dataclass(frozen=True)
class Segment:
    """One generation and the tool call after it (none after the last: zeros)."""
    completion_tokens: int
    api_time_s: float = 0.0
    return_tokens: int = 0

    @property
    def has_call(self) -> bool:
        return self.api_time_s > 0 or self.return_tokens > 0


class ScriptCursor:
    """Where a scripted request is in its segments: segment i ends once it has generated
    `lengths[i]` tokens, counting whole steps (a step that crosses the mark ends it there); the
    last segment ends with the request. The one rule for scripted tool calls: the engine's
    scripted ToolRuntime (InferCept's method) and the simulator both follow it."""

    def __init__(self, lengths) -> None:
        self.lengths = list(lengths)
        self.segment = 0            # the segment being generated
        self.segment_tokens = 0     # tokens generated in it so far

    def on_tokens(self, num_new_tokens: int) -> int | None:
        """The index of the segment these tokens completed (its tool call starts now), or None."""
        if self.segment >= len(self.lengths) - 1:
            return None
        self.segment_tokens += num_new_tokens
        if self.segment_tokens < self.lengths[self.segment]:
            return None
        self.segment_tokens = 0
        self.segment += 1
        return self.segment - 1


@dataclass(frozen=True)
class AugmentedRequest:
    type: str
    prompt_tokens: int
    segments: list[Segment]

    @property
    def num_calls(self) -> int:
        return sum(1 for s in self.segments if s.has_call)

    @property
    def output_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.segments)

    @property
    def api_time_s(self) -> float:
        return sum(s.api_time_s for s in self.segments)


@dataclass(frozen=True)
class TypeProfile:
    calls: tuple[int, int]
    gen_tokens: tuple[int, int]
    api_time_s: Any                 # {"lognormal_median": m, "sigma": s} | [lo, hi] | number
    return_tokens: tuple[int, int]


@dataclass(frozen=True)
class AugmentationProfiles:
    types: dict[str, TypeProfile]
    mixture: dict[str, float]
    prompt_tokens: tuple[int, int]
    source: str


def load_profiles(path: str | Path | None = None) -> AugmentationProfiles:
    """Profiles from a user file, or the bundled augmentations.json."""
    if path is None:
        text = resources.files("tandem.workload").joinpath("data/augmentations.json").read_text()
    else:
        text = Path(path).read_text()
    d = json.loads(text)
    types = {name: TypeProfile(_range(p["calls"]), _range(p["gen_tokens"]), p["api_time_s"],
                               _range(p["return_tokens"])) for name, p in d["types"].items()}
    mixture = {k: float(v) for k, v in d.get("mixture", {k: 1 for k in types}).items()}
    unknown = set(mixture) - set(types)
    if unknown:
        raise ValueError(f"mixture names unknown types: {sorted(unknown)}")
    return AugmentationProfiles(types, mixture, _range(d.get("prompt_tokens", [50, 400])),
                                str(path) if path else "augmentations.json (bundled)")


def _range(v: Any) -> tuple[int, int]:
    lo, hi = (v, v) if isinstance(v, (int, float)) else v
    return int(lo), int(hi)


def sample_api_time(spec: Any, rng: random.Random) -> float:
    """One tool-call duration in seconds from a profile's `api_time_s` spec."""
    if isinstance(spec, dict):
        return rng.lognormvariate(math.log(spec["lognormal_median"]), spec["sigma"])
    if isinstance(spec, (list, tuple)):
        return rng.uniform(float(spec[0]), float(spec[1]))
    return float(spec)


def sample_request(type_name: str, profile: TypeProfile, prompt_range: tuple[int, int],
                   rng: random.Random) -> AugmentedRequest:
    calls = rng.randint(*profile.calls)
    segments = [Segment(rng.randint(*profile.gen_tokens), sample_api_time(profile.api_time_s, rng),
                        rng.randint(*profile.return_tokens)) for _ in range(calls)]
    segments.append(Segment(rng.randint(*profile.gen_tokens)))
    return AugmentedRequest(type_name, rng.randint(*prompt_range), segments)


def sample_augmented(n: int, rng: random.Random, kind: str = MIXTURE,
                     profiles: AugmentationProfiles | None = None) -> list[AugmentedRequest]:
    """`n` requests of one augmentation type, or of the mixture (types drawn by the mixture weights)."""
    profiles = profiles or load_profiles()
    if kind != MIXTURE and kind not in profiles.types:
        raise ValueError(f"unknown augmentation type {kind!r}: one of {sorted(profiles.types)}, {MIXTURE!r}")
    names = list(profiles.mixture)
    weights = [profiles.mixture[k] for k in names]
    out = []
    for _ in range(n):
        name = kind if kind != MIXTURE else rng.choices(names, weights)[0]
        out.append(sample_request(name, profiles.types[name], profiles.prompt_tokens, rng))
    return out


def synthetic_text(num_tokens: int, rng: random.Random) -> str:
    """Filler text of about `num_tokens` tokens (common one-token English words)."""
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, num_tokens)))


# ---- InferCept's segment schema ---------------------------------------------------------------

def to_infercept(req: AugmentedRequest) -> list[dict[str, Any]]:
    out, context = [], req.prompt_tokens
    for s in req.segments:
        out.append({"prompt_tokens": context, "completion_tokens": s.completion_tokens,
                    "api_time": s.api_time_s, "api_token_length": s.return_tokens})
        context += s.completion_tokens + s.return_tokens
    return out


def from_infercept(segments: list[dict[str, Any]], type_name: str = "unknown") -> AugmentedRequest:
    if not segments:
        raise ValueError("a request needs at least one segment")
    segs = [Segment(int(s["completion_tokens"]), float(s.get("api_time", 0.0)),
                    int(s.get("api_token_length", 0))) for s in segments]
    return AugmentedRequest(type_name, int(segments[0]["prompt_tokens"]), segs)


def save_trace(path: str | Path, requests: list[AugmentedRequest], profile_source: str = "") -> None:
    doc = {"format": "infercept-segments", "profile": profile_source,
           "requests": [{"type": r.type, "segments": to_infercept(r)} for r in requests]}
    Path(path).write_text(json.dumps(doc, indent=1))


def load_trace(path: str | Path) -> list[AugmentedRequest]:
    """Requests from a trace file: our export, or a bare list of segment lists or {type, segments}."""
    return parse_trace(json.loads(Path(path).read_text()))


def is_trace(doc_or_first: Any) -> bool:
    """Whether a parsed JSON document (or its first element) looks like a segment trace."""
    if isinstance(doc_or_first, dict):
        return "requests" in doc_or_first or "segments" in doc_or_first
    return isinstance(doc_or_first, list)


def parse_trace(doc: Any) -> list[AugmentedRequest]:
    entries = doc["requests"] if isinstance(doc, dict) else doc
    out = []
    for e in entries:
        if isinstance(e, dict):
            out.append(from_infercept(e["segments"], e.get("type", "unknown")))
        else:
            out.append(from_infercept(e))
    return out
