"""Server-side tool calls inside generation (AugServe's setting), run by the engine.

For each tool-enabled request the runtime watches the generated text through the Hermes parser's
stream (the one the server parses tool calls with); when a complete `<tool_call>...</tool_call>`
appears it hands back the call (a malformed one too: it gets an error turn), the engine pauses the request in the
scheduler, and the tool runs on a worker thread with its timeout. Finished calls are collected by
`poll()`; their result (or an error message: unknown tool, malformed call, exception, timeout) is
truncated to `max_result_chars` (lone surrogates replaced, so that the tokenizer takes it) and turned
into tokens through the chat template's tool turn, and the engine resumes the request with them.
Each call runs on a thread of its own, at most `max_workers` at once; a call that times out (or
whose request is aborted) is abandoned: its thread runs on, but no longer counts against the cap,
so hung tools cannot starve the others (`ToolWorkers`). Scripted requests (InferCept's trace
method) pause after each segment's `completion_tokens` for `api_time_s` and resume with
`return_tokens` filler tokens.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import enum
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from tandem.tools.parsers.hermes import HermesToolCallStream, parse_call
from tandem.tools.registry import ToolRegistry
from tandem.workload.augmented import ScriptCursor


class ScriptedCall(enum.Enum):
    """What `on_tokens` returns when a scripted request's segment ends (instead of a call's text)."""
    SEGMENT_END = "segment end"


class _Outcome(enum.Enum):
    """How a call's future ended; its value (result, error text, return tokens) comes with it."""
    OK = "ok"
    SCRIPTED = "scripted"       # a scripted pause: the value is the number of tokens it returns
    REFUSED = "refused"         # malformed or unknown: never ran
    RAISED = "raised"           # the tool raised, or the workers refused it

_FILLER = " the result of the tool call is"


@dataclass
class ToolOptions:
    """Per-request tool settings (`LLM.chat(..., tools=...)`, the server's `--tools`, or a trace)."""

    names: list[str] | None = None          # tools this request may call (None: every registered one)
    max_tool_calls: int = 8
    script: list[tuple[int, float, int]] | None = None   # [(completion_tokens, api_time_s, return_tokens)]
    key: str = "default"                    # statistics key (workload type) for Stage I predictions


@dataclass
class _Watch:
    options: ToolOptions
    stream: HermesToolCallStream = field(default_factory=HermesToolCallStream)   # text since the last result
    segment: int = 0                # tool calls made so far
    cursor: ScriptCursor | None = None   # scripted: where the request is in its segments


@dataclass
class ToolEvent:
    request_id: str
    tool: str
    content: str
    error: bool = False
    log: dict[str, Any] = field(default_factory=dict)


class ToolWorkers:
    """Runs calls on threads of their own, at most `max_live` at once (the rest queue, first come
    first served). `abandon(future)` gives up on a call: a queued one is dropped; a running one
    keeps its thread (Python cannot kill it) but stops counting against `max_live`. At most
    `max_abandoned` abandoned threads may still run; past that, new calls fail at once rather than
    pile up threads."""

    def __init__(self, max_live: int = 8, max_abandoned: int = 64, name: str = "tandem-tool") -> None:
        self.max_live = max_live
        self.max_abandoned = max_abandoned
        self.name = name
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[cf.Future, Callable[..., Any], tuple]] = collections.deque()
        self._live: set[cf.Future] = set()            # running and not abandoned
        self._abandoned: set[cf.Future] = set()       # running, given up on
        self._closed = False

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def num_abandoned(self) -> int:
        return len(self._abandoned)

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the tool workers are shut down")
            if len(self._abandoned) >= self.max_abandoned:
                fut.set_exception(RuntimeError(f"{len(self._abandoned)} timed-out tool calls are still running"))
                return fut
            self._queue.append((fut, fn, args))
            self._start_queued()
        return fut

    def abandon(self, fut: cf.Future) -> None:
        with self._lock:
            if fut.cancel():                          # still queued
                return
            if fut in self._live:
                self._live.discard(fut)
                self._abandoned.add(fut)
                self._start_queued()

    def _start_queued(self) -> None:
        """(lock held) Start queued calls while live ones are under the cap."""
        while self._queue and len(self._live) < self.max_live:
            fut, fn, args = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue                              # cancelled while queued
            self._live.add(fut)
            threading.Thread(target=self._run, args=(fut, fn, args), name=self.name, daemon=True).start()

    def _run(self, fut: cf.Future, fn: Callable[..., Any], args: tuple) -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the future
            fut.set_exception(e)
        else:
            fut.set_result(result)
        with self._lock:
            self._live.discard(fut)
            self._abandoned.discard(fut)
            if not self._closed:
                self._start_queued()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            while self._queue:
                self._queue.popleft()[0].cancel()


class ToolRuntime:
    def __init__(self, registry: ToolRegistry, tokenizer, max_workers: int = 8, max_result_chars: int = 4000) -> None:
        self.registry = registry
        self.tokenizer = tokenizer
        self.max_result_chars = max_result_chars
        self._pool = ToolWorkers(max_live=max_workers)
        self._watch: dict[str, _Watch] = {}
        self._running: dict[str, tuple[cf.Future, float, float, str]] = {}   # rid -> (future, start, deadline, tool)
        self._suffix_cache: dict[str, list[int]] = {}
        self.num_calls = 0
        self.num_errors = 0

    # --- watching generation ---------------------------------------------------------------
    def watch(self, request_id: str, options: ToolOptions) -> None:
        self._watch[request_id] = _Watch(options)

    def forget(self, request_id: str) -> None:
        self._watch.pop(request_id, None)
        fut = self._running.pop(request_id, None)
        if fut is not None:
            self._pool.abandon(fut[0])

    def is_watched(self, request_id: str) -> bool:
        return request_id in self._watch

    def num_calls_of(self, request_id: str) -> int:
        w = self._watch.get(request_id)
        return w.segment if w else 0

    def on_tokens(self, request_id: str, new_text: str, num_new_tokens: int) -> str | ScriptedCall | None:
        """Feed a step's output; returns the raw tool call (or the end of a scripted segment) if one
        completed."""
        w = self._watch.get(request_id)
        if w is None:
            return None
        if w.options.script is not None:
            return self._scripted(w, num_new_tokens)
        w.stream.feed(new_text)
        if not w.stream.closed_blocks:
            return None
        raw = w.stream.closed_blocks[0]
        w.stream = HermesToolCallStream()       # the tool's turn follows; what came after the call is dropped
        w.segment += 1
        return raw

    def _scripted(self, w: _Watch, num_new_tokens: int) -> ScriptedCall | None:
        if w.cursor is None:
            w.cursor = ScriptCursor(n for n, _, _ in w.options.script)
        if w.cursor.on_tokens(num_new_tokens) is None:
            return None
        w.segment = w.cursor.segment
        return ScriptedCall.SEGMENT_END

    def over_limit(self, request_id: str) -> bool:
        w = self._watch[request_id]
        return w.options.script is None and w.segment > w.options.max_tool_calls

    # --- running calls ---------------------------------------------------------------------
    def start(self, request_id: str, raw: str | ScriptedCall, now: float) -> tuple[str, float | None]:
        """Start the call; returns (tool name, expected duration if known from the script)."""
        w = self._watch[request_id]
        self.num_calls += 1
        if isinstance(raw, ScriptedCall):
            _, api_time, ret = w.options.script[w.segment - 1]
            fut: cf.Future = cf.Future()
            fut.set_result((_Outcome.SCRIPTED, ret))
            self._running[request_id] = (fut, now, now + api_time, "script")
            return w.options.key, api_time
        call = parse_call(raw.strip())
        name = call.name if call else "?"
        tool = self.registry.get(name) if call else None
        allowed = w.options.names is None or name in w.options.names
        if call is None or tool is None or not allowed:
            msg = (f"error: malformed tool call {raw.strip()[:200]!r}" if call is None else f"error: unknown tool {name!r}")
            fut = cf.Future()
            fut.set_result((_Outcome.REFUSED, msg))
            self._running[request_id] = (fut, now, now, name)
            return name, 0.0
        args = json.loads(call.arguments)
        fut = self._pool.submit(_invoke, tool.fn, args)
        self._running[request_id] = (fut, now, now + tool.timeout_s, name)
        return name, None

    def poll(self, now: float) -> list[ToolEvent]:
        """Calls that completed (or timed out) by `now`."""
        events = []
        for rid, (fut, start, deadline, name) in list(self._running.items()):
            scripted = name == "script"
            if scripted and now < deadline:
                continue
            if not scripted and not fut.done() and now < deadline:
                continue
            del self._running[rid]
            events.append(self._event(rid, name, fut, start, deadline, now))
        return events

    def _event(self, rid: str, name: str, fut: cf.Future, start: float, deadline: float, now: float) -> ToolEvent:
        log = {"tool": name, "duration_s": now - start}
        if not fut.done():
            self._pool.abandon(fut)
            self.num_errors += 1
            return ToolEvent(rid, name, f"error: tool {name!r} timed out after {deadline - start:.1f}s", True, log)
        try:
            kind, value = fut.result()
        except Exception as e:   # the workers refused the call (too many hung ones)
            kind, value = _Outcome.RAISED, f"error: {e}"
        if kind is _Outcome.SCRIPTED:
            return ToolEvent(rid, name, "", False, dict(log, return_tokens=value))
        if kind in (_Outcome.REFUSED, _Outcome.RAISED):
            self.num_errors += 1
            return ToolEvent(rid, name, str(value), True, log)
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        text = _valid_unicode(text)
        if len(text) > self.max_result_chars:
            text = text[:self.max_result_chars] + f"... [truncated {len(text) - self.max_result_chars} characters]"
        return ToolEvent(rid, name, text, False, log)

    def poll_ready(self, now: float) -> bool:
        """Whether `poll(now)` would return something."""
        return any((n == "script" and now >= d) or (n != "script" and (f.done() or now >= d))
                   for f, _, d, n in self._running.values())

    def next_deadline(self) -> float | None:
        return min((d for _, _, d, _ in self._running.values()), default=None)

    def wait(self, timeout_s: float) -> None:
        """Block until a running call may have completed (or the timeout passes)."""
        futs = [f for f, _, _, n in self._running.values() if n != "script" and not f.done()]
        if futs:
            cf.wait(futs, timeout=timeout_s, return_when=cf.FIRST_COMPLETED)

    # --- results as tokens -----------------------------------------------------------------
    def result_tokens(self, event: ToolEvent) -> list[int]:
        if event.log.get("return_tokens") is not None:      # scripted: filler of the trace's length
            n = event.log["return_tokens"]
            ids = self.tokenizer.encode(_FILLER * (n // 4 + 2), add_special_tokens=False)
            return (ids * (n // max(1, len(ids)) + 1))[:n]
        return self.tool_turn_tokens(event.content)

    def tool_turn_tokens(self, content: str) -> list[int]:
        """End the assistant's turn, add a tool turn with `content`, open the next assistant turn."""
        hf = self.tokenizer.hf
        mark = "\u2063TANDEM_MARK\u2063"
        try:
            from tandem.tools.chat_format import render_chat
            base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}]
            text = render_chat(hf, base + [{"role": "tool", "content": content}])
            suffix = text[text.index(mark) + len(mark):]
        except Exception:       # a template without a way to write this turn: plain Hermes text
            suffix = f"\n<tool_response>\n{content}\n</tool_response>\n"
        return self.tokenizer.encode(suffix, add_special_tokens=False)

    def shutdown(self) -> None:
        self._pool.shutdown()


def _valid_unicode(text: str) -> str:
    """`text` with lone UTF-16 surrogates (which the tokenizer refuses) replaced by U+FFFD."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _invoke(fn, args: dict[str, Any]) -> tuple[_Outcome, Any]:
    try:
        return _Outcome.OK, fn(**args)
    except Exception as e:  # the tool's own failure becomes the model's error message
        return _Outcome.RAISED, f"error: {type(e).__name__}: {e}"
