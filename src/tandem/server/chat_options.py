"""vLLM's chat request options around templating and output parsing, checked against the server's
flags: `chat_template` (needs --trust-request-chat-template), `chat_template_kwargs`,
`add_generation_prompt` / `continue_final_message`, `documents`; tool_choice "auto" (needs
auto tool choice on); the reasoning parser; decoding with special tokens kept for tool formats
whose markers are special tokens (the engine never decodes the stop token a request ends on, so
it does not show up then either). Errors are 400s naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.errors import InvalidRequestError
from tandem.sampling_params import SamplingParams
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.serving_common import ServerState
from tandem.tools.parsers import ToolParser
from tandem.tools.parsers.forced import ForcedToolParser
from tandem.tools.reasoning import ReasoningParser, get_reasoning_parser

AUTO_TOOL_CHOICE_OFF = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                        "(this server runs with --no-enable-auto-tool-choice; tool_choice \"required\" or a "
                        "named function still works)")


def template_options(state: ServerState, req: ChatCompletionRequest) -> dict[str, Any]:
    """render_chat's keyword arguments for the request's templating fields."""
    if req.chat_template is not None and not state.config.trust_request_chat_template:
        raise InvalidRequestError("Chat template is passed with request, but --trust-request-chat-template is "
                                  "not set. Refused request with untrusted chat template.", field="chat_template")
    both = req.continue_final_message and req.add_generation_prompt
    if both and "add_generation_prompt" in req.model_fields_set:      # given, not the default
        raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to "
                                  "True.", field="continue_final_message")
    return dict(add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs, documents=req.documents)


def check_tool_choice(state: ServerState, req: ChatCompletionRequest) -> None:
    """Without auto tool choice, a request that leaves the choice to the model is refused."""
    if req.tools and req.tool_choice in (None, "auto") and not state.config.enable_auto_tool_choice:
        raise InvalidRequestError(AUTO_TOOL_CHOICE_OFF, field="tool_choice")


def output_options(state: ServerState, req: ChatCompletionRequest, parser: ToolParser | None,
                   params: list[SamplingParams], server_side: bool
                   ) -> tuple[list[SamplingParams], ReasoningParser | None]:
    """(params, the reasoning parser): special tokens kept in the text when the tool format needs
    them; no reasoning split for output a grammar shapes from the first token (a forced tool call,
    response_format ...), which has no reasoning section."""
    if (parser is not None and not isinstance(parser, ForcedToolParser) and not server_side
            and getattr(parser, "needs_special_tokens", False) and params[0].skip_special_tokens):
        params = [dataclasses.replace(p, skip_special_tokens=False) for p in params]
    reasoning = None
    if state.config.reasoning_parser is not None and params[0].structured_outputs is None:
        reasoning = get_reasoning_parser(state.config.reasoning_parser, req.chat_template_kwargs)
    return params, reasoning
