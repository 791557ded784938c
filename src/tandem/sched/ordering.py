"""Orderings of requests: who is admitted first from the waiting queue, who is preempted first.

An ordering maps a request to a sort key (smaller runs first). FCFS is the baseline: arrival time,
ties broken by submission order. Preempted requests keep their key, so they return first.
"""

from __future__ import annotations

from typing import Protocol

from tandem.types import Request


class Ordering(Protocol):
    dynamic: bool   # True if keys change over time (the queue is re-keyed every step)

    def key(self, request: Request, now: float) -> tuple:
        ...


class FCFS:
    dynamic = False

    def key(self, request: Request, now: float) -> tuple:
        return (request.arrival_time, request.extra.get("_seq", 0))


def make_ordering(name: str) -> Ordering:
    if name == "fcfs":
        return FCFS()
    raise ValueError(f"unknown scheduling policy {name!r}")
