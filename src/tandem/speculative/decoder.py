"""Speculative decoding inside one executor step: draft, verify, report.

`SpecDecoder.draft` asks the proposer for each scheduled request's drafts (up to the length the
scheduler chose); the verification round (verify_round.py) computes them after the request's last
committed token, and `verify` turns the target's logits at a request's k+1 verification rows into
emitted tokens (accepted drafts + one). After the step, `report` tells the scheduler how many
drafts each request's proposer could offer next and how long drafting took (the step-cost model
separates drafting from verifying with it).
"""

from __future__ import annotations

import time

import torch

from tandem.runner.sampler import Sampler, SampleRow, apply_min_tokens, token_logprob, warp_probs
from tandem.speculative.proposer import Draft, Proposer
from tandem.speculative.verify import verify_greedy, verify_sampled
from tandem.types import ScheduledSeq, StepPlan, StepResult, TokenLogprob


def num_accepted(out: list[int], drafts: list[int]) -> int:
    """Drafts accepted in `out` (every token but a trailing correction / bonus token)."""
    if len(out) <= len(drafts) and out == drafts[:len(out)]:
        return len(out)
    return len(out) - 1


class SpecDecoder:
    def __init__(self, proposer: Proposer, sampler: Sampler, method: str = "ngram",
                 frontier_size: int = 0, early_exit=None, overlap=None) -> None:
        self.proposer = proposer
        self.method = method                    # the SpecConfig method that built the proposer
        self.sampler = sampler
        self.frontier_size = frontier_size      # verify in chunks of this many rows (0: one pass)
        self.step_frontier = frontier_size      # this step's: the plan's choice, else frontier_size
        self.early_exit = early_exit            # a tandem.speculative.pruning.EarlyExit, or None
        self.overlap = overlap                  # a tandem.speculative.overlap.DraftWorker, or None
        self.draft_s = 0.0                      # this step's proposer seconds, and one forward pass's
        self.draft_pass_s = 0.0

    @property
    def prunes(self) -> bool:
        return bool(self.step_frontier) or self.early_exit is not None

    @property
    def overlaps(self) -> bool:
        """Draft frontier by frontier, the next one while the current one is verified."""
        return self.overlap is not None and self.step_frontier > 0 and self.proposer.runs_model

    def draft(self, plan: StepPlan) -> dict[str, Draft]:
        """Drafts for the step's drafting requests (the first frontier only when overlapping); also
        fixes the step's frontier size (`step_frontier`) that `prunes` and `overlaps` read."""
        self.step_frontier = self.frontier_size if plan.frontier_size is None else plan.frontier_size
        self.draft_s = self.draft_pass_s = 0.0
        seqs = [s for s in plan.seqs if s.num_draft_tokens > 0]
        if not seqs:
            return {}
        started = time.perf_counter()
        ks = [s.num_draft_tokens for s in seqs]
        if self.overlaps:                       # the first frontier now, the rest during verification
            ks = [min(k, self.step_frontier) for k in ks]
        drafts = self.proposer.propose(seqs, ks)
        self.draft_pass_s = self.proposer.pass_s
        self.draft_s = time.perf_counter() - started
        for s in seqs:                          # under a grammar: cut at the first token it refuses
            if s.sampling_params.structured_outputs is not None and s.request_id in drafts:
                self._cut_to_grammar(s, drafts[s.request_id])
        return drafts

    def _cut_to_grammar(self, s: ScheduledSeq, draft: Draft) -> None:
        row = SampleRow(s.request_id, s.sampling_params, s.num_output_tokens, s.stop_token_ids)
        keep = self.sampler.grammar_valid_prefix(row, draft.tokens)
        if keep < len(draft.tokens):
            draft.tokens = draft.tokens[:keep]
            if draft.probs is not None:
                draft.probs = draft.probs[:keep]

    def verify(self, seq: ScheduledSeq, draft: Draft, logits: torch.Tensor, first: int = 0
               ) -> tuple[list[int], list[TokenLogprob] | None]:
        """logits: raw target logits at rows first..first+n-1 of the k+1 verification rows (the last
        committed token, then each draft); they judge drafts first+1..first+n (and add the bonus
        token if the last row is row k)."""
        n = logits.shape[0]
        params = seq.sampling_params
        drafts = draft.tokens[first:first + n]
        rows = [SampleRow(seq.request_id, params, seq.num_output_tokens + first + j, seq.stop_token_ids)
                for j in range(n)]
        masked = apply_min_tokens(logits, rows)
        constrained = params.structured_outputs is not None
        if constrained:                 # each row masked by the grammar's state after the drafts before it
            allowed = self.sampler.grammar_masks(rows[0], drafts, n, logits.shape[-1])
            masked = masked.masked_fill(~allowed.to(masked.device), float("-inf"))
        if params.greedy:
            out = verify_greedy(masked.argmax(dim=-1).tolist(), drafts)
        else:
            p = torch.stack([warp_probs(masked[j], params) for j in range(n)])
            q = draft.probs[first:first + len(drafts)] if draft.probs is not None else None
            out = verify_sampled(p, drafts, q, self.sampler.generator_for(rows[0]))
        if constrained:
            self.sampler.grammar_advance(rows[0], out)
        lps = None
        if params.logprobs is not None:
            raw = torch.log_softmax(logits[:len(out)], dim=-1)
            lps = [token_logprob(raw[j], t, params.logprobs) for j, t in enumerate(out)]
        return out, lps

    def report(self, plan: StepPlan, result: StepResult) -> None:
        """Fill the result's drafting fields: the proposer's seconds this step (`draft_s`,
        `draft_pass_s`) and `draft_available` (what the proposer could offer next, where it says:
        an n-gram lookup's matches)."""
        result.draft_s, result.draft_pass_s = self.draft_s, self.draft_pass_s
        for s in plan.seqs:
            new = result.sampled_token_ids.get(s.request_id)
            if new:
                offer = self.proposer.offer(s, new)
                if offer is None:
                    return                      # a model drafts whatever it is asked for
                result.draft_available[s.request_id] = offer

    def settle(self, seq: ScheduledSeq, num_emitted: int) -> None:
        """The target emitted `num_emitted` tokens after the step's chunk; the last has no KV yet."""
        self.proposer.settle(seq.request_id, seq.start + seq.num_tokens + num_emitted - 1)

    def release(self, request_id: str, finished: bool = False) -> None:
        self.proposer.release(request_id, finished)
