"""Token log-probabilities in the two OpenAI shapes (chat `content` list, completions columns).

Owns the text and bytes shown for a token: for byte-level BPE tokenizers (GPT-2 style: SmolLM2,
Llama 3, Qwen) the token's exact bytes, otherwise the token decoded alone. Log-probabilities are
clamped to a finite floor, since JSON has no -inf.
"""

from __future__ import annotations

import math
from typing import Any

from tandem.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprobOut, TopLogprob
from tandem.types import TokenLogprob

LOGPROB_FLOOR = -9999.0


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in character of each byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()


def finite(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) else max(float(logprob), LOGPROB_FLOOR)


class TokenTexts:
    """Text and bytes of token ids for one tokenizer (cached)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_level = self._is_byte_level(tokenizer)
        self._special = set(getattr(tokenizer.hf, "all_special_ids", [])) if tokenizer is not None else set()

    @staticmethod
    def _is_byte_level(tokenizer: Any) -> bool:
        try:
            from tokenizers import decoders

            return isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
        except Exception:
            return False

    def get(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            self._cache[token_id] = self._compute(token_id)
        return self._cache[token_id]

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        raw = None
        if self._byte_level and token_id not in self._special:
            raw = self.tokenizer.hf.convert_ids_to_tokens(token_id)
        if isinstance(raw, str) and raw and all(ch in _BYTE_DECODER for ch in raw):
            data = bytes(_BYTE_DECODER[ch] for ch in raw)
        else:
            data = self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
        return data.decode("utf-8", errors="replace"), list(data)


def chat_logprobs(texts: TokenTexts, lps: list[TokenLogprob], top_n: int) -> ChatLogprobs:
    content = []
    for lp in lps:
        token, data = texts.get(lp.token_id)
        top = [TopLogprob(token=texts.get(t)[0], logprob=finite(v), bytes=texts.get(t)[1]) for t, v in lp.top[:top_n]]
        content.append(TokenLogprobOut(token=token, logprob=finite(lp.logprob), bytes=data, top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(texts: TokenTexts, lps: list[TokenLogprob], top_n: int, offset: int) -> CompletionLogprobs:
    """Columns for `lps`; `offset` is the text offset of the first token within the completion."""
    out = CompletionLogprobs()
    for lp in lps:
        token = texts.get(lp.token_id)[0]
        out.tokens.append(token)
        out.token_logprobs.append(finite(lp.logprob))
        out.top_logprobs.append({texts.get(t)[0]: finite(v) for t, v in lp.top[:top_n]} if top_n else None)
        out.text_offset.append(offset)
        offset += len(token)
    return out
