"""The torch executor: one forward pass per `StepPlan`, then sampling.

Implements the engine's `Executor` protocol. It owns the model, the paged KV tensors and the
per-request sampling state, and makes no scheduling decision.
"""

from __future__ import annotations

import torch

from tandem.models.llama import LlamaModel
from tandem.runner.attention import AttentionBackend, PagedKVCache
from tandem.runner.inputs import build_inputs
from tandem.runner.kernels import make_ops
from tandem.runner.sampler import SampleRow, Sampler
from tandem.types import StepPlan, StepResult


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, device: torch.device,
                 seed: int = 0) -> None:
        cfg = model.cfg
        self.model = model
        self.device = device
        self.block_size = block_size
        self.cache = PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                  model.dtype, device)
        model.ops = make_ops(device)
        self.attn = AttentionBackend(self.cache, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.ops)
        self.paged_kernel = self.attn.kernel is not None
        self.sampler = Sampler(device, seed)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        if plan.is_empty:
            return result
        inputs = build_inputs(plan, self.block_size, self.device, self.paged_kernel)
        hidden = self.model(inputs.input_ids, inputs.positions, self.attn, inputs.meta)
        picks = [(s, r + s.num_tokens - 1) for s, r in zip(inputs.seqs, inputs.row_starts) if s.sample]
        if not picks:
            return result
        rows_t = torch.tensor([r for _, r in picks], dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows_t))  # [M, V] float32
        rows = [SampleRow(s.request_id, s.sampling_params, s.num_output_tokens, s.stop_token_ids) for s, _ in picks]
        tokens, logprobs = self.sampler.sample(logits, rows)
        for (s, _), tok, lp in zip(picks, tokens, logprobs):
            result.sampled_token_ids[s.request_id] = [tok]
            if lp is not None:
                result.logprobs[s.request_id] = [lp]
        return result

    @torch.inference_mode()
    def forward_logits(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """Run the plan's forward pass (writing KV) and return every token's logits: [num_tokens, V]."""
        inputs = build_inputs(plan, self.block_size, self.device, self.paged_kernel)
        hidden = self.model(inputs.input_ids, inputs.positions, self.attn, inputs.meta)
        logits = self.model.compute_logits(hidden)
        return {s.request_id: logits[r:r + s.num_tokens] for s, r in zip(inputs.seqs, inputs.row_starts)}

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state (sampling generators) of finished requests."""
        for rid in request_ids:
            self.sampler.release(rid)
