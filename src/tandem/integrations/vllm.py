"""Tandem's scheduling policies inside vLLM: `vllm serve MODEL --scheduler-cls
tandem.integrations.vllm.TandemScheduler` (docs/vllm-plugin.md).

`TandemScheduler` subclasses vLLM's own scheduler and changes four decisions, each taken by a policy
of `tandem.sched` through `policy_bridge.PolicyBridge`; everything else (KV allocation, chunked
prefill, preemption, structured outputs, the outputs it builds) stays vLLM's:

- the waiting queue's order: AugServe's Stage I / Stage II ranking with anti-starvation, re-ranked
  before every step, in place of vLLM's FCFS queue;
- the step's token limit (`max_num_scheduled_tokens`), from the dynamic budget: running requests
  always get the full limit, admissions what the budget allows;
- each request's verified drafts: the drafts vLLM's proposer made, cut to FASER's per-request
  length (acceptance history and a step-cost model trained on this engine's steps);
- a finished call that carries a `session_id` (vLLM's chat-completion field for an agent's calls)
  keeps its KV blocks, referenced, for the session's next call when min-waste says so, so the
  prefix cache cannot evict them; the hold ends when the next call has taken the blocks over, at
  its ceiling, or when queued work needs the blocks.

Options come from `--additional-config '{"tandem": {...}}'` (`policy_bridge.BridgeConfig`). The
interface is vLLM's internal one, so this module supports one vLLM release (`SUPPORTED_VLLM`).
This is the only module of Tandem that imports vLLM; it translates and does nothing else.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from tandem.integrations.policy_bridge import BridgeConfig, Hold, PolicyBridge

SUPPORTED_VLLM = "0.32."
# how a call ends that its session may continue from (an abort or an error leaves nothing to hold)
_COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
# under vLLM's logger, so that its handlers print these lines with its own
logger = logging.getLogger("vllm.tandem")


class RankedQueue(RequestQueue):
    """vLLM's waiting queue in the order `PolicyBridge.ranked` gives, re-ranked once per step
    (`rerank`); between re-ranks new requests join at the back and preempted ones at the front,
    as in vLLM's FCFS queue."""

    def __init__(self) -> None:
        self._items: list[Request] = []

    def add_request(self, request: Request) -> None:
        self._items.append(request)

    def pop_request(self) -> Request:
        if not self._items:
            raise IndexError("pop from an empty queue")
        return self._items.pop(0)

    def peek_request(self) -> Request:
        if not self._items:
            raise IndexError("peek from an empty queue")
        return self._items[0]

    def prepend_request(self, request: Request) -> None:
        self._items.insert(0, request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for r in requests:                # as deque.extendleft: the last given ends up first
            self._items.insert(0, r)

    def remove_request(self, request: Request) -> None:
        self._items.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = set(requests)
        self._items = [r for r in self._items if r not in drop]

    def rerank(self, order: list[Request]) -> None:
        self._items = order

    def __bool__(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._items))


class TandemScheduler(Scheduler):
    """vLLM's scheduler with Tandem's ordering, budget, draft lengths and session holds. Where vLLM
    turned on async scheduling, it is built as `TandemAsyncScheduler` (the same changes over
    vLLM's `AsyncScheduler`)."""

    def __new__(cls, *args, **kwargs):
        config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is TandemScheduler and config is not None and config.scheduler_config.async_scheduling:
            cls = TandemAsyncScheduler
        return super().__new__(cls)

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        if not vllm.__version__.startswith(SUPPORTED_VLLM):
            raise RuntimeError(f"tandem.integrations.vllm supports vLLM {SUPPORTED_VLLM}x, not {vllm.__version__} "
                               "(the scheduler interface is internal to vLLM and changes between releases)")
        super().__init__(vllm_config, *args, **kwargs)
        options = (vllm_config.additional_config or {}).get("tandem")
        config = BridgeConfig.from_options(options)
        if config.hold_sessions and not self.cache_config.enable_prefix_caching:
            # a held context is found again only through the prefix cache
            config = dataclasses.replace(config, hold_sessions=False)
        spec = vllm_config.speculative_config
        self.full_token_budget = self.max_num_scheduled_tokens
        self.tandem = PolicyBridge(config, self.full_token_budget, spec.num_speculative_tokens if spec else 0)
        queue = RankedQueue()
        for r in self.waiting:
            queue.add_request(r)
        self.waiting = queue
        self._held: dict[str, tuple[list, int]] = {}   # session -> (its blocks, the fence step)
        self._adopting: dict[str, Hold] = {}           # request id -> the hold it takes over
        self._step: tuple[float, int, int, int] | None = None   # (started, tokens, drafts, decode rows)
        self._logged: tuple[float, tuple[int, ...]] = (0.0, (0, 0, 0, 0))
        logger.info("Tandem scheduler (%s) on vLLM %s: %s", type(self).__name__, vllm.__version__, config)

    # --- requests in and out ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        known = request.request_id in self.requests      # a streaming-input session's next chunk
        super().add_request(request)
        if known or request.request_id not in self.requests:
            return
        self._track(request)
        session = self._session(request)
        if session is not None:
            hold = self.tandem.arrived(session, time.time())
            if hold is not None:
                self._adopting[request.request_id] = hold

    def _track(self, request: Request):
        return self.tandem.track(request.request_id, list(request.prompt_token_ids or []),
                                 request._all_token_ids, request.arrival_time, request.max_tokens)

    @staticmethod
    def _session(request: Request) -> str | None:
        sid = getattr(request, "session_id", None)
        return None if not sid else f"{request.cache_salt or ''}\x00{sid}"

    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        self.tandem.finished(request.request_id, request.status in _COMPLETED)
        hold = self._adopting.pop(request.request_id, None)
        if hold is not None:
            self._release(hold.session)
        return super()._free_request(request, delay_free_blocks)

    def _free_request_blocks(self, request: Request) -> None:
        session = self._session(request) if request.is_finished() else None
        if session is None or request.status not in _COMPLETED:
            super()._free_request_blocks(request)
            return
        self._release(session)                     # a session holds one context: its latest
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)
        pool = self.kv_cache_manager.block_pool
        other = sum(r.num_computed_tokens for r in self.running)
        if self.tandem.hold(session, request.request_id, request.num_computed_tokens, other, len(blocks),
                            pool.num_gpu_blocks, time.time()):
            self._held[session] = (blocks, request.last_sched_seq)
        else:
            self._free_blocks_after(blocks, request.last_sched_seq)

    def _release(self, session: str) -> None:
        held = self._held.pop(session, None)
        if held is not None:
            self._free_blocks_after(*held)

    def _free_blocks_after(self, blocks: list, fence: int) -> None:
        """Return blocks to the pool, tail first, once no step in flight may still write them."""
        self._free_cow_retained_blocks(blocks[::-1], fence)

    # --- a step -------------------------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False):
        now = time.time()
        self._log_holds(now)
        for hold in self.tandem.expired(now):
            self._release(hold.session)
        self._make_room(now)
        pool = self.kv_cache_manager.block_pool
        active = len(self.running) + getattr(self, "num_waiting_for_streaming_input", 0)
        admits = bool(self.waiting) and active < self.max_num_active_reqs   # else order and budget are moot
        if admits:
            items = []
            for r in self.waiting:
                shadow = self.tandem.shadows.get(r.request_id) or self._track(r)
                self.tandem.sync(shadow, r.num_computed_tokens)
                items.append((r, shadow))
            self.waiting.rerank(self.tandem.ranked(items, now, self.kv_cache_manager.usage))
        if admits and self.tandem.policy.budget.admissions_only:
            running = sum(max(0, r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens)
                          for r in self.running)
            self.max_num_scheduled_tokens = self.tandem.step_tokens(running, pool.get_num_free_blocks(),
                                                                    pool.num_gpu_blocks)
        try:
            out = super().schedule(throttle_prefills)
        finally:
            self.max_num_scheduled_tokens = self.full_token_budget
        for rid in [rid for rid in self._adopting if rid in out.num_scheduled_tokens]:
            self._release(self._adopting.pop(rid).session)     # its blocks are the request's now
        spec = out.scheduled_spec_decode_tokens
        drafts = decodes = 0          # (the cost model prices drafts by the decodes beside them)
        if spec:
            drafts = sum(len(v) for v in spec.values())
            decodes = sum(1 for rid, n in out.num_scheduled_tokens.items() if n == 1 + len(spec.get(rid, ())))
        self._step = (time.perf_counter(), out.total_num_scheduled_tokens, drafts, decodes)
        return out

    def _make_room(self, now: float) -> None:
        """Free held sessions (expected back last first) when the head of the queue and one block
        per running request would not fit in the free blocks: held KV never costs a preemption."""
        if not self._held or not self.waiting:
            return
        head = self.waiting.peek_request()
        size = self.block_size
        need = -(-max(0, head.num_tokens - head.num_computed_tokens) // size) + len(self.running)
        short = need - self.kv_cache_manager.block_pool.get_num_free_blocks()
        if short > 0:
            for hold in self.tandem.victims(short, now):
                self._release(hold.session)

    def update_from_output(self, scheduler_output, model_runner_output):
        if self._step is not None:
            started, tokens, drafts, decodes = self._step
            self.tandem.observe_step(tokens, time.perf_counter() - started, drafts, decodes)
            self._step = None
        spec = scheduler_output.scheduled_spec_decode_tokens
        if spec and self.tandem.lengths_policy is not None:
            index = model_runner_output.req_id_to_index
            sampled = model_runner_output.sampled_token_ids
            invalid = scheduler_output.num_invalid_spec_tokens or {}
            for rid, drafts in spec.items():
                i, shadow = index.get(rid), self.tandem.shadows.get(rid)
                if i is None or shadow is None or i >= len(sampled):
                    continue
                drafted = len(drafts) - invalid.get(rid, 0)
                self.tandem.observe_drafts(shadow, drafted, max(0, min(drafted, len(sampled[i]) - 1)))
        return super().update_from_output(scheduler_output, model_runner_output)

    def update_draft_token_ids(self, draft_token_ids) -> None:
        super().update_draft_token_ids(draft_token_ids)
        if self.tandem.lengths_policy is None:
            return
        reqs = [self.requests[rid] for rid in draft_token_ids.req_ids
                if rid in self.requests and self.requests[rid].spec_token_ids]
        shadows = [self.tandem.shadows.get(r.request_id) or self._track(r) for r in reqs]
        for r, s in zip(reqs, shadows):
            self.tandem.sync(s, r.num_computed_tokens)
        lengths = self.tandem.draft_lengths(shadows, [len(r.spec_token_ids) for r in reqs], len(self.running))
        for r, k in zip(reqs, lengths):
            if k < len(r.spec_token_ids):
                r.spec_token_ids = r.spec_token_ids[:k]

    def _log_holds(self, now: float, every_s: float = 60.0) -> None:
        """The session-hold counters, at most once a minute and only when they moved."""
        t = self.tandem
        counts = (t.num_held, t.num_adopted, t.num_expired, t.num_evicted)
        if counts == self._logged[1] or now - self._logged[0] < every_s:
            return
        self._logged = (now, counts)
        logger.info("Tandem scheduler: %d session contexts held, %d taken over by the next call, %d expired, "
                    "%d freed for queued work; %d holding %d blocks now", *counts, len(t.holds), t.num_held_blocks)

    def shutdown(self) -> None:
        self._log_holds(float("inf"), every_s=0.0)
        for session in list(self._held):
            self._release(session)
        super().shutdown()


class TandemAsyncScheduler(TandemScheduler, AsyncScheduler):
    """`TandemScheduler` over vLLM's `AsyncScheduler` (chosen by `TandemScheduler` itself)."""
