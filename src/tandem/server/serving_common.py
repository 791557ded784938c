"""What both completion endpoints share: the server's state and limits, request checks that need
the model (name, context length, server limits), SamplingParams from a request, usage, SSE lines.

Raises `APIError` / `InvalidRequestError` naming the field; `errors.py` turns them into responses.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from pydantic import BaseModel

from tandem.engine.async_engine import AsyncLLMEngine
from tandem.errors import InvalidRequestError
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.server.errors import APIError
from tandem.server.logprobs import TokenTexts
from tandem.server.metrics import ServerMetrics
from tandem.server.middleware import bearer_token
from tandem.server.protocol import ACCEPTED_UNUSED, UNSUPPORTED, SamplingFields, UsageInfo, extra_fields
from tandem.structured.spec import StructuredOutputs
from tandem.types import SessionInfo

SESSION_HEADER = "x-session-id"
MAX_SESSION_KEY = 256

log = logging.getLogger("tandem.server")
MAX_STOP_STRINGS = 16
OFF_LOOP_CHARS = 32_768           # requests with more text are templated and tokenized on a worker thread
MAX_NESTING = 64                  # deepest JSON nesting a request may carry (the tokenizer's and json's stacks)


@dataclass(frozen=True)
class ServerConfig:
    """Limits and names (see `create_app` for their meaning)."""

    model_name: str
    model_aliases: tuple[str, ...] = ("default",)
    api_key: str | None = None
    max_request_bytes: int = 2 * 2**20
    max_tokens_limit: int = 4096
    max_prompt_tokens: int | None = None
    max_n: int = 16
    drain_timeout_s: float = 30.0
    tool_parser: str = "hermes"
    strict: bool = False              # unknown request fields are 400s (otherwise logged once per name)
    enable_auto_tool_choice: bool = True      # off: tool_choice "auto" (or tools with none given) is a 400
    reasoning_parser: str | None = None       # tandem.tools.reasoning's name; None: no reasoning split
    trust_request_chat_template: bool = False  # off: a request's own chat_template is a 400


class Drain:
    """The drain deadline: once shutdown begins, in-flight requests have `timeout_s` to finish; then
    the serving code ends them itself (a stream with an error event and [DONE], a whole response
    with a 503), before the HTTP server would cancel them mid-response."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._expired: asyncio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None

    def _event(self) -> asyncio.Event:
        if self._expired is None:
            self._expired = asyncio.Event()
        return self._expired

    def begin(self) -> None:
        """Start the countdown (from the event loop, when shutdown starts)."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self._event().set)

    @property
    def expired(self) -> bool:
        return self._expired is not None and self._expired.is_set()

    async def wait(self) -> None:
        """Return once the deadline has passed."""
        await self._event().wait()


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    config: ServerConfig
    metrics: ServerMetrics
    token_texts: TokenTexts
    tools: Any | None = None                 # the server-side tool registry (later); None: client-side only
    created: int = field(default_factory=lambda: int(time.time()))
    drain: Drain = field(default_factory=lambda: Drain(30.0))

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """The model's sampling defaults for fields a request omits (its generation_config.json)."""
        return getattr(getattr(self.engine, "engine", None), "generation_defaults", None) or {}


T = TypeVar("T")


async def off_loop_if_large(num_chars: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, on a worker thread when the request carries over OFF_LOOP_CHARS of text, so that
    templating and tokenizing a large prompt does not stall the event loop (other requests, /health)."""
    if num_chars > OFF_LOOP_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def response_id(prefix: str, req: SamplingFields) -> str:
    """`prefix-<request_id>` when the client names the request (vLLM's `request_id`), else a fresh id."""
    return f"{prefix}-{req.request_id}" if req.request_id else new_id(prefix)


_warned_fields: set[str] = set()
MAX_WARNED_FIELDS = 1024          # names remembered for warn-once (clients choose them: keep it bounded)


def session_info(headers: Any, req: BaseModel) -> SessionInfo | None:
    """Whom a request belongs to (tandem.sched.retention): the session its KV is held for after it
    finishes (the `x-session-id` header, else the OpenAI `user` field), the owner that session is
    scoped to and counted against (a digest of the bearer token as the API-key check reads it, or
    of the whole Authorization value if it is not a bearer token; "" without one), and its
    `cache_salt`. None when it names neither a session nor a salt."""
    key = headers.get(SESSION_HEADER) or getattr(req, "user", None) or None
    salt = getattr(req, "cache_salt", None)
    if key is None and salt is None:
        return None
    if key is not None and len(key) > MAX_SESSION_KEY:
        raise InvalidRequestError(f"the session key ({SESSION_HEADER} or user) is longer than {MAX_SESSION_KEY} "
                                  "characters", field="user")
    auth = headers.get("authorization", "").encode()
    owner = hashlib.sha256(bearer_token(auth) or auth).hexdigest()[:16] if auth else ""
    return SessionInfo(key, owner, salt)


def check_request(state: ServerState, req: BaseModel) -> None:
    """`check_request_text`, then the fields outside the schema (see protocol.py): a field this server
    does not implement is a 400 naming it unless it asks for the default; another unknown field is
    a 400 under `--strict`, else logged (once per name) and ignored."""
    check_request_text(req)
    for path, value in extra_fields(req):
        name = path.rsplit(".", 1)[-1]
        if "." not in path and name in ACCEPTED_UNUSED:
            continue
        if "." not in path and name in UNSUPPORTED:
            if value is None or any(type(value) is type(ok) and value == ok for ok in UNSUPPORTED[name]):
                continue
            raise InvalidRequestError(f"{name} is not supported by this server (only its default is accepted)",
                                      field=name)
        if state.config.strict:
            raise InvalidRequestError(f"unknown field {path} (the server runs with --strict)", field=path)
        if path not in _warned_fields and len(_warned_fields) < MAX_WARNED_FIELDS:
            _warned_fields.add(path)
            log.warning("ignoring request field %r: this server does not know it (--strict makes it a 400)", path)


def truncate_prompt(state: ServerState, ids: list[int], req: SamplingFields) -> list[int]:
    """The prompt cut to `truncate_prompt_tokens` (vLLM's: -1 is the context length; `truncation_side`
    left keeps the end)."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return ids
    keep = state.max_model_len if keep == -1 else keep
    if keep == 0:
        raise InvalidRequestError("truncate_prompt_tokens=0 leaves no prompt", field="truncate_prompt_tokens")
    if len(ids) <= keep:
        return ids
    return ids[len(ids) - keep:] if req.truncation_side == "left" else ids[:keep]


def check_model(state: ServerState, name: str | None) -> None:
    cfg = state.config
    if name is not None and name != cfg.model_name and name not in cfg.model_aliases:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {cfg.model_name!r}",
                       "model", "model_not_found")


def check_num_choices(state: ServerState, num: int, field_name: str = "n") -> None:
    """`num` engine requests (n choices, times the prompts): within max_n, and within the queue
    (each waits in it, so more than `--max-waiting` could never be accepted: 400, not 503 forever)."""
    if num > state.config.max_n:
        raise InvalidRequestError(f"n={num} choices is over this server's limit of {state.config.max_n}", field="n")
    max_waiting = getattr(state.engine, "max_waiting", None)
    if isinstance(max_waiting, int) and num > max_waiting:
        raise InvalidRequestError(f"this request needs {num} generations (n times the prompts) but this server "
                                  f"queues at most {max_waiting} (--max-waiting {max_waiting}); send fewer",
                                  field=field_name)


def _bad_text(s: str) -> int | None:
    """The index of the first lone UTF-16 surrogate in `s` (which no tokenizer can encode), or None."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


_WALKED = (str, BaseModel, dict, list, tuple)


def check_request_text(req: BaseModel) -> None:
    """400 naming the field for text the tokenizer cannot take (lone surrogates, from JSON escapes
    such as \\ud800) and for nesting deeper than MAX_NESTING, anywhere in the request."""
    # (value, its field path, depth, the model field it lies under: nesting errors name that field)
    stack: list[tuple[Any, str, int, str]] = [(req, "", 0, "")]
    while stack:
        obj, path, depth, anchor = stack.pop()
        if isinstance(obj, str):
            pos = _bad_text(obj)
            if pos is not None:
                raise InvalidRequestError(f"{path or 'the request'} contains a lone UTF-16 surrogate "
                                          f"(U+{ord(obj[pos]):04X}) at character {pos}: text must be valid "
                                          "Unicode", field=path or None)
            continue
        if depth > MAX_NESTING:
            raise InvalidRequestError(f"{anchor} is nested more than {MAX_NESTING} levels deep", field=anchor)
        children: list[tuple[Any, str, int, str]] = []
        if isinstance(obj, BaseModel):
            for name in type(obj).model_fields:
                value = getattr(obj, name)
                if isinstance(value, _WALKED):
                    sub = f"{path}.{name}" if path else name
                    children.append((value, sub, depth + 1, sub))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if isinstance(k, str):
                    children.append((k, path, depth + 1, anchor))        # a bad key names its object
                    if _bad_text(k) is None:
                        children.append((v, f"{path}.{k}", depth + 1, anchor))
                        continue
                children.append((v, path, depth + 1, anchor))
        elif isinstance(obj, (list, tuple)):
            children = [(v, f"{path}[{i}]", depth + 1, anchor) for i, v in enumerate(obj) if isinstance(v, _WALKED)]
        stack.extend(reversed(children))


def resolve_max_tokens(state: ServerState, requested: int | None, num_prompt_tokens: int, field_name: str,
                       prompt_field: str, default: int | None = None) -> int:
    """The output budget: the request's, within the server limit and the context; if the request
    gives none, `default` or the largest allowed (whichever is smaller)."""
    limit = state.config.max_tokens_limit
    context = state.max_model_len
    max_prompt = min(state.config.max_prompt_tokens or context - 1, context - 1)
    if num_prompt_tokens > max_prompt:
        raise InvalidRequestError(f"the prompt has {num_prompt_tokens} tokens; the limit is {max_prompt} "
                                  f"(context length {context})", field=prompt_field)
    room = context - num_prompt_tokens
    if requested is None:   # the model's max_new_tokens (generation_config.json) first, as vLLM
        default = state.generation_defaults.get("max_tokens", default)
        return max(1, min(limit, room, default or limit))
    if requested > limit:
        raise InvalidRequestError(f"{field_name}={requested} is over this server's limit of {limit}", field=field_name)
    if requested > room:
        raise InvalidRequestError(
            f"this model's maximum context length is {context} tokens; the request asks for "
            f"{num_prompt_tokens + requested} ({num_prompt_tokens} in the prompt, {requested} for the completion): "
            f"reduce the prompt or {field_name}", field=field_name)
    return requested


# Neutral values of the fields a model's generation_config.json may give defaults for.
NEUTRAL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0}


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None, n: int,
                    defaults: dict[str, Any] | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed, choice i uses seed + i (distinct but reproducible).
    A field the request omits takes `defaults` (the model's generation_config.json, see
    `ServerState.generation_defaults`), else its neutral value; the request's own value always wins."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", field="stop")
    base = {**NEUTRAL_SAMPLING, **{k: v for k, v in (defaults or {}).items() if k in NEUTRAL_SAMPLING}}
    pick = {k: base[k] if getattr(req, k) is None else getattr(req, k) for k in NEUTRAL_SAMPLING}
    top_k = -1 if pick["top_k"] in (0, -1) else pick["top_k"]
    structured = structured_outputs(req)
    return [SamplingParams(max_tokens=max_tokens, temperature=pick["temperature"], top_p=pick["top_p"], top_k=top_k,
                           seed=None if req.seed is None else req.seed + i, stop=list(stop),
                           stop_token_ids=list(req.stop_token_ids or []),
                           include_stop_str_in_output=req.include_stop_str_in_output,
                           skip_special_tokens=req.skip_special_tokens,
                           ignore_eos=req.ignore_eos, min_tokens=req.min_tokens or 0, logprobs=logprobs,
                           presence_penalty=pick["presence_penalty"], frequency_penalty=pick["frequency_penalty"],
                           repetition_penalty=pick["repetition_penalty"], min_p=pick["min_p"],
                           logit_bias=req.logit_bias or None,
                           structured_outputs=structured)
            for i in range(n)]


STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def structured_outputs(req: SamplingFields) -> StructuredOutputs | None:
    """The request's output constraint, from whichever one field carries it (two is a 400)."""
    found: list[StructuredOutputs] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(StructuredOutputs(json_object=True, field="response_format"))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if schema is None:
                raise InvalidRequestError("response_format json_schema needs json_schema.schema",
                                          field="response_format.json_schema.schema")
            found.append(StructuredOutputs(json=schema, field="response_format"))
        elif kind != "text":
            raise InvalidRequestError(f"response_format type {kind!r} is not one of text, json_object, json_schema",
                                      field="response_format.type")
    if req.structured_outputs is not None:
        unknown = sorted(set(req.structured_outputs) - set(STRUCTURED_KEYS))
        if unknown:
            raise InvalidRequestError(f"structured_outputs.{unknown[0]} is not supported; give one of "
                                      f"{', '.join(STRUCTURED_KEYS)}", field=f"structured_outputs.{unknown[0]}")
        found.append(StructuredOutputs(**{k: v for k, v in req.structured_outputs.items() if v is not None},
                                       field="structured_outputs"))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append(StructuredOutputs(**{key: value}, field=name))
    if len(found) > 1:
        raise InvalidRequestError(f"give one output constraint, not {len(found)} ({', '.join(s.field for s in found)})",
                                  field=found[1].field)
    return found[0] if found else None


def usage(num_prompt_tokens: int, outputs: list[RequestOutput]) -> UsageInfo:
    completion = sum(len(o.token_ids) for o in outputs)
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion,
                     total_tokens=num_prompt_tokens + completion)


def sse(payload: BaseModel | dict[str, Any] | str) -> str:
    """One server-sent event line."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
