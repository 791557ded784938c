"""Request routing across Tandem replicas: which replica serves a request, from what each replica
reports (queue, running batch, KV usage, KV held by tool-paused requests, a digest of its prefix
cache) and where each session went before. Pure: stdlib only, no torch, no ray, no clock; the same
seed and the same calls give the same choices. The simulator's cluster scenario and the Ray Serve
request router both call `Router.choose` / `Router.observe`.

Policies
--------
- "round_robin": replicas in turn (the order of the list passed in).
- "power_of_two": Ray Serve's default: two distinct replicas drawn at random, the one with the
  shorter queue (running + waiting requests; ties: fewer waiting tokens, then the first drawn).
- "prefix": prefix-only: the replica whose digest matches the most leading blocks of the prompt;
  ties, and no match anywhere, are broken at random.
- "tandem": a weighted sum of scorers, as llm-d's scheduler and SGLang's cache-aware router do:

      score_r = d_r * A_r - L_r                                     (the largest score wins)

  Affinity  A_r = w_session * [r served this session last]   (w_tool instead for a tool follow-up:
                                                               its whole context sits on r)
                + w_prefix  * p_r,   p_r = matched leading blocks / prompt blocks (from the digest)
  Load      L_r = w_queue   * waiting_tokens / token_scale
                + w_running * running_requests / max_num_seqs
                + w_kv      * kv_usage
                + w_paused  * paused_kv_tokens / token_scale
  Overload  o_r = max(kv_usage, running_requests / max_num_seqs, waiting_tokens / queue_limit_tokens)
  Discount  d_r = clamp((1 - o_r) / (1 - overload_soft), 0, 1)   (1 below overload_soft, 0 at 1):
            a session's replica keeps its requests while it has room; once saturated, its affinity
            fades and the request goes where the load is lower (it recomputes its prefix there).

  Without any affinity signal (no replica holds the session, no digest matches), the choice is
  power-of-two over L_r (two random replicas, the lower load), not argmin L_r: argmin over stale
  stats herds every new request onto the same replica. Ties in score are broken at random.

Weights (WEIGHTS; `Router(weights=...)` overrides any of them) were set by hand before any cluster
run, not tuned; the simulator's figures (docs/simulator.md) use seed 1. The digest is bounded (DIGEST_SIZE
hashes; its owner picks which, most recently used first): a prefix that fell out of it reads as
absent, so session affinity is the stronger, exact signal and prefix affinity the fallback for
sessions the router never saw (new router, shared system prompts, LRU overflow).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Mapping

POLICIES = ("tandem", "round_robin", "power_of_two", "prefix")
DIGEST_SIZE = 4096

WEIGHTS: dict[str, float] = {
    "session": 1.0,          # w_session: the replica this session's previous request went to
    "tool": 2.0,             # w_tool: the same, for a tool follow-up (its KV/prefix is there)
    "prefix": 1.0,           # w_prefix: fraction of the prompt's blocks in the replica's digest
    "queue": 0.5,            # w_queue: per token_scale waiting tokens
    "running": 0.5,          # w_running: running requests / max_num_seqs
    "kv": 0.5,               # w_kv: KV usage (0-1)
    "paused": 0.25,          # w_paused: per token_scale tokens of KV held by tool-paused requests
    "token_scale": 8192.0,   # tokens that count as one unit of queue
    "queue_limit_tokens": 32768.0,   # waiting tokens at which a replica counts as saturated
    "overload_soft": 0.8,    # overload level at which affinity starts to fade (gone at 1.0)
}


@dataclass(frozen=True)
class ReplicaStats:
    replica_id: str
    waiting_tokens: int              # prompt tokens queued, not yet computed
    running_requests: int
    kv_usage: float                  # fraction of KV blocks in use, 0-1
    paused_kv_tokens: int            # KV held by requests paused in tool calls
    avg_draft_len: float
    prefix_digest: frozenset[int]    # first 8 bytes (big-endian) of cached chained block hashes
    max_num_seqs: int = 64
    waiting_requests: int = 0        # queued requests (power_of_two's queue length = running + this)


@dataclass(frozen=True)
class RouteRequest:
    session_id: str | None
    block_hashes: tuple[int, ...]    # the prompt's chained block hashes (hash_ints), in order
    num_prompt_tokens: int
    tool_followup: bool = False      # resumes a conversation after a tool result


def hash_ints(block_hashes: list[bytes]) -> tuple[int, ...]:
    """Chained block hashes (tandem.kv.hashing) as 64-bit ints: their first 8 bytes, big-endian."""
    return tuple(int.from_bytes(h[:8], "big") for h in block_hashes)


def digest_of(hashes: Iterable[bytes], max_size: int = DIGEST_SIZE) -> frozenset[int]:
    """A prefix digest: the first `max_size` of `hashes` (pass them most recently used first) as ints."""
    out: set[int] = set()
    for h in hashes:
        if len(out) >= max_size:
            break
        out.add(int.from_bytes(h[:8], "big"))
    return frozenset(out)


def matched_blocks(block_hashes: tuple[int, ...], digest: frozenset[int]) -> int:
    """Leading blocks of the prompt present in the digest (a chained hash implies its whole prefix)."""
    n = 0
    for h in block_hashes:
        if h not in digest:
            break
        n += 1
    return n


class Router:
    def __init__(self, policy: str = "tandem", weights: Mapping[str, float] | None = None, seed: int = 0,
                 session_capacity: int = 100_000) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}: one of {POLICIES}")
        unknown = set(weights or {}) - set(WEIGHTS)
        if unknown:
            raise ValueError(f"unknown router weights {sorted(unknown)}: known {sorted(WEIGHTS)}")
        if session_capacity < 1:
            raise ValueError(f"session_capacity must be >= 1, got {session_capacity}")
        self.policy = policy
        self.weights = {**WEIGHTS, **(weights or {})}
        self.seed = seed
        self.session_capacity = session_capacity
        self._rng = random.Random(seed)
        self._sessions: OrderedDict[str, str] = OrderedDict()    # session -> replica, LRU order
        self._rr = 0
        self.num_affinity_choices = 0       # tandem: choices where an affinity signal existed

    # --- sessions ----------------------------------------------------------------------------
    def observe(self, req: RouteRequest, replica_id: str) -> None:
        """Record that `req` went to `replica_id` (the session's next request prefers it)."""
        if req.session_id is None:
            return
        sessions = self._sessions
        sessions[req.session_id] = replica_id
        sessions.move_to_end(req.session_id)
        while len(sessions) > self.session_capacity:
            sessions.popitem(last=False)

    def forget_replica(self, replica_id: str) -> None:
        """Drop every session pinned to a replica that went away."""
        for sid in [s for s, r in self._sessions.items() if r == replica_id]:
            del self._sessions[sid]

    def session_replica(self, session_id: str | None) -> str | None:
        return None if session_id is None else self._sessions.get(session_id)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    # --- choosing ----------------------------------------------------------------------------
    def choose(self, req: RouteRequest, replicas: list[ReplicaStats]) -> str:
        if not replicas:
            raise ValueError("no replicas to route to")
        if len(replicas) == 1:
            return replicas[0].replica_id
        if self.policy == "round_robin":
            r = replicas[self._rr % len(replicas)]
            self._rr += 1
            return r.replica_id
        if self.policy == "power_of_two":
            a, b = self._rng.sample(replicas, 2)
            return min((a, b), key=lambda s: (s.running_requests + s.waiting_requests, s.waiting_tokens)).replica_id
        if self.policy == "prefix":
            matches = [matched_blocks(req.block_hashes, s.prefix_digest) for s in replicas]
            best = max(matches)
            return self._rng.choice([s for s, m in zip(replicas, matches) if m == best]).replica_id
        return self._choose_tandem(req, replicas)

    def load(self, s: ReplicaStats) -> float:
        w = self.weights
        return (w["queue"] * s.waiting_tokens / w["token_scale"]
                + w["running"] * s.running_requests / max(1, s.max_num_seqs)
                + w["kv"] * s.kv_usage
                + w["paused"] * s.paused_kv_tokens / w["token_scale"])

    def discount(self, s: ReplicaStats) -> float:
        w = self.weights
        over = max(s.kv_usage, s.running_requests / max(1, s.max_num_seqs),
                   s.waiting_tokens / w["queue_limit_tokens"])
        soft = w["overload_soft"]
        return min(1.0, max(0.0, (1.0 - over) / max(1e-9, 1.0 - soft)))

    def scores(self, req: RouteRequest, replicas: list[ReplicaStats]) -> list[tuple[float, float, float]]:
        """Per replica (in order): (affinity A_r, load L_r, discount d_r)."""
        w = self.weights
        home = self.session_replica(req.session_id)
        w_home = w["tool"] if req.tool_followup else w["session"]
        num_blocks = len(req.block_hashes)
        out = []
        for s in replicas:
            a = w_home if s.replica_id == home else 0.0
            if num_blocks:
                a += w["prefix"] * matched_blocks(req.block_hashes, s.prefix_digest) / num_blocks
            out.append((a, self.load(s), self.discount(s)))
        return out

    def _choose_tandem(self, req: RouteRequest, replicas: list[ReplicaStats]) -> str:
        sc = self.scores(req, replicas)
        if not any(a > 0 for a, _, _ in sc):
            i, j = self._rng.sample(range(len(replicas)), 2)
            return replicas[i if sc[i][1] <= sc[j][1] else j].replica_id
        self.num_affinity_choices += 1
        values = [d * a - load for a, load, d in sc]
        best = max(values)
        top = [s for s, v in zip(replicas, values) if v >= best - 1e-12]
        return top[0].replica_id if len(top) == 1 else self._rng.choice(top).replica_id
