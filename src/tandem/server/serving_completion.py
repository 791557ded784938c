"""POST /v1/completions: text or token-id prompts (one or a batch), n choices each, whole or streamed.

Choice `p * n + j` is the j-th sample of prompt p, as OpenAI numbers them. Owns the completions
response and stream shapes (text deltas, finish_reason on a choice's last chunk, usage when asked,
then [DONE]) and the column-style logprobs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.errors import InvalidRequestError
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.server.errors import error_body, to_api_error
from tandem.server.logprobs import completion_logprobs
from tandem.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from tandem.server.serving_common import (SSE_DONE, ServerState, check_model, check_num_choices, check_request,
                                          off_loop_if_large, resolve_max_tokens, response_id, sampling_params,
                                          session_info, sse, truncate_prompt, usage)
from tandem.server.streams import ClosingStreamingResponse, MergedStream, submit, until_disconnected

DEFAULT_MAX_TOKENS = 16           # OpenAI's default for /v1/completions


@dataclass
class CompletionJob:
    response_id: str
    created: int
    model: str
    prompts: list[list[int]]        # one entry per choice (prompt p repeated n times)
    params: list[SamplingParams]
    num_prompt_tokens: int          # all distinct prompts together
    logprobs: int | None
    include_usage: bool


def _check_fields(req: CompletionRequest) -> None:
    if req.echo:
        raise InvalidRequestError("echo is not supported", field="echo")
    if req.suffix:
        raise InvalidRequestError("suffix is not supported", field="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequestError("best_of is not supported (only best_of = n)", field="best_of")


def prompt_token_ids(state: ServerState, prompt: str | list[int] | list[str] | list[list[int]],
                     add_special_tokens: bool = True) -> list[list[int]]:
    """The request's prompts as token ids (text is encoded with the tokenizer's special tokens
    unless `add_special_tokens` is false)."""
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]                                   # type: ignore[list-item]
    else:
        items = list(prompt) or [""]                       # type: ignore[arg-type]
    vocab = state.engine.engine.vocab_size
    out = []
    for item in items:
        ids = (state.tokenizer.encode(item, add_special_tokens=add_special_tokens) if item else []) \
            if isinstance(item, str) else list(item)
        if not ids:
            raise InvalidRequestError("prompt is empty", field="prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", field="prompt")
        out.append(ids)
    return out


def _text_size(prompt: str | list[int] | list[str] | list[list[int]]) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str))


def prepare_completion(state: ServerState, req: CompletionRequest) -> CompletionJob:
    check_request(state, req)
    check_model(state, req.model)
    _check_fields(req)
    num_prompts = 1 if isinstance(req.prompt, str) or all(isinstance(t, int) for t in req.prompt) else len(req.prompt)
    check_num_choices(state, max(1, num_prompts) * req.n, "n" if req.n > 1 else "prompt")
    prompts = [truncate_prompt(state, ids, req) for ids in prompt_token_ids(state, req.prompt, req.add_special_tokens)]
    params: list[SamplingParams] = []
    for ids in prompts:
        max_tokens = resolve_max_tokens(state, req.max_tokens, len(ids), "max_tokens", "prompt",
                                        default=DEFAULT_MAX_TOKENS)
        params += sampling_params(req, max_tokens, req.logprobs, req.n, state.generation_defaults)
    return CompletionJob(response_id("cmpl", req), int(time.time()), state.config.model_name,
                         [ids for ids in prompts for _ in range(req.n)], params, sum(len(p) for p in prompts),
                         req.logprobs, req.include_usage)


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    job = await off_loop_if_large(_text_size(req.prompt), prepare_completion, state, req)
    ids = [f"{job.response_id}-{i}" for i in range(len(job.params))]
    stream = await submit(state.engine, job.prompts, job.params, ids, state.metrics.observe,
                          state.metrics.observe_abort, session=session_info(raw.headers, req))
    if req.stream:
        return ClosingStreamingResponse(stream_completion(state, job, stream), media_type="text/event-stream",
                                        drain=state.drain)
    response = await until_disconnected(raw, collect_completion(state, job, stream), state.drain)
    return JSONResponse(response.model_dump(mode="json"))


def _usage(job: CompletionJob, outs: list[RequestOutput]) -> UsageInfo:
    u = usage(0, outs)
    return UsageInfo(prompt_tokens=job.num_prompt_tokens, completion_tokens=u.completion_tokens,
                     total_tokens=job.num_prompt_tokens + u.completion_tokens)


async def collect_completion(state: ServerState, job: CompletionJob, stream: MergedStream) -> CompletionResponse:
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in stream:
            if out.finished:
                finals[i] = out
    finally:
        await stream.aclose()
    outs = [finals[i] for i in range(len(job.params))]
    choices = []
    for i, out in enumerate(outs):
        lps = None
        if job.logprobs is not None:
            lps = completion_logprobs(state.token_texts, out.outputs[0].logprobs or [], job.logprobs, 0)
        choices.append(CompletionChoice(index=i, text=out.text, logprobs=lps, finish_reason=out.finish_reason))
    return CompletionResponse(id=job.response_id, created=job.created, model=job.model, choices=choices,
                              usage=_usage(job, outs))


async def stream_completion(state: ServerState, job: CompletionJob, stream: MergedStream) -> AsyncIterator[str]:
    n = len(job.params)
    sent_lps, offsets = [0] * n, [0] * n
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in stream:
            lps = None
            if job.logprobs is not None:
                new = (out.outputs[0].logprobs or [])[sent_lps[i]:]
                sent_lps[i] += len(new)
                lps = completion_logprobs(state.token_texts, new, job.logprobs, offsets[i])
                offsets[i] += sum(len(t) for t in lps.tokens)
            if out.finished:
                finals[i] = out
            if not out.delta_text and lps is None and not out.finished:
                continue
            choice = CompletionChoice(index=i, text=out.delta_text, logprobs=lps,
                                      finish_reason=out.finish_reason if out.finished else None)
            yield sse(CompletionResponse(id=job.response_id, created=job.created, model=job.model, choices=[choice]))
        if job.include_usage:
            outs = [finals[i] for i in range(n)]
            yield sse(CompletionResponse(id=job.response_id, created=job.created, model=job.model, choices=[],
                                         usage=_usage(job, outs)))
    except Exception as e:          # headers are sent: report in the stream, then end it
        err = to_api_error(e)
        yield sse(error_body(err.status, err.message, err.param, err.code))
    finally:
        await stream.aclose()        # a client gone mid-stream: abort what still runs
    yield SSE_DONE
