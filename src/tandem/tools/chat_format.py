"""Render a chat with tools into prompt text, with or without the chat template's help.

If the model's chat template renders `tools` itself (Qwen 2.5/3, Hermes, Llama 3.1 ...), the
messages and tools go to it unchanged (tool-call arguments as dicts, as those templates expect).
Otherwise (SmolLM2's template ignores tools) the Hermes conventions are written in by hand:
a system prompt lists the tools as JSON schemas and asks for `<tool_call>` JSON; assistant tool
calls become `<tool_call>` text; `tool` results become a user turn of `<tool_response>` blocks.

Messages arrive as plain dicts in the OpenAI shape (already validated by the server); errors raise
`InvalidRequestError` naming `messages` or `tools`. Knows nothing of HTTP or the engine.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tandem.errors import InvalidRequestError

MAX_ARGUMENT_NESTING = 64        # deeper tool-call arguments are refused (json and jinja recurse)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_PROBE_NAME = "tandem_probe_tool_4f2a"
_native_cache: dict[str, bool] = {}
_variables_cache: dict[str, frozenset[str] | None] = {}
_MAX_CACHED_TEMPLATES = 64
# chat_template_kwargs keys refused (vLLM refuses the first two; the rest collide with what the
# template is given) and keys the request's own fields set (those win, as in vLLM).
RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize", "messages", "conversation", "tools"})
_SET_BY_RENDER = frozenset({"add_generation_prompt", "continue_final_message", "documents"})

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>{extra}'
)


def select_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None
                 ) -> tuple[list[dict[str, Any]] | None, str]:
    """The tools to show the model and an extra instruction, as `tool_choice` asks.

    "none" hides the tools; "required" asks for at least one call; a named function keeps only
    that tool. (Without constrained decoding these are requests to the model, not guarantees.)"""
    if not tools or tool_choice == "none":
        return None, ""
    if tool_choice in (None, "auto"):
        return tools, ""
    if tool_choice == "required":
        return tools, "\n\nYou must call at least one function."
    name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    chosen = [t for t in tools if t.get("function", {}).get("name") == name]
    if not chosen:
        raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools", field="tool_choice")
    return chosen, f"\n\nYou must call the function {name}."


def template_renders_tools(hf_tokenizer: Any, template: str | None = None) -> bool:
    """Whether the chat template (the tokenizer's, or `template`) writes the `tools` it is given into
    the prompt (probed once per template)."""
    template = hf_tokenizer.chat_template if template is None else template
    if not isinstance(template, str):
        return False
    if template not in _native_cache:
        probe = [{"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                                    "parameters": {"type": "object", "properties": {}}}}]
        try:
            text = hf_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe,
                                                    tokenize=False, add_generation_prompt=True,
                                                    chat_template=template)
            renders = _PROBE_NAME in text
        except Exception:   # a template that chokes on tools does not render them
            renders = False
        if len(_native_cache) >= _MAX_CACHED_TEMPLATES:     # request templates must not grow it forever
            _native_cache.clear()
        _native_cache[template] = renders
    return _native_cache[template]


def template_variables(template: str) -> frozenset[str] | None:
    """The variables `template` reads from its context (None if it cannot be parsed here)."""
    if template not in _variables_cache:
        try:
            import jinja2.meta
            from transformers.utils.chat_template_utils import _compile_jinja_template

            env = _compile_jinja_template(template).environment     # transformers' own (its extensions)
            found: frozenset[str] | None = frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
        except Exception:   # jinja and transformers' private API: any failure means "unknown"
            found = None
        if len(_variables_cache) >= _MAX_CACHED_TEMPLATES:
            _variables_cache.clear()
        _variables_cache[template] = found
    return _variables_cache[template]


def template_kwargs(template: str, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` as vLLM passes them on: only the variables the template reads (others
    would do nothing); the keys render_chat sets itself are left out (the request's own fields win),
    and `chat_template` / `tokenize` / the conversation and tools are refused (400 naming the key)."""
    if not kwargs:
        return {}
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            hint = " (use the request's chat_template field)" if key == "chat_template" else ""
            raise InvalidRequestError(f"chat_template_kwargs may not set {key!r}{hint}",
                                      field=f"chat_template_kwargs.{key}")
    used = template_variables(template)
    return {k: v for k, v in kwargs.items() if k not in _SET_BY_RENDER and (used is None or k in used)}


def render_chat(hf_tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                tool_choice: str | dict[str, Any] | None = None, add_generation_prompt: bool = True, *,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None,
                documents: list[dict[str, str]] | None = None) -> str:
    """The prompt text (special tokens written by the template), ending with the assistant's turn
    unless `add_generation_prompt` is False.

    vLLM's chat request fields: `continue_final_message` leaves the last message open for the model
    to continue (no generation prompt then); `chat_template` replaces the tokenizer's template;
    `chat_template_kwargs` are more template variables (e.g. Qwen3's `enable_thinking`; see
    `template_kwargs`; a `documents` key there counts when the `documents` argument is None);
    `documents` go to the template as `documents` (RAG templates read them)."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true",
                                  field="continue_final_message")
    template = chat_template if chat_template is not None else getattr(hf_tokenizer, "chat_template", None)
    if template is None:
        raise InvalidRequestError("this model has no chat template; use /v1/completions", field="messages")
    if chat_template is not None:
        _check_template_syntax(chat_template)
    extra_vars = template_kwargs(template, chat_template_kwargs) if isinstance(template, str) else {}
    if documents is None and isinstance((chat_template_kwargs or {}).get("documents"), list):
        documents = chat_template_kwargs["documents"]
    if continue_final_message and not (messages and content_text(messages[-1].get("content"))):
        raise InvalidRequestError("continue_final_message needs a last message with content to continue",
                                  field="continue_final_message")
    shown, extra = select_tools(tools, tool_choice)
    if template_renders_tools(hf_tokenizer, chat_template):
        msgs = [_native_message(m, i) for i, m in enumerate(messages)]
        if extra:
            msgs = _with_system_text(msgs, extra.strip())
    else:
        msgs = hermes_messages(messages, shown, extra)
        shown = None
    try:
        return hf_tokenizer.apply_chat_template(msgs, tools=shown, tokenize=False,
                                                add_generation_prompt=add_generation_prompt,
                                                continue_final_message=continue_final_message,
                                                chat_template=chat_template, documents=documents, **extra_vars)
    except Exception as e:   # jinja raises many kinds on messages it does not expect
        if continue_final_message and "continue_final_message" in str(e):
            field = "continue_final_message"
        else:
            field = "chat_template" if chat_template is not None else "messages"
        raise InvalidRequestError(f"cannot apply the chat template: {e}", field=field) from e


def _check_template_syntax(template: str) -> None:
    """A request's own template must compile (else 400 naming chat_template)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:       # transformers' private API moved: apply_chat_template will say
        return
    try:
        _compile_jinja_template(template)
    except Exception as e:    # jinja's TemplateSyntaxError, and whatever else compiling raises
        raise InvalidRequestError(f"chat_template does not compile: {e}", field="chat_template") from e


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    extra: str = "") -> list[dict[str, str]]:
    """Messages with tools, tool calls and tool results written as Hermes text (plain roles only)."""
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        role, content = m["role"], content_text(m.get("content"))
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_response>"):
                out[-1]["content"] += "\n" + block        # consecutive results share one user turn
            else:
                out.append({"role": "user", "content": block})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_tool_call_text(c, f"messages[{i}].tool_calls[{j}].function.arguments")
                              for j, c in enumerate(m["tool_calls"]))
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        out = _with_system_text(out, HERMES_SYSTEM.format(tools=listing, extra=extra))
    return out


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    """The text of a message's content (a string or a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise InvalidRequestError(f"content part of type {part.get('type')!r} is not supported (text only)",
                                      field="messages")
        parts.append(part.get("text") or "")
    return "".join(parts)


def _tool_call_text(call: dict[str, Any], field: str = "messages") -> str:
    fn = call.get("function") or {}
    body = json.dumps({"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"), field)},
                      ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _string_nesting_over(text: str, limit: int) -> bool:
    """Whether the JSON text nests brackets deeper than `limit` (brackets inside strings do not count)."""
    if "[" not in text and "{" not in text:
        return False
    depth = 0
    for ch in _NOT_BRACKET.sub("", _JSON_STRING.sub("", text)):
        depth += 1 if ch in "[{" else -1
        if depth > limit:
            return True
    return False


def _value_nesting_over(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests deeper than `limit` (iteratively: no recursion to overflow)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth >= limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def _arguments(args: Any, field: str = "messages") -> Any:
    """Arguments as a JSON object where they parse as one (the wire format sends a JSON string).
    Nesting deeper than MAX_ARGUMENT_NESTING is refused before parsing (InvalidRequestError naming `field`)."""
    too_deep = InvalidRequestError(f"{field} is nested more than {MAX_ARGUMENT_NESTING} levels deep", field=field)
    if isinstance(args, str):
        if _string_nesting_over(args, MAX_ARGUMENT_NESTING):
            raise too_deep
        try:
            return json.loads(args)
        except (ValueError, RecursionError):
            return args
    if _value_nesting_over(args, MAX_ARGUMENT_NESTING):
        raise too_deep
    return {} if args is None else args


def _native_message(m: dict[str, Any], index: int = 0) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"],
                           "content": content_text(m.get("content"))}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            msg[key] = m[key]
    if m.get("tool_calls"):
        msg["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": (c.get("function") or {}).get("name"),
                                           "arguments": _arguments((c.get("function") or {}).get("arguments"),
                                                                   f"messages[{index}].tool_calls[{j}].function"
                                                                   ".arguments")}}
                             for j, c in enumerate(m["tool_calls"])]
    return msg


def _with_system_text(msgs: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """Append `text` to the first system message, or put a system message first."""
    if msgs and msgs[0]["role"] == "system":
        first = dict(msgs[0], content=f"{msgs[0]['content']}\n\n{text}" if msgs[0]["content"] else text)
        return [first, *msgs[1:]]
    return [{"role": "system", "content": text}, *msgs]
