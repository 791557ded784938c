"""Tool calls forced by `tool_choice` (a named function, or "required"), as vLLM does them: the
request's output is constrained by a JSON-schema grammar (tandem.structured), so the model writes
the call itself as JSON rather than in its chat format's tags, and this parser reads it back.

- a named function: the output is the function's arguments object (its `parameters` schema);
- "required": the output is a non-empty array of {"name": one of the tools, "parameters": its
  arguments}, one element per call.

An output cut short by max_tokens is not a valid call: it stays in the content, like any
malformed call. Calls come out when the text is complete (streamed as one delta at the end)."""

from __future__ import annotations

import json
from typing import Any

from tandem.structured.spec import StructuredOutputs
from tandem.tools.parsers.base import ToolCall


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", {}).get("parameters") or {"type": "object"}


def forced_constraint(tools: list[dict[str, Any]], choice: Any) -> StructuredOutputs:
    """The output constraint of tool_choice `choice` ("required" or {"function": {"name": ...}})."""
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                   "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    else:
        name = choice["function"]["name"]
        schema = _parameters(next(t for t in tools if t["function"]["name"] == name))
    return StructuredOutputs(json=schema, field="tool_choice")


class _Buffered:
    def __init__(self, parser: "ForcedToolParser") -> None:
        self._parser, self._text, self._calls = parser, "", 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._text += delta
        return "", []

    def flush(self) -> tuple[str, list[ToolCall]]:
        content, calls = self._parser.parse(self._text)
        self._calls = len(calls)
        return content or "", calls

    @property
    def num_calls(self) -> int:
        return self._calls


class ForcedToolParser:
    name = "forced"

    def __init__(self, function: str | None) -> None:
        self.function = function        # None: tool_choice "required"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        if self.function is not None:
            return (None, [ToolCall(self.function, json.dumps(value))]) if isinstance(value, dict) else (text, [])
        if not isinstance(value, list) or not value or not all(
                isinstance(v, dict) and isinstance(v.get("name"), str) and "parameters" in v for v in value):
            return text, []
        return None, [ToolCall(v["name"], json.dumps(v["parameters"])) for v in value]

    def stream(self) -> _Buffered:
        return _Buffered(self)
