"""llguidance behind Tandem's structured outputs: grammars compiled once per distinct constraint
against the model's tokenizer, one matcher per request, its next-token mask as a bitmask.

The tokenizer view llguidance needs (~1 s to build for a 50k vocabulary) is built on the first
constrained request, so engines that never see one never pay for it."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from tandem.errors import ConfigError, InvalidRequestError
from tandem.structured.spec import StructuredOutputs


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


class GrammarBackend:
    """Compiles `StructuredOutputs` for one tokenizer (a transformers fast tokenizer) and vocabulary
    size (the model's logits width, which may exceed the tokenizer's)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int = 256) -> None:
        if not available():
            raise ConfigError("structured outputs need the llguidance package (pip install llguidance)")
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()              # the server validates on its loop, the engine thread matches
        self._grammars: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._cache_size = cache_size

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                               eos_token=list(self.eos_token_ids) or None)
            return self._tokenizer

    def grammar(self, spec: StructuredOutputs) -> str:
        """The llguidance grammar of `spec`, checked against the tokenizer (InvalidRequestError,
        naming spec.field, if it does not compile)."""
        key = spec.key()
        with self._lock:
            hit = self._grammars.get(key)
            if hit is not None:
                self._grammars.move_to_end(key)
                return hit
        import llguidance

        try:
            text = _to_grammar(spec)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer)
        except (ValueError, TypeError, RuntimeError) as e:
            raise InvalidRequestError(f"invalid {spec.kind} constraint: {e}", field=spec.field) from None
        if is_error:
            raise InvalidRequestError(f"invalid {spec.kind} constraint: {messages[0] if messages else 'error'}",
                                      field=spec.field)
        with self._lock:
            self._grammars[key] = text
            while len(self._grammars) > self._cache_size:
                self._grammars.popitem(last=False)
        return text

    def matcher(self, spec: StructuredOutputs):
        """A fresh matcher at the start of `spec`'s grammar."""
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)
        if m.is_error():
            raise InvalidRequestError(f"invalid {spec.kind} constraint: {m.get_error()}", field=spec.field)
        return m


# JSON as json.dumps writes it (", " and ": "), no other whitespace: a model cannot loop on blanks
# (vLLM's disable_any_whitespace); a schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _to_grammar(spec: StructuredOutputs) -> str:
    import llguidance

    kind = spec.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec.json), defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
    try:
        return llguidance.grammar_from("grammar", spec.grammar)       # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise InvalidRequestError(str(e), field=spec.field) from None
