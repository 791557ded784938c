"""Qwen3 tool calls (`qwen3`): inside `<tool_call>...</tool_call>`, either the JSON object of Qwen 2.5
and Qwen3 (`{"name": ..., "arguments": {...}}`, as `hermes` reads it) or the XML of Qwen3-Coder and
Qwen3.5 (`<function=NAME><parameter=P>value</parameter></function>`, as `qwen3_coder` reads it,
parameters typed by the tools' schemas). Each block is read as whichever form it is written in.
"""

from __future__ import annotations

from typing import Any

from tandem.tools.parsers.base import ToolCall
from tandem.tools.parsers._stream import MarkerCallStream, whole
from tandem.tools.parsers.qwen3_coder import TOOL_OPEN, XmlBody


class Qwen3ToolParser:
    name = "qwen3"
    needs_special_tokens = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return whole(self.stream(), text)

    def stream(self) -> MarkerCallStream:
        return MarkerCallStream((TOOL_OPEN,), lambda marker: XmlBody(marker, self.tools, json_calls=True))
