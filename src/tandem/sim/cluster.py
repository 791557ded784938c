"""N simulated replicas behind a router, in one virtual clock.

Each replica is a full `SimEngine` (the real Scheduler and KVCacheManager, the cost model's
executor, built by `build_scheduler` as for one deployment); all share one `EventLoop`, so their
steps interleave in virtual time. A session's request arrives, the router (tandem.router, the same
pure module the Ray Serve router calls) sees every replica's `ReplicaStats` as of that instant,
and the request joins the chosen replica at once (no network delay modelled). When it finishes,
the session's next request (a tool follow-up or the next chat turn) is scheduled after its gap,
with the whole context as its prompt, so its leading blocks are cached on the replica that served
it, and only there.

ReplicaStats from a replica's scheduler, by the function the Ray replica reports with
(`tandem.cluster.stats.scheduler_routing_stats`): waiting_tokens = tokens still to prefill (queued
requests and unfinished prefills), running/waiting requests, KV usage, KV that paused requests
hold (x block size), the mean draft length since the last report, and the prefix digest: the
DIGEST_SIZE most recently published or reused cached block hashes (`DigestPool` keeps that set
incrementally, as the KV manager's `recent_block_hashes` orders them). Stats are exact at arrival time
(a real router sees them a little late; see docs/simulator.md). No torch, no clock.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tandem.cluster.stats import scheduler_routing_stats
from tandem.kv.block_pool import Block, BlockPool
from tandem.kv.hashing import BlockHash, hash_full_blocks
from tandem.router import DIGEST_SIZE, ReplicaStats, RouteRequest, Router, hash_ints
from tandem.sampling_params import SamplingParams
from tandem.sim.build import SimConfig, build_scheduler
from tandem.sim.cost.base import CostModel
from tandem.sim.engine import FIRST_PROMPT_TOKEN, SimEngine
from tandem.sim.events import ORDER_ARRIVAL, EventLoop, event
from tandem.sim.executor import FILL_TOKEN, SimExecutor
from tandem.sim.metrics import SLO, RequestRecord, summarize
from tandem.sim.sessions import Session
from tandem.sim.workload import SimRequest
from tandem.types import Request, SessionInfo
from tandem.workload.augmented import AugmentedRequest, Segment

HEAD_TOKEN = -1_000_000        # - head id: a session's shared head (system prompt), see Session.head
DIVERGE_TOKEN = -2_000_000     # + turn: the first token after a rewritten context (no false prefix hit)


class DigestPool(BlockPool):
    """A BlockPool that keeps the ints of its cached hashes in recency order (published or reused,
    as `recent_hashes` orders them), so that its digest, the `size` most recent, is the one the
    Ray replica builds from `recent_hashes` (`digest_of`), without a pass over hashes per report."""

    def __init__(self, num_blocks: int, size: int = DIGEST_SIZE) -> None:
        super().__init__(num_blocks)
        self.size = size
        self._recent: OrderedDict[int, None] = OrderedDict()
        self._version = 0
        self._digest: tuple[int, frozenset[int]] = (-1, frozenset())

    def _note(self, h: BlockHash) -> None:
        key = int.from_bytes(h[:8], "big")
        recent = self._recent
        if key in recent:
            recent.move_to_end(key)
        else:
            recent[key] = None                  # at most one per cached block: no cap needed
        self._version += 1

    def cache(self, block: Block, block_hash: BlockHash) -> None:
        super().cache(block, block_hash)
        if block.block_hash is block_hash:
            self._note(block_hash)

    def touch(self, blocks: list[Block]) -> None:
        super().touch(blocks)
        for b in blocks:
            if b.block_hash is not None:
                self._note(b.block_hash)

    def _uncache(self, block: Block) -> None:
        h = block.block_hash
        if h is not None and self._cached.get(h) is block:
            self._recent.pop(int.from_bytes(h[:8], "big"), None)
            self._version += 1
        super()._uncache(block)

    def digest(self) -> frozenset[int]:
        if self._digest[0] != self._version:
            self._digest = (self._version, frozenset(itertools.islice(reversed(self._recent), self.size)))
        return self._digest[1]


@dataclass
class Pending:
    """A routed request's session bookkeeping."""
    session: Session
    turn: int
    replica: str


class ReplicaEngine(SimEngine):
    """A SimEngine whose prompts are given token lists (real prefixes) and that reports finishes."""

    def __init__(self, replica_id: str, cluster: "Cluster", *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replica_id = replica_id
        self.cluster = cluster
        self._prompts: dict[str, tuple[list[int], list[BlockHash]]] = {}
        self.num_admitted = 0
        self._spec_last: tuple[int, int] | None = None    # speculation counters at the last report

    def submit(self, spec: SimRequest, token_ids: list[int], hashes: list[BlockHash], now: float,
               session: str | None = None) -> None:
        """`session`: the key its KV is held under after it finishes (None: nothing held)."""
        self._prompts[spec.request_id] = (token_ids, hashes, session)
        self.num_admitted += 1
        self.loop.push(self._admit(spec, self.num_admitted, now))
        if self.records[spec.request_id].finish_reason == "rejected":
            self._prompts.pop(spec.request_id, None)
            self.cluster.on_finished(self, spec.request_id, None, now)

    def _new_request(self, spec: SimRequest, index: int, now: float) -> Request:
        token_ids, hashes, session = self._prompts.pop(spec.request_id)
        params = SamplingParams(max_tokens=max(1, spec.output_tokens), temperature=0.0, ignore_eos=True)
        request = Request(spec.request_id, token_ids, params, arrival_time=now, session=SessionInfo(session))
        request.block_hashes = hashes                  # the KV manager's per-request hash memo
        return request

    def _close(self, request: Request, now: float, reason: str) -> None:
        super()._close(request, now, reason)
        self.cluster.on_finished(self, request.request_id, request, now)

    def stats(self) -> ReplicaStats:
        """What the Ray replica reports (tandem.cluster.stats), read from this replica's scheduler;
        the digest is the DigestPool's, the same set kept incrementally."""
        fields = scheduler_routing_stats(self.scheduler, self.replica_id, self._spec_last,
                                         digest=self.scheduler.kv.pool.digest())
        self._spec_last = fields.pop("_spec")
        return ReplicaStats(**fields)


@dataclass
class ClusterResult:
    records: list[RequestRecord]
    replicas: list[dict[str, Any]]
    routing: dict[str, Any]
    virtual_end_s: float
    num_events: int
    extra: dict[str, Any] = field(default_factory=dict)


class Cluster:
    def __init__(self, cost: CostModel, cfg: SimConfig, num_replicas: int, router: Router,
                 digest_size: int = DIGEST_SIZE, retain_sessions: bool = False) -> None:
        """`retain_sessions`: requests carry their session's key, so that a finished request's KV is
        held for the session's next one (tandem.sched.retention)."""
        self.cost, self.cfg, self.router = cost, cfg, router
        self.retain_sessions = retain_sessions
        self.loop = EventLoop()
        dep = cost.deployment()
        self.replicas: dict[str, ReplicaEngine] = {}
        for i in range(num_replicas):
            scheduler = build_scheduler(cfg, cost, dep, lambda n: DigestPool(n, digest_size))
            executor = SimExecutor(cost, cfg.seed * 1000 + i, cfg.position_decay)
            rid = f"r{i}"
            eng = ReplicaEngine(rid, self, scheduler, executor, cfg)
            eng.loop = self.loop
            self.replicas[rid] = eng
        self._pending: dict[str, Pending] = {}
        self._context: dict[str, tuple[list[int], list[BlockHash]]] = {}   # session -> its tokens, hashes
        self.placements: list[tuple[str, int, str]] = []     # (session, turn, replica) in routing order
        self.num_followups = self.num_followups_same = 0
        self.reusable_tokens = 0        # context tokens a later request resends (full blocks): the ideal hits
        self.placements_by_session: dict[str, str] = {}

    # --- routing ---------------------------------------------------------------------------
    def _arrive(self, session: Session, turn: int, now: float) -> None:
        t = session.turns[turn]
        bs = self.cfg.block_size
        if turn == 0:
            n_head, head_id = session.head if session.head[0] < t.new_tokens else (0, 0)
            head = [HEAD_TOKEN - head_id] + [FILL_TOKEN] * (n_head - 1) if n_head else []
            tokens = head + [FIRST_PROMPT_TOKEN + session.index] + [FILL_TOKEN] * (t.new_tokens - n_head - 1)
            hashes: list[BlockHash] = []
        else:
            tokens, hashes = self._context.pop(session.session_id)
            new = [FILL_TOKEN] * t.new_tokens
            if t.keep_tokens is not None:           # the context was rewritten after keep_tokens
                tokens, hashes = tokens[:t.keep_tokens], hashes[:t.keep_tokens // bs]
                new[0] = DIVERGE_TOKEN + turn
            self.reusable_tokens += (len(tokens) // bs) * bs
            tokens = tokens + new
        hash_full_blocks(tokens, bs, hashes)
        req = RouteRequest(session.session_id, hash_ints(hashes), len(tokens), t.tool_followup)
        stats = [r.stats() for r in self.replicas.values()]
        choice = self.router.choose(req, stats)
        self.router.observe(req, choice)
        rid = f"{session.session_id}-{turn}"
        prev = self.placements_by_session.get(session.session_id)
        if prev is not None:
            self.num_followups += 1
            self.num_followups_same += prev == choice
        self.placements_by_session[session.session_id] = choice
        self.placements.append((session.session_id, turn, choice))
        self._pending[rid] = Pending(session, turn, choice)
        spec = SimRequest(rid, now, AugmentedRequest(session.kind, len(tokens), [Segment(t.output_tokens)]),
                          session.acceptance)
        self.replicas[choice].submit(spec, tokens, hashes, now, session.session_id if self.retain_sessions else None)

    def on_finished(self, replica: ReplicaEngine, request_id: str, request: Request | None, now: float) -> None:
        p = self._pending.pop(request_id)
        nxt = p.turn + 1
        if request is None or str(request.finish_reason) == "abort" or nxt >= len(p.session.turns):
            return
        t = p.session.turns[nxt]
        if (request.num_tokens if t.keep_tokens is None else t.keep_tokens) + t.new_tokens >= replica.max_model_len:
            return                                    # the conversation would not fit: it ends here
        self._context[p.session.session_id] = (list(request.token_ids), request.block_hashes)
        s = p.session
        self.loop.push([event(now + s.turns[nxt].gap_s, ORDER_ARRIVAL, lambda t, s=s, n=nxt: self._go(s, n, t))])

    def _go(self, session: Session, turn: int, now: float) -> list:
        self._arrive(session, turn, now)
        return []

    def run(self, sessions: list[Session]) -> ClusterResult:
        for s in sessions:
            self.loop.push([event(s.arrival_s, ORDER_ARRIVAL, lambda t, s=s: self._go(s, 0, t))])
        self.loop.run()
        records: list[RequestRecord] = []
        per_replica = []
        for rid, eng in self.replicas.items():
            stuck = [r for r, q in eng._requests.items() if not q.is_finished]
            if stuck:
                raise RuntimeError(f"replica {rid} ended with {len(stuck)} unfinished requests")
            recs = list(eng.records.values())
            records.extend(recs)
            kv = eng.scheduler.kv
            per_replica.append({"replica": rid, "requests": len(recs), "busy_s": eng.executor.busy_s,
                                "steps": eng.num_steps, "preemptions": eng.scheduler.num_preemptions,
                                "query_tokens": kv.num_query_tokens, "hit_tokens": kv.num_hit_tokens,
                                "evictions": kv.pool.num_evictions})
        records.sort(key=lambda r: (r.arrival_s, r.request_id))
        routing = {"followups": self.num_followups, "followups_same_replica": self.num_followups_same,
                   "affinity_choices": self.router.num_affinity_choices}
        return ClusterResult(records, per_replica, routing, self.loop.now, self.loop.num_events)


def cluster_summary(res: ClusterResult, slo: SLO | None, reusable_tokens: int) -> dict[str, Any]:
    """The run's figures (tandem.sim.metrics.summarize) plus cache, balance and routing figures."""
    s = summarize(res.records, slo)
    query = sum(r["query_tokens"] for r in res.replicas)
    hits = sum(r["hit_tokens"] for r in res.replicas)
    prompt = sum(r.prompt_tokens for r in res.records)
    duration = s["duration_s"]
    busy = [r["busy_s"] / duration for r in res.replicas]
    reqs = [r["requests"] for r in res.replicas]
    s.update({
        "prompt_tokens": prompt,
        "prefix_hit_rate": hits / max(1, query),          # KV manager: tokens served from cache / asked
        "cached_prompt_tokens": hits,                      # KV recompute saved (prompt tokens)
        "reusable_tokens": reusable_tokens,                # what a perfect router could have saved
        "reuse_captured": hits / max(1, reusable_tokens),
        "prefill_tokens_computed": query - hits,
        "busy_mean": sum(busy) / len(busy), "busy_max": max(busy),
        "requests_per_replica_max_over_mean": max(reqs) / max(1e-9, sum(reqs) / len(reqs)),
        "preemptions": sum(r["preemptions"] for r in res.replicas),
        "followup_same_replica": res.routing["followups_same_replica"] / max(1, res.routing["followups"]),
    })
    return s


def simulate_cluster(cost: CostModel, cfg: SimConfig, sessions: list[Session], num_replicas: int, router: Router,
                     slo: SLO | None = None, digest_size: int = DIGEST_SIZE) -> dict[str, Any]:
    cluster = Cluster(cost, dataclasses.replace(cfg), num_replicas, router, digest_size)
    res = cluster.run(sessions)
    return {"summary": cluster_summary(res, slo, cluster.reusable_tokens), "routing": res.routing,
            "replicas": res.replicas, "virtual_end_s": res.virtual_end_s, "events": res.num_events,
            "records": res.records}
