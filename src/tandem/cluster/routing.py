"""The Ray Serve request router of the Tandem replicas: `tandem.router.Router` picks the replica.

Ray Serve asks `choose_replicas` for ranked candidates; the ingress passes what the router needs in
the call's keyword argument `route` (a dict, see `route_info`): the session id, the prompt's
chained block hashes (as 64-bit ints, `tandem.router.hash_ints`), the prompt's length and whether
the request follows a tool call. The replicas' load, pauses and prefix caches come from their
`record_routing_stats` (each replica's `routing_stats` here, refreshed every
`request_routing_stats_period_s`). The first rank is Tandem's choice; the second is a
power-of-two-choices pair of the others (what Serve does by default), used when the first
replica's queue is full. A request without `route` (or when the policy fails) gets the
power-of-two pair only. `route={"replica": id}` pins a call to one replica (the ingress's
/health and /metrics fan-out).

This router is built inside every process holding a handle to the replicas (the ingress);
`routers()` finds the ones in this process, for the replica list the fan-out needs.
"""

from __future__ import annotations

import asyncio
import logging
import random
import weakref
from typing import Any

from ray.serve._private.replica_result import ReplicaResult
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

log = logging.getLogger("tandem.cluster")

_ROUTERS: "weakref.WeakSet[TandemRequestRouter]" = weakref.WeakSet()


def routers(deployment: str | None = None) -> list["TandemRequestRouter"]:
    """The Tandem routers built in this process (for `deployment`, if given)."""
    return [r for r in list(_ROUTERS) if deployment is None or r._deployment_id.name == deployment]


def _stats_of(replica: RunningReplica):
    from tandem.router import ReplicaStats

    uid = replica.replica_id.unique_id
    raw = dict(replica.routing_stats or {})
    raw.pop("_spec", None)
    if not raw:                            # no report yet (a new replica): idle, empty cache
        return ReplicaStats(replica_id=uid, waiting_tokens=0, running_requests=0, kv_usage=0.0,
                            paused_kv_tokens=0, avg_draft_len=0.0, prefix_digest=frozenset(),
                            max_num_seqs=replica.max_ongoing_requests)
    raw["replica_id"] = uid
    raw["prefix_digest"] = frozenset(raw.get("prefix_digest") or ())
    return ReplicaStats(**raw)


def _route_request(route: dict[str, Any]):
    from tandem.router import RouteRequest

    return RouteRequest(session_id=route.get("session_id"), block_hashes=tuple(route.get("block_hashes") or ()),
                        num_prompt_tokens=int(route.get("num_prompt_tokens") or 0),
                        tool_followup=bool(route.get("tool_followup", False)))


class TandemRequestRouter(RequestRouter):
    def initialize_state(self, policy: str = "tandem", seed: int = 0, **_: Any) -> None:
        from tandem.router import Router

        self.policy = policy
        self.router = Router(policy=policy, seed=seed)
        self.num_routed = 0
        self.num_fallbacks = 0
        # Registered through the imported module: Serve ships this class to the handle's process
        # pickled, and a class pickled by value would see a copy of this module's globals.
        import tandem.cluster.routing as this

        this._ROUTERS.add(self)

    @staticmethod
    def _route_of(pending_request: PendingRequest | None) -> dict[str, Any] | None:
        if pending_request is None:
            return None
        route = pending_request.kwargs.get("route")
        return route if isinstance(route, dict) else None

    def _pow2(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        return random.sample(candidates, min(2, len(candidates)))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        route = self._route_of(pending_request)
        if route is not None and route.get("replica"):            # pinned: that replica or none
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == route["replica"]]
            if not pinned:              # gone: Serve asks again at once, so wait (the caller times out)
                await asyncio.sleep(0.05)
            return [pinned]
        if route is None:
            return [self._pow2(candidate_replicas)]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        try:
            chosen = self.router.choose(_route_request(route), [_stats_of(r) for r in candidate_replicas])
        except Exception:                                           # noqa: BLE001 - route anyway
            log.exception("tandem router failed; power of two choices instead")
            chosen = None
        first = by_id.get(chosen)
        if first is None:
            self.num_fallbacks += 1
            return [self._pow2(candidate_replicas)]
        rest = [r for r in candidate_replicas if r is not first]
        return [[first], self._pow2(rest)] if rest else [[first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        route = self._route_of(pending_request)
        if route is None or route.get("replica"):
            return
        self.num_routed += 1
        try:
            self.router.observe(_route_request(route), replica_id.unique_id)
        except Exception:                                           # noqa: BLE001
            log.exception("tandem router observe failed")

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.router.forget_replica(replica_id.unique_id)    # its sessions start afresh elsewhere

    def replica_ids(self) -> list[str]:
        return sorted(r.unique_id for r in self.curr_replicas)
