"""Running one HTTP request's engine requests: submit all or none, merge their streams, abort on exit.

A request with `n` choices (or several completion prompts) is several engine requests. `submit`
starts them together and, if any is refused (bad input, queue full), cancels the others before the
error becomes the HTTP response. `MergedStream` yields `(choice index, RequestOutput)` as outputs
arrive; closing it early (client gone, error) cancels what is still running, which aborts those
engine requests and frees their KV blocks. `until_disconnected` does the same for non-streamed
requests whose client leaves while they are being generated.
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
from tandem.server.errors import APIError

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
                 on_abort: Callable[[str], None], tool_options: Any = None) -> MergedStream:
    """Start one engine request per (prompt ids, params); all are queued or none is.
    `tool_options` (server-side tools) makes the engine run the model's tool calls itself."""
    extra = {"tool_options": tool_options} if tool_options is not None else {}
    gens = [engine.generate(None, p, prompt_token_ids=ids, request_id=rid, **extra)
            for ids, p, rid in zip(prompts, params, request_ids)]
    stream = MergedStream(gens, request_ids, on_output, on_abort)
    await stream.check_started()
    return stream


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it (aborting its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
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
    stops iterating; closing here makes the abort (and the KV blocks' return) prompt either way."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
