"""POST /v1/chat/completions: render the chat (with tools), run n choices, answer whole or streamed.

Owns the chat response shapes: the message (content and client-side `tool_calls`, found in the
generated text by the tool parser, with finish_reason "tool_calls"; with a reasoning parser, the
reasoning split off first as `reasoning` / `reasoning_content`), chat logprobs, and the stream
(role delta first, reasoning, content and tool-call deltas, a final chunk with finish_reason per
choice, usage when asked, then [DONE]). Server-side tool execution is not here: it will run inside
the engine. vLLM's templating options and flags are checked in chat_options.py.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.errors import InvalidRequestError
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.server.chat_options import check_tool_choice, output_options, template_options
from tandem.server.errors import error_body, to_api_error
from tandem.server.logprobs import TokenTexts, chat_logprobs
from tandem.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                    ChatDelta, ChatResponseMessage, ChatStreamChoice, DeltaFunction, DeltaToolCall,
                                    FunctionCallOut, NamedToolChoice, ToolCallOut)
from tandem.server.serving_common import (SSE_DONE, ServerState, check_model, check_num_choices, check_request,
                                          off_loop_if_large, resolve_max_tokens, response_id, sampling_params,
                                          session_info, sse, truncate_prompt, usage)
from tandem.server.streams import ClosingStreamingResponse, MergedStream, submit, until_disconnected
from tandem.tools.chat_format import render_chat
from tandem.tools.output import OutputStream, parse_output
from tandem.tools.parsers import ToolCall, ToolParser, get_tool_parser
from tandem.tools.parsers.forced import ForcedToolParser, forced_constraint
from tandem.tools.reasoning import ReasoningParser


@dataclass
class ChatJob:
    """A chat request resolved against the model, ready to generate."""

    response_id: str
    created: int
    model: str
    prompt_token_ids: list[int]
    params: list[SamplingParams]
    parser: ToolParser | None          # None: tools absent or tool_choice "none"
    top_logprobs: int | None           # None: no logprobs
    include_usage: bool
    server_tools: Any = None           # ToolOptions when the server runs the tools itself
    reasoning: ReasoningParser | None = None    # --reasoning-parser, when the output may reason
    include_reasoning: bool = True


def _check_fields(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs: true", field="top_logprobs")
    if req.tool_choice not in (None, "none") and not req.tools:
        raise InvalidRequestError("tool_choice requires tools", field="tool_choice")
    for i, m in enumerate(req.messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise InvalidRequestError(f"messages[{i}] ({m.role}) has no content", field=f"messages[{i}].content")


def _text_size(req: ChatCompletionRequest) -> int:
    """Characters of message text (what templating and tokenizing cost grows with)."""
    size = 0
    for m in req.messages:
        if isinstance(m.content, str):
            size += len(m.content)
        elif m.content:
            size += sum(len(p.text or "") for p in m.content)
        for c in m.tool_calls or ():
            size += len(c.function.arguments) if isinstance(c.function.arguments, str) else 0
    return size


def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> ChatJob:
    check_request(state, req)
    check_model(state, req.model)
    _check_fields(req)
    check_num_choices(state, req.n)
    check_tool_choice(state, req)
    template = template_options(state, req)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice: Any = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    server_tools = None
    if tools is None and state.tools is not None and choice != "none":
        # Server-side tools: offered to the model, run inside the engine; the answer comes back whole.
        from tandem.engine.tool_runtime import ToolOptions

        tools, server_tools = state.tools.schemas(), ToolOptions()
    prompt = render_chat(state.tokenizer.hf, messages, tools, choice, **template)
    ids = truncate_prompt(state, state.tokenizer.encode(prompt, add_special_tokens=False), req)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(state, req.max_completion_tokens or req.max_tokens, len(ids), field, "messages")
    top = (req.top_logprobs or 0) if req.logprobs else None
    parser = get_tool_parser(state.config.tool_parser, tools) if tools and choice != "none" else None
    params = sampling_params(req, max_tokens, top, req.n, state.generation_defaults)
    if server_tools is None and tools and (choice == "required" or isinstance(choice, dict)):
        # A forced call: a grammar makes the output the call's JSON, which ForcedToolParser reads.
        if params[0].structured_outputs is not None:
            raise InvalidRequestError(f"tool_choice {'required' if choice == 'required' else 'of a function'} "
                                      f"and {params[0].structured_outputs.field} both constrain the output; "
                                      "give one", field="tool_choice")
        constraint = forced_constraint(tools, choice)
        params = [dataclasses.replace(p, structured_outputs=constraint) for p in params]
        parser = ForcedToolParser(None if choice == "required" else choice["function"]["name"])
    params, reasoning = output_options(state, req, parser, params, server_tools is not None)
    return ChatJob(response_id("chatcmpl", req), int(time.time()), state.config.model_name, ids,
                   params, parser, top, req.include_usage, server_tools, reasoning, req.include_reasoning)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    job = await off_loop_if_large(_text_size(req), prepare_chat, state, req)
    ids = [f"{job.response_id}-{i}" for i in range(len(job.params))]
    stream = await submit(state.engine, [job.prompt_token_ids] * len(ids), job.params, ids,
                          state.metrics.observe, state.metrics.observe_abort, job.server_tools,
                          session_info(raw.headers, req))
    if req.stream:
        return ClosingStreamingResponse(stream_chat(state, job, stream), media_type="text/event-stream",
                                        drain=state.drain)
    response = await until_disconnected(raw, collect_chat(state, job, stream), state.drain)
    return JSONResponse(response.model_dump(mode="json"))


def _tool_calls_out(calls: list[ToolCall]) -> list[ToolCallOut] | None:
    return [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls] or None


def chat_choice(index: int, out: RequestOutput, parser: ToolParser | None, texts: TokenTexts | None = None,
                top_logprobs: int | None = None, server_side: bool = False, reasoning: ReasoningParser | None = None,
                include_reasoning: bool = True) -> ChatChoice:
    """The choice for a finished output: the reasoning split off when the server has a reasoning
    parser, then tool calls parsed out of the rest when tools are on."""
    thought, content, calls = parse_output(out.text, parser, reasoning)
    thought = thought if include_reasoning else None
    reason = "tool_calls" if calls else out.finish_reason
    if server_side:            # the engine ran the calls: the answer is the text around them
        calls, reason = [], out.finish_reason
    logprobs = None
    if top_logprobs is not None and texts is not None:
        logprobs = chat_logprobs(texts, out.outputs[0].logprobs or [], top_logprobs)
    message = ChatResponseMessage(content=content, tool_calls=_tool_calls_out(calls), reasoning=thought,
                                  reasoning_content=thought)
    return ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=reason)


async def collect_chat(state: ServerState, job: ChatJob, stream: MergedStream) -> ChatCompletionResponse:
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in stream:
            if out.finished:
                finals[i] = out
    finally:
        await stream.aclose()
    outs = [finals[i] for i in range(len(job.params))]
    choices = [chat_choice(i, o, job.parser, state.token_texts, job.top_logprobs, job.server_tools is not None,
                           job.reasoning, job.include_reasoning)
               for i, o in enumerate(outs)]
    return ChatCompletionResponse(id=job.response_id, created=job.created, model=job.model, choices=choices,
                                  usage=usage(len(job.prompt_token_ids), outs))


def _chunk(job: ChatJob, choices: list[ChatStreamChoice]) -> str:
    return sse(ChatCompletionChunk(id=job.response_id, created=job.created, model=job.model, choices=choices))


def _delta_choice(state: ServerState, job: ChatJob, i: int, out: RequestOutput,
                  parser_state: OutputStream, num_logprobs_sent: int) -> ChatStreamChoice | None:
    """The chunk choice for one output's new reasoning, text, tool calls and logprobs (None if
    nothing new)."""
    first_call = parser_state.num_calls
    thought, content, calls = parser_state.feed(out.delta_text, out.finished)
    thought = thought if job.include_reasoning else ""
    deltas = [DeltaToolCall(index=first_call + k, id=c.id, type="function",
                            function=DeltaFunction(name=c.name, arguments=c.arguments))
              for k, c in enumerate(calls)] if job.server_tools is None else []   # server-run calls stay inside
    new_lps = (out.outputs[0].logprobs or [])[num_logprobs_sent:] if job.top_logprobs is not None else []
    if not content and not deltas and not new_lps and not thought:
        return None
    logprobs = chat_logprobs(state.token_texts, new_lps, job.top_logprobs or 0) if new_lps else None
    delta = ChatDelta(content=content if content or not (deltas or thought) else None, tool_calls=deltas or None,
                      reasoning=thought or None, reasoning_content=thought or None)
    return ChatStreamChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=None)


async def stream_chat(state: ServerState, job: ChatJob, stream: MergedStream) -> AsyncIterator[str]:
    n = len(job.params)
    parsers = [OutputStream(job.parser, job.reasoning) for _ in range(n)]
    sent = [0] * n
    finals: dict[int, RequestOutput] = {}
    started = [False] * n
    try:
        async for i, out in stream:
            if not started[i]:      # the role goes out with the choice's first token, as vLLM sends it
                started[i] = True
                yield _chunk(job, [ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            choice = _delta_choice(state, job, i, out, parsers[i], sent[i])
            sent[i] = len(out.outputs[0].logprobs or [])
            if choice is not None:
                yield _chunk(job, [choice])
            if out.finished:
                finals[i] = out
                called = parsers[i].num_calls > 0 and job.server_tools is None
                reason = "tool_calls" if called else out.finish_reason
                yield _chunk(job, [ChatStreamChoice(index=i, delta=ChatDelta(), finish_reason=reason)])
        if job.include_usage:
            outs = [finals[i] for i in range(n)]
            yield sse(ChatCompletionChunk(id=job.response_id, created=job.created, model=job.model, choices=[],
                                          usage=usage(len(job.prompt_token_ids), outs)))
    except Exception as e:          # headers are sent: report in the stream, then end it
        err = to_api_error(e)
        yield sse(error_body(err.status, err.message, err.param, err.code))
    finally:
        await stream.aclose()        # a client gone mid-stream: abort what still runs
    yield SSE_DONE
