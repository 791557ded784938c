"""vLLM's tokenizer endpoints: `/tokenize` (a prompt, or chat messages through the model's chat
template, as the chat endpoint renders them) and `/detokenize` (token ids to text)."""

from __future__ import annotations

from tandem.errors import InvalidRequestError
from tandem.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from tandem.server.serving_common import ServerState, check_model, check_request, off_loop_if_large
from tandem.tools.chat_format import render_chat


def _tokenize(state: ServerState, req: TokenizeRequest) -> list[int]:
    tok = state.tokenizer
    if req.messages is not None:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        prompt = render_chat(tok.hf, messages, tools, "auto" if tools else None,
                             add_generation_prompt=req.add_generation_prompt)
        return tok.encode(prompt, add_special_tokens=False)
    return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens) if req.prompt else []


async def tokenize(state: ServerState, req: TokenizeRequest) -> TokenizeResponse:
    check_request(state, req)
    check_model(state, req.model)
    size = len(req.prompt) if req.prompt is not None else \
        sum(len(m.content) if isinstance(m.content, str) else 0 for m in req.messages or [])
    ids = await off_loop_if_large(size, _tokenize, state, req)
    strs = state.tokenizer.hf.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)


def detokenize(state: ServerState, req: DetokenizeRequest) -> DetokenizeResponse:
    check_request(state, req)
    check_model(state, req.model)
    vocab = state.engine.engine.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if t >= vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {req.tokens[bad]} is out of range (vocabulary size {vocab})",
                                  field=f"tokens[{bad}]")
    return DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens, skip_special_tokens=False))
