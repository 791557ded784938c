"""Text <-> token ids for one model: encoding, chat templates, EOS ids (transformers' tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.errors import InvalidRequestError, ModelLoadError


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as e:  # transformers raises many kinds here
            raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {e}") from e
        self.backend = self.hf.backend_tokenizer   # the Rust `tokenizers.Tokenizer`
        self.eos_token_ids = self._eos_ids(model_dir)
        self.vocab_size = len(self.hf)

    def _eos_ids(self, model_dir: Path) -> tuple[int, ...]:
        ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            f = model_dir / name
            if f.is_file():
                eos = json.loads(f.read_text()).get("eos_token_id")
                if eos is not None:
                    ids.extend(eos if isinstance(eos, list) else [eos])
                    break
        if self.hf.eos_token_id is not None:
            ids.append(self.hf.eos_token_id)
        return tuple(dict.fromkeys(int(i) for i in ids))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", field="messages")
        if self.hf.chat_template is None:
            raise InvalidRequestError("this model has no chat template; use generate() with a prompt",
                                      field="messages")
        try:
            text = self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja errors on malformed messages
            raise InvalidRequestError(f"cannot apply the chat template: {e}", field="messages") from e
        # The template writes special tokens itself; do not add BOS twice.
        return self.encode(text, add_special_tokens=False)
