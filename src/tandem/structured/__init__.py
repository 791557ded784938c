"""Structured outputs: constrain a request's tokens to a JSON schema, any JSON object, a regular
expression, a choice of strings or a grammar (Lark or GBNF), with llguidance as the grammar engine.

`StructuredOutputs` (spec.py) is what a request asks for, checked on construction and free of
torch and of llguidance; `GrammarBackend` (grammar.py) compiles it against the model's tokenizer
and gives each request a matcher, whose next-token mask the sampler applies to the logits."""

from tandem.structured.spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
