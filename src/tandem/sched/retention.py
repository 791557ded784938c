"""KV held for a session between its calls: tool loops that run on the client.

An agent that runs its own tools sends each turn as a new request carrying the whole context so far.
A request with a session key (`Request.session.key`) that finishes leaves its KV held for the
session, through the same pause path as a server-side tool call (`PauseBook.pause`): the policy's
KV rule (InferCept's min-waste) keeps it on the device, moves it to host memory or frees it, for a
wait predicted from the gaps this session has shown so far, with the gaps of all sessions as the
prior. While held, it is a paused request like any other: the scheduler frees it before it would
preempt a running request, and for a queued request that needs the blocks (`evict_one`). When the
session's next request arrives and starts with the held context, it adopts the held KV
(`KVCacheManager.transfer`) and waits like a request back from a tool with its KV kept, in the
ordering's place for it. Freed (or never held) context falls back to
the prefix cache, as in vLLM.

Bounds, so that no client pins memory: a ceiling on how long a session holds (`max_hold_s`), a
share of the device cache that held sessions may keep (`max_share`; past it they swap or free),
and blocks per owner (`max_blocks_per_owner`, device and host; past it the context is freed).
Sessions are keyed by (owner, key): one owner cannot resume another's session. No clock: `now`
arrives from the scheduler.

With a TTL rule (`ttl`, Continuum's: sched/continuum.py) instead of min-waste, a context is kept on
the device for the TTL the rule picks (none: freed at once) and freed when it runs out. Either way
the book remembers, for a bounded number of sessions, when each session's first call arrived
(`times.program_start` of its later calls: program-level ordering) and when its last call finished
(the gaps the TTL rule learns from, also for sessions whose context was not held).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from tandem.config import RetentionConfig
from tandem.kv import KVCacheManager
from tandem.sched.continuum import ContinuumTTL
from tandem.sched.pauses import PauseBook
from tandem.types import KVAction, Request

CLIENT_TOOL = "client-tool"     # the ToolStats key of every session's gaps: each session's prior
MAX_REMEMBERED = 65536          # sessions whose first arrival and last finish are remembered


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, up to `limit` (slice compares: contexts run to
    100k+ tokens and usually match whole)."""
    if limit <= 0 or a[:limit] == b[:limit]:
        return max(0, limit)
    lo, hi = 0, limit               # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def remember(table: OrderedDict, key, value: float) -> None:
    """Set `table[key]`, keeping the `MAX_REMEMBERED` most recently set keys."""
    table[key] = value
    table.move_to_end(key)
    if len(table) > MAX_REMEMBERED:
        table.popitem(last=False)


def pop_due(deadlines: list, held: dict, now: float) -> list:
    """The entries of `held` whose deadline has come, removed from it. `deadlines` is a heap of
    (until, request id, key); an entry whose key now holds another request's context (taken over or
    replaced since) is skipped."""
    due = []
    while deadlines and deadlines[0][0] <= now:
        _, rid, key = heapq.heappop(deadlines)
        item = held.get(key)
        if item is not None and item.request_id == rid:
            del held[key]
            due.append(item)
    return due


class SessionBook:
    def __init__(self, kv: KVCacheManager, pauses: PauseBook, limits: RetentionConfig | None = None,
                 ttl: ContinuumTTL | None = None) -> None:
        self.kv = kv
        self.pauses = pauses
        self.limits = limits or RetentionConfig()
        self.ttl = ttl
        self.held: dict[tuple[str, str], Request] = {}     # (owner, key) -> the finished call holding it
        self._deadlines: list[tuple[float, str, tuple[str, str]]] = []   # TTLs: (until, request id, session)
        self._first_arrival: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._last_finish: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.num_adopted_tokens = 0       # context tokens a session's next call took over
        self.num_expired = 0              # held contexts freed at the ceiling
        self.num_capped = 0               # contexts not held: their owner was at its cap

    @staticmethod
    def _tool(sid: tuple[str, str]) -> str:
        return f"session:{sid[0]}:{sid[1]}"

    def _blocks(self, r: Request) -> int:
        return self.kv.num_blocks_of(r.request_id) + self.kv.num_swapped_blocks(r.request_id)

    def hold(self, r: Request, now: float, other_tokens: int) -> KVAction | None:
        """`r` finished with a session key: hold its KV for the session's next call (the action
        taken), or None if nothing is held (the caller frees its KV)."""
        sid = (r.session.owner, r.session.key)
        remember(self._last_finish, sid, now)
        old = self.held.pop(sid, None)
        if old is not None:                       # a session holds one context: its latest
            self._release(old, forget=False)
        nblocks = self.kv.num_blocks_of(r.request_id)
        cap = self.limits.max_blocks_per_owner
        if cap is not None and nblocks + sum(self._blocks(h) for s, h in self.held.items() if s[0] == sid[0]) > cap:
            self.num_capped += 1
            self.pauses.tools.forget(self._tool(sid))
            return None
        on_device = sum(self.kv.num_blocks_of(h.request_id) for h in self.held.values())
        can_preserve = on_device + nblocks <= self.limits.max_share * self.kv.num_blocks
        if self.ttl is not None:
            return self._pin(r, sid, now, nblocks, can_preserve, other_tokens)
        tool = self._tool(sid)
        expected = self.pauses.tools.duration(tool, default=self.pauses.tools.duration(CLIENT_TOOL))
        action = self.pauses.pause(r, now, expected, other_tokens, tool, can_preserve, tool_call=False)
        self.held[sid] = r
        return action

    def _pin(self, r: Request, sid: tuple[str, str], now: float, nblocks: int, can_preserve: bool,
             other_tokens: int) -> KVAction | None:
        """Continuum's hold: on the device for the TTL rule's time-to-live, or not at all."""
        ttl = self.ttl.ttl_s(r.num_computed_tokens, nblocks / self.kv.num_blocks, self.kv.usage,
                             self.limits.max_hold_s) if can_preserve else 0.0
        if ttl <= 0:
            return None
        action = self.pauses.pause(r, now, ttl, other_tokens, self._tool(sid), can_preserve=True, tool_call=False)
        self.held[sid] = r
        heapq.heappush(self._deadlines, (now + ttl, r.request_id, sid))
        return action

    def adopt(self, new: Request, now: float) -> int:
        """`new` arrived with a session key: take over the KV its session holds for the part of the
        held context `new` starts with (whole blocks; at least one token is left to compute).
        Returns the tokens taken over (0: nothing held, or nothing in common)."""
        sid = (new.session.owner, new.session.key)
        new.times.program_start = self._first_arrival.get(sid, new.arrival_time)
        remember(self._first_arrival, sid, new.times.program_start)
        last = self._last_finish.pop(sid, None)
        if last is not None and self.ttl is not None:
            self.ttl.observe(now - last)
        held = self.held.pop(sid, None)
        if held is None:
            return 0
        self.pauses.drop(held)
        gap = now - held.pause.since
        for key in (self._tool(sid), CLIENT_TOOL):
            self.pauses.tools.observe_call(key, gap, 0)
        n = 0
        if held.session.cache_salt == new.session.cache_salt:
            n = common_prefix(held.token_ids, new.token_ids, min(held.num_computed_tokens, new.num_tokens - 1))
        tokens = self.kv.transfer(held, new, n) if n else 0
        self._release(held, forget=False)
        new.num_computed_tokens = new.num_cached_tokens = tokens
        self.num_adopted_tokens += tokens
        return tokens

    def expire(self, now: float) -> None:
        """Free the contexts whose TTL ran out (a heap of deadlines; an entry whose context was
        taken over or replaced is skipped) and those held longer than the ceiling. Every step calls
        this: `held` is in hold order (a context is inserted when held), so the ceiling's scan
        stops at the first one still young."""
        for r in pop_due(self._deadlines, self.held, now):            # TTLs run out (Continuum)
            self._release(r)
            self.num_expired += 1
        ceiling = self.limits.max_hold_s
        while self.held:
            sid, r = next(iter(self.held.items()))
            if now - r.pause.since <= ceiling:
                return
            del self.held[sid]
            self._release(r)
            self.num_expired += 1

    def evict_one(self) -> bool:
        """Free the device KV of the held context expected to wait longest (queued work needs the
        blocks; the session's next call recomputes, or finds it in the prefix cache). False if
        no held context is on the device."""
        return self.pauses.discard_preserved(self.held.values())

    def release_all(self) -> None:
        for r in self.held.values():
            self._release(r)
        self.held.clear()
        self._deadlines.clear()

    def _release(self, r: Request, forget: bool = True) -> None:
        if r.request_id in self.pauses.paused:
            self.pauses.drop(r)
        if self._blocks(r):
            self.kv.free(r)
            self.pauses.mark_released(r)
        if forget:
            self.pauses.tools.forget(self._tool((r.session.owner, r.session.key)))

    @property
    def num_held(self) -> int:
        return len(self.held)

    def num_held_blocks(self) -> tuple[int, int]:
        """(device, host) blocks held for waiting sessions."""
        return (sum(self.kv.num_blocks_of(h.request_id) for h in self.held.values()),
                sum(self.kv.num_swapped_blocks(h.request_id) for h in self.held.values()))
