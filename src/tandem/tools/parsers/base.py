"""What every tool-call parser shares: the call it finds (`ToolCall`) and the protocols of a parser
and of its streaming state (tandem.tools.parsers explains them)."""

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
