"""Early pruning in verification (FASER): frontiers and an intermediate-layer rejection check.

Frontiers: a request's k+1 verification rows (its last committed token, then its k drafts) are
computed in chunks of `frontier_size` rows, one forward pass per chunk; after each pass the drafts
those rows judge are verified, and a rejection cancels the later chunks of that request (they are
never computed). Requests without drafts run in the first pass only.

Early exit: after `layer` layers, the target's hidden state at row j is scored (final norm, then
the LM head restricted to a shortlist: the most frequently emitted tokens plus the batch's drafts)
and draft j+1 is predicted rejected if `topk` or more shortlist tokens outscore it. The rows after
a predicted rejection are dropped from the deeper layers; row j itself stays, so draft j+1 is still
verified exactly. A wrong prediction only loses the dropped drafts' chance (the emitted tokens
then end with an accepted draft and no bonus token); output stays exactly the target's.

Both are options of the verification round (tandem.speculative.verify_round); the check runs inside
a pass through `ForwardPass.run_with_exit`, with `EarlyExit.rows_kept` as its answer.
"""

from __future__ import annotations

from collections.abc import Container

import torch

from tandem.runner.inputs import StepInputs


class EarlyExit:
    def __init__(self, model, layer: int, topk: int, shortlist_size: int = 256) -> None:
        if layer >= model.cfg.num_layers:
            from tandem.errors import ConfigError
            raise ConfigError(f"early_exit_layer {layer} must be below the target's {model.cfg.num_layers} layers")
        self.model = model
        self.layer = layer
        self.topk = topk
        self.shortlist_size = shortlist_size
        self.counts = torch.zeros(model.cfg.vocab_size)
        self.num_checked = 0
        self.num_predicted_rejections = 0
        self.num_wrong_predictions = 0      # predicted rejected, then accepted by the full model

    def observe(self, tokens: list[int]) -> None:
        if tokens:
            self.counts.index_add_(0, torch.tensor(tokens), torch.ones(len(tokens)))

    def predicted_rejections(self, h: torch.Tensor, next_tokens: list[int], extra: list[int]) -> list[bool]:
        """h: [M, hidden] residual rows; next_tokens[i]: the draft row i judges."""
        m = self.model
        k = min(self.shortlist_size, int((self.counts > 0).sum()))
        short = torch.topk(self.counts, k).indices if k else torch.empty(0, dtype=torch.long)
        cand = torch.unique(torch.cat([short, torch.tensor(extra + next_tokens, dtype=torch.long)]))
        hn = m.ops.add_rms_norm(h.contiguous(), None, m.norm, m.cfg.rms_norm_eps)
        scores = hn @ m.head_rows(cand.to(hn.device)).t()                               # [M, |cand|]
        own = (hn * m.head_rows(torch.tensor(next_tokens, device=hn.device))).sum(-1, keepdim=True)
        rank = (scores > own).sum(-1)
        self.num_checked += len(next_tokens)
        out = (rank >= self.topk).tolist()
        self.num_predicted_rejections += sum(out)
        return out

    def rows_kept(self, x: torch.Tensor, inputs: StepInputs, verifying: Container[str]) -> dict[str, int]:
        """After `layer` layers of a pass over `inputs` (x: the residual stream, a row per input):
        {request id: rows to keep} for each chunk in `verifying` with a draft predicted rejected,
        keeping rows up to the one that judges it; empty where none is (`ForwardPass.run_with_exit`)."""
        checks, where = [], []
        for s, r0 in zip(inputs.seqs, inputs.row_starts):
            if s.request_id not in verifying:
                continue
            for j in range(s.num_tokens - 1):        # row j judges the token that is row j+1's input
                checks.append(r0 + j)
                where.append((s.request_id, j))
        if not checks:
            return {}
        idx = torch.tensor(checks, dtype=torch.long, device=x.device)
        reject = self.predicted_rejections(x.index_select(0, idx), [inputs.input_ids[i + 1].item() for i in checks], [])
        kept: dict[str, int] = {}
        for (rid, j), rej in zip(where, reject):
            if rej and rid not in kept:
                kept[rid] = j + 1                     # keep rows 0..j of this pass
        return kept
