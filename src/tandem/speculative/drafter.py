"""Model-based drafting: a small draft model with its own paged KV, or layer-skip self-speculation.

Both draft k tokens autoregressively for a batch of requests, one forward pass per draft position
(pass j carries every request that drafts at least j tokens). A separate draft model keeps its
own KV in tensors shaped for it but indexed by the target's block tables (the scheduler already
reserved the slots), and catches up lazily: its first pass for a request feeds every committed
token it has not seen yet. Layer-skip runs the target's first L layers plus the final norm and
LM head, writing those layers' KV into the target's own cache (the verification pass rewrites
the same values), so it never needs to catch up.
"""

from __future__ import annotations

import time

import torch

from tandem.runner.passes import ForwardPass
from tandem.runner.sampler import Sampler, SampleRow, apply_min_tokens, warp_probs
from tandem.speculative.proposer import Draft
from tandem.types import ScheduledSeq


class ModelDrafter:
    """Drafting with a model (a `Proposer`): `passes` runs a separate draft model over its own paged
    KV, or the target's first layers over the target's KV (`shares_target_kv`)."""

    runs_model = True

    def __init__(self, passes: ForwardPass, sampler: Sampler, shares_target_kv: bool = False) -> None:
        self.passes = passes
        self.model = passes.model
        self.device = passes.device
        self.sampler = sampler
        self.shares_target_kv = shares_target_kv
        self._computed: dict[str, int] = {}     # positions whose draft KV is valid (own-KV drafters)
        self.pass_s = 0.0                       # last propose(): seconds of one steady forward pass

    @torch.inference_mode()
    def propose(self, seqs: list[ScheduledSeq], ks: list[int], prefix: dict[str, Draft] | None = None,
                cancelled: set[str] | frozenset[str] = frozenset(), pace=None) -> dict[str, Draft]:
        """Draft until seqs[i] has ks[i] draft tokens; returns the new tokens only.

        `prefix[rid]`: drafts the request already has (drafting continues after them: the overlap
        drafts a request's next frontier while the previous one is verified). A request whose id
        appears in `cancelled` (its verification rejected a draft meanwhile) is dropped from the
        passes that follow. `pace()`, if given, runs before each pass (the overlap's thread handoff)."""
        prefix = prefix or {}
        have = {s.request_id: list(prefix[s.request_id].tokens) if s.request_id in prefix else [] for s in seqs}
        begin = {rid: len(t) for rid, t in have.items()}
        drafts = {s.request_id: Draft([], [] if not s.sampling_params.greedy else None) for s in seqs}
        last_pos = {s.request_id: s.start + s.num_tokens - 1 for s in seqs}
        passes: list[float] = []
        for j in range(min(begin.values(), default=0), max(ks, default=0)):
            batch = [s for s, k in zip(seqs, ks) if begin[s.request_id] <= j < k and s.request_id not in cancelled]
            if not batch:
                continue
            if pace is not None:
                pace()
            started = time.perf_counter()
            pass_seqs = [self._pass_seq(s, have[s.request_id], last_pos[s.request_id], j) for s in batch]
            inputs = self.passes.inputs(pass_seqs)
            hidden = self.passes.run(inputs)
            logits = self.passes.logits(hidden, [r + s.num_tokens - 1 for s, r in zip(inputs.seqs, inputs.row_starts)])
            order = {s.request_id: i for i, s in enumerate(inputs.seqs)}
            for s in batch:
                self._extend(drafts[s.request_id], s, logits[order[s.request_id]], j)
                have[s.request_id].append(drafts[s.request_id].tokens[-1])
            passes.append(time.perf_counter() - started)
        # A pass's cost, for the step-cost model: the first pass also feeds the draft model what it
        # has not seen (a new request's whole prompt), so it counts only when it is the only one.
        steady = passes[1:] or passes
        self.pass_s = sum(steady) / len(steady) if steady else 0.0
        for s in seqs:
            if not self.shares_target_kv and drafts[s.request_id].tokens:
                self._computed[s.request_id] = last_pos[s.request_id] + len(have[s.request_id])
        for d in drafts.values():
            if isinstance(d.probs, list):
                d.probs = torch.stack(d.probs) if d.probs else None
        return drafts

    def _pass_seq(self, s: ScheduledSeq, tokens: list[int], p: int, j: int) -> ScheduledSeq:
        if j == 0:
            start = p if self.shares_target_kv else min(self._computed.get(s.request_id, 0), p)
            ids = s.history[start:p + 1]
        else:
            start, ids = p + j, [tokens[-1]]
        return ScheduledSeq(s.request_id, ids, start, s.block_ids, True, s.sampling_params,
                            s.num_output_tokens + j, s.stop_token_ids)

    def _extend(self, draft: Draft, s: ScheduledSeq, logits: torch.Tensor, j: int) -> None:
        row = SampleRow(s.request_id, s.sampling_params, s.num_output_tokens + j, s.stop_token_ids)
        logits = apply_min_tokens(logits.unsqueeze(0), [row])[0]
        if s.sampling_params.greedy:
            draft.tokens.append(int(logits.argmax()))
            return
        q = warp_probs(logits, s.sampling_params)
        draft.tokens.append(Sampler.draw(q, self.sampler.generator_at(row)))
        draft.probs.append(q)

    def offer(self, seq: ScheduledSeq, new_tokens: list[int]) -> None:
        return None

    def settle(self, request_id: str, num_computed: int) -> None:
        """The target kept KV for `num_computed` tokens: draft KV past them is void."""
        if request_id in self._computed:
            self._computed[request_id] = min(self._computed[request_id], num_computed)

    def release(self, request_id: str, finished: bool = False) -> None:
        self._computed.pop(request_id, None)
