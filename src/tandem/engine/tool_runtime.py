"""Server-side tool calls inside generation (AugServe's setting), run by the engine.

For each tool-enabled request the runtime watches the generated text; when a complete
`<tool_call>...</tool_call>` appears it hands back the call, the engine pauses the request in the
scheduler, and the tool runs on a worker thread with its timeout. Finished calls are collected by
`poll()`; their result (or an error message: unknown tool, malformed call, exception, timeout) is
truncated to `max_result_chars` and turned into tokens through the chat template's tool turn, and
the engine resumes the request with them. Scripted requests (InferCept's trace method) pause after
each segment's `completion_tokens` for `api_time_s` and resume with `return_tokens` filler tokens.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from dataclasses import dataclass, field
from typing import Any

from tandem.tools.parsers.hermes import CLOSE, OPEN, parse_call
from tandem.tools.registry import ToolRegistry

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
    text: str = ""                  # generated text since the last tool result
    segment: int = 0                # scripted: current segment
    segment_tokens: int = 0         # scripted: tokens generated in it


@dataclass
class ToolEvent:
    request_id: str
    tool: str
    content: str
    error: bool = False
    log: dict[str, Any] = field(default_factory=dict)


class ToolRuntime:
    def __init__(self, registry: ToolRegistry, tokenizer, max_workers: int = 8, max_result_chars: int = 4000) -> None:
        self.registry = registry
        self.tokenizer = tokenizer
        self.max_result_chars = max_result_chars
        self._pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tandem-tool")
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
            fut[0].cancel()

    def is_watched(self, request_id: str) -> bool:
        return request_id in self._watch

    def num_calls_of(self, request_id: str) -> int:
        w = self._watch.get(request_id)
        return w.segment if w else 0

    def on_tokens(self, request_id: str, new_text: str, num_new_tokens: int) -> str | None:
        """Feed a step's output; returns the raw tool call (or a script marker) if one completed."""
        w = self._watch.get(request_id)
        if w is None:
            return None
        if w.options.script is not None:
            return self._scripted(w, num_new_tokens)
        w.text += new_text
        start = w.text.find(OPEN)
        end = w.text.find(CLOSE, start + len(OPEN)) if start != -1 else -1
        if end == -1:
            return None
        raw = w.text[start + len(OPEN):end]
        w.text = ""
        w.segment += 1
        return raw

    def _scripted(self, w: _Watch, num_new_tokens: int) -> str | None:
        script = w.options.script
        if w.segment >= len(script) - 1:          # the last segment ends with the request
            return None
        w.segment_tokens += num_new_tokens
        if w.segment_tokens < script[w.segment][0]:
            return None
        w.segment_tokens = 0
        w.segment += 1
        return "__script__"

    def over_limit(self, request_id: str) -> bool:
        w = self._watch[request_id]
        return w.options.script is None and w.segment > w.options.max_tool_calls

    # --- running calls ---------------------------------------------------------------------
    def start(self, request_id: str, raw: str, now: float) -> tuple[str, float | None]:
        """Start the call; returns (tool name, expected duration if known from the script)."""
        w = self._watch[request_id]
        self.num_calls += 1
        if raw == "__script__":
            _, api_time, ret = w.options.script[w.segment - 1]
            fut: cf.Future = cf.Future()
            fut.set_result(("__script__", ret))
            self._running[request_id] = (fut, now, now + api_time, "script")
            return w.options.key, api_time
        call = parse_call(raw.strip())
        name = call.name if call else "?"
        tool = self.registry.get(name) if call else None
        allowed = w.options.names is None or name in w.options.names
        if call is None or tool is None or not allowed:
            msg = (f"error: malformed tool call {raw.strip()[:200]!r}" if call is None else f"error: unknown tool {name!r}")
            fut = cf.Future()
            fut.set_result(("__error__", msg))
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
            fut.cancel()
            self.num_errors += 1
            return ToolEvent(rid, name, f"error: tool {name!r} timed out after {deadline - start:.1f}s", True, log)
        kind, value = fut.result()
        if kind == "__script__":
            return ToolEvent(rid, name, "", False, dict(log, return_tokens=value))
        if kind in ("__error__", "__raised__"):
            self.num_errors += 1
            return ToolEvent(rid, name, str(value), True, log)
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
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
        self._pool.shutdown(wait=False, cancel_futures=True)


def _invoke(fn, args: dict[str, Any]) -> tuple[str, Any]:
    try:
        return "__ok__", fn(**args)
    except Exception as e:  # the tool's own failure becomes the model's error message
        return "__raised__", f"error: {type(e).__name__}: {e}"
