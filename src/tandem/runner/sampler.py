"""Token sampling: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, per-request
seeds, min_tokens, logprobs.

A step's sampled tokens are drawn together by inverse CDF: one uniform per row, the first token
whose cumulative probability reaches it. A request with a seed takes its uniform from a hash of
(seed, output position), so its tokens do not depend on what else is in the batch or on preemption.
Speculative verification and model drafters draw single tokens by the exponential race
(argmax(p / E), E ~ Exp(1)), from the request's own generator.
Logprobs are those of the model's raw distribution (before temperature, top-k and top-p), as vLLM
reports them by default. Logit bias and the repetition, frequency and presence penalties adjust the
raw logits first (vLLM's order), for greedy and sampled rows alike; only rows that ask pay for them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.errors import InvalidRequestError
from tandem.sampling_params import SamplingParams
from tandem.types import TokenLogprob

log = logging.getLogger("tandem")


@dataclass
class SampleRow:
    request_id: str
    params: SamplingParams
    num_output_tokens: int
    stop_token_ids: frozenset[int]
    history: Sequence[int] = ()      # the request's tokens so far (prompt, then output), for penalties


class Sampler:
    """Random draws for sampled tokens. `stream` names an independent stream of the same seeds: the
    target samples on stream 0 and a model drafter on stream 1, so drafting (possibly on another
    thread, see tandem.speculative.overlap) never shares a generator with verification."""

    def __init__(self, device: torch.device, seed: int = 0, stream: int = 0, grammar=None) -> None:
        self.device = device
        self.seed = seed
        self.stream = stream
        self.generator = torch.Generator(device=device).manual_seed(self._seed(seed))
        self._request_generators: dict[str, torch.Generator] = {}
        self._fused = _fused_sampler(device)     # the compiled inverse-CDF draw of plain rows, or None
        self._mask_kernel = _cpu_kernel(device, "mask_by_bits_")   # grammar bitmasks applied in place, or None
        self.grammar = grammar                   # a tandem.structured.grammar.GrammarBackend, if constrained
        self._matchers: dict[str, object] = {}   # request id -> its llguidance matcher

    def _seed(self, seed: int) -> int:
        return seed if self.stream == 0 else _mix(seed, self.stream)

    def release(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)
        self._matchers.pop(request_id, None)

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
        """logits: [M, V] float32, one row per entry of `rows` -> token ids (and logprobs if asked).

        Batched: greedy rows take the argmax; sampled rows are warped together (temperature, top-k,
        top-p as tensor ops over the rows that ask for them) and drawn by inverse CDF with one uniform
        per row. A seeded request's uniform is a hash of (seed, stream, output position), so its tokens
        do not depend on the batch, on preemption or on earlier draws; others draw from the shared
        generator."""
        raw_logprobs = None
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if lp_rows:
            raw_logprobs = torch.log_softmax(logits.index_select(0, _index(lp_rows, logits.device)), dim=-1)
        logits = apply_adjustments(apply_min_tokens(logits, rows), rows)
        constrained = [i for i, r in enumerate(rows) if r.params.structured_outputs is not None]
        if constrained:
            logits = self._mask_by_grammar(logits, rows, constrained)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not sampled:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
            greedy = [i for i, r in enumerate(rows) if r.params.greedy]
            if greedy:
                idx = _index(greedy, logits.device)
                tokens.index_copy_(0, idx, logits.index_select(0, idx).argmax(dim=-1))
            u = self._uniforms([rows[i] for i in sampled])
            fused = self._fused is not None and logits.dtype == torch.float32 and logits.is_contiguous()
            plain = [j for j, i in enumerate(sampled) if fused and _temperature_only(rows[i].params, logits.shape[-1])]
            if plain:           # temperature alone: one fused pass per row (no [M, V] probabilities)
                rows_idx = _index([sampled[j] for j in plain], logits.device)
                temps = torch.tensor([rows[sampled[j]].params.temperature for j in plain], dtype=torch.float32)
                tokens.index_copy_(0, rows_idx, self._fused(logits, rows_idx, temps, u[_index(plain, u.device)]))
            done = set(plain)
            warped = [j for j in range(len(sampled)) if j not in done]
            if warped:
                idx = _index([sampled[j] for j in warped], logits.device)
                probs = batched_probs(logits.index_select(0, idx), [rows[sampled[j]].params for j in warped])
                tokens.index_copy_(0, idx, inverse_cdf(probs, u[_index(warped, u.device)]))
        token_list = tokens.tolist()
        for i in constrained:
            self._matchers[rows[i].request_id].consume_token(token_list[i])
        lps: list[TokenLogprob | None] = [None] * len(rows)
        for j, i in enumerate(lp_rows):
            lps[i] = token_logprob(raw_logprobs[j], token_list[i], rows[i].params.logprobs)
        return token_list, lps

    def _mask_by_grammar(self, logits: torch.Tensor, rows: list[SampleRow], constrained: list[int]) -> torch.Tensor:
        """Set to -inf the logits of tokens the rows' grammars do not allow next. Each request's
        matcher is made on its first constrained step and advanced by every token drawn for it; it
        is dropped with the request (`release`). A matcher in an error state allows only EOS."""
        vocab = logits.shape[-1]
        words = (vocab + 31) // 32
        bits = torch.empty(len(constrained), words, dtype=torch.int32)
        for j, i in enumerate(constrained):
            self._matcher(rows[i]).unsafe_compute_mask_ptr(bits[j].data_ptr(), words * 4)
        idx = _index(constrained, logits.device)
        logits = logits.clone()
        if self._mask_kernel is not None and logits.dtype == torch.float32 and logits.is_contiguous():
            self._mask_kernel(logits, idx, bits)       # one pass per row, in place (csrc/grammar_mask.cpp)
            return logits
        allowed = _unpack_bits(bits, vocab)
        logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill(~allowed.to(logits.device), float("-inf")))
        return logits

    def _matcher(self, r: SampleRow):
        """The request's matcher, made on first use (its state: every token committed so far)."""
        m = self._matchers.get(r.request_id)
        if m is None:
            if self.grammar is None:
                raise RuntimeError("a request asks for structured outputs but this sampler has no grammar backend")
            try:
                m = self.grammar.matcher(r.params.structured_outputs)
            except InvalidRequestError as e:    # validated at admission; never fail the whole step
                log.error("request %s: %s; ending it", r.request_id, e)
                m = _EndNow(self.grammar.eos_token_ids)
            self._matchers[r.request_id] = m
        return m

    # Speculative decoding under a grammar: drafts are cut at their first token the grammar refuses,
    # and each verification row is masked by the grammar's state after the drafts before it, so the
    # target distribution the verifier samples from is the constrained one (lossless).
    def grammar_valid_prefix(self, row: SampleRow, tokens: list[int]) -> int:
        """How many of `tokens`, drafted after the committed ones, the grammar accepts in a row."""
        return self._matcher(row).validate_tokens(list(tokens)) if tokens else 0

    def grammar_masks(self, row: SampleRow, drafts: list[int], num_rows: int, vocab: int) -> torch.Tensor:
        """[num_rows, vocab] bool: the tokens allowed at each verification row (row j follows the
        committed tokens and drafts[:j]). Rows after a draft the grammar refuses repeat the last
        mask: verification stops at that draft (its target probability is 0) and never reads them."""
        m = self._matcher(row)
        words = (vocab + 31) // 32
        bits = torch.empty(num_rows, words, dtype=torch.int32)
        consumed = j = 0
        for j in range(num_rows):
            m.unsafe_compute_mask_ptr(bits[j].data_ptr(), words * 4)
            if j == num_rows - 1 or j >= len(drafts) or m.try_consume_tokens([drafts[j]]) != 1:
                break
            consumed += 1
        bits[j + 1:] = bits[j]
        if consumed:
            m.rollback(consumed)
        return _unpack_bits(bits, vocab)

    def grammar_advance(self, row: SampleRow, tokens: list[int]) -> None:
        """Commit tokens emitted by verification to the request's matcher."""
        m = self._matcher(row)
        for t in tokens:
            m.consume_token(t)

    def _uniforms(self, rows: list[SampleRow]) -> torch.Tensor:
        """One uniform in (0, 1] per row: keyed by (seed, stream, position) when seeded."""
        u = 1.0 - torch.rand(len(rows), generator=self.generator, device=self.device, dtype=torch.float64)
        for j, r in enumerate(rows):
            if r.params.seed is not None:
                u[j] = keyed_uniform(r.params.seed, self.stream, r.num_output_tokens)
        return u

    @staticmethod
    def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
        """One token from `probs` [V] (exponential race)."""
        e = torch.empty_like(probs).exponential_(generator=generator)
        return int((probs / e).argmax())


def _unpack_bits(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[M, words] int32 bitmasks (llguidance's layout: token t is bit t % 32 of word t // 32) -> [M, vocab] bool."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], bits.shape[1] * 32)[:, :vocab].bool()


class _EndNow:
    """Stands in for a matcher that could not be made: allows EOS only, so the request ends."""

    def __init__(self, eos_token_ids) -> None:
        self.eos = list(eos_token_ids)

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> None:
        import ctypes

        words = (ctypes.c_uint32 * (nbytes // 4)).from_address(ptr)
        for w in range(nbytes // 4):
            words[w] = 0
        for t in self.eos:
            if t // 32 < nbytes // 4:
                words[t // 32] |= 1 << (t % 32)

    def consume_token(self, token: int) -> bool:
        return token in self.eos

    def validate_tokens(self, tokens: list[int]) -> int:
        return 1 if tokens and tokens[0] in self.eos else 0

    def try_consume_tokens(self, tokens: list[int]) -> int:
        return self.validate_tokens(tokens)

    def rollback(self, num_tokens: int) -> bool:
        return True


def _fused_sampler(device: torch.device):
    """The compiled `sample_rows` (csrc/sampling.cpp) on CPU where the kernels built, else None."""
    return _cpu_kernel(device, "sample_rows")


def _cpu_kernel(device: torch.device, name: str):
    """The compiled kernel `name` (a csrc/ file) on CPU where the kernels built, else None."""
    if device.type != "cpu":
        return None
    from tandem.runner.kernels import load_cpu_kernels

    module = load_cpu_kernels()
    return getattr(module, name, None) if module is not None else None


def _temperature_only(p: SamplingParams, vocab: int) -> bool:
    """A sampled row warped by its temperature alone (no top-k, top-p or min-p)."""
    return not 0 < p.top_k < vocab and p.top_p >= 1.0 and p.min_p <= 0


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def keyed_uniform(*parts: int) -> float:
    """A uniform in (0, 1] that depends only on the integers given (splitmix64 of their mix)."""
    z = (_mix(*parts) + 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    z ^= z >> 31
    return ((z >> 11) + 1) / float(1 << 53)


def batched_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[M, V] logits -> [M, V] probabilities after each row's temperature, min-p, top-k and top-p.

    Same rules as `warp_probs`, as tensor ops over all rows: top-k takes one `topk` at the largest k
    asked; top-p sorts only the rows that ask for it (a full-vocabulary sort is the costly part)."""
    dev, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
    logits = logits / temps.unsqueeze(1)
    if any(p.min_p > 0 for p in params):
        logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=dev))
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        k_max = max(ks)
        top = torch.topk(logits, k_max, dim=-1).values                           # [M, k_max] descending
        kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev).unsqueeze(1))
        kth = kth.masked_fill(torch.tensor([k == 0 for k in ks], device=dev).unsqueeze(1), float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        idx = _index(p_rows, dev)
        sub = logits.index_select(0, idx)
        sorted_logits, order = torch.sort(sub, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        top_p = torch.tensor([params[i].top_p for i in p_rows], dtype=sorted_probs.dtype, device=dev)
        # Drop a token once the mass strictly before it already reaches top_p (the first always stays).
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p.unsqueeze(1)
        sub = sub.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        logits = logits.index_copy(0, idx, sub)
    return torch.softmax(logits, dim=-1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative probability reaches u[i] (u in (0, 1]) of the row's total.
    A token of probability 0 is never chosen: the cumulative sum does not rise there."""
    exact = torch.float64 if probs.device.type in ("cpu", "cuda") else torch.float32   # MPS has no float64
    cdf = torch.cumsum(probs, dim=-1, dtype=exact)
    target = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _mix(*parts: int) -> int:
    """A generator seed from several integers (hashes of int tuples do not vary between runs)."""
    return hash(parts) & 0x7FFF_FFFF_FFFF_FFFF


def apply_adjustments(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Logit bias, then repetition / frequency / presence penalties, on the rows that ask (vLLM's
    definitions: repetition over prompt and output, frequency and presence over the output)."""
    todo = [(i, r) for i, r in enumerate(rows) if r.params.logit_bias or r.params.has_penalties]
    if not todo:
        return logits
    logits = logits.clone()
    vocab, dev = logits.shape[-1], logits.device
    for i, r in todo:
        p, row = r.params, logits[i]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=dev))
        if not p.has_penalties:
            continue
        history = torch.tensor(list(r.history), dtype=torch.long, device=dev)
        n_out = min(r.num_output_tokens, len(r.history))
        output = history[len(r.history) - n_out:]
        if p.repetition_penalty != 1.0 and len(history):
            seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
            seen[history] = True
            rp = p.repetition_penalty
            row.copy_(torch.where(seen, torch.where(row > 0, row / rp, row * rp), row))
        if (p.frequency_penalty or p.presence_penalty) and n_out:
            counts = torch.bincount(output, minlength=vocab).to(row.dtype)
            row.sub_(counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[M, V] tempered logits: drop tokens whose probability is below min_p[i] x the row's largest."""
    probs = torch.softmax(logits, dim=-1)
    keep = probs >= probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1)
    return logits.masked_fill(~keep, float("-inf"))


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
    """[V] logits -> [V] probabilities after temperature, min-p, top-k and top-p."""
    logits = logits / params.temperature
    if params.min_p > 0:
        logits = apply_min_p(logits.unsqueeze(0), torch.tensor([params.min_p], dtype=logits.dtype,
                                                                device=logits.device))[0]
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
