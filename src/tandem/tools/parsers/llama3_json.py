"""Llama 3.1 / 3.2 JSON tool calls (vLLM's `llama3_json`): the output opens with the calls, each
`{"name": ..., "parameters": {...}}` (or "arguments"), several separated by `;`, optionally after
`<|python_tag|>`:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

Only an output that opens with a call (after whitespace) has calls: JSON further into a reply is
content (vLLM's streaming path decides the same way; its whole-text path would also pick up JSON
objects after prose). A first call that does not parse leaves the whole text as content; a later
one ends the calls there, the rest being content. `<|python_tag|>` is a special token, so the chat
path decodes tool requests with special tokens kept (`needs_special_tokens`).
"""

from __future__ import annotations

import json
from typing import Any

from tandem.tools.parsers.base import ToolCall
from tandem.tools.parsers._stream import NEED_MORE, AnchoredCallStream, ValueExtent, arguments_json, whole

PYTHON_TAG = "<|python_tag|>"


def llama_call(obj: Any) -> ToolCall | None:
    """The call in a parsed JSON object, or None: a non-empty string `name` and an object (or JSON
    text of one) under `parameters` or `arguments` (one of the two is required)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if "parameters" in obj and "arguments" in obj:
        return None
    key = "parameters" if "parameters" in obj else "arguments" if "arguments" in obj else None
    if key is None:
        return None
    args = arguments_json(obj[key])
    return None if args is None else ToolCall(obj["name"], args)


def _opens(text: str) -> bool:
    if text.startswith(PYTHON_TAG):
        rest = text[len(PYTHON_TAG):].lstrip()
        return not rest or rest[0] == "{"
    return text[0] == "{" or PYTHON_TAG.startswith(text)


class _CallReader:
    """Reads `{...}; {...}` after the optional tag, one call at a time (see the module docstring)."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.pos = -1                # start of the object being read (-1: between calls)
        self.end = 0                 # end of the last call read
        self.extent: ValueExtent | None = None

    def __call__(self, text: str, final: bool) -> Any:
        if PYTHON_TAG.startswith(text) and not final:
            return NEED_MORE
        if self.pos < 0 and not self.calls:
            self.pos = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
            while self.pos < len(text) and text[self.pos].isspace():
                self.pos += 1
            if self.pos >= len(text):
                return None if final else self._rewind()
            self.extent = ValueExtent()
        while True:
            if self.pos < 0:                       # after a call: `;`, whitespace, then another `{`?
                i = self.end
                while i < len(text) and text[i].isspace():
                    i += 1
                if i < len(text) and text[i] == ";":
                    i += 1
                    while i < len(text) and text[i].isspace():
                        i += 1
                if i >= len(text):
                    return self._done() if final else NEED_MORE
                if text[i] != "{":
                    return self._done()
                self.pos, self.extent = i, ValueExtent()
            end = self.extent.scan(text[self.pos:])
            if end is None:
                return self._done() if final else NEED_MORE
            try:
                call = llama_call(json.loads(text[self.pos:self.pos + end]))
            except (ValueError, RecursionError):
                call = None
            if call is None:
                return self._done()
            self.calls.append(call)
            self.end, self.pos = self.pos + end, -1

    def _rewind(self) -> Any:
        self.pos = -1
        return NEED_MORE

    def _done(self) -> Any:
        """The calls read so far end here (None: there were none, the text is content)."""
        return (self.end, self.calls) if self.calls else None


class Llama3JsonToolParser:
    name = "llama3_json"
    needs_special_tokens = True

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return whole(self.stream(), text)

    def stream(self) -> AnchoredCallStream:
        return AnchoredCallStream(_opens, _CallReader())
