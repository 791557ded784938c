"""Running one HTTP request's engine requests: submit all or none, merge their streams, abort on exit.

A request with `n` choices (or several completion prompts) is several engine requests. `submit`
starts them together and, if any is refused (bad input, queue full), cancels the others before the
error becomes the HTTP response. `MergedStream` yields `(choice index, RequestOutput)` as outputs
arrive; closing it early (client gone, error) cancels what is still running, which aborts those
engine requests and frees their KV blocks. `until_disconnected` does the same for non-streamed
requests whose client leaves while they are being generated. Both also end their request at the
drain deadline (`Drain`): a whole response becomes a 503, a stream gets an error event and [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.server.errors import APIError, error_body
from tandem.server.serving_common import SSE_DONE, Drain, sse

T = TypeVar("T")


class MergedStream:
    """The outputs of several engine requests, interleaved as they come."""

    def __init__(self, gens: list[AsyncIterator[RequestOutput]], request_ids: list[str],
                 on_output: Callable[[RequestOutput], None], on_abort: Callable[[str], None]) -> None:
        self._gens = gens
        self._ids = request_ids
        self._on_output = on_output
        self._on_abort = on_abort
        self._tasks: dict[int, asyncio.Task[RequestOutput]] = {
            i: asyncio.ensure_future(g.__anext__()) for i, g in enumerate(gens)}
        self._finished: set[int] = set()

    async def check_started(self) -> None:
        """Raise the first refusal (after cancelling the rest); each generator validates and queues
        its request synchronously in its first step, which one turn of the event loop runs."""
        await asyncio.sleep(0)
        for task in self._tasks.values():
            if task.done() and not task.cancelled() and task.exception() is not None:
                error = task.exception()
                await self.aclose(count_aborts=False)
                raise error  # type: ignore[misc]

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            while self._tasks:
                done, _ = await asyncio.wait(self._tasks.values(), return_when=asyncio.FIRST_COMPLETED)
                for i in sorted(i for i, t in self._tasks.items() if t in done):
                    out = self._tasks.pop(i).result()      # engine errors propagate to the caller
                    self._on_output(out)
                    if out.finished:
                        self._finished.add(i)
                    else:
                        self._tasks[i] = asyncio.ensure_future(self._gens[i].__anext__())
                    yield i, out
        finally:
            await self.aclose()

    async def aclose(self, count_aborts: bool = True) -> None:
        """Cancel whatever still runs: the engine generators abort their requests on the way out.
        (The synchronous part comes first: awaits here may be cancelled again by the caller's scope.)"""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for i, rid in enumerate(self._ids):
            if i not in self._finished:
                self._finished.add(i)
                if count_aborts:
                    self._on_abort(rid)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for gen in self._gens:
            with contextlib.suppress(Exception):
                await gen.aclose()           # type: ignore[attr-defined]


async def submit(engine: AsyncLLMEngine, prompts: list[list[int]], params: list[SamplingParams],
                 request_ids: list[str], on_output: Callable[[RequestOutput], None],
                 on_abort: Callable[[str], None], tool_options: Any = None, session: Any = None) -> MergedStream:
    """Start one engine request per (prompt ids, params); all are queued or none is.
    `tool_options` (server-side tools) makes the engine run the model's tool calls itself.
    `session` (a SessionInfo): the first request's KV is held for that session after it finishes
    (the others are alternatives the client will not continue)."""
    extra = {"tool_options": tool_options} if tool_options is not None else {}
    gens = [engine.generate(None, p, prompt_token_ids=ids, request_id=rid,
                            **(extra | {"session": session} if session is not None and i == 0 else extra))
            for i, (ids, p, rid) in enumerate(zip(prompts, params, request_ids))]
    stream = MergedStream(gens, request_ids, on_output, on_abort)
    await stream.check_started()
    return stream


SHUTTING_DOWN = "shutting_down"


def drain_message(drain: Drain) -> str:
    return (f"the server is shutting down and this request did not finish within the drain timeout "
            f"({drain.timeout_s:g} s); retry it")


async def until_disconnected(request: Request, work: Awaitable[T], drain: Drain | None = None) -> T:
    """Run `work`; if the client disconnects first, or the drain deadline passes, cancel it
    (aborting its engine requests): 499, or 503 at the deadline."""
    task = asyncio.ensure_future(work)
    watchers = [asyncio.ensure_future(_wait_disconnect(request))]
    if drain is not None:
        watchers.append(asyncio.ensure_future(drain.wait()))
    try:
        await asyncio.wait([task, *watchers], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        for w in watchers:
            w.cancel()
        raise
    for w in watchers:
        w.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if drain is not None and drain.expired:
            raise APIError(503, drain_message(drain), None, SHUTTING_DOWN)
        raise APIError(499, "client disconnected")
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, however the response ends.

    Starlette cancels the body on a client disconnect under ASGI spec < 2.4, but under 2.4 it only
    stops iterating; closing here makes the abort (and the KV blocks' return) prompt either way.
    With a `drain`, the stream is cut at the drain deadline: its engine requests are aborted and
    the client gets an error event and `data: [DONE]`, so it can tell the stream was cut."""

    def __init__(self, content: Any, *, drain: Drain | None = None, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if self.drain is None:
                await super().__call__(scope, receive, send)
            else:
                await self._until_drained(scope, receive, send, self.drain)
        finally:
            await self._close_body()

    async def _close_body(self) -> None:
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            await aclose()

    async def _until_drained(self, scope: Scope, receive: Receive, send: Send, drain: Drain) -> None:
        sent = {"start": False, "end": False}

        async def tracked(message: Any) -> None:
            if message["type"] == "http.response.start":
                sent["start"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["end"] = True
            await send(message)

        task = asyncio.ensure_future(super().__call__(scope, receive, tracked))
        deadline = asyncio.ensure_future(drain.wait())
        try:
            await asyncio.wait([task, deadline], return_when=asyncio.FIRST_COMPLETED)
        finally:
            deadline.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        if sent["end"]:
            return
        await self._close_body()                # abort the engine requests before answering
        if not sent["start"]:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        tail = sse(error_body(503, drain_message(drain), None, SHUTTING_DOWN)) + SSE_DONE
        await send({"type": "http.response.body", "body": tail.encode(), "more_body": False})
