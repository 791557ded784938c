"""Asyncio front of the engine: one background thread steps the engine, requests stream back.

The engine (and the torch work under it) runs on its own thread so the event loop stays free for
HTTP. Give the constructor a *builder* (a callable returning the engine) rather than an engine, and
the engine is built on that thread too: on CPU, oneDNN-prepacked weights made on one thread and
used from another run their matmuls markedly slower, so everything torch touches should be made
where it is used.
Requests and aborts are handed over through a command queue and applied between steps; outputs
are delivered to per-request asyncio queues with `call_soon_threadsafe`. A failing step fails the
requests it was running, never the thread: others keep being served.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from tandem.engine.llm_engine import EngineStats, LLMEngine, ValidRequest
from tandem.engine.tool_runtime import ToolOptions
from tandem.errors import TandemError
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.types import SessionInfo

log = logging.getLogger("tandem.engine")


class QueueFullError(TandemError):
    """Too many requests are waiting; retry later (HTTP 503)."""


class EngineDeadError(TandemError):
    """The engine thread has stopped."""


@dataclass
class _Add:
    request_id: str
    valid: ValidRequest
    sink: "_Sink"
    tool_options: ToolOptions | None = None
    session: SessionInfo | None = None


@dataclass
class _Abort:
    request_id: str


class _Sink:
    """Delivers a request's outputs from the engine thread into the asyncio loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class HeapTrim:
    """Hands the C heap's free pages back to the system while the engine is idle (glibc's
    malloc_trim). Steps allocate and free large buffers from several threads, and glibc keeps what
    was freed in its arenas, so without this a server's resident memory stays at the high-water
    mark of its busiest moment. At most once per `interval_s`; a no-op without glibc."""

    def __init__(self, interval_s: float = 10.0) -> None:
        try:
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self._trim = None
        self.interval_s = interval_s
        self._last = float("-inf")
        self.num_trims = 0

    def idle(self, now: float) -> None:
        if self._trim is None or now - self._last < self.interval_s:
            return
        self._last = now
        self._trim(0)
        self.num_trims += 1


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], max_waiting: int = 256,
                 idle_wait_s: float = 0.05) -> None:
        """`engine`: a built engine, or a callable that builds one (called on the engine thread;
        the constructor returns once it has, and re-raises what it raised)."""
        builder = None if isinstance(engine, LLMEngine) else engine
        self.engine: LLMEngine = engine if builder is None else None   # type: ignore[assignment]
        self.max_waiting = max_waiting
        self.idle_wait_s = idle_wait_s
        self._commands: queue.Queue[_Add | _Abort] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._num_pending = 0          # added but not finished
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._build_error: BaseException | None = None
        self.heap = HeapTrim()
        self._thread = threading.Thread(target=self._run, args=(builder,), name="tandem-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._build_error is not None:
            raise self._build_error

    # --- API used from the event loop -------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive."""
        return self._thread.is_alive()

    @property
    def num_pending(self) -> int:
        return self._num_pending

    def stats(self) -> EngineStats:
        return self._stats

    async def generate(self, prompt: str | None, params: SamplingParams, *, prompt_token_ids: list[int] | None = None,
                       request_id: str | None = None, tool_options: ToolOptions | None = None,
                       session: SessionInfo | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (one per step that produced tokens; the last has finished=True).

        Validation errors raise before anything is queued. Leaving the iterator early (a client
        disconnect) aborts the request and frees its KV blocks."""
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")
        valid = self.engine.validate(prompt, prompt_token_ids, params)
        if self._num_pending - self.engine.scheduler.num_running >= self.max_waiting:
            raise QueueFullError(f"{self.max_waiting} requests are already waiting")
        rid = request_id or f"async-{next(self._ids)}"
        sink = _Sink(asyncio.get_running_loop())
        self._count(+1)
        self._commands.put(_Add(rid, valid, sink, tool_options, session))
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(rid))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no request is in flight (or the timeout passes); True if drained."""
        deadline = time.monotonic() + timeout_s
        while self._num_pending > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._num_pending == 0

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _count(self, delta: int) -> None:
        with self._lock:
            self._num_pending += delta

    # --- the engine thread ------------------------------------------------------------------------
    def _run(self, builder: Callable[[], LLMEngine] | None) -> None:
        try:
            if builder is not None:
                self.engine = builder()
            self._stats = self.engine.stats()
        except BaseException as e:  # noqa: BLE001 - handed to the constructor, which re-raises it
            self._build_error = e
            return
        finally:
            self._ready.set()
        while not self._stop.is_set():
            self._apply_commands(block=not self.engine.has_unfinished_requests())
            if not self.engine.has_unfinished_requests():
                self.engine.expire_held_sessions()
                self._stats = self.engine.stats()
                self.heap.idle(time.monotonic())
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug or a device error: fail what was running, keep serving
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out)
            self._stats = self.engine.stats()
            if not outputs and not self.engine.scheduler.has_work():
                self.engine.wait_for_tools(0.01)      # only paused requests: wait for a tool, not spin

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self.idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(cmd, _Add):
                self._sinks[cmd.request_id] = cmd.sink
                try:
                    self.engine.add_valid(cmd.valid, request_id=cmd.request_id, tool_options=cmd.tool_options,
                                          session=cmd.session)
                except Exception as e:
                    self._sinks.pop(cmd.request_id, None)
                    self._count(-1)
                    cmd.sink.put(e)
            else:
                out = self.engine.abort_request(cmd.request_id)
                if out is not None:
                    self._deliver(out)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if out.finished:
            if self._sinks.pop(out.request_id, None) is not None:
                self._count(-1)
        if sink is not None:
            sink.put(out)

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self._sinks):
            self.engine.abort_request(rid)
            sink = self._sinks.pop(rid)
            self._count(-1)
            sink.put(RuntimeError(f"engine step failed: {error}"))
