"""Reasoning parsers (`tandem serve --reasoning-parser`, vLLM's names): split a reasoning model's
output into its reasoning (`<think>...</think>`) and the answer (content), which the chat endpoint
returns as `reasoning` / `reasoning_content` and `content`; tool calls are parsed from the content.

As vLLM 0.32 does:

- `deepseek_r1`: the output is reasoning up to `</think>`, whether or not it opens with `<think>`
  (R1's template writes `<think>` into the prompt); with no `</think>` at all, all of it is
  reasoning and there is no content.
- `qwen3`: the same, with Qwen3's extras: a `<tool_call>` also ends the reasoning (the call is
  content, for the tool parser), a stray `</think>` after the reasoning is dropped, and with
  `chat_template_kwargs: {"enable_thinking": false}` there is no reasoning (the text is the content).

A `<think>` inside the reasoning is dropped (it opens what is already open; for deepseek_r1, with
the whitespace before it when it opens the output). Text is not otherwise trimmed:
Qwen3's `\\n\\n` after `</think>` starts the content, as in vLLM. Empty reasoning or content is None.
Streaming holds back only text that may be a partial tag, and equals parsing the whole text.
"""

from __future__ import annotations

from typing import Any, Protocol

from tandem.tools.parsers._stream import earliest, partial_suffix_len

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


class ReasoningStream(Protocol):
    def feed(self, delta: str) -> tuple[str, str]:
        """Take new text; return (reasoning, content) that can be shown now."""
        ...

    def flush(self) -> tuple[str, str]:
        """End of text: what was held back."""
        ...


class ReasoningParser(Protocol):
    name: str

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content), each None when empty."""
        ...

    def stream(self) -> ReasoningStream:
        ...


class ThinkStream:
    """Reasoning first (until an end marker), then content."""

    def __init__(self, ends: tuple[str, ...], kept_ends: tuple[str, ...], dropped_in_content: tuple[str, ...],
                 thinking: bool = True, open_drops_whitespace: bool = False) -> None:
        self._lead = open_drops_whitespace       # whitespace before an opening <think> is dropped
        self._ends = ends                       # end the reasoning, and are dropped
        self._kept = kept_ends                  # end the reasoning, and start the content
        self._in_reasoning_markers = (THINK_OPEN, *ends, *kept_ends)
        self._dropped = dropped_in_content if thinking else ()    # dropped from the content
        self._reasoning = thinking
        self._buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._run(final=False)

    def flush(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        if self._lead and self._reasoning:
            body = self._buf.lstrip()
            if not final and (not body or (THINK_OPEN.startswith(body) and body != THINK_OPEN)):
                return "", ""                   # leading whitespace, or what may be <think>
            self._lead = False
            if body.startswith(THINK_OPEN):
                self._buf = body
        while self._reasoning:
            hit = earliest(self._buf, self._in_reasoning_markers)
            if hit is None:
                keep = 0 if final else partial_suffix_len(self._buf, self._in_reasoning_markers)
                reasoning.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return "".join(reasoning), ""
            i, marker = hit
            reasoning.append(self._buf[:i])
            self._buf = self._buf[i if marker in self._kept else i + len(marker):]
            if marker != THINK_OPEN:
                self._reasoning = False
        if self._dropped:
            while (hit := earliest(self._buf, self._dropped)) is not None:
                content.append(self._buf[:hit[0]])
                self._buf = self._buf[hit[0] + len(hit[1]):]
            keep = 0 if final else partial_suffix_len(self._buf, self._dropped)
        else:
            keep = 0
        content.append(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return "".join(reasoning), "".join(content)


class _ThinkParser:
    name = ""
    ends: tuple[str, ...] = (THINK_CLOSE,)
    kept_ends: tuple[str, ...] = ()
    dropped_in_content: tuple[str, ...] = ()

    def __init__(self, thinking: bool = True) -> None:
        self.thinking = thinking

    def parse(self, text: str) -> tuple[str | None, str | None]:
        stream = self.stream()
        r1, c1 = stream.feed(text)
        r2, c2 = stream.flush()
        return (r1 + r2) or None, (c1 + c2) or None

    open_drops_whitespace = False

    def stream(self) -> ThinkStream:
        return ThinkStream(self.ends, self.kept_ends, self.dropped_in_content, self.thinking,
                           self.open_drops_whitespace)


class DeepSeekR1ReasoningParser(_ThinkParser):
    name = "deepseek_r1"
    open_drops_whitespace = True            # vLLM drops what precedes R1's <think>


class Qwen3ReasoningParser(_ThinkParser):
    name = "qwen3"
    kept_ends = ("<tool_call>",)
    dropped_in_content = (THINK_CLOSE,)


def get_reasoning_parser(name: str, chat_template_kwargs: dict[str, Any] | None = None) -> ReasoningParser:
    """The parser registered under `name` (one of REASONING_PARSERS), for a request rendered with
    `chat_template_kwargs` (Qwen3 reads `enable_thinking` there)."""
    if name == "deepseek_r1":
        return DeepSeekR1ReasoningParser()
    if name == "qwen3":
        thinking = (chat_template_kwargs or {}).get("enable_thinking", True) is not False
        return Qwen3ReasoningParser(thinking)
    raise ValueError(f"unknown reasoning parser {name!r}; known: {list(REASONING_PARSERS)}")


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]
