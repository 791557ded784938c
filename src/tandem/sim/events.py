"""The event loop: a heap of timestamped events whose handlers return more events.

An event is (time_s, order, seq, handler): at equal times, `order` decides (see the ORDER_*
constants: a finished step is settled before arrivals join, and a new step starts last, after
everything else due at that instant); `seq` keeps insertion order among equals, so runs are
deterministic. Owns virtual time; knows nothing of requests or scheduling.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable

Handler = Callable[[float], Iterable["Event"]]
Event = tuple[float, int, int, Handler]

ORDER_STEP_DONE, ORDER_ABORT, ORDER_ARRIVAL, ORDER_TOOL_RETURN, ORDER_STEP_START = range(5)
_seq = itertools.count()


def event(time_s: float, order: int, handler: Handler) -> Event:
    return (time_s, order, next(_seq), handler)


class EventLoop:
    def __init__(self) -> None:
        self._heap: list[Event] = []
        self.now = 0.0
        self.num_events = 0

    def push(self, events: Iterable[Event]) -> None:
        for ev in events:
            heapq.heappush(self._heap, ev)

    def run(self) -> float:
        """Process events in time order until none is left; returns the last event's time."""
        heap = self._heap
        while heap:
            time_s, _, _, handler = heapq.heappop(heap)
            self.now = time_s
            self.num_events += 1
            for ev in handler(time_s):
                heapq.heappush(heap, ev)
        return self.now
