"""One executor step with early pruning: frontier passes and/or the early-exit check (pruning.py).

Used by the runner when the speculation config asks for pruning; otherwise verification is one
plain pass. It runs the target through the runner's `ForwardPass` (tandem.runner.passes) and samples
the rows of requests without drafts through the runner's `sample_rows`, both handed in. Pass 0 carries every scheduled request; later passes carry only the drafting requests
whose drafts were all accepted so far. With overlap (overlap.py) the drafts arrive one frontier at
a time: while pass f verifies frontier f, the worker drafts frontier f+1 for the requests that
still want more; a rejection in pass f cancels that request's drafting in flight.
"""

from __future__ import annotations

import torch

from tandem.runner.passes import ForwardPass
from tandem.speculative.decoder import SpecDecoder, num_accepted
from tandem.speculative.proposer import Draft
from tandem.speculative.pruning import _Rows, exit_hook, pass_seq
from tandem.types import StepPlan, StepResult


def execute_with_pruning(passes: ForwardPass, sample_rows, spec: SpecDecoder, plan: StepPlan,
                         drafts: dict[str, Draft]) -> StepResult:
    """The step's result; `sample_rows(result, [(seq, logits row)], logits)` samples plain rows."""
    result = StepResult()
    overlap = spec.overlap if spec.overlaps else None
    rows = {s.request_id: _Rows(s, [s.token_ids[-1]] + drafts[s.request_id].tokens,
                                total=1 + (s.num_draft_tokens if overlap else len(drafts[s.request_id].tokens)))
            for s in plan.seqs if s.request_id in drafts and drafts[s.request_id].tokens}
    first = {rid: 0 for rid in rows}
    lps: dict[str, list] = {rid: [] for rid in rows}
    width = spec.step_frontier or max((len(r.tokens) for r in rows.values()), default=1)
    cancelled: set[str] = set()          # requests whose drafting in flight is void (read by the worker)
    pass_no = 0
    while True:
        seqs = [s for s in plan.seqs if s.request_id not in rows] if pass_no == 0 else []
        active = {rid: r for rid, r in rows.items() if not r.done}
        seqs += [pass_seq(r, first[rid], min(first[rid] + width, len(r.tokens))) for rid, r in active.items()]
        if not seqs:
            break
        more = [r for r in active.values() if len(r.tokens) < r.total] if overlap is not None else []
        if more:
            job = overlap.submit(spec.proposer.propose, [r.seq for r in more],
                                 [min(len(r.tokens) - 1 + width, r.total - 1) for r in more],
                                 {r.seq.request_id: drafts[r.seq.request_id] for r in more}, cancelled,
                                 overlap.pace)
            try:
                with overlap.verifying():
                    _one_pass(passes, sample_rows, spec, seqs, active, first, drafts, result, lps, cancelled)
            finally:
                new = overlap.result(job)        # never leave the worker drafting past this step
            _take_drafts(new, rows, drafts)
        else:
            _one_pass(passes, sample_rows, spec, seqs, active, first, drafts, result, lps, cancelled)
        pass_no += 1
    for rid, r in rows.items():
        d = drafts[rid].tokens
        result.sampled_token_ids[rid] = r.emitted
        result.num_draft_tokens[rid] = len(d)
        result.num_accepted_tokens[rid] = num_accepted(r.emitted, d)
        result.num_pruned_tokens[rid] = r.pruned
        if lps[rid]:
            result.logprobs[rid] = lps[rid]
        spec.settle(r.seq, len(r.emitted))
        if spec.early_exit is not None:
            spec.early_exit.observe(r.emitted)
    return result


def _take_drafts(new: dict[str, Draft], rows: dict[str, _Rows], drafts: dict[str, Draft]) -> None:
    """Append a frontier drafted during the last pass; a request rejected meanwhile prunes it."""
    for rid, d in new.items():
        if not d.tokens:
            continue
        old = drafts[rid]
        old.tokens = old.tokens + d.tokens
        if d.probs is not None:
            old.probs = d.probs if old.probs is None else torch.cat([old.probs, d.probs])
        r = rows[rid]
        if r.done:
            r.pruned += len(d.tokens)
        else:
            r.tokens = r.tokens + d.tokens


def _one_pass(passes: ForwardPass, sample_rows, spec: SpecDecoder, seqs, active, first, drafts,
              result: StepResult, lps, cancelled: set[str]) -> None:
    inputs = passes.inputs(seqs)
    state: dict = {}
    ee = spec.early_exit
    hook = exit_hook(ee, inputs, active, first, passes.inputs, state) if ee is not None else None
    hidden = passes.run(inputs, exit_layer=ee.layer if ee is not None else None, exit_hook=hook)
    inputs = state.get("inputs", inputs)
    plain = [(s, r + s.num_tokens - 1) for s, r in zip(inputs.seqs, inputs.row_starts)
             if s.request_id not in active and s.sample]
    if plain:
        logits = passes.logits(hidden, [r for _, r in plain])
        sample_rows(result, [(s, i) for i, (s, _) in enumerate(plain)], logits)
        if ee is not None:
            for s, _ in plain:
                ee.observe(result.sampled_token_ids.get(s.request_id, []))
    for s, r0 in zip(inputs.seqs, inputs.row_starts):
        if s.request_id not in active:
            continue
        rs, a = active[s.request_id], first[s.request_id]
        n = s.num_tokens
        logits = passes.logits(hidden[r0:r0 + n])
        out, lp = spec.verify(rs.seq, drafts[s.request_id], logits, first=a)
        rs.emitted += out
        if lp:
            lps[s.request_id] += lp
        all_drafts = num_accepted(out, drafts[s.request_id].tokens[a:a + n]) == len(out)
        planned = min(a + (spec.step_frontier or len(rs.tokens)), len(rs.tokens)) - a
        first[s.request_id] = a + n
        if n < planned and all_drafts and ee is not None:
            ee.num_wrong_predictions += 1             # the draft predicted rejected was accepted
        if not all_drafts or n < planned or first[s.request_id] >= rs.total:
            rs.done = True
            cancelled.add(s.request_id)
            rs.pruned += len(rs.tokens) - first[s.request_id] - (planned - n)
