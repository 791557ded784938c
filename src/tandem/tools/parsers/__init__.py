"""Tool-call parsers: find a model's tool calls in its generated text.

A parser turns finished text into `(content, tool_calls)`; for streaming it hands out a
`ToolCallStream` that takes text deltas and returns the content that is safe to show now plus the
tool calls completed so far. Parsing the whole text at once must equal feeding it in any pieces, so
streamed and non-streamed responses agree. Malformed calls stay in the content, never raise.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


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
    """A tool-call text format (Hermes `<tool_call>` JSON, ...).

    `needs_special_tokens` (optional, default False): the format's markers are special tokens
    (Mistral's `[TOOL_CALLS]`), so the chat path decodes tool requests with special tokens kept,
    as vLLM does."""

    name: str

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None when only tool calls were produced, tool calls in order)."""
        ...

    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one sequence."""
        ...


TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3", "qwen3_coder")
# vLLM's other names for these formats
ALIASES = {"qwen3_json": "hermes", "qwen3_xml": "qwen3_coder", "llama4_json": "llama3_json",
           "llama4_pythonic": "pythonic"}


def get_tool_parser(name: str = "hermes", tools: list[dict[str, Any]] | None = None) -> ToolParser:
    """The parser registered under `name` (one of TOOL_PARSERS, or an alias in ALIASES), for a
    request offering `tools` (OpenAI tool dicts; the parsers that read typed parameters use their
    schemas)."""
    name = ALIASES.get(name, name)
    if name == "hermes":
        from tandem.tools.parsers.hermes import HermesToolParser

        return HermesToolParser()
    if name == "llama3_json":
        from tandem.tools.parsers.llama3_json import Llama3JsonToolParser as cls
    elif name == "mistral":
        from tandem.tools.parsers.mistral import MistralToolParser as cls
    elif name == "pythonic":
        from tandem.tools.parsers.pythonic import PythonicToolParser as cls
    elif name == "qwen3":
        from tandem.tools.parsers.qwen3 import Qwen3ToolParser as cls
    elif name == "qwen3_coder":
        from tandem.tools.parsers.qwen3_coder import Qwen3CoderToolParser as cls
    else:
        raise ValueError(f"unknown tool parser {name!r}; known: {list(TOOL_PARSERS) + list(ALIASES)}")
    return cls(tools)


__all__ = ["ALIASES", "TOOL_PARSERS", "ToolCall", "ToolCallStream", "ToolParser", "get_tool_parser", "new_tool_call_id"]
