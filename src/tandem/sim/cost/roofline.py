"""Analytic step times from a model's shape and an accelerator's roofline.

A forward pass over T tokens (R of them through the LM head, attention over C cached tokens with
P query-key pairs) costs
    compute = (2 * layer_params * T + 2 * vocab * hidden * R + 4 * layers * heads * head_dim * P) / FLOP/s
    memory  = (layer weights + LM head weights + KV bytes per token * C) / bytes/s
    time    = max(compute, memory) + tensor-parallel all-reduces
with FLOP/s and bytes/s the hardware's peaks times its efficiency factors (see hardware.py). A
step adds a fixed overhead and a per-sequence overhead; with a separate draft model, each draft
position is one more (small) forward over the sequences still drafting, plus one draft forward
over the step's prefill tokens (the draft keeps its own KV). Verification in frontiers (see
base.FrontierStep) is one target forward per pass; a pass overlapped with drafting takes the
longer of the two, or what their FLOPs and bytes together need of the shared machine. The whole
step uses max(compute, memory), which slightly flatters mixed prefill+decode steps. Tensor parallelism over N GPUs is an
aggregate machine (N x peaks x `tp_efficiency`) with two all-reduces per layer over NVLink.

KV capacity: N x memory x `gpu_memory_utilization`, minus the weights (target and draft) and a
2 GiB-per-GPU activation reserve, divided by the KV bytes per token of the target (plus the draft).
Owns these formulas; knows nothing of scheduling or the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.sim.cost.base import Deployment, StepShape
from tandem.sim.cost.hardware import Hardware
from tandem.sim.cost.models import ModelArch

ACTIVATION_RESERVE_BYTES = 2 * 2**30
SWAP_LATENCY_S = 2e-5


@dataclass
class RooflineCost:
    model: ModelArch
    hardware: Hardware
    num_gpus: int = 1
    draft: ModelArch | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space_gb: float = 32.0

    def __post_init__(self) -> None:
        hw, n = self.hardware, self.num_gpus
        scale = n * (hw.tp_efficiency if n > 1 else 1.0)
        self._flops = hw.peak_flops * hw.compute_efficiency * scale
        self._bandwidth = hw.memory_bandwidth * hw.memory_efficiency * scale
        self._kv_bytes = self.model.kv_bytes_per_token + (self.draft.kv_bytes_per_token if self.draft else 0)
        self.name = f"roofline:{self.model.name}" + (f"+draft:{self.draft.name}" if self.draft else "") + \
            f"@{n}x{hw.name}"

    # --- time ----------------------------------------------------------------------------
    def _work(self, arch: ModelArch, tokens: int, rows: int, context: int, pairs: int) -> tuple[float, float]:
        """(FLOPs, bytes) of one forward pass of `arch` (see the module docstring)."""
        flops = 2 * arch.layer_params * tokens + 2 * arch.lm_head_params * rows + \
            4 * arch.num_layers * arch.attention_width * pairs
        weights = arch.layer_params + (arch.lm_head_params if rows else 0)
        return flops, weights * arch.bytes_per_param + arch.kv_bytes_per_token * context

    def forward_s(self, arch: ModelArch, tokens: int, rows: int, context: int, pairs: int) -> float:
        """One forward pass of `arch` (see the module docstring)."""
        flops, nbytes = self._work(arch, tokens, rows, context, pairs)
        return max(flops / self._flops, nbytes / self._bandwidth) + self._allreduce_s(arch, tokens)

    def _allreduce_s(self, arch: ModelArch, tokens: int) -> float:
        n = self.num_gpus
        if n == 1:
            return 0.0
        ring_bytes = tokens * arch.hidden_size * arch.bytes_per_param * 2 * (n - 1) / n
        per = self.hardware.allreduce_latency_s + ring_bytes / self.hardware.nvlink_bandwidth
        return 2 * arch.num_layers * per

    def step_time_s(self, shape: StepShape) -> float:
        if shape.num_seqs == 0:
            return 0.0
        return self.verify_time_s(shape, first=True) + self.draft_time_s(shape)

    def verify_time_s(self, shape: StepShape, first: bool) -> float:
        """The target's forward over the shape: the step's first pass carries the step's fixed and
        per-sequence overheads, a further frontier pass one forward's launch (`draft_overhead_s`)."""
        hw = self.hardware
        t = self.forward_s(self.model, shape.num_tokens, shape.num_logit_rows, shape.context_tokens,
                           shape.attention_pairs)
        return t + (hw.step_overhead_s + hw.seq_overhead_s * shape.num_seqs if first else hw.draft_overhead_s)

    def _draft_forwards(self, shape: StepShape) -> list[tuple[int, int, int, int]]:
        """(tokens, rows, context, pairs) of each draft forward: one over the step's prefill tokens,
        then one per draft position."""
        out = []
        if shape.num_prefill_tokens:
            n = shape.num_prefill_tokens
            out.append((n, 0, n, n ** 2 // 2))
        first = shape.draft_rows[0] if shape.draft_rows else 0
        for rows in shape.draft_rows:
            ctx = shape.draft_context_tokens * rows // first
            out.append((rows, rows, ctx, ctx))
        return out

    def draft_time_s(self, shape: StepShape) -> float:
        """Draft-model forwards (none without a draft model), each with its launch overhead."""
        if self.draft is None:
            return 0.0
        return sum(self.forward_s(self.draft, *f) + self.hardware.draft_overhead_s
                   for f in self._draft_forwards(shape))

    def concurrent_time_s(self, verify: StepShape, first: bool, draft: StepShape) -> float:
        """A verification pass and drafting at once on disjoint compute (FASER's SM partitions): no
        faster than either alone, and no faster than their FLOPs and bytes together allow, since
        they share the machine's FLOP/s and memory bandwidth."""
        t_v, t_d = self.verify_time_s(verify, first), self.draft_time_s(draft)
        if t_d == 0.0:
            return t_v
        flops, nbytes = self._work(self.model, verify.num_tokens, verify.num_logit_rows, verify.context_tokens,
                                   verify.attention_pairs)
        for f in self._draft_forwards(draft):
            fl, nb = self._work(self.draft, *f)
            flops, nbytes = flops + fl, nbytes + nb
        return max(t_v, t_d, flops / self._flops, nbytes / self._bandwidth)

    def swap_time_s(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        return SWAP_LATENCY_S + num_blocks * self.block_size * self.swap_s_per_token

    # --- memory --------------------------------------------------------------------------
    @property
    def swap_s_per_token(self) -> float:
        hw = self.hardware
        return self._kv_bytes / (hw.host_link_bandwidth * hw.host_link_efficiency * self.num_gpus)

    def num_kv_blocks(self) -> int:
        n, hw = self.num_gpus, self.hardware
        weights = self.model.weight_bytes + (self.draft.weight_bytes if self.draft else 0)
        free = n * (hw.memory_bytes * self.gpu_memory_utilization - ACTIVATION_RESERVE_BYTES) - weights
        blocks = int(free // (self._kv_bytes * self.block_size))
        if blocks < 1:
            raise ValueError(f"{self.model.name} ({weights / 1e9:.1f} GB of weights) does not fit "
                             f"{n} x {hw.name}: give more GPUs")
        return blocks

    def deployment(self) -> Deployment:
        host = int(self.swap_space_gb * 2**30 // (self._kv_bytes * self.block_size))
        blocks = self.num_kv_blocks()
        desc = (f"{self.model.name} ({self.model.num_params / 1e9:.1f}B)" +
                (f" + draft {self.draft.name}" if self.draft else "") +
                f" on {self.num_gpus} x {self.hardware.name}: {blocks * self.block_size:,} KV tokens")
        return Deployment(blocks, host, self.swap_s_per_token, desc)
