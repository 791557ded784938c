"""Session workloads for the cluster scenario: conversations whose every request resends the whole
context so far, so that the replica that served the previous request holds its prefix.

- "tools": the augmented tool trace (tandem.workload.augmented, InferCept's six types) with the
  tool loop on the client, as an OpenAI-style API runs it: each generation segment is one request;
  when it ends in a tool call the client waits the call's `api_time_s` and sends a follow-up whose
  prompt is the previous prompt + the generated tokens + the tool's `return_tokens`
  (`tool_followup=True`). A request with k calls is a session of k + 1 requests.
- "chat": multi-turn ShareGPT-like chat (a documented synthetic generator; the ShareGPT download is
  not assumed): turns per conversation 1 + Geometric(mean CHAT["turns_mean"] - 1), clipped to
  CHAT["max_turns"]; each user message and reply drawn from the simulator's ShareGPT-shaped "chat"
  kind (tandem.sim.workload.DEFAULT_KINDS: lognormal, median 180 / 200 tokens); the next turn comes
  a think time (lognormal, median CHAT["think_median_s"]) after the reply finished, and its prompt
  is the whole conversation + the new message. A conversation stops before its context would pass
  CHAT["max_context"] tokens.

Sessions start as a Poisson process (tandem.workload.arrivals); later requests of a session are
closed-loop (they follow the previous one's completion), so the offered load is set by the session
rate. Seeded by `random.Random`; no clock.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tandem.sim.workload import DEFAULT_ACCEPTANCE, DEFAULT_KINDS, lognormal
from tandem.workload.arrivals import make_arrivals
from tandem.workload.augmented import load_profiles, sample_augmented

WORKLOADS = ("tools", "chat")
CHAT = {"turns_mean": 4.0, "max_turns": 12, "think_median_s": 5.0, "think_sigma": 0.8, "max_context": 6000}


@dataclass(frozen=True)
class Turn:
    new_tokens: int          # tokens appended to the context before this request (prompt, message, tool result)
    output_tokens: int
    gap_s: float = 0.0       # after the previous request finished (tool time / think time); 0 for the first
    tool_followup: bool = False
    keep_tokens: int | None = None   # of the previous request's context it starts with (None: all)


@dataclass(frozen=True)
class Session:
    session_id: str
    index: int
    arrival_s: float
    kind: str
    turns: tuple[Turn, ...]
    acceptance: float = 0.0
    head: tuple[int, int] = (0, 0)   # (tokens, id): its first prompt starts with `tokens` tokens
                                     # shared by every session of the same id (a system prompt)

    @property
    def num_requests(self) -> int:
        return len(self.turns)


def tool_sessions(n: int, rng: random.Random) -> list[tuple[str, tuple[Turn, ...]]]:
    out = []
    for req in sample_augmented(n, rng, profiles=load_profiles()):
        segs = req.segments
        turns = [Turn(req.prompt_tokens, segs[0].completion_tokens)]
        for prev, seg in zip(segs, segs[1:]):
            turns.append(Turn(max(1, prev.return_tokens), seg.completion_tokens, prev.api_time_s, True))
        out.append((req.type, tuple(turns)))
    return out


def chat_sessions(n: int, rng: random.Random) -> list[tuple[str, tuple[Turn, ...]]]:
    kind = DEFAULT_KINDS["chat"]
    p = 1.0 / max(1.0, CHAT["turns_mean"])          # P(stop) after each turn: mean turns_mean
    out = []
    for _ in range(n):
        turns, context = [], 0
        while len(turns) < CHAT["max_turns"]:
            msg, reply = lognormal(kind["prompt"], rng), lognormal(kind["output"], rng)
            if turns and context + msg + reply > CHAT["max_context"]:
                break
            gap = rng.lognormvariate(math.log(CHAT["think_median_s"]), CHAT["think_sigma"]) if turns else 0.0
            turns.append(Turn(msg, reply, gap))
            context += msg + reply
            if rng.random() < p:
                break
        out.append(("chat", tuple(turns)))
    return out


def build_sessions(workload: str, num_sessions: int, rate: float, seed: int) -> list[Session]:
    """`num_sessions` sessions starting at `rate` sessions/s (Poisson), in arrival order."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown session workload {workload!r}: one of {WORKLOADS}")
    rng = random.Random(seed)
    shapes = tool_sessions(num_sessions, rng) if workload == "tools" else chat_sessions(num_sessions, rng)
    times = make_arrivals("poisson", rate, random.Random(seed + 1), n=num_sessions)
    acc = random.Random(seed + 2)
    out = []
    for i, ((kind, turns), t) in enumerate(zip(shapes, times)):
        a, b = DEFAULT_ACCEPTANCE.get(kind, DEFAULT_ACCEPTANCE["default"])
        out.append(Session(f"s{i}", i, t, kind, turns, acc.betavariate(a, b)))
    return out
