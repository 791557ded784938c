"""Qwen3-Coder XML tool calls (vLLM's `qwen3_coder`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

One or more `<function=NAME>` blocks inside `<tool_call>...</tool_call>` (a bare `<function=...>
...</function>` is taken too, as vLLM does); `</parameter>` may be left out before the next
parameter or `</function>`, and `</tool_call>` at the very end of the output. A value loses one
newline at each end (the template's framing) and is converted by the tool's JSON schema for that
parameter (integer, number, boolean, null, object, array; string stays as written), tried in
vLLM's order; a parameter with no schema type (or a function not in the request's tools) is read
as JSON where it parses, else kept as a string. A block that is not well formed stays content.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from tandem.tools.parsers.base import ToolCall
from tandem.tools.parsers._stream import NEED_MORE, MarkerCallStream, finite_json, whole

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)
_TYPE_ALIASES = {"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
                 "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "long": "integer",
                 "short": "integer", "unsigned": "integer", "float": "number", "float32": "number",
                 "float64": "number", "double": "number", "bool": "boolean", "dict": "object",
                 "list": "array", "arr": "array", "sequence": "array"}
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (`type`, `enum` values, anyOf/oneOf/allOf);
    empty when it says nothing about the type."""
    if not isinstance(schema, dict):
        return set()
    found: set[str] = set()
    t = schema.get("type")
    for name in [t] if isinstance(t, str) else t if isinstance(t, list) else []:
        if isinstance(name, str):
            found.add(_TYPE_ALIASES.get(name.strip().lower(), name.strip().lower()))
    for v in schema.get("enum") or [] if isinstance(schema.get("enum"), list) else []:
        found.add("null" if v is None else "boolean" if isinstance(v, bool) else "integer" if isinstance(v, int)
                  else "number" if isinstance(v, float) else "string" if isinstance(v, str)
                  else "array" if isinstance(v, list) else "object")
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or [] if isinstance(schema.get(key), list) else []:
            found |= schema_types(sub)
    return found


def _loose_json(value: str) -> Any:
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return value
    return parsed if finite_json(parsed) else value


def convert_value(value: str, types: set[str]) -> Any:
    """`value` as the first of `types` (in vLLM's order) it reads as; JSON (else the string) when
    none fits or no type is known."""
    for t in _ORDER:
        if t not in types:
            continue
        if t == "string":
            return value
        if t == "null" and value.strip().lower() == "null":
            return None
        if t == "integer":
            try:
                return int(value.strip())
            except ValueError:
                continue
        if t == "number":
            try:
                f = float(value.strip())
            except ValueError:
                continue
            if math.isfinite(f):
                return int(f) if f == int(f) else f
        if t == "boolean" and value.strip().lower() in ("true", "false", "1", "0"):
            return value.strip().lower() in ("true", "1")
        if t in ("object", "array"):
            parsed = _loose_json(value)
            if isinstance(parsed, dict if t == "object" else list):
                return parsed
    return _loose_json(value)


def _trim(value: str) -> str:
    """One newline off each end (the template writes the value on lines of its own)."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def parameter_types(tools: list[dict[str, Any]] | None, function: str) -> dict[str, set[str]]:
    for t in tools or []:
        fn = t.get("function") or {}
        if fn.get("name") == function:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: schema_types(v) for k, v in props.items()} if isinstance(props, dict) else {}
    return {}


def xml_calls(body: str, tools: list[dict[str, Any]] | None) -> list[ToolCall] | None:
    """The calls in `body` (one or more `<function=...>...</function>`, nothing else but
    whitespace around them), or None."""
    calls, pos = [], 0
    while pos < len(body):
        m = _FUNCTION.match(body, pos)
        if m is None:
            return None
        name, inner = m.group(1).strip(), m.group(2)
        if not _NAME.match(name):
            return None
        types = parameter_types(tools, name)
        args: dict[str, Any] = {}
        rest = inner
        for p in _PARAM.finditer(inner):
            key = p.group(1).strip()
            if not key:
                return None
            args[key] = convert_value(_trim(p.group(2)), types.get(key, set()))
        if _PARAM.sub("", rest).strip():                 # text outside the parameters
            return None
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        pos = m.end()
    return calls or None


class XmlBody:
    """The text after `<tool_call>` (up to `</tool_call>`) or after a bare `<function=`."""

    def __init__(self, marker: str, tools: list[dict[str, Any]] | None, json_calls: bool = False) -> None:
        self.marker, self.tools, self.json_calls = marker, tools, json_calls
        self.searched = 0

    def __call__(self, text: str, final: bool) -> Any:
        if self.marker == FUNC_OPEN:
            return self._bare(text, final)
        end = text.find(TOOL_CLOSE, self.searched)
        if end < 0:
            self.searched = max(0, len(text) - len(TOOL_CLOSE) + 1)
            if not final:
                return NEED_MORE
            calls = self._calls(text)                    # `</tool_call>` may be missing at the very end
            return None if calls is None else (len(text), calls)
        calls = self._calls(text[:end])
        return None if calls is None else (end + len(TOOL_CLOSE), calls)

    def _bare(self, text: str, final: bool) -> Any:
        end = text.find(FUNC_CLOSE, self.searched)
        if end < 0:
            self.searched = max(0, len(text) - len(FUNC_CLOSE) + 1)
            return None if final else NEED_MORE
        calls = xml_calls(FUNC_OPEN + text[:end + len(FUNC_CLOSE)], self.tools)
        return None if calls is None else (end + len(FUNC_CLOSE), calls)

    def _calls(self, body: str) -> list[ToolCall] | None:
        if self.json_calls and body.strip().startswith("{"):
            from tandem.tools.parsers.hermes import parse_call

            call = parse_call(body)
            return None if call is None else [call]
        return xml_calls(body, self.tools)


class Qwen3CoderToolParser:
    name = "qwen3_coder"
    needs_special_tokens = False       # <tool_call> is an ordinary added token in Qwen3's tokenizer

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return whole(self.stream(), text)

    def stream(self) -> MarkerCallStream:
        return MarkerCallStream((TOOL_OPEN, FUNC_OPEN), lambda marker: XmlBody(marker, self.tools))
