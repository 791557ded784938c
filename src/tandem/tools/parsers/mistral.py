"""Mistral tool calls (vLLM's `mistral`), after the `[TOOL_CALLS]` special token, in either form:

- the older one (tokenizers before v11): a JSON array of calls (or one call object),
  `[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]`;
- the newer one (v11+): the name, then `[ARGS]` (or straight away `{`) and the arguments object,
  one marker per call: `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}`.

Text before the first marker is content, as is text after the calls. A marker not followed by a
well-formed call (bad JSON, a name with characters a function name cannot have, an output cut
short) stays in the content as written. Calls get Mistral's ids: 9 letters and digits (what
Mistral's chat template accepts back in `tool_call_id`). `[TOOL_CALLS]` and `[ARGS]` are special
tokens, so the chat path decodes tool requests with special tokens kept (`needs_special_tokens`).
"""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

from tandem.tools.parsers.base import ToolCall
from tandem.tools.parsers._stream import NEED_MORE, MarkerCallStream, ValueExtent, arguments_json, whole

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_.-")
_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """A Mistral tool-call id: 9 random letters and digits."""
    return "".join(random.choices(_ALPHANUMERIC, k=9))


def _json_calls(value: Any) -> list[ToolCall] | None:
    """The calls in the older form's JSON (a list of calls or one call), or None if any is not one."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for obj in items:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not _NAME.match(obj["name"]):
            return None
        args = arguments_json(obj.get("arguments", {}))
        if args is None:
            return None
        calls.append(ToolCall(obj["name"], args, id=mistral_call_id()))
    return calls or None


class _Body:
    """What follows one `[TOOL_CALLS]`: a JSON array/object (older form) or `name[ARGS]{...}`."""

    def __init__(self) -> None:
        self.start = -1              # where the JSON value starts
        self.extent: ValueExtent | None = None
        self.name: str | None = None

    def __call__(self, text: str, final: bool) -> Any:
        if self.start < 0:
            found = self._find_start(text, final)
            if found is not NEED_MORE and found is not True:
                return found
            if found is NEED_MORE:
                return NEED_MORE
        end = self.extent.scan(text[self.start:])
        if end is None:
            return None if final else NEED_MORE
        try:
            value = json.loads(text[self.start:self.start + end])
        except (ValueError, RecursionError):
            return None
        if self.name is None:
            calls = _json_calls(value)
        else:
            args = arguments_json(value) if isinstance(value, dict) else None
            calls = None if args is None else [ToolCall(self.name, args, id=mistral_call_id())]
        return None if calls is None else (self.start + end, calls)

    def _find_start(self, text: str, final: bool) -> Any:
        """Locate the JSON value: True when found (self.start set), else NEED_MORE or None."""
        stripped = text.lstrip()
        if not stripped:
            return None if final else NEED_MORE
        lead = len(text) - len(stripped)
        if stripped[0] in "[{" and not ARGS.startswith(stripped[:len(ARGS)]):
            self.start, self.extent = lead, ValueExtent()          # the older form: JSON right away
            return True
        i, name_end = lead, None
        while i < len(text):                                       # the newer form: name, [ARGS], {
            c = text[i]
            if c == "{" or text.startswith(ARGS, i):
                name = text[lead:i].strip()
                if not _NAME.match(name):
                    return None
                j = i + len(ARGS) if c != "{" else i
                while j < len(text) and text[j].isspace():
                    j += 1
                if j >= len(text):
                    return None if final else NEED_MORE
                if text[j] != "{":
                    return None
                self.name, self.start, self.extent = name, j, ValueExtent()
                return True
            if c == "[":
                return NEED_MORE if ARGS.startswith(text[i:]) and not final else None   # `[ARGS]` arriving?
            if c.isspace():
                name_end = i if name_end is None else name_end
            elif c not in _NAME_CHARS or name_end is not None:
                return None                                        # not a name (or a space inside one)
            i += 1
        return None if final else NEED_MORE


class MistralToolParser:
    name = "mistral"
    needs_special_tokens = True

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return whole(self.stream(), text)

    def stream(self) -> MarkerCallStream:
        return MarkerCallStream((TOOL_CALLS,), lambda _marker: _Body())
