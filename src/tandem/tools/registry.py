"""The tool registry: named callables with OpenAI function schemas and per-call timeouts.

Tools are plain Python callables taking keyword arguments (the JSON arguments of the call) and
returning a string, or anything JSON-serialisable. `ToolRegistry.with_builtins()` holds the real
built-ins (`calculator`, `retrieve`); users add their own with `register(fn, schema)`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from tandem.errors import ConfigError


@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]          # OpenAI tool shape: {"type": "function", "function": {...}}
    timeout_s: float


def _schema_from_signature(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    props = {p: {"type": "string"} for p in inspect.signature(fn).parameters}
    return {"type": "function", "function": {"name": name, "description": (fn.__doc__ or "").strip(),
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": list(props)}}}


class ToolRegistry:
    def __init__(self, default_timeout_s: float = 10.0) -> None:
        self.default_timeout_s = default_timeout_s
        self._tools: dict[str, Tool] = {}

    def register(self, fn: Callable[..., Any], schema: dict[str, Any] | None = None, *, name: str | None = None,
                 timeout_s: float | None = None) -> Tool:
        if not callable(fn):
            raise ConfigError(f"tool {fn!r} is not callable")
        if schema is not None and "function" not in schema:
            schema = {"type": "function", "function": schema}       # accept the bare function schema too
        name = name or (schema["function"]["name"] if schema else fn.__name__)
        schema = schema or _schema_from_signature(fn, name)
        schema["function"]["name"] = name
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
        tool = Tool(name, fn, schema, timeout_s or self.default_timeout_s)
        self._tools[name] = tool
        return tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return sorted(self._tools)

    def schemas(self, names: list[str] | None = None) -> list[dict[str, Any]]:
        chosen = self.names() if names is None else names
        return [self._tools[n].schema for n in chosen if n in self._tools]

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    @classmethod
    def with_builtins(cls, docs_dir: str | None = None, default_timeout_s: float = 10.0) -> "ToolRegistry":
        from tandem.tools.builtins import CALCULATOR_SCHEMA, RETRIEVE_SCHEMA, Retriever, calculator

        reg = cls(default_timeout_s)
        reg.register(calculator, CALCULATOR_SCHEMA)
        reg.register(Retriever(docs_dir).search, RETRIEVE_SCHEMA, name="retrieve")
        return reg
