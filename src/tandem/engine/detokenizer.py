"""Incremental detokenization and stop strings, per request.

Text is produced with `tokenizers`' DecodeStream, which holds back bytes until they form whole
UTF-8 characters, primed with the last prompt tokens so that word-boundary spacing is right. Stop
strings are searched in the text (they may span tokens); text that could be the start of a stop
string is held back from streaming until it is decided.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from tandem.engine.tokenizer import Tokenizer
from tandem.sampling_params import SamplingParams

_PRIME_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stream = DecodeStream(ids=prompt_token_ids[-_PRIME_TOKENS:],
                                   skip_special_tokens=params.skip_special_tokens)
        self.text = ""          # all text so far (after stop-string truncation once stopped)
        self.num_emitted = 0    # characters of `text` already handed out as deltas
        self.stopped = False
        self._max_stop = max((len(s) for s in params.stop), default=0)

    def inject(self, token_ids: list[int]) -> None:
        """Tokens appended to the context by a tool result: not output text, but the new context
        for decoding what follows."""
        self.stream = DecodeStream(ids=token_ids[-_PRIME_TOKENS:], skip_special_tokens=self.params.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> bool:
        """Decode new tokens; returns True when a stop string was found (text is cut there)."""
        for tok in token_ids:
            if self.stopped:
                break
            piece = self.stream.step(self.tokenizer.backend, tok)
            if piece:
                self.text += piece
                self._check_stop(len(piece))
        return self.stopped

    def _check_stop(self, new_chars: int) -> None:
        if not self.params.stop:
            return
        window_start = max(0, len(self.text) - new_chars - self._max_stop + 1)
        best = None
        for s in self.params.stop:
            i = self.text.find(s, window_start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[:i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
            self.stopped = True

    def delta(self, finished: bool) -> str:
        """New text since the last call; holds back a possible stop-string prefix unless finished."""
        end = len(self.text)
        if not finished and not self.stopped and self._max_stop > 1:
            end = max(self.num_emitted, end - self._max_stop + 1)
        out = self.text[self.num_emitted:end]
        self.num_emitted = end
        return out
