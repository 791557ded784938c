"""The FastAPI app: routes, guards (API key, body limit), error handlers, metrics, lifespan.

`create_app` wires an already running `AsyncLLMEngine` to HTTP; it does not own the engine (the
caller starts and stops it) and holds no global state, so several apps can live in one process.
On shutdown the lifespan waits (bounded) for in-flight requests to drain.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.server.errors import install_error_handlers
from tandem.server.logprobs import TokenTexts
from tandem.server.metrics import PREFIXES, ServerMetrics
from tandem.server.middleware import APIKeyMiddleware, BodyLimitMiddleware, CatchAllMiddleware
from tandem.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                    CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorResponse,
                                    ModelCard, ModelList, TokenizeRequest, TokenizeResponse, VersionResponse)
from tandem.server.serving_chat import create_chat_completion
from tandem.server.serving_common import Drain, ServerConfig, ServerState
from tandem.server.serving_completion import create_completion
from tandem.server.serving_tokenize import detokenize, tokenize

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}


def create_app(async_engine: AsyncLLMEngine, model_name: str, *, api_key: str | None = None,
               max_request_bytes: int = 2 * 2**20, body_timeout_s: float | None = 30.0,
               max_tokens_limit: int = 4096, max_prompt_tokens: int | None = None, max_n: int = 16,
               drain_timeout_s: float = 30.0,
               model_aliases: tuple[str, ...] = ("default",), tool_parser: str = "hermes",
               tools: Any | None = None, on_shutdown: Callable[[], None] | None = None,
               metrics_prefixes: tuple[str, ...] = PREFIXES, strict: bool = False,
               enable_auto_tool_choice: bool = True, reasoning_parser: str | None = None,
               trust_request_chat_template: bool = False) -> FastAPI:
    """An OpenAI-compatible app over `async_engine`.

    model_name: the served name (`/v1/models`; requests naming another model, other than one of
    `model_aliases`, get 404). api_key: if set, `Authorization: Bearer <key>` is required on the
    /v1 routes (as vLLM does: /health, /metrics, /version and the tokenizer routes stay public).
    max_request_bytes: larger bodies get 413. body_timeout_s: a body that takes longer to arrive
    gets 408 (None: no limit). max_tokens_limit: the largest
    `max_tokens` a request may ask for (400 above). max_prompt_tokens: the longest prompt (default:
    the context length minus one). max_n: most choices per request. drain_timeout_s: how long
    shutdown waits for in-flight requests (counted from `app.state.tandem.drain.begin()`, which the
    launcher's server calls when shutdown starts; then streams end with an error event and [DONE],
    whole responses with a 503). tools: the server-side tool registry: a chat request that brings
    no tools of its own is offered these, the engine runs the calls (the request pauses meanwhile)
    and the response is the final answer; None serves client-side tool calls only. on_shutdown:
    called after the drain (the launcher stops the engine thread there). A request whose `n` (times
    its prompts) exceeds the engine's `max_waiting` gets a 400: it could never be queued whole.
    metrics_prefixes: the /metrics names' prefixes (default both `tandem:` and vLLM's `vllm:`).
    strict: a request field the server does not know is a 400 (otherwise it is logged and ignored).
    tool_parser: the tool-call format read from chat outputs (tandem.tools.parsers.TOOL_PARSERS).
    enable_auto_tool_choice: False refuses tool_choice "auto" (and tools without a tool_choice)
    with a 400, as vLLM does without --enable-auto-tool-choice; "required" and named functions
    still work. reasoning_parser: split chat outputs into reasoning and content
    (tandem.tools.reasoning.REASONING_PARSERS; None: no split). trust_request_chat_template:
    accept a request's own `chat_template` (otherwise a 400, as in vLLM).
    """
    from tandem.tools.parsers import get_tool_parser
    from tandem.tools.reasoning import get_reasoning_parser

    get_tool_parser(tool_parser)                  # an unknown name fails here, not on the first request
    if reasoning_parser is not None:
        get_reasoning_parser(reasoning_parser)
    config = ServerConfig(model_name=model_name, model_aliases=tuple(model_aliases), api_key=api_key,
                          max_request_bytes=max_request_bytes, max_tokens_limit=max_tokens_limit,
                          max_prompt_tokens=max_prompt_tokens, max_n=max_n, drain_timeout_s=drain_timeout_s,
                          tool_parser=tool_parser, strict=strict, enable_auto_tool_choice=enable_auto_tool_choice,
                          reasoning_parser=reasoning_parser,
                          trust_request_chat_template=trust_request_chat_template)
    state = ServerState(engine=async_engine, config=config, metrics=ServerMetrics(async_engine.stats, model_name,
                                                                                         prefixes=metrics_prefixes),
                        token_texts=TokenTexts(async_engine.tokenizer), tools=tools, drain=Drain(drain_timeout_s))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await async_engine.drain(drain_timeout_s)
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="Tandem", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.tandem = state
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes, timeout_s=body_timeout_s)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(CatchAllMiddleware)                        # added last: runs first
    _add_routes(app, state)
    return app


def _engine_alive(engine: AsyncLLMEngine) -> bool:
    return getattr(engine, "is_running", True)     # test doubles without a thread count as alive


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(state, body, request)

    @app.post("/v1/completions", responses={200: {"model": CompletionResponse}, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(state, body, request)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        card = ModelCard(id=state.config.model_name, created=state.created, max_model_len=state.max_model_len)
        return ModelList(data=[card])

    @app.get("/health")
    async def health() -> Response:
        if not _engine_alive(state.engine):
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.post("/tokenize", responses={200: {"model": TokenizeResponse}, **_ERRORS})
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenize(state, body)

    @app.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **_ERRORS})
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return detokenize(state, body)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        from tandem import __version__

        return VersionResponse(version=__version__)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
