"""Sampling parameters of one request (the familiar vLLM / OpenAI shape), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.errors import InvalidRequestError
from tandem.structured.spec import StructuredOutputs

GREEDY_TEMPERATURE = 1e-5       # temperatures below this sample greedily
MIN_TOP_P = 1e-6                # smaller top_p values are raised to this


@dataclass
class SamplingParams:
    """How to sample one request's output.

    temperature 0 means greedy, and so does any temperature below GREEDY_TEMPERATURE (1e-5): at such
    temperatures the distribution is greedy's anyway, and dividing the logits by them overflows to
    inf and NaN (1e-300 would sample nothing but token 0); such a temperature reads back as 0.0.
    top_p below MIN_TOP_P (1e-6) is raised to it: that keeps the most likely token only, as any
    tiny top_p does, where a top_p under float32's smallest number would keep none. `seed` makes a
    sampled request reproducible regardless of what else is in the batch. `min_tokens` suppresses
    EOS and `stop_token_ids` until that many tokens exist (vLLM semantics). `stop` strings are
    matched on the detokenized text and removed from it. `logprobs=n` returns the sampled token's
    log-probability and the top-n alternatives, computed from the model's raw distribution (before
    temperature / top-k / top-p).

    Logit adjustments, applied before temperature in vLLM's order: `logit_bias` adds to the given
    token ids' logits (OpenAI's -100..100); `repetition_penalty` (> 0, 1 = off) divides positive
    and multiplies negative logits of every token seen so far, prompt included; `frequency_penalty`
    and `presence_penalty` (-2..2) subtract count x frequency and presence of each token in the
    output so far. `min_p` (0..1) drops tokens less likely than min_p times the most likely one,
    after temperature. Requests with penalties or a logit bias decode without speculation (the
    drafts' verification sees raw logits); min_p is applied in verification too.

    `structured_outputs` constrains the output to a JSON schema, any JSON object, a regex, a choice
    or a grammar (tandem.structured): each step's logits are masked to the tokens the grammar
    allows, so the output matches it when it ends by EOS (a `max_tokens` cut can leave it unfinished).
    With speculation, drafts are cut where the grammar refuses them and every verification row is
    masked by it, so the output is what unspeculated decoding would give.

    `output_kind` (vLLM's RequestOutputKind): "cumulative" (default) reports the whole output so
    far every step that produced tokens; "final_only" reports only the finished output, so a
    caller that reads only the end (`LLM.generate` sets it) does not pay for a copy of every token
    and logprob list each step. (The server keeps "cumulative": its inter-token latency metrics
    are taken from each step's output.)
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputs | None = None
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               "max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(self.temperature >= 0.0, "temperature", f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        if self.top_p < MIN_TOP_P:
            self.top_p = MIN_TOP_P
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k",
               f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k!r}")
        if self.top_k == 0:
            self.top_k = -1                    # vLLM's 0 and the older -1 both mean off
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
               f"logprobs must be in [0, 20], got {self.logprobs}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and -2.0 <= v <= 2.0, name, f"{name} must be in [-2, 2], got {v!r}")
        _check(isinstance(self.repetition_penalty, (int, float)) and 0.0 < self.repetition_penalty <= 1e4,
               "repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _check(isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0, "min_p",
               f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logit_bias:
            _check(isinstance(self.logit_bias, dict) and all(
                _is_token_id(k) and isinstance(v, (int, float)) and not isinstance(v, bool)
                for k, v in self.logit_bias.items()),
                "logit_bias", "logit_bias must map token ids (non-negative integers) to numbers")
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            bad = [v for v in self.logit_bias.values() if not -100.0 <= v <= 100.0]
            _check(not bad, "logit_bias", f"logit_bias values must be in [-100, 100], got {bad[:1]}")
        else:
            self.logit_bias = None
        _check(self.output_kind in OUTPUT_KINDS, "output_kind",
               f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
               "structured_outputs", "structured_outputs must be a tandem.structured.StructuredOutputs")
        _check(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**64), "seed",
               "seed must be an integer in [-2**63, 2**64)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def speculation_ok(self) -> bool:
        """False when the next token's distribution depends on adjustments that speculative
        verification does not apply (penalties, logit bias): such requests decode one token a step.
        A grammar is applied (drafts cut where it refuses them, each verification row masked)."""
        return not self.has_penalties and not self.logit_bias


def _is_token_id(k) -> bool:
    if isinstance(k, bool):
        return False
    if isinstance(k, int):
        return k >= 0
    return isinstance(k, str) and k.isdigit()       # JSON object keys arrive as strings


OUTPUT_KINDS = ("cumulative", "final_only")


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, field=field_name)
