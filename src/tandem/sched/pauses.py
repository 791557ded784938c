"""Requests paused on tool calls: their KV action, swap bookkeeping, and the resume path.

The scheduler delegates here. On `pause`, the KV policy chooses preserve / swap / discard for the
request (swap within a per-step block budget and free host space); a swap-out's copies wait until
its device blocks are reused (tandem.kv: the plan of the step that reuses them carries them). On
`resume`, the tool result's tokens join the request's context as tokens to compute (not output)
and the request rejoins the waiting queue; a swapped request is swapped back in when admitted.
When the scheduler needs blocks that a paused or waiting request kept, `evict` frees them
(recomputed when the request runs).
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem.kv import KVCacheManager
from tandem.sched.ordering import tool_key
from tandem.sched.predictor import ToolStats
from tandem.sched.pause_kv import KVPausePolicy, PauseContext
from tandem.types import KVAction, PauseState, Request, RequestStatus


class PauseBook:
    def __init__(self, kv: KVCacheManager, policy: KVPausePolicy, tools: ToolStats,
                 swap_budget_blocks: int = 64) -> None:
        self.kv = kv
        self.policy = policy
        self.tools = tools
        self.swap_budget_blocks = swap_budget_blocks
        self.paused: dict[str, Request] = {}
        self._holding: set[str] = set()     # paused requests that kept device blocks (read every step)
        self.released: list[str] = []       # requests whose device KV was freed or moved (for the plan)
        self._swapped_this_step = 0
        self.num_actions = {a: 0 for a in KVAction}
        self.num_discarded_kept = 0         # kept KV taken back (waiting or paused requests)
        self.num_recompute_tokens = 0       # computed tokens whose KV was freed here (recomputed later)

    @property
    def num_held_blocks(self) -> int:
        """Device blocks held by paused (preserved) requests. Only `pause` sets a held count, and it
        records the request in `_holding`; entries of requests gone since are skipped."""
        paused = self.paused
        return sum(paused[rid].pause.num_held_blocks for rid in self._holding if rid in paused)

    def pause(self, r: Request, now: float, expected_s: float | None, other_tokens: int, tool: str,
              can_preserve: bool = True, tool_call: bool = True) -> KVAction:
        """`tool_call`: False for a finished request held for its session (sched/retention.py): its
        swap is not bounded per step (it happens once per wait of seconds or more, and the KV rule
        prices the stall it causes)."""
        key = tool or tool_key(r)
        expected = self.tools.duration(key) if expected_s is None else expected_s
        nblocks = self.kv.num_blocks_of(r.request_id)
        can_swap = self.kv.can_swap_out(r) and \
            (not tool_call or self._swapped_this_step + nblocks <= self.swap_budget_blocks)
        action = self.policy.decide(PauseContext(r.num_computed_tokens, other_tokens, expected, nblocks, can_swap,
                                                 can_preserve))
        held = 0
        if action is KVAction.SWAP:
            self.kv.swap_out(r)
            self._swapped_this_step += nblocks
            self.mark_released(r)
        elif action is KVAction.DISCARD:
            self.kv.free(r)
            self.num_recompute_tokens += r.num_computed_tokens
            r.num_computed_tokens = 0
            self.mark_released(r)
        else:
            held = nblocks
            self._holding.add(r.request_id)
        r.status = RequestStatus.PAUSED_TOOL
        r.pause = PauseState(action, now, expected, key, held)
        r.tool.num_calls += tool_call
        self.paused[r.request_id] = r
        self.num_actions[action] += 1
        return action

    @property
    def num_paused(self) -> int:
        return len(self.paused)

    def drop(self, r: Request) -> None:
        """A paused request ended (aborted, or finished by its caller): forget it; its KV is the
        scheduler's to free."""
        del self.paused[r.request_id]
        self._holding.discard(r.request_id)

    def resume(self, r: Request, token_ids: list[int], now: float) -> None:
        del self.paused[r.request_id]
        self._holding.discard(r.request_id)
        r.tool.injected_spans.append((len(r.token_ids), len(token_ids)))
        r.token_ids.extend(token_ids)
        self.tools.observe_call(r.pause.tool, now - r.pause.since, len(token_ids))
        r.tool.last_resumed = now
        r.status = RequestStatus.WAITING

    def discard_preserved(self, among: Iterable[Request] | None = None) -> bool:
        """Free the KV of one preserved paused request (the longest expected pause left), of
        `among` if given (else of all): cheaper than preempting a running request. Returns False
        if none holds KV."""
        held = [r for r in (self.paused.values() if among is None else among) if r.pause.num_held_blocks]
        if not held:
            return False
        victim = max(held, key=lambda r: r.pause.expected_s)
        self.evict(victim)
        victim.pause.action, victim.pause.num_held_blocks = KVAction.DISCARD, 0
        return True

    def evict_waiting(self, waiting: list[Request], exclude: Request | None = None) -> bool:
        """Free the device KV of the lowest-ranked waiting request that holds some (one that
        came back from a tool call with its KV kept); False if none does."""
        for r in reversed(waiting):
            if r is not exclude and self.kv.num_blocks_of(r.request_id):
                self.evict(r)
                return True
        return False

    def evict(self, r: Request) -> None:
        """Free r's device KV, which it kept through a tool call: it is recomputed when r runs.
        (Swapping it out instead was measured and lost in the simulator: docs/simulator.md.)"""
        self.kv.free(r)
        self.num_recompute_tokens += r.num_computed_tokens
        r.num_computed_tokens = 0
        self.num_discarded_kept += 1
        self.mark_released(r)

    def mark_released(self, r: Request) -> None:
        """r's device KV is gone or will move blocks (here or in the scheduler): so is whatever a
        draft model read of it; the next plan says so."""
        r.draft.num_seen = 0
        r.draft.ready = 0
        self.released.append(r.request_id)

    def take_released(self) -> list[str]:
        out, self.released = self.released, []
        return out

    def end_step(self) -> None:
        self._swapped_this_step = 0
