"""The OpenAI wire format: request, response and stream-chunk shapes of the served endpoints.

Pydantic validates requests (a failure names the field, e.g. `messages[0].content`, and becomes an
HTTP 400) and documents the API in the app's OpenAPI schema. Only shape and range checks live here;
what depends on the model (context length, model name, tool names) is checked by the serving code.
Fields outside the schema are kept (`model_extra`) for the serving code to judge (`UNSUPPORTED`,
`ACCEPTED_UNUSED`, `extra_fields`): a vLLM or OpenAI field this server does not implement is a 400
naming it unless it asks for the default; any other unknown field is logged, or a 400 under
`--strict`. Types are strict: no "yes" for a boolean, no `true` or `2.0` for an integer (an integer
is a fine number, though).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_validator
from pydantic_core import PydanticUndefined

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# Request fields of vLLM 0.32 and OpenAI that this server does not implement, with the values that
# ask for the default behaviour (accepted; null is too); any other value is a 400 naming the field.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "watermarking": (), "bad_words": ([],),
    "spaces_between_special_tokens": (True,),
    "prompt_logprobs": (), "logprob_token_ids": (), "allowed_token_ids": (), "echo": (False,),
    "priority": (0,), "return_tokens_as_token_ids": (False,), "return_token_ids": (False,),
    "return_token_offsets": (False,), "return_prompt_text": (False,), "routed_experts_prompt_start": (),
    "media_io_kwargs": ({},), "mm_processor_kwargs": ({},), "mm_payload": (), "return_mm_kwargs": (False,),
    "prompt_embeds": (), "kv_transfer_params": (), "ec_transfer_params": (),
    "vllm_xargs": ({},), "repetition_detection": (), "stream_interval": (1,), "thinking_token_budget": (),
    "reasoning_effort": (), "add_special_tokens": (False,),
    "modalities": (["text"],), "audio": (), "prediction": (), "web_search_options": (), "verbosity": (),
    "functions": (), "function_call": (), "suffix": (),
}
# Bookkeeping fields with no effect on the output: accepted and unused, as vLLM does.
ACCEPTED_UNUSED = frozenset({"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                             "session_id"})


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """An explicit null for a field with a non-null default (`"stream": null`, as some clients
        send) means the default."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if not (v is None and k in fields and fields[k].default not in (None, PydanticUndefined))}
        return data


def extra_fields(req: BaseModel, path: str = "") -> list[tuple[str, Any]]:
    """(field path, value) of every field outside the schema, in `req` and the requests nested in it
    (`messages[0].foo`)."""
    found = [(f"{path}.{k}" if path else k, v) for k, v in (req.model_extra or {}).items()]
    for name in type(req).model_fields:
        value = getattr(req, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, _Request):
                sub = f"{path}.{name}" if path else name
                found += extra_fields(item, f"{sub}[{i}]" if isinstance(value, list) else sub)
    return found


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- requests -------------------------------------------------------------------------------------
class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str = Field(min_length=1)


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCallIn(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Request):
    include_usage: bool | None = False


class SamplingFields(_Request):
    """Fields both endpoints share: OpenAI's, plus vLLM's sampling extras (top_k, min_p,
    repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
    skip_special_tokens)."""

    model: str | None = None
    # vLLM's: requests share cached prefix blocks only with requests of the same salt
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    request_id: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$",
                                   description="the response id's suffix (vLLM's field)")
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1,
                                               description="keep this many prompt tokens (-1: the context length)")
    truncation_side: Literal["left", "right"] = "left"
    # Structured outputs (at most one of these): OpenAI's response_format, vLLM's structured_outputs
    # ({"json" | "json_object" | "regex" | "choice" | "grammar": ...}) and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat templating fields
    add_generation_prompt: bool = Field(default=True, description="end the prompt with the assistant's turn")
    continue_final_message: bool = Field(
        default=False, description="leave the last message open for the model to continue (no generation "
                                   "prompt; add_generation_prompt: true as well is a 400)")
    chat_template: str | None = Field(default=None, description="a Jinja chat template for this request "
                                                                "(needs --trust-request-chat-template)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="more template variables, e.g. {\"enable_thinking\": false} for Qwen3")
    documents: list[dict[str, str]] | None = Field(default=None, description="documents for RAG templates")
    include_reasoning: bool = Field(default=True, description="false: leave the reasoning out of the response "
                                                              "(with --reasoning-parser)")


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=1, description="default 16 (within the server's limit)")
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True
    best_of: int | None = Field(default=None, ge=1)


# --- responses ------------------------------------------------------------------------------------
class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprobOut] | None = None


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    # With --reasoning-parser: the reasoning, under vLLM 0.32's name and under its older (and
    # DeepSeek's) name `reasoning_content`, which many clients still read.
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunction(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: ChatDelta) -> dict[str, Any]:
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# --- tokenizer endpoints (vLLM's /tokenize and /detokenize) ------------------------------------------
class TokenizeRequest(_Request):
    """vLLM's /tokenize body: a `prompt` (completion form) or chat `messages` (chat form), not both."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True                # completion form: the tokenizer's BOS etc.
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDefinition] | None = None
    add_generation_prompt: bool = True             # chat form: end with the assistant's turn
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str
