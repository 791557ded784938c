"""One forward pass of a model over scheduled chunks: the unit every executor step is made of.

A plain step is one pass (tandem.executor); a verification round is one pass or, in frontiers,
several (tandem.speculative.verify_round); a model drafter runs one pass per draft position
(tandem.speculative.drafter). `ForwardPass` is the one way they all run a model: build the
pass's inputs from its chunks, run the layers over the paged KV (writing the chunks' K/V), and take
the logits of the rows asked for. It holds no per-request state and makes no decision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cached_property

import torch

from tandem.runner.attention import AttentionBackend
from tandem.runner.inputs import StepInputs, build_inputs
from tandem.types import ScheduledSeq, StepPlan


class ForwardPass:
    def __init__(self, model, attn: AttentionBackend, block_size: int, device: torch.device,
                 num_layers: int | None = None) -> None:
        """`model`: a tandem.models.llama.LlamaModel; `num_layers`: run only its first layers
        (layer-skip drafting), else all."""
        self.model = model
        self.attn = attn
        self.block_size = block_size
        self.device = device
        self.num_layers = num_layers
        self.paged_kernel = attn.kernel is not None
        self.fused = True           # decode steps through the model's DecoderStack where it applies

    def inputs(self, seqs: list[ScheduledSeq]) -> StepInputs:
        """The pass's tensors; rows are grouped batched-first (`StepInputs.seqs` is their order)."""
        return build_inputs(StepPlan(seqs), self.block_size, self.device, self.paged_kernel)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of every row: [rows, hidden]."""
        stack = self.stack if self.fused else None
        if stack is not None and not stack.applies(inputs.meta, int(inputs.input_ids.shape[0])):
            stack = None
        return self.model(inputs.input_ids, inputs.positions, self.attn, inputs.meta, self.num_layers, stack=stack)

    def run_with_exit(self, inputs: StepInputs, exit_layer: int,
                      rows_kept: Callable[[torch.Tensor], dict[str, int]]) -> tuple[torch.Tensor, StepInputs]:
        """A pass whose chunks may stop early: after `exit_layer` layers, `rows_kept(residual)` returns
        {request id: rows of its chunk to keep} for the chunks it shortens (empty: keep every row),
        and the deeper layers compute only the rows kept. Returns their hidden states and the inputs
        of the chunks as kept (the same `inputs` if none was shortened).

        This is the one user of LlamaModel.forward's `exit_hook`, which takes (rows to keep, their
        positions, their attention metadata) from the hook; the kept inputs come back from here."""
        kept = inputs

        def hook(x: torch.Tensor):
            nonlocal kept
            cut = rows_kept(x)
            if not cut:
                return None
            kept = self.inputs([dataclasses.replace(s, token_ids=s.token_ids[:cut[s.request_id]])
                                if s.request_id in cut else s for s in inputs.seqs])
            start = {s.request_id: r for s, r in zip(inputs.seqs, inputs.row_starts)}
            keep = torch.cat([torch.arange(start[s.request_id], start[s.request_id] + s.num_tokens)
                              for s in kept.seqs]).to(x.device)
            return keep, kept.positions, kept.meta

        hidden = self.model(inputs.input_ids, inputs.positions, self.attn, inputs.meta, self.num_layers,
                            exit_layer=exit_layer, exit_hook=hook)
        return hidden, kept

    @cached_property
    def stack(self):
        """The model's tandem.models.llama.DecoderStack over this pass's cache, or None; built on
        first use, when the model's kernels and 8-bit records are final."""
        return self.model.decoder_stack(self.attn)

    def logits(self, hidden: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """Float32 logits of hidden's rows `rows` (all rows if None): [len(rows), vocab]."""
        if rows is not None:
            hidden = hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=hidden.device))
        return self.model.compute_logits(hidden)
