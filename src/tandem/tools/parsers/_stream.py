"""Shared machinery of the tool-call parsers: incremental streams whose output, for any split of the
text into deltas, equals parsing the text whole (each decision is taken only once the text seen so
far settles it, never from where a delta happens to end).

- `MarkerCallStream`: calls that begin at a marker anywhere in the content (`[TOOL_CALLS]`,
  `<tool_call>`); the content around them is shown as it comes, except a possible partial marker.
- `AnchoredCallStream`: calls that must open the output (Llama's JSON, pythonic lists); content
  before the first call is not a call.
- `ValueExtent`: where a JSON (or Python) bracketed value that starts at `{`/`[` ends, scanned
  incrementally, so a long call costs linear time however finely it is streamed.

Whitespace follows the Hermes parser's rules: whitespace that only separates calls from each other
or from the content is dropped; with no call, the content is the text exactly.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from tandem.tools.parsers.base import ToolCall

NEED_MORE = object()        # a body parser's answer: the text so far does not decide yet


def partial_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if m.startswith(text[-n:]):
                best = n
                break
    return best


def earliest(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """(index, marker) of the first marker in `text` at or after `start` (the longest on a tie)."""
    found = None
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (found is None or i < found[0] or (i == found[0] and len(m) > len(found[1]))):
            found = (i, m)
    return found


def finite_json(value: Any) -> bool:
    """Whether `value` (parsed JSON) holds no NaN or infinity (which JSON cannot carry back)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return True


def arguments_json(args: Any) -> str | None:
    """A call's arguments as the wire's JSON text: an object, or a string holding one; None if not."""
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except (ValueError, RecursionError):
            return None
        return args if isinstance(parsed, dict) and finite_json(parsed) else None
    if isinstance(args, dict) and finite_json(args):
        return json.dumps(args, ensure_ascii=False)
    return None


class ValueExtent:
    """Finds the end of a bracketed value starting at `text[0]` (`{` or `[`), incrementally: call
    `scan(text)` with the text grown; returns the end index (exclusive) once the brackets close,
    else None. JSON strings (`"`, backslash escapes) or, with `python=True`, Python strings (single,
    double and triple quotes) hide brackets. Brackets are only counted, not matched: the caller
    parses the extent, and a mismatch fails there."""

    def __init__(self, python: bool = False) -> None:
        self.python = python
        self.pos = 0
        self.depth = 0
        self.quote = ""          # the open string's quote ('', '"', "'", '"""', "'''")
        self.escape = False

    def scan(self, text: str) -> int | None:
        i, n = self.pos, len(text)
        while i < n:
            c = text[i]
            if self.quote:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif text.startswith(self.quote, i):
                    i += len(self.quote)
                    self.quote = ""
                    continue
                elif len(self.quote) == 3 and c == self.quote[0] and n - i < 3:
                    break                          # a closing triple quote may be arriving
                i += 1
                continue
            if c == '"' or (self.python and c == "'"):
                if self.python and text.startswith(c * 3, i):
                    self.quote = c * 3
                    i += 3
                    continue
                if self.python and n - i < 3 and text[i:] == c * (n - i):
                    break                          # '' or ' at the end: a triple quote may be opening
                self.quote = c
            elif c in "[{(" if self.python else c in "[{":
                self.depth += 1
            elif c in "]})" if self.python else c in "]}":
                self.depth -= 1
                if self.depth <= 0:
                    self.pos = i + 1
                    return i + 1
            i += 1
        self.pos = i
        return None


BodyParser = Callable[[str, bool], Any]


class HeldWhitespace:
    """The content rule the streams share: text outside calls is shown as it comes, except trailing
    whitespace, held until more content follows (it may only separate calls), and whitespace right
    after a call is dropped. Subclasses keep `_ws` and `_after_call`."""

    _ws: str
    _after_call: bool

    def _emit(self, text: str, out: list[str]) -> None:
        """Content outside calls: shown, except trailing whitespace, held until more content follows."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            out.append(self._ws + body)
            self._ws = text[len(body):]
        else:
            self._ws += text


class MarkerCallStream(HeldWhitespace):
    """Content with tool calls, each starting at one of `markers`.

    `new_body(marker)` makes a body parser for one marker occurrence: called as `body(text, final)`
    with the text after the marker (grown each time), it returns NEED_MORE (undecided; never when
    `final`), None (not a call: the marker stays in the content as written and scanning goes on
    right after it), or `(consumed, calls)`: the characters of `text` the calls took (closing tags
    included) and the calls."""

    def __init__(self, markers: tuple[str, ...], new_body: Callable[[str], BodyParser]) -> None:
        self._markers = markers
        self._new_body = new_body
        self._buf = ""              # text not yet classified (after the marker, inside a call)
        self._marker: str | None = None
        self._body: BodyParser | None = None
        self._ws = ""               # trailing whitespace held back (may precede a tool call)
        self._after_call = False    # drop whitespace that directly follows a call
        self._num_calls = 0

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        out: list[str] = []
        calls: list[ToolCall] = []
        self._run(out, calls, final=False)
        return "".join(out), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        out: list[str] = []
        calls: list[ToolCall] = []
        self._run(out, calls, final=True)
        if self._num_calls == 0:
            out.append(self._ws)
        self._ws = ""
        return "".join(out), calls

    def _run(self, out: list[str], calls: list[ToolCall], final: bool) -> None:
        while True:
            if self._marker is not None:
                result = self._body(self._buf, final)
                if result is NEED_MORE:
                    return
                marker, self._marker, self._body = self._marker, None, None
                if result is None:                     # not a call: the marker is content
                    self._emit(marker, out)
                    continue
                consumed, found = result
                self._buf = self._buf[consumed:]
                calls.extend(found)
                self._num_calls += len(found)
                self._ws, self._after_call = "", True
                continue
            hit = earliest(self._buf, self._markers)
            if hit is not None:
                i, marker = hit
                self._emit(self._buf[:i], out)
                self._buf = self._buf[i + len(marker):]
                self._marker, self._body = marker, self._new_body(marker)
                continue
            keep = 0 if final else partial_suffix_len(self._buf, self._markers)
            self._emit(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return


class AnchoredCallStream:
    """Tool calls that must open the output (after whitespace): `read_calls(text, final)` gets the
    text after the leading whitespace and returns NEED_MORE, None (no calls: all of it is content),
    or `(consumed, calls)`; what follows the calls is content (whitespace around it dropped).
    `opens(text)` says whether the text may still start a call (False: content from here on)."""

    def __init__(self, opens: Callable[[str], bool], read_calls: BodyParser) -> None:
        self._opens = opens
        self._read = read_calls
        self._buf = ""
        self._mode = "start"         # start | calls | content
        self._after_call = False
        self._ws = ""                # trailing whitespace held back after calls
        self._num_calls = 0

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        return self._run(final=False)

    def flush(self) -> tuple[str, list[ToolCall]]:
        content, calls = self._run(final=True)
        self._ws = ""                # whitespace after the calls' content is dropped
        return content, calls

    def _run(self, final: bool) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        if self._mode == "start":
            body = self._buf.lstrip()
            if not body and not final:
                return "", []
            if not body or not self._opens(body):
                self._mode = "content"
            else:
                result = self._read(body, final)
                if result is NEED_MORE:
                    return "", []
                if result is None:
                    self._mode = "content"
                else:
                    consumed, calls = result
                    self._buf = body[consumed:]
                    self._num_calls = len(calls)
                    self._mode, self._after_call = "content", True
        text, self._buf = self._buf, ""
        if self._num_calls == 0:
            return text, calls
        if self._after_call:
            text = text.lstrip()
            if not text:
                return "", calls
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._ws += text
            return "", calls
        out, self._ws = self._ws + body, text[len(body):]
        return out, calls


def whole(stream: Any, text: str) -> tuple[str | None, list[ToolCall]]:
    """`parse()` by way of the stream: (content, or None when only calls came; calls)."""
    content, calls = stream.feed(text)
    rest, more = stream.flush()
    content, calls = content + rest, calls + more
    return (content or None) if calls else content, calls
