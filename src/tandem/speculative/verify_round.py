"""One verification round: a step whose drafts the target verifies, in one pass or in frontiers.

The executor (tandem.executor) hands a step with drafts to `VerifyRound`; a step without any runs
its plain pass and never gets here. Each drafting request's state is one `VerifyRows`: its
verification rows (the last committed token x0, then its drafts) and how far they got. The round
is one loop of forward passes (through the runner's `ForwardPass`); each pass computes every
unfinished request's next frontier of rows, verifies them (SpecDecoder.verify), and a request is
done at its first rejected draft or at its last row. Pass 0 also carries the requests without
drafts, whose rows are sampled through the executor's `sample_rows`.

- One pass (no pruning): the frontier is as wide as the longest draft, so pass 0 verifies
  everything. It keeps the plan's order of requests, and every row's logits come from one call.
- Frontiers (`frontier_size` F, or the plan's choice): passes of F rows per request; a rejection
  prunes the request's later rows, never computed (tandem.speculative.pruning).
- Early exit (`early_exit_layer`): within a pass, rows after a draft an intermediate layer predicts
  rejected are dropped from the deeper layers (`ForwardPass.run_with_exit`, `EarlyExit.rows_kept`).
- Overlap (overlap.py): the drafts arrive one frontier at a time; while pass f verifies frontier f,
  the worker drafts frontier f+1 for the requests that still want more, and a rejection in pass f
  cancels that request's drafting in flight (`VerifyRound.cancelled`, read by the worker).
With pruning (the last three), pass 0 puts the requests without drafts first, and each request's
rows get their own logits call: each mode keeps the row order and logits grouping it always had
(a kernel may be chosen by the number of rows, e.g. a GGUF model's, so the bits stay the same).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from tandem.runner.inputs import StepInputs
from tandem.runner.passes import ForwardPass
from tandem.speculative.decoder import SpecDecoder, num_accepted
from tandem.speculative.proposer import Draft
from tandem.types import ScheduledSeq, StepPlan, StepResult, TokenLogprob

# TorchExecutor.sample_rows: sample one token for each (seq, row of logits) into the result.
SampleRows = Callable[[StepResult, list[tuple[ScheduledSeq, int]], torch.Tensor], None]


@dataclass
class VerifyRows:
    """One drafting request's verification in a round."""

    seq: ScheduledSeq            # the request's scheduled decode (token_ids = [x0])
    draft: Draft                 # its drafts (with overlap, longer by a frontier after each pass)
    tokens: list[int]            # its rows' tokens: x0, then the drafts taken into verification
    total: int                   # rows once every draft is in (1 + the drafts asked for)
    first: int = 0               # the next row to verify (rows before it are verified)
    done: bool = False           # verification stopped: a draft rejected, or no row left
    emitted: list[int] = field(default_factory=list)             # accepted drafts (+ one token)
    pruned: int = 0              # drafts never verified (rows after the stop, frontiers drafted after it)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def pass_seq(self, width: int) -> ScheduledSeq:
        """The chunk of the next pass: rows first..first+width-1, as far as the tokens go."""
        a, b, s = self.first, min(self.first + width, len(self.tokens)), self.seq
        return ScheduledSeq(s.request_id, self.tokens[a:b], s.start + a, s.block_ids, True,
                            s.sampling_params, s.num_output_tokens + a, s.stop_token_ids)

    def take(self, more: Draft) -> None:
        """Append a frontier drafted during the last pass (pruned at once if verification stopped)."""
        if not more.tokens:
            return
        d = self.draft
        d.tokens = d.tokens + more.tokens
        if more.probs is not None:
            d.probs = more.probs if d.probs is None else torch.cat([d.probs, more.probs])
        if self.done:
            self.pruned += len(more.tokens)
        else:
            self.tokens = self.tokens + more.tokens


class VerifyRound:
    def __init__(self, passes: ForwardPass, sample_rows: SampleRows, spec: SpecDecoder, plan: StepPlan,
                 drafts: dict[str, Draft]) -> None:
        """`drafts`: SpecDecoder.draft's for the plan (the first frontier only when overlapping)."""
        self.passes = passes
        self.sample_rows = sample_rows
        self.spec = spec
        self.plan = plan
        self.prunes = spec.prunes                    # frontiers and/or early exit; else one pass
        self.early_exit = spec.early_exit            # a tandem.speculative.pruning.EarlyExit, or None
        self.overlap = spec.overlap if spec.overlaps else None
        self.rows = {s.request_id: VerifyRows(s, d, [s.token_ids[-1]] + d.tokens,
                                              1 + (s.num_draft_tokens if self.overlap is not None else len(d.tokens)))
                     for s in plan.seqs if (d := drafts.get(s.request_id)) is not None and d.tokens}
        self.width = spec.step_frontier or max((len(r.tokens) for r in self.rows.values()), default=1)
        self.cancelled: set[str] = set()             # done requests, whose drafting in flight is void
        self.result = StepResult()

    def run(self) -> StepResult:
        """Verify every request's drafts, sample the rest; the step's result (without SpecDecoder.report)."""
        seqs = self._first_pass()
        while seqs:
            self._pass(seqs, {rid: r for rid, r in self.rows.items() if not r.done})
            seqs = [r.pass_seq(self.width) for r in self.rows.values() if not r.done]
        for rid, r in self.rows.items():
            d = r.draft.tokens
            self.result.sampled_token_ids[rid] = r.emitted
            self.result.num_draft_tokens[rid] = len(d)
            self.result.num_accepted_tokens[rid] = num_accepted(r.emitted, d)
            self.result.num_pruned_tokens[rid] = r.pruned
            if r.logprobs:
                self.result.logprobs[rid] = r.logprobs
            self.spec.settle(r.seq, len(r.emitted))
            if self.early_exit is not None:
                self.early_exit.observe(r.emitted)
        return self.result

    def _first_pass(self) -> list[ScheduledSeq]:
        """Every scheduled request, a drafting one as its first frontier."""
        first = {rid: r.pass_seq(self.width) for rid, r in self.rows.items()}
        if not self.prunes:
            return [first.get(s.request_id, s) for s in self.plan.seqs]
        return [s for s in self.plan.seqs if s.request_id not in first] + list(first.values())

    def _pass(self, seqs: list[ScheduledSeq], active: dict[str, VerifyRows]) -> None:
        """One pass over `seqs`, `active`'s frontiers among them; with overlap, drafting the next."""
        ov = self.overlap
        more = [r for r in active.values() if len(r.tokens) < r.total] if ov is not None else []
        if not more:
            self._compute(seqs, active)
            return
        job = ov.submit(self.spec.proposer.propose, [r.seq for r in more],
                        [min(len(r.tokens) - 1 + self.width, r.total - 1) for r in more],
                        {r.seq.request_id: r.draft for r in more}, self.cancelled, ov.pace)
        try:
            with ov.verifying():
                self._compute(seqs, active)
        finally:
            new = ov.result(job)                     # never leave the worker drafting past this step
        for rid, d in new.items():
            self.rows[rid].take(d)

    def _compute(self, seqs: list[ScheduledSeq], active: dict[str, VerifyRows]) -> None:
        """Run the pass, sample its plain rows, verify its frontiers."""
        inputs = self.passes.inputs(seqs)
        ee = self.early_exit
        if ee is None:
            hidden = self.passes.run(inputs)
        else:
            hidden, inputs = self.passes.run_with_exit(inputs, ee.layer,
                                                       partial(ee.rows_kept, inputs=inputs, verifying=active))
        plain, plain_logits, checks = self._logits(hidden, inputs, active)
        if plain:
            self.sample_rows(self.result, plain, plain_logits)
            if ee is not None:
                for s, _ in plain:
                    ee.observe(self.result.sampled_token_ids.get(s.request_id, []))
        for r, logits in checks:
            self._verify(r, logits)

    def _logits(self, hidden: torch.Tensor, inputs: StepInputs, active: dict[str, VerifyRows]
                ) -> tuple[list[tuple[ScheduledSeq, int]], torch.Tensor | None, list[tuple[VerifyRows, torch.Tensor]]]:
        """([(plain seq, its row of the plain logits)], the plain logits, [(VerifyRows, logits of its
        rows in the pass)]). One pass takes them all in one call, as the plain step; pruning, the
        plain rows' in one call and each request's in its own."""
        plain, spans, rows = [], [], []      # rows: the pass rows whose logits are needed, in pass order
        for s, r0 in zip(inputs.seqs, inputs.row_starts):
            r = active.get(s.request_id)
            if r is not None:
                spans.append((r, r0, len(rows), s.num_tokens))
                rows.extend(range(r0, r0 + s.num_tokens))
            elif s.sample:
                plain.append((s, r0 + s.num_tokens - 1, len(rows)))
                rows.append(r0 + s.num_tokens - 1)
        if self.prunes:
            logits = self.passes.logits(hidden, [row for _, row, _ in plain]) if plain else None
            return ([(s, i) for i, (s, _, _) in enumerate(plain)], logits,
                    [(r, self.passes.logits(hidden[r0:r0 + n])) for r, r0, _, n in spans])
        if not rows:
            return [], None, []
        logits = self.passes.logits(hidden, rows)
        return [(s, o) for s, _, o in plain], logits, [(r, logits[o:o + n]) for r, _, o, n in spans]

    def _verify(self, r: VerifyRows, logits: torch.Tensor) -> None:
        """Verify r's rows first.. of this pass (`logits`: as many as the pass kept) and advance."""
        a, n = r.first, logits.shape[0]
        planned = min(self.width, len(r.tokens) - a)    # the rows the pass had before an exit cut
        out, lps = self.spec.verify(r.seq, r.draft, logits, first=a)
        r.emitted += out
        if lps:
            r.logprobs += lps
        all_drafts = num_accepted(out, r.draft.tokens[a:a + n]) == len(out)
        r.first = a + n
        if n < planned and all_drafts and self.early_exit is not None:
            self.early_exit.num_wrong_predictions += 1   # the draft predicted rejected was accepted
        if not all_drafts or n < planned or r.first >= r.total:
            r.done = True
            self.cancelled.add(r.seq.request_id)
            r.pruned += len(r.tokens) - r.first
