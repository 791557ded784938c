"""Tool-call parsers: find a model's tool calls in its generated text.

A parser turns finished text into `(content, tool_calls)`; for streaming it hands out a
`ToolCallStream` that takes text deltas and returns the content that is safe to show now plus the
tool calls completed so far. Parsing the whole text at once must equal feeding it in any pieces, so
streamed and non-streamed responses agree. Malformed calls stay in the content, never raise.
"""

from __future__ import annotations

from typing import Any

from tandem.tools.parsers.base import ToolCall, ToolCallStream, ToolParser, new_tool_call_id

__all__ = ["ALIASES", "TOOL_PARSERS", "ToolCall", "ToolCallStream", "ToolParser", "get_tool_parser",
           "new_tool_call_id"]

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
