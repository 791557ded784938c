"""Pythonic tool calls (vLLM's `pythonic`; Llama 3.2 / 4, ToolACE): the output opens with a Python
list of calls with keyword arguments, optionally inside `<|python_start|>...<|python_end|>`:

    [get_weather(city="Paris", unit="celsius"), get_time()]

The list is read with `ast`, never run: the function is a name (or a dotted one, `a.b`), the
arguments keywords whose values are literals (strings, numbers, True/False/None, lists, dicts,
tuples), which become the JSON arguments. An output that does not open with such a list (after
whitespace) is content, as is any list that is not all calls; text after the list is content.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from tandem.tools.parsers.base import ToolCall
from tandem.tools.parsers._stream import NEED_MORE, AnchoredCallStream, ValueExtent, finite_json, whole

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_MAX_SOURCE = 1_000_000          # longer lists are not parsed (ast on huge input is slow)


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def python_calls(source: str) -> list[ToolCall] | None:
    """The calls in `source`, a Python list of calls, or None if it is not one."""
    if len(source) > _MAX_SOURCE:
        return None
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted(node.func)
        if name is None:
            return None
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:                 # **kwargs
                return None
            try:
                value = ast.literal_eval(kw.value)
                json.dumps(value, allow_nan=False)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
            args[kw.arg] = value
        if not finite_json(args):
            return None
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls


def _opens(text: str) -> bool:
    if text.startswith(PYTHON_START):
        rest = text[len(PYTHON_START):].lstrip()
        return not rest or rest[0] == "["
    return text[0] == "[" or PYTHON_START.startswith(text)


class _ListReader:
    def __init__(self) -> None:
        self.start = -1
        self.end = -1                 # where the list ends, once it has
        self.calls: list[ToolCall] = []
        self.extent = ValueExtent(python=True)

    def __call__(self, text: str, final: bool) -> Any:
        if self.start < 0:
            if PYTHON_START.startswith(text) and not final:
                return NEED_MORE
            i = len(PYTHON_START) if text.startswith(PYTHON_START) else 0
            while i < len(text) and text[i].isspace():
                i += 1
            if i >= len(text):
                return None if final else NEED_MORE
            self.start = i
        if self.end < 0:
            end = self.extent.scan(text[self.start:])
            if end is None:
                return None if final else NEED_MORE
            calls = python_calls(text[self.start:self.start + end])
            if calls is None:
                return None
            self.end, self.calls = self.start + end, calls
        j = self.end                              # a closing <|python_end|> goes with the calls
        while j < len(text) and text[j].isspace():
            j += 1
        if text.startswith(PYTHON_END, j):
            return j + len(PYTHON_END), self.calls
        if not final and PYTHON_END.startswith(text[j:]):
            return NEED_MORE                      # it may be arriving
        return self.end, self.calls


class PythonicToolParser:
    name = "pythonic"
    needs_special_tokens = False        # with the tags decoded away, the list alone still parses

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return whole(self.stream(), text)

    def stream(self) -> AnchoredCallStream:
        return AnchoredCallStream(_opens, _ListReader())
