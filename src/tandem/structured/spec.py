"""What a request's output must match (vLLM's `StructuredOutputsParams` shape): exactly one of a
JSON schema, any JSON object, a regular expression, a list of choices, or a grammar."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

from tandem.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """`json`: a JSON schema (dict or its JSON text); `json_object`: any JSON object; `regex`: a
    regular expression the whole output matches; `choice`: the output is one of these strings;
    `grammar`: a Lark or GBNF (llama.cpp) grammar. `field` names the request field it came from,
    for error messages (e.g. "response_format")."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(given) != 1:
            raise InvalidRequestError(
                f"give exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}", field=self.field)
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", field=self.field) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("a JSON schema must be an object", field=self.field)
            object.__setattr__(self, "json", schema)
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise InvalidRequestError("regex must be a non-empty string", field=self.field)
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar.strip()):
            raise InvalidRequestError("grammar must be a non-empty string", field=self.field)
        if self.choice is not None:
            choices = self.choice
            if isinstance(choices, str) or not all(isinstance(c, str) and c for c in choices) or not choices:
                raise InvalidRequestError("choice must be a non-empty list of non-empty strings", field=self.field)
            object.__setattr__(self, "choice", tuple(choices))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints compile once."""
        kind = self.kind
        if kind == "json":
            return kind, _json.dumps(self.json, sort_keys=True)
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, _json.dumps(list(self.choice))
        return kind, getattr(self, kind)
