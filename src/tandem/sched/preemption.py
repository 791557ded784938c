"""Victim choice when KV blocks run out: the running request the ordering ranks last."""

from __future__ import annotations

from tandem.sched.ordering import Ordering
from tandem.types import Request


def choose_victim(candidates: list[Request], ordering: Ordering, now: float) -> Request:
    """The candidate with the largest ordering key (for FCFS: the latest arrival)."""
    return max(candidates, key=lambda r: ordering.key(r, now))
