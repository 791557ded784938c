"""Speculative decoding inside one executor step: draft, extend the plan, verify, report.

`SpecDecoder.draft` asks the proposer for each scheduled request's drafts (up to the length the
scheduler chose), `extend` appends them to the step's inputs, and `verify` turns the target's
logits at a request's k+1 verification rows into emitted tokens (accepted drafts + one). After the
step, `hints` tells the scheduler how many drafts each request's proposer could offer next.
"""

from __future__ import annotations

import dataclasses

import torch

from tandem.runner.sampler import SampleRow, Sampler, apply_min_tokens, token_logprob, warp_probs
from tandem.spec.drafter import Draft, ModelDrafter
from tandem.spec.ngram import NgramProposer
from tandem.spec.verify import verify_greedy, verify_sampled
from tandem.types import ScheduledSeq, StepPlan, StepResult, TokenLogprob


class SpecDecoder:
    def __init__(self, proposer: NgramProposer | ModelDrafter, sampler: Sampler) -> None:
        self.proposer = proposer
        self.sampler = sampler

    def draft(self, plan: StepPlan) -> dict[str, Draft]:
        seqs = [s for s in plan.seqs if s.num_draft_tokens > 0]
        for rid in plan.preempted_ids:
            self.proposer.release(rid)
        if not seqs:
            return {}
        if isinstance(self.proposer, NgramProposer):
            return {s.request_id: Draft(self.proposer.propose(s.request_id, s.history, s.num_draft_tokens))
                    for s in seqs}
        return self.proposer.propose(seqs, [s.num_draft_tokens for s in seqs])

    @staticmethod
    def extend(plan: StepPlan, drafts: dict[str, Draft]) -> StepPlan:
        """The plan the target computes: each drafting request's chunk followed by its drafts."""
        if not drafts:
            return plan
        seqs = [dataclasses.replace(s, token_ids=s.token_ids + drafts[s.request_id].tokens, num_draft_tokens=0)
                if s.request_id in drafts else s for s in plan.seqs]
        return StepPlan(seqs, plan.preempted_ids)

    def verify(self, seq: ScheduledSeq, draft: Draft, logits: torch.Tensor) -> tuple[list[int], list[TokenLogprob] | None]:
        """logits: [k+1, V] raw target logits at the last committed token and each draft."""
        k = len(draft.tokens)
        params = seq.sampling_params
        rows = [SampleRow(seq.request_id, params, seq.num_output_tokens + j, seq.stop_token_ids) for j in range(k + 1)]
        masked = apply_min_tokens(logits, rows)
        if params.greedy:
            out = verify_greedy(masked.argmax(dim=-1).tolist(), draft.tokens)
        else:
            p = torch.stack([warp_probs(masked[j], params) for j in range(k + 1)])
            out = verify_sampled(p, draft.tokens, draft.probs, self.sampler.generator_for(rows[0]))
        lps = None
        if params.logprobs is not None:
            raw = torch.log_softmax(logits[:len(out)], dim=-1)
            lps = [token_logprob(raw[j], t, params.logprobs) for j, t in enumerate(out)]
        return out, lps

    def hints(self, plan: StepPlan, result: StepResult) -> None:
        """Fill `result.draft_available` (n-gram: how many tokens a lookup would offer next step)."""
        if not isinstance(self.proposer, NgramProposer):
            return
        for s in plan.seqs:
            new = result.sampled_token_ids.get(s.request_id)
            if new:
                result.draft_available[s.request_id] = self.proposer.available(s.request_id, s.history, new)

    def settle(self, seq: ScheduledSeq, num_accepted: int) -> None:
        if isinstance(self.proposer, ModelDrafter):
            self.proposer.settle(seq.request_id, seq.start + seq.num_tokens + num_accepted)

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)
