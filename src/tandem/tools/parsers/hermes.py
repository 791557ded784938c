"""Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more.

The format of NousResearch Hermes 2 Pro and Qwen 2/2.5/3. Whitespace around and inside the tags is
tolerated; whitespace that only separates tool calls from each other or from the content is dropped.
A block whose JSON is not a call (bad JSON, no name) is left in the content as the model wrote it.

Streaming holds text back from the moment a `<tool_call>` tag may be starting until it closes, then
emits the call whole (one tool-call delta per call). The stream is also the engine's detector for
tools it runs itself (tandem.engine.tool_runtime): it reads `closed_blocks`, every closed block's
text whether or not it is a call, since there a malformed call gets an error turn, not content.
"""

from __future__ import annotations

import json

from tandem.tools.parsers.base import ToolCall
from tandem.tools.parsers._stream import HeldWhitespace

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def parse_call(raw: str) -> ToolCall | None:
    """The call in the JSON between the tags, or None if it is not one."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_tag_len(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of the opening tag."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class HermesToolCallStream(HeldWhitespace):
    """Incremental Hermes parser for one sequence (see the module docstring)."""

    def __init__(self) -> None:
        self._buf = ""              # text not yet classified
        self._in_call = False       # inside <tool_call> ... waiting for </tool_call>
        self._ws = ""               # trailing whitespace held back (may precede a tool call)
        self._after_call = False    # drop whitespace that directly follows a call
        self._num_calls = 0
        self.closed_blocks: list[str] = []   # the text between each pair of tags so far, call or not

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        out: list[str] = []
        calls: list[ToolCall] = []
        while self._step(out, calls):
            pass
        return "".join(out), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        out: list[str] = []
        self._emit(OPEN + self._buf if self._in_call else self._buf, out)   # an unclosed call is content
        self._buf, self._in_call = "", False
        if self._num_calls == 0:
            out.append(self._ws)
        self._ws = ""
        return "".join(out), []

    def _step(self, out: list[str], calls: list[ToolCall]) -> bool:
        """Consume one piece of the buffer; False when the rest must wait for more text."""
        if self._in_call:
            end = self._buf.find(CLOSE)
            if end < 0:
                return False
            raw, self._buf, self._in_call = self._buf[:end], self._buf[end + len(CLOSE):], False
            self.closed_blocks.append(raw)
            call = parse_call(raw)
            if call is None:
                self._emit(OPEN + raw + CLOSE, out)
            else:
                calls.append(call)
                self._num_calls += 1
                self._ws, self._after_call = "", True
            return True
        start = self._buf.find(OPEN)
        if start >= 0:
            self._emit(self._buf[:start], out)
            self._buf, self._in_call = self._buf[start + len(OPEN):], True
            return True
        keep = _partial_tag_len(self._buf)
        self._emit(self._buf[:len(self._buf) - keep], out)
        self._buf = self._buf[len(self._buf) - keep:]
        return False


class HermesToolParser:
    name = "hermes"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        stream = self.stream()
        content, calls = stream.feed(text)
        rest, more = stream.flush()
        content, calls = content + rest, calls + more
        return (content or None) if calls else content, calls

    def stream(self) -> HermesToolCallStream:
        return HermesToolCallStream()
