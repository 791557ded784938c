"""Tool-call parsers: find a model's tool calls in its generated text.

A parser turns finished text into `(content, tool_calls)`; for streaming it hands out a
`ToolCallStream` that takes text deltas and returns the content that is safe to show now plus the
tool calls completed so far. Parsing the whole text at once must equal feeding it in any pieces, so
streamed and non-streamed responses agree. Malformed calls stay in the content, never raise.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One function call: `arguments` is a JSON text (the OpenAI wire format)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)


class ToolCallStream(Protocol):
    """Incremental parser state for one generated sequence."""

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Take new text; return (content that can be shown now, tool calls completed by it)."""
        ...

    def flush(self) -> tuple[str, list[ToolCall]]:
        """End of text: return what was held back (content, and any last calls)."""
        ...

    @property
    def num_calls(self) -> int:
        """Tool calls found so far."""
        ...


class ToolParser(Protocol):
    """A tool-call text format (Hermes `<tool_call>` JSON, ...)."""

    name: str

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None when only tool calls were produced, tool calls in order)."""
        ...

    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one sequence."""
        ...


def get_tool_parser(name: str = "hermes") -> ToolParser:
    """The parser registered under `name`."""
    from tandem.tools.parsers.hermes import HermesToolParser

    parsers: dict[str, type] = {"hermes": HermesToolParser}
    if name not in parsers:
        raise ValueError(f"unknown tool parser {name!r}; known: {sorted(parsers)}")
    return parsers[name]()


__all__ = ["ToolCall", "ToolCallStream", "ToolParser", "get_tool_parser", "new_tool_call_id"]
