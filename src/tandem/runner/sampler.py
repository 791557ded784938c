"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, min_tokens, logprobs.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. draws exactly from p.
A request with a seed draws its E from its own generator, so its tokens do not depend on what
else is in the batch (or on preemption: one draw per sampled token, wherever it runs).
Logprobs are those of the model's raw distribution (before temperature, top-k and top-p), as vLLM
reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.sampling_params import SamplingParams
from tandem.types import TokenLogprob


@dataclass
class SampleRow:
    request_id: str
    params: SamplingParams
    num_output_tokens: int
    stop_token_ids: frozenset[int]


class Sampler:
    """Random draws for sampled tokens. `stream` names an independent stream of the same seeds: the
    target samples on stream 0 and a model drafter on stream 1, so drafting (possibly on another
    thread, see tandem.spec.overlap) never shares a generator with verification."""

    def __init__(self, device: torch.device, seed: int = 0, stream: int = 0) -> None:
        self.device = device
        self.seed = seed
        self.stream = stream
        self.generator = torch.Generator(device=device).manual_seed(self._seed(seed))
        self._request_generators: dict[str, torch.Generator] = {}

    def _seed(self, seed: int) -> int:
        return seed if self.stream == 0 else _mix(seed, self.stream)

    def release(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def generator_for(self, row: SampleRow) -> torch.Generator:
        if row.params.seed is None:
            return self.generator
        g = self._request_generators.get(row.request_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(self._seed(row.params.seed))
            self._request_generators[row.request_id] = g
        return g

    def generator_at(self, row: SampleRow) -> torch.Generator:
        """For a seeded request, a generator for output position `row.num_output_tokens` alone: the draw
        does not depend on how many came before. Drafters use it, since drafting may be cancelled at
        any point (overlap), and a position is judged at most once, so its draw stays independent."""
        if row.params.seed is None:
            return self.generator
        seed = _mix(row.params.seed, self.stream, row.num_output_tokens)
        return torch.Generator(device=self.device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [M, V] float32, one row per entry of `rows` -> token ids (and logprobs if asked)."""
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_min_tokens(logits, rows)
        probs = self.processed_probs(logits, rows)                        # [M, V] or None if all greedy
        tokens = logits.argmax(dim=-1)
        if probs is not None:
            for i, r in enumerate(rows):
                if not r.params.greedy:
                    tokens[i] = self.draw(probs[i], self.generator_for(r))
        token_list = tokens.tolist()
        lps: list[TokenLogprob | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, r in enumerate(rows):
                if r.params.logprobs is not None:
                    lps[i] = token_logprob(raw_logprobs[i], token_list[i], r.params.logprobs)
        return token_list, lps

    def processed_probs(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor | None:
        """Probabilities after temperature, top-k and top-p (rows of greedy requests are left as is)."""
        if all(r.params.greedy for r in rows):
            return None
        probs = torch.empty_like(logits)
        for i, r in enumerate(rows):
            if not r.params.greedy:
                probs[i] = warp_probs(logits[i], r.params)
        return probs

    @staticmethod
    def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
        """One token from `probs` [V] (exponential race)."""
        e = torch.empty_like(probs).exponential_(generator=generator)
        return int((probs / e).argmax())


def _mix(*parts: int) -> int:
    """A generator seed from several integers (hashes of int tuples do not vary between runs)."""
    return hash(parts) & 0x7FFF_FFFF_FFFF_FFFF


def apply_min_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Forbid stop tokens for requests that have fewer than `min_tokens` outputs (vLLM semantics)."""
    masked = [(i, r) for i, r in enumerate(rows) if r.num_output_tokens < r.params.min_tokens and r.stop_token_ids]
    if not masked:
        return logits
    logits = logits.clone()
    for i, r in masked:
        logits[i, list(r.stop_token_ids)] = float("-inf")
    return logits


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] logits -> [V] probabilities after temperature, top-k and top-p."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the mass strictly before it already reaches top_p (the first always stays).
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    return torch.softmax(logits, dim=-1)


def token_logprob(logprobs: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if top_n > 0:
        values, ids = torch.topk(logprobs, top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id=token, logprob=float(logprobs[token]), top=top)
