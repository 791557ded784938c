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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.runner.inputs import StepInputs
from tandem.types import ScheduledSeq


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


@dataclass
class _Rows:
    seq: ScheduledSeq            # the drafting request's scheduled seq (token_ids = [x0])
    tokens: list[int]            # x0 then the drafts (so far: with overlap they arrive frontier by frontier)
    total: int = 0               # rows once every draft is in (0: len(tokens))
    done: bool = False
    emitted: list[int] = field(default_factory=list)
    pruned: int = 0

    def __post_init__(self) -> None:
        self.total = self.total or len(self.tokens)


def pass_seq(r: _Rows, a: int, b: int) -> ScheduledSeq:
    return ScheduledSeq(r.seq.request_id, r.tokens[a:b], r.seq.start + a, r.seq.block_ids, True,
                        r.seq.sampling_params, r.seq.num_output_tokens + a, r.seq.stop_token_ids)


def exit_hook(ee: EarlyExit, inputs: StepInputs, rows: dict[str, _Rows], firsts: dict[str, int],
              build, state: dict):
    """The model's exit hook for one pass: drop rows after a predicted rejection. `build(seqs)`
    makes the inputs of the rows kept (ForwardPass.inputs); they are left in state["inputs"]."""
    def hook(x: torch.Tensor):
        checks, where = [], []
        for s, r0 in zip(inputs.seqs, inputs.row_starts):
            if s.request_id not in rows:
                continue
            for j in range(s.num_tokens - 1):        # row j judges the token that is row j+1's input
                checks.append(r0 + j)
                where.append((s.request_id, j))
        if not checks:
            return None
        idx = torch.tensor(checks, dtype=torch.long, device=x.device)
        reject = ee.predicted_rejections(x.index_select(0, idx), [inputs.input_ids[i + 1].item() for i in checks], [])
        cut: dict[str, int] = {}
        for (rid, j), rej in zip(where, reject):
            if rej and rid not in cut:
                cut[rid] = j + 1                      # keep rows 0..j of this pass
        if not cut:
            return None
        seqs = [ScheduledSeq(s.request_id, s.token_ids[:cut[s.request_id]], s.start, s.block_ids, s.sample,
                             s.sampling_params, s.num_output_tokens, s.stop_token_ids)
                if s.request_id in cut else s for s in inputs.seqs]
        new = build(seqs)
        old_start = {s.request_id: r for s, r in zip(inputs.seqs, inputs.row_starts)}
        keep = torch.cat([torch.arange(old_start[s.request_id], old_start[s.request_id] + s.num_tokens)
                          for s in new.seqs]).to(x.device)
        for rid, n in cut.items():
            rows[rid].pruned += next(s.num_tokens for s in inputs.seqs if s.request_id == rid) - n
        state["inputs"] = new
        return keep, new.positions, new.meta
    return hook
