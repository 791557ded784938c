"""The engine: owns the clock, the tokenizer and the request states; runs the three-line step.

    plan = scheduler.schedule(now)
    result = executor.execute(plan)
    updates = scheduler.update(plan, result, now)

Around the step it validates requests on the way in, detokenizes and applies stop strings on the
way out. Decisions belong to the scheduler; computation to the executor.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.executor import Executor
from tandem.engine.tokenizer import Tokenizer
from tandem.engine.tool_runtime import ToolOptions, ToolRuntime
from tandem.config import SpecConfig
from tandem.errors import InvalidRequestError
from tandem.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.sched.scheduler import Scheduler
from tandem.sched.pause_kv import fit_tool_result
from tandem.types import FinishReason, Request, SeqUpdate, SessionInfo, TokenLogprob


@dataclass
class _ReqState:
    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer | None
    logprobs: list[TokenLogprob] | None
    tool_log: list[dict] = field(default_factory=list)


@dataclass
class StepInfo:
    """The last step, for benchmarks and metrics."""

    num_seqs: int
    num_tokens: int
    decode_only: bool
    duration_s: float


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int
    num_generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_paused: int = 0                 # requests paused on a tool call (AugServe)
    spec_num_drafts: int = 0            # speculative decoding: verification rounds with >= 1 draft token
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    tool_num_calls: int = 0
    tool_num_errors: int = 0
    num_paused_kv_tokens: int = 0          # device KV (tokens of whole blocks) held by tool-paused requests
    kv_actions: dict[str, int] = field(default_factory=dict)   # tool pauses by KV action
    num_discarded_kept: int = 0            # KV that waiting or paused requests kept, freed to make room
    num_recompute_tokens: int = 0          # computed tokens whose KV was freed (recomputed later)
    num_held_sessions: int = 0             # sessions holding their last call's KV (sched/retention.py)
    num_adopted_tokens: int = 0            # context tokens a session's next call took over


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed `LLMEngine.validate`: its prompt, token ids and parameters."""
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


class LLMEngine:
    def __init__(self, scheduler: Scheduler, executor: Executor, tokenizer: Tokenizer | None,
                 vocab_size: int, max_model_len: int, clock: Callable[[], float] = time.monotonic,
                 tools: ToolRuntime | None = None, grammar=None,
                 generation_defaults: dict | None = None, speculation: SpecConfig | None = None) -> None:
        self.scheduler = scheduler
        self.speculation = speculation      # the SpecConfig the scheduler and executor run (None: off)
        # SamplingParams fields a request that omits them gets (the model's generation_config.json,
        # tandem.models.generation_config): read by the server and by LLM.generate without params.
        self.generation_defaults: dict = dict(generation_defaults or {})
        self.grammar = grammar              # tandem.structured.grammar.GrammarBackend, or None
        self.tools = tools
        self.executor = executor
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.clock = clock
        self._states: dict[str, _ReqState] = {}
        self._ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.last_step: StepInfo | None = None

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Time requests by `clock` from now on (a replay's wall or virtual clock); between runs only."""
        if self.has_unfinished_requests():
            raise RuntimeError("set_clock while requests are in the engine: their times would mix two clocks")
        self.clock = clock

    # --- requests in -----------------------------------------------------------------------
    def validate(self, prompt: str | None, prompt_token_ids: list[int] | None,
                 params: SamplingParams) -> ValidRequest:
        """The request checked once and tokenized once (a `ValidRequest`, for `add_valid`), or
        InvalidRequestError naming the problem."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams", field="sampling_params")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise InvalidRequestError(f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary "
                                      f"[0, {self.vocab_size})", field="logit_bias")
        if params.structured_outputs is not None:
            if self.grammar is None:
                raise InvalidRequestError("this engine has no grammar backend for structured outputs "
                                          "(the llguidance package is missing)", field=params.structured_outputs.field)
            self.grammar.grammar(params.structured_outputs)     # compiled and checked now, cached for the sampler
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt must be a string", field="prompt")
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass prompt_token_ids", field="prompt")
            prompt_token_ids = self.tokenizer.encode(prompt) if prompt else []
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequestError("prompt is empty", field="prompt")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})",
                                      field="prompt_token_ids")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context length is {self.max_model_len} "
                f"(prompt plus at least one output token must fit)", field="prompt")
        return ValidRequest(prompt, ids, params)

    def add_request(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                    arrival_time: float | None = None, tool_options: ToolOptions | None = None,
                    session: SessionInfo | None = None) -> str:
        valid = self.validate(prompt, prompt_token_ids, params if params is not None else SamplingParams())
        return self.add_valid(valid, request_id=request_id, arrival_time=arrival_time, tool_options=tool_options,
                              session=session)

    def add_valid(self, valid: ValidRequest, *, request_id: str | None = None, arrival_time: float | None = None,
                  tool_options: ToolOptions | None = None, session: SessionInfo | None = None) -> str:
        """Queue a request `validate` has passed (callers that validate a batch before queueing
        any, or on another thread, do not check or tokenize it twice). `session`: its owner, the
        session its KV is held for after it finishes, and its prefix-cache salt."""
        if not isinstance(valid, ValidRequest):
            raise TypeError("add_valid takes what LLMEngine.validate returns")
        prompt, ids, params = valid.prompt, valid.prompt_token_ids, valid.params
        if tool_options is not None and self.tools is None:
            raise InvalidRequestError("this engine runs no tools", field="tools")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._states:
            raise InvalidRequestError(f"duplicate request id {rid!r}", field="request_id")
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        request = Request(rid, ids, params, eos_token_ids=eos,
                          arrival_time=self.clock() if arrival_time is None else arrival_time,
                          session=session or SessionInfo())
        detok = IncrementalDetokenizer(self.tokenizer, ids, params) if self.tokenizer is not None else None
        self._states[rid] = _ReqState(request, prompt, detok, [] if params.logprobs is not None else None)
        if tool_options is not None:
            request.tool.key = tool_options.key
            self.tools.watch(rid, tool_options)
        self.scheduler.add_request(request)
        self.num_prompt_tokens += len(ids)
        return rid

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.abort_request(request_id)
        if self.tools is not None:
            self.tools.forget(request_id)
        state.request.times.finished = self.clock()
        self.executor.release([request_id])
        return self._output(state, finished=True, delta_ids=[])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def expire_held_sessions(self) -> None:
        """Free what sessions hold past their ceiling. Each step does this; an idle engine, which
        runs no step, calls it from its loop, or an idle server would hold them forever."""
        self.scheduler.expire_sessions(self.clock())

    # --- the step --------------------------------------------------------------------------
    def wait_for_tools(self, timeout_s: float = 0.05) -> None:
        """Nothing to compute while requests wait on tools: block until one may have returned."""
        if self.tools is None:
            return
        deadline = self.tools.next_deadline()
        if deadline is not None:
            timeout_s = max(0.0, min(timeout_s, deadline - self.clock()))
        self.tools.wait(timeout_s)
        if not self.tools.poll_ready(self.clock()):
            time.sleep(min(timeout_s, 0.005))

    def _resume_tools(self, now: float) -> None:
        for ev in self.tools.poll(now):
            state = self._states.get(ev.request_id)
            if state is None:
                continue
            ids = fit_tool_result(self.tools.result_tokens(ev), state.request.num_tokens, self.max_model_len)
            self.scheduler.resume_request(ev.request_id, ids, now)
            if state.detok is not None:
                state.detok.inject(ids)
            state.tool_log.append(dict(ev.log, error=ev.error, result=ev.content[:200]))

    def step(self) -> list[RequestOutput]:
        start = self.clock()
        if self.tools is not None:
            self._resume_tools(start)
            if not self.scheduler.has_work():
                return []
        plan = self.scheduler.schedule(start)
        if plan.is_empty:
            if plan.preempted_ids or plan.released_ids:
                self.executor.execute(plan)     # computes nothing; drops state tied to freed KV
            return []
        result = self.executor.execute(plan)
        now = self.clock()
        updates = self.scheduler.update(plan, result, now)
        self.last_step = StepInfo(len(plan.seqs), plan.num_tokens, all(s.num_tokens == 1 for s in plan.seqs),
                                  now - start)
        outputs, finished = [], []
        for u in updates:
            out = self._apply(u, result.logprobs.get(u.request.request_id))
            if out is None:              # output_kind "final_only", not finished: nothing to report
                continue
            outputs.append(out)
            if out.finished:
                finished.append(u.request.request_id)
        if finished:
            self.executor.release(finished)
        return outputs

    def _apply(self, u: SeqUpdate, logprobs: list[TokenLogprob] | None) -> RequestOutput | None:
        rid = u.request.request_id
        state = self._states[rid]
        self.num_generation_tokens += len(u.new_token_ids)
        if state.logprobs is not None and logprobs:
            state.logprobs.extend(logprobs[:len(u.new_token_ids)])
        finished = u.finished
        before = len(state.detok.text) if state.detok is not None else 0
        text_ids = u.new_token_ids
        if finished and text_ids and text_ids[-1] in u.request.stop_token_ids \
                and u.request.finish_reason == FinishReason.STOP and not u.request.sampling_params.include_stop_str_in_output:
            text_ids = text_ids[:-1]        # the stop token (EOS, stop_token_ids) is output, not text (vLLM's)
        if state.detok is not None and state.detok.add_tokens(text_ids) and not finished:
            self._finish(u.request, FinishReason.STOP)
            finished = True
        if not finished and self.tools is not None and self.tools.is_watched(rid):
            new_text = state.detok.text[before:] if state.detok is not None else ""
            finished = self._maybe_pause(u.request, new_text, len(u.new_token_ids))
        if finished:
            del self._states[rid]
            if self.tools is not None:
                self.tools.forget(rid)
        elif u.request.sampling_params.output_kind == "final_only":
            return None
        return self._output(state, finished, u.new_token_ids)

    def _finish(self, request, reason: FinishReason) -> None:
        """A finish the engine sees (a stop string, a tool runtime's end): as the scheduler's own, a
        request with a session key leaves its KV held for the session."""
        now = self.clock()
        self.scheduler.finish_request(request, reason, now)
        request.times.finished = now

    def _maybe_pause(self, request, new_text: str, num_new: int) -> bool:
        """Pause the request if its output just completed a tool call; True if it finished instead."""
        raw = self.tools.on_tokens(request.request_id, new_text, num_new)
        if raw is None:
            return False
        if self.tools.over_limit(request.request_id):
            self._finish(request, FinishReason.TOOL_LIMIT)
            return True
        now = self.clock()
        name, expected = self.tools.start(request.request_id, raw, now)
        self.scheduler.pause_request(request.request_id, now, expected, tool=name)
        return False

    def _output(self, state: _ReqState, finished: bool, delta_ids: list[int]) -> RequestOutput:
        r = state.request
        text, delta = "", ""
        if state.detok is not None:
            delta = state.detok.delta(finished)
            text = state.detok.text if finished else state.detok.text[:state.detok.num_emitted]
        reason = r.finish_reason.value if finished and r.finish_reason is not None else None
        metrics = RequestMetrics(
            arrival_time=r.times.arrival, first_scheduled_time=r.times.first_scheduled,
            first_token_time=r.times.first_token, finished_time=r.times.finished,
            num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=r.num_output_tokens,
            num_cached_tokens=r.num_cached_tokens, num_preemptions=r.num_preemptions,
            spec=r.draft.stats.as_dict() if r.draft.stats.chosen_lengths else None, tool_calls=list(state.tool_log),
            predicted_output_tokens=r.rank.predicted_output_tokens)
        completion = CompletionOutput(0, text, r.generated_token_ids, reason,
                                      list(state.logprobs) if state.logprobs is not None else None)
        return RequestOutput(r.request_id, state.prompt, r.prompt_token_ids, [completion], finished, metrics,
                             delta_text=delta, delta_token_ids=list(delta_ids))

    def stats(self) -> EngineStats:
        return EngineStats(
            **dataclasses.asdict(self.scheduler.stats()),
            num_prompt_tokens=self.num_prompt_tokens, num_generation_tokens=self.num_generation_tokens,
            tool_num_calls=self.tools.num_calls if self.tools else 0,
            tool_num_errors=self.tools.num_errors if self.tools else 0)
