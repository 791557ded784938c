"""The torch executor: one forward pass per `StepPlan`, then sampling; a step with drafts is a
verification round instead (tandem.speculative.verify_round: one pass, or several in frontiers).

Implements the engine's `Executor` protocol. It owns the model, the paged KV tensors, the
per-request sampling state and, with speculation, the proposer; it makes no scheduling decision.
It sits above what it drives (tandem.runner's primitives, tandem.models, tandem.speculative), which
therefore never import it.
"""

from __future__ import annotations

import torch

from tandem.models.llama import LlamaModel
from tandem.runner.attention import AttentionBackend, PagedKVCache
from tandem.runner.kernels import make_ops
from tandem.runner.passes import ForwardPass
from tandem.runner.sampler import SampleRow, Sampler
from tandem.speculative.verify_round import VerifyRound
from tandem.types import ScheduledSeq, StepPlan, StepResult


class TorchExecutor:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, device: torch.device,
                 seed: int = 0, num_host_blocks: int = 0, kv_dtype: torch.dtype | None = None,
                 grammar=None) -> None:
        """`grammar`: a tandem.structured.grammar.GrammarBackend for constrained requests, or None."""
        cfg = model.cfg
        kv_dtype = kv_dtype or model.dtype
        self.model = model
        self.device = device
        self.block_size = block_size
        self.cache = PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                  kv_dtype, device)
        model.ops = make_ops(device)
        self.attn = AttentionBackend(self.cache, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.ops)
        self.passes = ForwardPass(model, self.attn, block_size, device)   # how every step runs the model
        self.sampler = Sampler(device, seed, grammar=grammar)
        self.spec = None            # a tandem.speculative.decoder.SpecDecoder when speculation is on (set_speculation)
        # Host copies of swapped-out blocks (tool pauses); pinned when the device is a GPU.
        self.host = PagedKVCache(cfg.num_layers, num_host_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                 kv_dtype, torch.device("cpu"), pin=device.type == "cuda") \
            if num_host_blocks else None

    def set_speculation(self, decoder) -> None:
        """Verify drafts with `decoder` (a SpecDecoder built over this runner's model, attention and
        sampler, hence after the runner; None: plain decoding). Between steps only."""
        self.spec = decoder

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        if self.spec is not None:               # their KV is gone or moved: so is the draft model's
            for rid in plan.preempted_ids + plan.released_ids:
                self.spec.release(rid)
        if plan.swap_out:
            self._copy_blocks(plan.swap_out, self.cache, self.host)
        if plan.swap_in:
            self._copy_blocks(plan.swap_in, self.host, self.cache)
        if not plan.seqs:
            return result
        drafts = self.spec.draft(plan) if self.spec is not None else {}
        if drafts:                              # one pass, or frontiers and/or the early-exit check
            result = VerifyRound(self.passes, self.sample_rows, self.spec, plan, drafts).run()
            self.spec.report(plan, result)
            return result
        inputs = self.passes.inputs(plan.seqs)  # the plain step: one pass, a token for each sampled seq
        hidden = self.passes.run(inputs)
        chosen = [(s, r + s.num_tokens - 1) for s, r in zip(inputs.seqs, inputs.row_starts) if s.sample]
        if not chosen:
            return result
        logits = self.passes.logits(hidden, [r for _, r in chosen])            # [M, V] float32
        self.sample_rows(result, [(s, i) for i, (s, _) in enumerate(chosen)], logits)
        if self.spec is not None:
            self.spec.report(plan, result)
        return result

    def sample_rows(self, result: StepResult, chosen: list[tuple[ScheduledSeq, int]], logits: torch.Tensor) -> None:
        """Sample one token for each (seq, row of `logits`) in `chosen` into `result`."""
        if not chosen:
            return
        offsets = [o for _, o in chosen]
        rows = [SampleRow(s.request_id, s.sampling_params, s.num_output_tokens, s.stop_token_ids, s.history)
                for s, _ in chosen]
        if offsets == list(range(offsets[0], offsets[0] + len(offsets))):
            picked = logits[offsets[0]:offsets[0] + len(offsets)]      # consecutive rows: a view, no copy
        else:
            picked = logits.index_select(0, torch.tensor(offsets, dtype=torch.long, device=self.device))
        tokens, logprobs = self.sampler.sample(picked, rows)
        for (s, _), tok, lp in zip(chosen, tokens, logprobs):
            result.sampled_token_ids[s.request_id] = [tok]
            if lp is not None:
                result.logprobs[s.request_id] = [lp]

    def _copy_blocks(self, pairs: list[tuple[int, int]], src: PagedKVCache, dst: PagedKVCache) -> None:
        """Copy whole blocks (src block -> dst block) of every layer's K and V."""
        bs = self.block_size
        offsets = torch.arange(bs)
        src_slots = (torch.tensor([a for a, _ in pairs])[:, None] * bs + offsets).reshape(-1)
        dst_slots = (torch.tensor([b for _, b in pairs])[:, None] * bs + offsets).reshape(-1)
        for s_k, s_v, d_k, d_v in zip(src.k, src.v, dst.k, dst.v):
            d_k.index_copy_(1, dst_slots.to(d_k.device), s_k.index_select(1, src_slots.to(s_k.device)).to(d_k.device))
            d_v.index_copy_(1, dst_slots.to(d_v.device), s_v.index_select(1, src_slots.to(s_v.device)).to(d_v.device))

    @torch.inference_mode()
    def forward_logits(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """Run the plan's forward pass (writing KV) and return every token's logits: [num_tokens, V]."""
        inputs = self.passes.inputs(plan.seqs)
        logits = self.passes.logits(self.passes.run(inputs))
        return {s.request_id: logits[r:r + s.num_tokens] for s, r in zip(inputs.seqs, inputs.row_starts)}

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state (sampling generators, proposer indexes) of finished requests."""
        for rid in request_ids:
            self.sampler.release(rid)
            if self.spec is not None:
                self.spec.release(rid, finished=True)

