"""The Ray Serve application: N `TandemReplica`s (one engine each) behind one `TandemIngress`.

Each replica builds its engine exactly as `tandem serve` does (`tandem.cli_engine.make_llm`, on the
engine thread of an `AsyncLLMEngine`) with torch limited to the replica's CPUs, and serves the
same FastAPI app (`tandem.server.create_app`), called in-process as ASGI (`tandem.cluster.asgi`).
The ingress is thin: it reads the request just enough to route it (session, prompt block hashes,
tool follow-up), hands the HTTP request to a replica through a streaming handle, and passes the
response back, SSE events as they come. The replica is chosen by `TandemRequestRouter`
(tandem.cluster.routing) from the replicas' `record_routing_stats`.

Sessions: the `x-session-id` header, else the OpenAI `user` field of the body (the header wins:
it is what a gateway sets, whatever the client put in the body).

A replica that dies: a request that had received nothing from it yet is retried once on another
replica (nothing reached the client, so this is safe); a stream already under way ends with an
error event and [DONE]; a whole response then gets a 503. Serve restarts the replica.
"""

# (no `from __future__ import annotations`: FastAPI must read the routes' annotations as types)

import argparse
import asyncio
import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve import context as serve_context
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from tandem.cluster.asgi import ResponseHead, forward
from tandem.cluster.prom import merge_metrics
from tandem.cluster.routing import routers
from tandem.cluster.stats import routing_stats

log = logging.getLogger("tandem.cluster")

REPLICA_HEADER = "x-tandem-replica"
SESSION_HEADER = "x-session-id"
ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions")
PINNED_TIMEOUT_S = 5.0


class TandemReplica:
    """One Tandem engine and its OpenAI app."""

    def __init__(self, args: argparse.Namespace, num_threads: int = 1) -> None:
        import torch

        from tandem.cli_engine import make_llm, served_model_name
        from tandem.engine.async_engine import AsyncLLMEngine
        from tandem.server.app import create_app

        torch.set_num_threads(num_threads)
        built: dict[str, Any] = {}

        def build():                     # on the engine thread, as `tandem serve` builds it
            torch.set_num_threads(num_threads)
            built["llm"] = make_llm(args)
            return built["llm"].engine

        self.engine = AsyncLLMEngine(build, max_waiting=args.max_waiting)
        llm = built["llm"]
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:                # noqa: BLE001 - outside Serve (tests of the class itself)
            self.replica_id = "local"
        self.app = create_app(self.engine, args.served_model_name or served_model_name(args.model),
                              api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                              max_tokens_limit=args.max_tokens_limit, drain_timeout_s=args.drain_timeout,
                              tools=llm.tool_registry, metrics_prefixes=args.metrics_prefix, strict=args.strict,
                              tool_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                              reasoning_parser=args.reasoning_parser,
                              trust_request_chat_template=args.trust_request_chat_template)
        self._spec_last: tuple[int, int] | None = None

    async def forward(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                      route: dict[str, Any] | None = None):
        """The app's response to one HTTP request: a ResponseHead (with the first bytes), then bytes.
        (`route` is read by the router, not here.)"""
        async for item in forward(self.app, method, path, query, headers, body,
                                  extra_headers=[(REPLICA_HEADER, self.replica_id)]):
            yield item

    def record_routing_stats(self) -> dict[str, Any]:
        stats = routing_stats(self.engine.engine, self.replica_id, self._spec_last)
        self._spec_last = stats["_spec"]
        return stats

    def check_health(self) -> None:
        if not self.engine.is_running:
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


# --- the ingress -------------------------------------------------------------------------------------
def _session_of(request: Request, body: dict[str, Any]) -> str | None:
    header = request.headers.get(SESSION_HEADER)
    if header:
        return header
    user = body.get("user")
    return user if isinstance(user, str) and user else None


class RouteInfo:
    """What the router needs from a request, computed with the tokenizer only."""

    def __init__(self, model: str | None, block_size: int) -> None:
        from tandem.engine.tokenizer import Tokenizer
        from tandem.models.fetch import resolve_model

        self.tokenizer = Tokenizer(resolve_model(model, progress=False))
        self.block_size = block_size

    def prompt_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        from tandem.server.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
        from tandem.tools.chat_format import render_chat

        tok = self.tokenizer
        if path == "/v1/chat/completions":        # rendered as serving_chat.prepare_chat renders it
            req = ChatCompletionRequest.model_validate(body)
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            choice: Any = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) \
                else req.tool_choice
            return tok.encode(render_chat(tok.hf, messages, tools, choice), add_special_tokens=False)
        req = CompletionRequest.model_validate(body)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]                    # several prompts: route by the first
        if isinstance(prompt, str):
            return tok.encode(prompt, add_special_tokens=getattr(req, "add_special_tokens", True))
        return list(prompt or [])

    def route(self, path: str, body: dict[str, Any], session: str | None) -> dict[str, Any]:
        from tandem.kv.hashing import hash_full_blocks
        from tandem.router import hash_ints

        route: dict[str, Any] = {"session_id": session, "block_hashes": (), "num_prompt_tokens": 0,
                                 "tool_followup": False}
        messages = body.get("messages")
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
            route["tool_followup"] = messages[-1].get("role") == "tool"
        try:
            ids = self.prompt_ids(path, body)
        except Exception:                         # noqa: BLE001 - an invalid request: the replica answers it
            return route
        route["num_prompt_tokens"] = len(ids)
        route["block_hashes"] = tuple(hash_ints(hash_full_blocks(ids, self.block_size)))
        return route


def _error(status: int, message: str, code: str) -> JSONResponse:
    from tandem.server.errors import error_body

    return JSONResponse(error_body(status, message, None, code), status_code=status)


def _sse_error(message: str) -> bytes:
    from tandem.server.errors import error_body

    return (f"data: {json.dumps(error_body(503, message, None, 'replica_died'))}\n\n"
            "data: [DONE]\n\n").encode()


def _response(head: ResponseHead, rest=None) -> Response:
    skip = {"content-length", "transfer-encoding"} if rest is not None else set()
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in head.headers if k.lower() not in skip]
    response = (StreamingResponse(rest, status_code=head.status) if rest is not None
                else Response(head.body, status_code=head.status))
    if rest is None:
        raw = [(k, v) for k, v in raw if k != b"content-length"] + [(b"content-length", str(len(head.body)).encode())]
    response.raw_headers = raw
    return response


api = FastAPI(title="Tandem cluster", summary="OpenAI-compatible LLM server over Tandem replicas on Ray Serve")


@serve.ingress(api)
class TandemIngress:
    def __init__(self, replicas: DeploymentHandle, num_replicas: int, model: str | None,
                 block_size: int = 16, replica_deployment: str = "TandemReplica") -> None:
        self.replicas = replicas
        self.num_replicas = num_replicas
        self.replica_deployment = replica_deployment
        self.route_info = RouteInfo(model, block_size)

    # --- forwarding ----------------------------------------------------------------------------------
    async def _open(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                    route: dict[str, Any] | None):
        # Each handle call its own internal request id: calls made while serving one HTTP request
        # inherit its id, and Serve's router hands a chosen replica to the pending call *with that
        # id*, so concurrent calls (the /health fan-out, a retry) would take each other's replicas.
        serve_context._set_request_context(_internal_request_id=uuid.uuid4().hex)
        gen = self.replicas.options(stream=True).forward.remote(method, path, query, headers, body, route=route)
        try:
            head = await gen.__anext__()
        except BaseException:
            gen.cancel()
            raise
        return head, gen

    async def _forward(self, request: Request, route: dict[str, Any] | None, body: bytes) -> Response:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() != "host"]
        query = request.url.query
        path = request.url.path
        for attempt in (0, 1):
            try:
                head, gen = await self._open(request.method, path, query, headers, body, route)
                break
            except RayActorError as e:            # died before answering: nothing sent, so retry once
                if attempt == 1:
                    return _error(503, f"the replica serving this request died before answering "
                                       f"(retried once): {type(e).__name__}", "replica_died")
                log.warning("replica died before answering %s; retrying on another", path)
        if not head.more:
            return _response(head)
        sse = (head.header("content-type") or "").startswith("text/event-stream")

        async def rest():
            done = False
            try:
                if head.body:
                    yield head.body
                async for chunk in gen:
                    yield chunk
                done = True
            except RayActorError as e:            # mid-stream: the client has part of it; say so and end
                done = True
                if sse:
                    yield _sse_error(f"the replica serving this stream died ({type(e).__name__}); "
                                     "the stream is incomplete")
                else:
                    raise
            finally:
                if not done:
                    gen.cancel()                  # the client left: abort on the replica

        return _response(head, rest())

    async def _pinned(self, replica_id: str | None, path: str) -> tuple[int, bytes]:
        """GET `path` on one replica (None: any); (status, body), (0, reason) if unreachable."""
        async def call():
            head, gen = await self._open("GET", path, "", [], b"", {"replica": replica_id} if replica_id else None)
            body = head.body
            async for chunk in gen:
                body += chunk
            return head.status, body

        try:
            return await asyncio.wait_for(call(), PINNED_TIMEOUT_S)
        except asyncio.TimeoutError:
            return 0, b"no answer in time"
        except Exception as e:                    # noqa: BLE001
            return 0, f"{type(e).__name__}: {e}".encode()

    async def _replica_ids(self) -> list[str]:
        found = routers(self.replica_deployment)
        if not found:                            # the handle builds its router on its first call
            await self._pinned(None, "/health")
            found = routers(self.replica_deployment)
        return sorted({uid for r in found for uid in r.replica_ids()})

    # --- routes --------------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> Response:
        ids = await self._replica_ids()
        results = await asyncio.gather(*(self._pinned(uid, "/health") for uid in ids))
        status = {uid: ("ok" if code == 200 else (body.decode(errors="replace") or f"HTTP {code}"))
                  for uid, (code, body) in zip(ids, results)}
        up = sum(1 for s in status.values() if s == "ok")
        ok = up >= self.num_replicas
        return JSONResponse({"status": "ok" if ok else "degraded", "replicas_up": up,
                             "replicas_expected": self.num_replicas, "replicas": status},
                            status_code=200 if ok else 503)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        ids = await self._replica_ids()
        results = await asyncio.gather(*(self._pinned(uid, "/metrics") for uid in ids))
        texts = {uid: body.decode() for uid, (code, body) in zip(ids, results) if code == 200}
        up = (f"# HELP tandem:cluster_replicas_up Replicas that answered this scrape.\n"
              f"# TYPE tandem:cluster_replicas_up gauge\ntandem:cluster_replicas_up {len(texts)}\n"
              f"# HELP tandem:cluster_replicas_expected Replicas the deployment asks for.\n"
              f"# TYPE tandem:cluster_replicas_expected gauge\n"
              f"tandem:cluster_replicas_expected {self.num_replicas}\n")
        return Response(merge_metrics(texts) + up, media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.api_route("/{path:path}", methods=["GET", "POST"])
    async def proxy(self, path: str, request: Request) -> Response:
        body = await request.body()
        route = None
        if request.method == "POST" and request.url.path in ROUTED_PATHS:
            try:
                parsed = json.loads(body) if body else {}
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                session = _session_of(request, parsed)
                if len(body) > 32_768:            # long prompts: tokenize off the event loop
                    route = await asyncio.to_thread(self.route_info.route, request.url.path, parsed, session)
                else:
                    route = self.route_info.route(request.url.path, parsed, session)
        return await self._forward(request, route, body)


# --- the application -----------------------------------------------------------------------------
def build(args: argparse.Namespace):
    """The Serve application for parsed `tandem serve` arguments (with --replicas, --replica-cpus)."""
    from tandem.runner.device import resolve_block_size, resolve_device

    n = max(1, int(args.replicas))
    cpus = float(args.replica_cpus) if args.replica_cpus else 1.0
    threads = max(1, int(cpus))
    router = RequestRouterConfig(request_router_class="tandem.cluster.routing:TandemRequestRouter",
                                 request_router_kwargs={"policy": args.router_policy, "seed": args.seed},
                                 request_routing_stats_period_s=args.routing_stats_period,
                                 request_routing_stats_timeout_s=max(5.0, 5 * args.routing_stats_period))
    replica = serve.deployment(TandemReplica, name="TandemReplica").options(
        num_replicas=n, ray_actor_options={"num_cpus": cpus},
        max_ongoing_requests=args.max_waiting + args.max_num_seqs,
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=args.drain_timeout, request_router_config=router)
    ingress = serve.deployment(TandemIngress, name="TandemIngress").options(
        num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=4 * n * (args.max_waiting + args.max_num_seqs))
    return ingress.bind(replica.bind(args, threads), n, args.model,
                       resolve_block_size(getattr(args, "block_size", None), resolve_device(args.device)), "TandemReplica")
