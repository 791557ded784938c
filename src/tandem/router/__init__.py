"""Routing across replicas (pure policy: stdlib only, no torch, no ray, no clock)."""

from tandem.router.policy import (DIGEST_SIZE, POLICIES, WEIGHTS, ReplicaStats, RouteRequest, Router, digest_of,
                                  hash_ints, matched_blocks)

__all__ = ["DIGEST_SIZE", "POLICIES", "WEIGHTS", "ReplicaStats", "RouteRequest", "Router", "digest_of",
           "hash_ints", "matched_blocks"]
