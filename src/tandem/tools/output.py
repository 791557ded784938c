"""A chat output taken apart: reasoning first (a reasoning parser, when the server has one), then
tool calls in what follows it (the request's tool parser), the rest being the content. Whole and
streamed give the same result for any split of the text, since both parsers do.
"""

from __future__ import annotations

from tandem.tools.parsers import ToolCall, ToolParser
from tandem.tools.reasoning import ReasoningParser


def parse_output(text: str, tools: ToolParser | None, reasoning: ReasoningParser | None = None
                 ) -> tuple[str | None, str | None, list[ToolCall]]:
    """(reasoning, content, tool calls) of a finished output. Without a reasoning parser the
    content is as the tool parser gives it (the text itself without one); with one, empty content
    is None."""
    thought = None
    if reasoning is not None:
        thought, text = reasoning.parse(text)
        text = text or ""
    content, calls = tools.parse(text) if tools is not None else (text, [])
    if reasoning is not None and not content:
        content = None
    return thought, content, calls


class OutputStream:
    """`parse_output` incrementally, for one streamed choice."""

    def __init__(self, tools: ToolParser | None, reasoning: ReasoningParser | None = None) -> None:
        self._tools = tools.stream() if tools is not None else None
        self._reasoning = reasoning.stream() if reasoning is not None else None

    @property
    def num_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, tool calls) that the new text (the last when `finished`) settles."""
        thought, content = "", delta
        if self._reasoning is not None:
            thought, content = self._reasoning.feed(delta)
            if finished:
                more_thought, more_content = self._reasoning.flush()
                thought, content = thought + more_thought, content + more_content
        calls: list[ToolCall] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content)
            if finished:
                rest, more = self._tools.flush()
                content, calls = content + rest, calls + more
        return thought, content, calls
